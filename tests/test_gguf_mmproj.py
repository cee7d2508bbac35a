"""Vision projector files (`--mmproj`, llama.cpp's `clip` layout) checked against llama.cpp's own converter
(tests/llama_convert.py) on a tiny random Qwen3.5 VLM: the converter's model + projector files load as the safetensors
checkpoint does (logits with an image, greedy tokens), F32 and F16 projectors; `qwenrt convert --mmproj` writes the
converter's projector file (tensors, types, bytes, metadata but general.name) at every type; hostile projector
files and misuses get one line each."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V, GGUFWriter

import qwenrt
from qwenrt.cli import build_parser, main
from qwenrt.default_model import default_model_path
from qwenrt.engine.prefix_store import model_identity
from qwenrt.errors import QwenrtError
from qwenrt.gguf.export import export_gguf
from qwenrt.gguf.reader import FileReader
from qwenrt.prompt import prepare_prompt
from tests.checkpoints import DENSE, PREPROCESSOR, VISION, randomize
from tests.llama_convert import convert
from tests.test_checkpoint_errors import expect_error
from tests.test_gguf_errors import rewrite
from tests.test_multimodal import ask, ours, picture

KINDS = ("f32", "f16", "bf16", "q8_0")
MESSAGES = ask({"type": "image", "image": picture(64, 96, 0)})
# the built-in model's tokenizer holds the vision tokens: <|vision_start|> 524, <|vision_end|> 525, <|image_pad|> 527
TOKEN_IDS = dict(image_token_id=527, video_token_id=528, vision_start_token_id=524, vision_end_token_id=525)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny random Qwen3.5 VLM stored in bf16, its weights exact in every F32, F16 and BF16 file, with the
    built-in model's tokenizer and Qwen3.5's published preprocessing (the defaults a projector file implies)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = tmp_path_factory.mktemp("vlm")
    text = dict(DENSE, vocab_size=576, model_type="qwen3_5_text", eos_token_id=[517, 515], pad_token_id=515)
    config = Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=True, **TOKEN_IDS)
    # gain 1: its greedy tokens vary (at 0.5 this tiny model repeats one token)
    model = randomize(Qwen3_5ForConditionalGeneration(config).eval(), 2, gain=1.0).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # no values in float16's subnormal range: those F16 files would round
            p.masked_fill_(p.abs() < torch.finfo(torch.float16).tiny, 0)
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(default_model_path() / file, path / file)
    (path / "preprocessor_config.json").write_text(json.dumps({k: v for k, v in PREPROCESSOR.items() if k != "size"}))
    return path


@pytest.fixture(scope="module")
def theirs(vlm, tmp_path_factory):
    """llama.cpp's converter's files: {"model": the F32 text model, kind: the projector file of that type}."""
    out = tmp_path_factory.mktemp("theirs")
    files = {"model": convert(vlm, out / "model.gguf", "f32", "qwen35", "--no-mtp")}
    return files | {k: convert(vlm, out / f"mmproj-{k}.gguf", k, None, "--mmproj") for k in KINDS}


@pytest.fixture(scope="module")
def exported(vlm, tmp_path_factory):
    """`qwenrt convert --mmproj`'s files: {kind: (model, projector)}."""
    out = tmp_path_factory.mktemp("ours")
    return {k: (export_gguf(vlm, out / f"model-{k}.gguf", k, mmproj=out / f"mmproj-{k}.gguf"),
                out / f"mmproj-{k}.gguf") for k in KINDS}


@pytest.fixture(scope="module")
def reference(vlm):
    return qwenrt.load(vlm, dtype="float32")


def image_logits(model, tokenizer, messages=MESSAGES) -> tuple[list[int], torch.Tensor]:
    prepared = prepare_prompt(model, tokenizer, messages)
    with torch.inference_mode():
        return prepared.ids, ours(model, prepared).float()


