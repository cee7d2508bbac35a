"""GGUF files of the related families as llama.cpp's own converter writes them (tests/llama_convert.py): `qwen3vl`
with its DeepStack projector file, `qwen3vlmoe` (from the hub's expert layout), `qwen3next` with its MTP block, on tiny
random checkpoints over Qwen2's 151,936-token vocabulary (the Qwen3 tokenizer these families publish). Each loads as
its safetensors checkpoint does: the same logits, tokens, images and speculative decoding; a Q8_0 file's blocks
(Qwen3-Next's fused ssm_ba read back by rows) within Q8_0's rounding."""

from __future__ import annotations

import json

import pytest
import torch

import qwenrt
from qwenrt.errors import QwenrtError
from qwenrt.gguf.reader import open_gguf
from qwenrt.prompt import prepare_prompt
from tests.checkpoints import (PREPROCESSOR, QWEN3_NEXT, QWEN3_VL_MOE, QWEN3_VL_TEXT, QWEN3_VL_VISION, add_mtp_head,
                               randomize)
from tests.llama_convert import convert
from tests.numerics import rel_err
from tests.test_multimodal import ask, ours, picture
from tests.test_mtp import check_lossless
from tests.tokenizer_fixture import build_qwen3_tokenizer

VOCAB = 151936
# the Qwen3 tokenizer's vision tokens
TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                 vision_end_token_id=151653)
TEXT = dict(eos_token_id=151645, pad_token_id=151643, vocab_size=VOCAB)
IMAGE = ask({"type": "image", "image": picture(64, 96, 0)})
IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


def build_vl(path, moe: bool):
    """A Qwen3-VL (DeepStack after blocks 0 and 2) or a Qwen3-VL-MoE with every layer sparse (llama.cpp's qwen3vlmoe
    has no dense layers) and its experts as the hub's files hold them (the layout the converter expects)."""
    from safetensors.torch import load_file, save_file
    from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                              Qwen3VLMoeForConditionalGeneration)

    config_cls, model_cls = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                             else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    text = dict(QWEN3_VL_TEXT, **TEXT, **(dict(QWEN3_VL_MOE, mlp_only_layers=[]) if moe else {}))
    vision = dict(QWEN3_VL_VISION, deepstack_visual_indexes=[0, 2])
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=not moe, **TOKEN_IDS)
    randomize(model_cls(config).eval(), 3 + moe, gain=1.0).save_pretrained(path)
    if moe:  # the hub's banks: gate_up [E, D, 2I], down [E, I, D]
        tensors = load_file(path / "model.safetensors")
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    build_qwen3_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps({k: v for k, v in PREPROCESSOR.items() if k != "size"}))
    return path


def build_next(path):
    """A Qwen3-Next (Hv/Hk = 3, every layer sparse, raw top-k) with an MTP head."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**dict(QWEN3_NEXT, **TEXT, mlp_only_layers=[]))
    trunk = path.with_name(path.name + "-trunk")
    randomize(Qwen3NextForCausalLM(config).eval(), 5, gain=1.0).save_pretrained(trunk)
    build_qwen3_tokenizer(trunk)
    return add_mtp_head(trunk, path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{family: (checkpoint, {kind: llama.cpp's file})}: F32 files, a Q8_0 Qwen3-Next and Qwen3-VL's projector."""
    root = tmp_path_factory.mktemp("families")
    ckpts = {"vl": build_vl(root / "vl", False), "vlmoe": build_vl(root / "vlmoe", True),
             "next": build_next(root / "next")}
    made = {name: (path, {"f32": convert(path, root / f"{name}.gguf", "f32")}) for name, path in ckpts.items()}
    made["next"][1]["q8_0"] = convert(ckpts["next"], root / "next-q8_0.gguf", "q8_0")
    made["vl"][1]["mmproj"] = convert(ckpts["vl"], root / "mmproj-vl.gguf", "f32", None, "--mmproj")
    return made


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).float()