@pytest.mark.parametrize("maker, kind", [("llama.cpp", "f32"), ("llama.cpp", "f16"), ("qwenrt", "bf16")])
def test_a_projector_file_gives_the_checkpoints_vision(theirs, exported, reference, maker, kind):
    model_file, projector = (theirs["model"], theirs[kind]) if maker == "llama.cpp" else exported[kind]
    model, tokenizer = qwenrt.load(model_file, mmproj=projector, dtype="float32")
    assert model.config.is_vlm and model.config.image_token_id == 527
    ids, got = image_logits(model, tokenizer)
    ref_ids, expected = image_logits(*reference)
    assert ids == ref_ids and ids.count(527) == 70  # 64×96 grows to the published 65536-pixel minimum: 224×320
    assert float((got - expected).abs().max() / expected.abs().max()) == 0.0  # the same weights, the same arithmetic
    greedy = qwenrt.complete(model, tokenizer, MESSAGES, max_tokens=12).tokens
    assert greedy == qwenrt.complete(*reference, MESSAGES, max_tokens=12).tokens and len(set(greedy)) > 2
    assert model.vision_checkpoint is None  # the projector's tensors live in the tower alone once it is built


def test_video_through_a_projector_file(theirs, reference):
    """Video frames take the projector's preprocessing too (Qwen3.5's published video bounds)."""
    video = ask({"type": "video", "video": [picture(64, 64, 10 + i) for i in range(4)]})
    ids, got = image_logits(*qwenrt.load(theirs["model"], mmproj=theirs["f32"], dtype="float32"), video)
    ref_ids, expected = image_logits(*reference, video)
    assert ids == ref_ids and ids.count(528) > 0 and torch.equal(got, expected)


def test_the_projector_file_is_part_of_the_models_identity(theirs):
    """Prompt states kept on disk (prefix_cache_dir) are a model's: an image prompt's depend on the projector."""
    identities = {model_identity(qwenrt.load(theirs["model"], mmproj=projector)[0])
                  for projector in (None, theirs["f32"], theirs["f16"])}
    assert len(identities) == 3


def differences(ours, theirs) -> list[str]:
    """What differs between two GGUF files: the tensors (in order: name, type, shape, bytes) and the metadata (the
    model's name aside: qwenrt writes the checkpoint directory's, the converter a title made of it)."""
    a, b = FileReader(ours, "r"), FileReader(theirs, "r")
    found = [f"tensor {x.name}" for x, y in zip(a.tensors, b.tensors) if (x.name, x.tensor_type, list(x.shape)) !=
             (y.name, y.tensor_type, list(y.shape)) or x.data.tobytes() != y.data.tobytes()]
    found += ["tensor count"] if len(a.tensors) != len(b.tensors) else []
    keys = [k for k in a.fields if k != "general.name"]
    if keys != [k for k in b.fields if k != "general.name"]:
        return found + ["keys"]
    return found + [f"key {k}" for k in keys if (a.fields[k].types, a.fields[k].contents()) !=
                    (b.fields[k].types, b.fields[k].contents())]


@pytest.mark.parametrize("kind", KINDS)
def test_convert_writes_the_converters_projector(theirs, exported, kind):
    assert differences(exported[kind][1], theirs[kind]) == []
    types = {t.name: t.tensor_type.name for t in FileReader(exported[kind][1], "r").tensors}
    matrix = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[kind]
    assert types["v.blk.1.attn_qkv.weight"] == types["mm.0.weight"] == matrix
    assert types["v.patch_embd.weight.1"] == ("F16" if kind == "f16" else "F32")  # as the converter forces it
    assert types["v.position_embd.weight"] == types["v.blk.0.ln1.bias"] == "F32"