@pytest.mark.parametrize("family, name", [("vl", "Qwen3-VL"), ("vlmoe", "Qwen3-VL"), ("next", "Qwen3-Next")])
def test_a_converted_file_gives_the_checkpoints_logits(files, family, name):
    path, made = files[family]
    model, tokenizer = qwenrt.load(made["f32"], dtype="float32")
    reference, ref_tokenizer = qwenrt.load(path, dtype="float32")
    assert model.config.text.family == name and model.config.text.is_moe == (family != "vl")
    assert rel_err(logits(model), logits(reference)) <= 1e-6  # the norms' w + 1 - 1 round in fp32, nothing else
    text = "Hello wörld, naïve café 12345 — ok?\n\n  def f(x):\treturn x**2"
    assert tokenizer.encode(text) == ref_tokenizer.encode(text)  # Qwen2's pre-tokenizer from `tokenizer.ggml.pre`
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert qwenrt.complete(model, tokenizer, messages, max_tokens=8).tokens == \
        qwenrt.complete(reference, ref_tokenizer, messages, max_tokens=8).tokens


def test_qwen3_vl_images_through_the_deepstack_projector(files):
    """The projector file's DeepStack mergers feed the first decoder layers as the checkpoint's do."""
    path, made = files["vl"]
    model, tokenizer = qwenrt.load(made["f32"], mmproj=made["mmproj"], dtype="float32")
    reference, ref_tokenizer = qwenrt.load(path, dtype="float32")
    assert model.config.vision["deepstack_visual_indexes"] == [0, 2]
    prepared, expected = prepare_prompt(model, tokenizer, IMAGE), prepare_prompt(reference, ref_tokenizer, IMAGE)
    assert prepared.ids == expected.ids and prepared.ids.count(TOKEN_IDS["image_token_id"]) == 70
    with torch.inference_mode():
        assert rel_err(ours(model, prepared).float(), ours(reference, expected).float()) <= 1e-6
    greedy = qwenrt.complete(model, tokenizer, IMAGE, max_tokens=10).tokens
    assert greedy == qwenrt.complete(reference, ref_tokenizer, IMAGE, max_tokens=10).tokens


def test_qwen3_next_mtp_block_drives_speculative_decoding(files):
    model, tokenizer = qwenrt.load(files["next"][1]["f32"], dtype="float32")
    assert model.mtp is not None
    check_lossless(model, tokenizer, ["Count to five.", "Name a colour."], n=12)


def test_qwen3_next_q8_0_blocks(files):
    """Q8_0 blocks held as stored, ssm_ba's rows split into in_proj_b / in_proj_a piece by piece: each weight is the
    file's tensor dequantized and split, and the first position's logits are the F32 file's within Q8_0's rounding
    (later positions drift apart: this random model amplifies any rounding)."""
    path = files["next"][1]["q8_0"]
    q8, _ = qwenrt.load(path, dtype="float32")
    dequantized = open_gguf(path, blocks=False)
    for name in ("in_proj_b", "in_proj_a", "in_proj_qkv", "in_proj_z"):
        module = getattr(q8.model.layers[0].linear_attn, name)
        assert type(module).__name__ == "QuantLinear"
        with torch.inference_mode():
            weight = module(torch.eye(module.in_features)).T  # [N, K]
        assert torch.equal(weight, dequantized.get(f"model.layers.0.linear_attn.{name}.weight").float()), name
    f32, _ = qwenrt.load(files["next"][1]["f32"], dtype="float32")
    assert rel_err(logits(q8, IDS[:, :1]), logits(f32, IDS[:, :1])) < 0.03


def test_a_projector_for_qwen3_next_is_refused(files):
    with pytest.raises(QwenrtError, match="a vision projector for a Qwen3-Next model, which takes no images"):
        qwenrt.load(files["next"][1]["f32"], mmproj=files["vl"][1]["mmproj"])