def test_the_command_line(vlm, theirs, tmp_path, capsys):
    model, projector = tmp_path / "model.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(vlm), str(model), "--type", "bf16", "--mmproj", str(projector)]) == 0
    assert differences(projector, theirs["bf16"]) == []
    capsys.readouterr()
    assert main(["inspect", "--json", str(model), "--mmproj", str(projector)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["family"], report["vision_tensors"], report["mmproj"]) == ("dense VLM", 33, str(projector))
    image = tmp_path / "picture.png"
    picture(64, 96, 0).save(image)
    run = ["run", str(model), "Describe this.", "--image", str(image), "-n", "3", "--temp", "0"]
    assert main([*run, "--mmproj", str(projector)]) == 0
    assert main(run) == 1
    assert "--image/--video need its vision projector file too (--mmproj FILE)" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", str(model), "--mmproj", str(projector)]).mmproj == str(projector)


def refused(model, projector, *fragments) -> None:
    with pytest.raises(QwenrtError) as info:
        qwenrt.load(model, mmproj=projector)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_misused_projector_files(vlm, theirs, tmp_path):
    model, projector = theirs["model"], theirs["f32"]
    refused(model, tmp_path / "missing.gguf", "vision projector file not found")
    refused(model, model, f"{model}: not a vision projector file (general.architecture 'qwen35', expected 'clip')")
    refused(vlm, projector, "a vision projector file (mmproj) goes with a GGUF model")
    expect_error(projector, f"{projector}: a vision projector (mmproj) file, not a model")
    # a model whose vocabulary has no <|image_pad|> token is text-only
    tokens = FileReader(model, "r").fields["tokenizer.ggml.tokens"].contents()
    tokens[527] = "<|not_an_image|>"
    text_only = rewrite(model, tmp_path / "text-only.gguf",
                        fields={"tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING)})
    refused(text_only, projector, "a text-only model (no <|image_pad|> token in its vocabulary of 576) cannot take")
    with pytest.raises(QwenrtError, match="the model has no vision tower to write as mmproj.gguf"):
        export_gguf("qwenrt-tiny", tmp_path / "tiny.gguf", "bf16", mmproj=tmp_path / "mmproj.gguf")
    with pytest.raises(QwenrtError, match="mmproj-f32.gguf: already exists"):
        export_gguf(vlm, tmp_path / "new.gguf", "bf16", mmproj=projector)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text-only.gguf"]  # nothing written by the refusals


@pytest.mark.parametrize("edit, fragments", [
    ({"fields": {"clip.vision.projection_dim": (96, V.UINT32, None)}},
     ["projection_dim 96 does not match the model's hidden size 64 (a projector made for another model)"]),
    ({"fields": {"clip.projector_type": ("qwen2.5vl_merger", V.STRING, None)}},
     ["projector 'qwen2.5vl_merger' is not Qwen3.5's vision tower ('qwen3vl_merger')"]),
    ({"fields": {"clip.vision.feed_forward_length": (48, V.UINT32, None)}},
     ["6 tensor(s) with the wrong shape", "blocks.0.mlp.linear_fc1.weight is [64, 32], expected [48, 32]"]),
    ({"drop": ["v.patch_embd.weight.1"]}, ["missing 1 tensor(s): v.patch_embd.weight.1"]),
    ({"fields": {"clip.vision.block_count": ("2", V.STRING, None)}},
     ["GGUF metadata key 'clip.vision.block_count' must be an integer, got STRING"]),
    ({"fields": {"clip.vision.image_mean": ([0.5] * 1000, V.ARRAY, V.FLOAT32)}},
     ["'clip.vision.image_mean' must hold 3 values, got 1000"]),
    ({"fields": {"clip.vision.is_deepstack_layers": ([True, False], V.ARRAY, V.BOOL)}},
     ["a projector with DeepStack layers (Qwen3-VL's) for a Qwen3.5 model, which has none"]),
    ({"fields": {"clip.vision.attention.layer_norm_epsilon": (1e-5, V.FLOAT32, None)}},
     ["layer_norm_epsilon 1e-05 is not Qwen3.5's vision LayerNorm's 1e-06"]),
    ({"fields": {"clip.vision.image_size": (770, V.UINT32, None)}},
     ["image_size 770 is not a whole number of 16-pixel patches"]),
])
def test_hostile_projector_files(theirs, tmp_path, edit, fragments):
    bad = rewrite(theirs["f32"], tmp_path / "bad.gguf", **edit)
    refused(theirs["model"], bad, str(bad), *fragments)


def test_a_truncated_projector_file(theirs, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(theirs["f16"].read_bytes()[:-1000])
    refused(theirs["model"], bad, f"{bad}: not a readable GGUF file (tensor 'v.position_embd.weight' lies past the end")


def with_tensor(src, dst, name, array):
    """A copy of F32 GGUF file src with tensor `name` holding `array` (PyTorch order, as the reader gives) instead."""
    reader = FileReader(src, "r")
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kinds = field.types
            writer.add_key_value(key, field.contents(), kinds[0], kinds[-1] if kinds[0] == V.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, array if t.name == name else np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_patch_kernels_of_two_shapes(theirs, tmp_path):
    frame = next(t for t in FileReader(theirs["f32"], "r").tensors if t.name == "v.patch_embd.weight.1")
    narrow = np.array(frame.data)[:, :, :8, :8].copy()  # [D, C, P, P] -> [D, C, 8, 8]
    bad = with_tensor(theirs["f32"], tmp_path / "bad.gguf", "v.patch_embd.weight.1", narrow)
    refused(theirs["model"], bad, f"{bad}: tensors v.patch_embd.weight and v.patch_embd.weight.1 differ in shape")
