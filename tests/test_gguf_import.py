"""GGUF import and export checked against files made by llama.cpp's own converter (tests/llama_convert.py): the
built-in model (dense, Hv > Hk so the V-head reorder is undone, an MTP head) and a random MoE as F32/BF16/Q8_0 files
load as their safetensors checkpoints do; `qwenrt convert` writes the converter's tensors and metadata; a Qwen3.5
tokenizer read from a file's metadata encodes as the original."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import qwenrt
from qwenrt.default_model import default_model_path
from qwenrt.engine import Engine, Request
from qwenrt.errors import QwenrtError
from qwenrt.gguf.export import export_gguf, tensor_type
from qwenrt.gguf.layout import is_one_plus_norm
from qwenrt.gguf.metadata import Metadata, tokenizer_parts
from qwenrt.decode_plan import DecodePlan
from qwenrt.gguf.reader import FileReader, open_gguf
from qwenrt.loader import _load_verified, verify_checkpoint
from qwenrt.quant import QuantEmbedding, QuantExperts, QuantLinear, dequantize_weight, weight_format
from qwenrt.sampling import SamplingParams
from qwenrt.tokenizer import Tokenizer
from tests.checkpoints import DENSE, MOE, add_mtp_head, randomize
from tests.llama_convert import convert
from tests.numerics import teacher_forced_logits

PROMPT = [[5, 77, 301, 12, 9, 450, 33, 2, 101, 260, 17, 88]]  # token ids: the files' tokenizers may split text apart


def logits(model, ids=PROMPT) -> torch.Tensor:
    with torch.inference_mode():
        out = model(torch.tensor(ids))
    return (out if isinstance(out, torch.Tensor) else out[0]).float()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """The built-in model (bf16, MTP head) as llama.cpp's converter writes it: {outtype: path}."""
    out = tmp_path_factory.mktemp("gguf")
    # its tokenizer follows Qwen3.5's rules but for capitals: the converter is told it is `qwen35`
    return {t: convert(default_model_path(), out / f"tiny-{t}.gguf", t, "qwen35") for t in ("bf16", "q8_0")}


@pytest.fixture(scope="module")
def builtin():
    return qwenrt.load()


def test_a_bf16_file_is_the_checkpoint(tiny_files, builtin):
    model, tokenizer = qwenrt.load(tiny_files["bf16"])
    assert next(model.parameters()).dtype == torch.bfloat16  # "auto": as the file stores it
    assert model.mtp is not None and tokenizer.vocab_size == builtin[1].vocab_size
    assert relative(logits(model), logits(builtin[0])) == 0.0
    # speculative decoding through the file's MTP head gives the checkpoint's greedy tokens
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = [list(Engine(m, t, speculative_tokens=2).submit(Request(PROMPT[0], params)))
            for m, t in ((model, tokenizer), builtin)]
    assert [i for o in outs[0] for i in o.token_ids] == [i for o in outs[1] for i in o.token_ids]


def test_a_q8_0_file_holds_the_weights_to_its_blocks_rounding(tiny_files, builtin):
    ckpt = open_gguf(tiny_files["q8_0"])
    assert ckpt.file_types["model.layers.0.linear_attn.in_proj_qkv.weight"] == "Q8_0"
    assert ckpt.file_types["model.layers.0.linear_attn.A_log"] == "F32"
    source = dict(builtin[0].named_parameters())
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.2.self_attn.q_proj.weight",
                 "model.layers.1.linear_attn.out_proj.weight", "model.embed_tokens.weight"):
        original, loaded = source[name].float(), ckpt.get(name)
        blocks = original.reshape(-1, 32)
        step = blocks.abs().amax(1, keepdim=True) / 127  # Q8_0: one fp16 scale d per 32 values, |q| <= 127
        # half a step, plus the scale's fp16 rounding (2^-11 of d) times |q|
        assert ((loaded.reshape(-1, 32) - blocks).abs() <= step * (0.5 + 127 / 2048) + 1e-7).all(), name
    model, _ = qwenrt.load(tiny_files["q8_0"], dtype=torch.float32)
    assert relative(logits(model), logits(builtin[0])) < 0.05


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """A random dense model whose matrices have 256 or 512 columns (K-quants take whole 256-column super-blocks) and
    8 DeltaNet value heads of 32 (the output projection's head reorder moves whole groups of 32, not whole Q4_K
    headers), with an MTP head."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tmp = tmp_path_factory.mktemp("wide")
    config = Qwen3_5TextConfig(**dict(DENSE, vocab_size=576, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                      linear_num_value_heads=8))
    randomize(Qwen3_5ForCausalLM(config).eval(), 12).save_pretrained(tmp / "wide")
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_model_path() / file, tmp / "wide" / file)
    return add_mtp_head(tmp / "wide", tmp / "wide-mtp")


def dequantized(path) -> torch.nn.Module:
    """The GGUF model with every block dequantized to fp32 (as qwenrt loaded quantized files before it held them)."""
    cpu = torch.device("cpu")
    return _load_verified(path, verify_checkpoint(path, blocks=False), torch.float32, cpu, False, None, True)


def check_blocks_held_exactly(path, formats: str) -> torch.nn.Module:
    """qwenrt.load holds the file's blocks as they are: each quantized weight is bit for bit its dequantized value,
    and in fp32 the logits are the dequantized model's. Returns the model loaded at "auto" (bf16)."""
    native, _ = qwenrt.load(path, dtype=torch.float32)
    reference = dequantized(path)
    assert weight_format(native) == formats
    dense = dict(reference.named_parameters())
    held = {path: m for path, m in native.named_modules() if isinstance(m, QuantLinear)}
    for name, m in held.items():
        weight = dense.get(f"{name}.weight", dense.get(name, dense.get("model.embed_tokens.weight")))
        pieces = {key: getattr(m, key) for key in m.spec.pieces}
        assert torch.equal(dequantize_weight(pieces, m.spec), weight), name
    assert relative(logits(native), logits(reference)) <= 1e-6
    return qwenrt.load(path)[0]


def test_q4_k_m_blocks_are_held_as_they_are_and_decode_natively(wide_ckpt, tmp_path, monkeypatch):
    """Q4_K (int4 with its own headers), Q6_K (int8 per 16) and Q8_0 (int8 per 32) in one file, and the DeltaNet
    output at Q4_K as llama-quantize's own mix has it (its 32-wide value heads cut Q4_K's 256-column headers: int4
    with fp32 scales and zeros). At "auto" the model is bf16 and decodes through the native GEMVs of those formats:
    the one-call decode plan gives the modules' logits, and speculative decoding through the file's MTP head the
    plain greedy tokens."""
    monkeypatch.setattr("qwenrt.gguf.export.SENSITIVE", ("ssm_alpha.weight", "ssm_beta.weight"))
    gguf = export_gguf(wide_ckpt, tmp_path / "wide-q4_k_m.gguf", "q4_k_m")
    model = check_blocks_held_exactly(gguf, "int4 Q4_K + int8 g32 fp32 + int4 g32 fp32 + int8 g16 fp32")
    ids = torch.randint(0, 576, (2, 20), generator=torch.Generator().manual_seed(3))
    assert DecodePlan.for_model(model).stack is not None
    assert torch.equal(teacher_forced_logits(model, ids, 12), teacher_forced_logits(model, ids, 12, modules=True))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokenizer = qwenrt.load(gguf)[1]
    outs = [[i for o in Engine(model, tokenizer, speculative_tokens=k).submit(Request(PROMPT[0], params))
             for i in o.token_ids] for k in (0, 2)]
    assert outs[0] == outs[1]


def test_q4_0_and_moe_q8_0_blocks_are_held_as_they_are(wide_ckpt, moe_ckpt, tmp_path):
    q4_0 = export_gguf(wide_ckpt, tmp_path / "wide-q4_0.gguf", "q4_0")  # Q4_0, the head Q6_K, DeltaNet's Q8_0
    check_blocks_held_exactly(q4_0, "int4 Q4_0 + int8 g32 fp32 + int8 g16 fp32")  # Q4_0: codes and fp16 d
    model = check_blocks_held_exactly(export_gguf(moe_ckpt, tmp_path / "moe-q8_0.gguf", "q8_0"), "int8 g32 fp32")
    assert isinstance(model.model.layers[0].mlp.experts, QuantExperts) and model.mtp is not None
    # the untied embedding is looked up in its own blocks
    lookup, reference = model.model.embed_tokens, dequantized(tmp_path / "moe-q8_0.gguf").model.embed_tokens
    assert isinstance(lookup, QuantEmbedding)
    ids = torch.tensor([[0, 7, 575]])
    assert torch.equal(lookup(ids), reference(ids).bfloat16())
    # Q4_0 experts (codes and fp16 d) in the native MoE block: what the per-expert modules give, bit for bit
    model = check_blocks_held_exactly(export_gguf(moe_ckpt, tmp_path / "moe-q4_0.gguf", "q4_0"),
                                      "int4 Q4_0 + int8 g32 fp32")
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj.spec.q40
    x = torch.randn(3, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        assert torch.equal(block(x), block.dispatched(x))


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """A random MoE over the built-in model's tokenizer, with an MTP head (per-expert names, fp32)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    tmp = tmp_path_factory.mktemp("moe")
    src, ckpt = tmp / "moe", tmp / "moe-mtp"
    config = Qwen3_5MoeTextConfig(**dict(MOE, vocab_size=576, num_hidden_layers=4))
    randomize(Qwen3_5MoeForCausalLM(config).eval(), 11).save_pretrained(src)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_model_path() / file, src / file)
    return add_mtp_head(src, ckpt)


def test_a_moe_file_with_an_mtp_head_matches_its_checkpoint_in_fp32(moe_ckpt, tmp_path):
    ckpt = moe_ckpt
    gguf = convert(ckpt, tmp_path / "moe.gguf", "f32", "qwen35")
    model, _ = qwenrt.load(gguf, dtype=torch.float32)
    reference, _ = qwenrt.load(ckpt, dtype=torch.float32)
    assert model.mtp is not None
    assert relative(logits(model), logits(reference)) <= 1e-6
    loaded = dict(model.mtp.named_parameters())
    for name, p in reference.mtp.named_parameters():
        if is_one_plus_norm(name, model.config.text):  # stored as 1 + w: the norm multiplies by the same 1 + w, w itself may differ
            assert torch.equal(1 + loaded[name], 1 + p), name
        else:
            assert torch.equal(loaded[name], p), name


def test_the_tokenizer_and_template_come_from_the_metadata(tmp_path, chat_ckpt):
    """A Qwen3.5 tokenizer written by the converter (vocab only) encodes, decodes and renders as the original."""
    src = tmp_path / "vocab"
    src.mkdir()
    for file in chat_ckpt[0].iterdir():
        if file.suffix in (".json", ".jinja") and file.name != "model.safetensors.index.json":
            shutil.copy(file, src / file.name)
    gguf = convert(src, tmp_path / "vocab.gguf", "f32", None, "--vocab-only", "--no-mtp")
    ours = Tokenizer(tokenizer_parts(Metadata(FileReader(gguf, "r").fields, gguf)), model_vocab_size=248320)
    original = Tokenizer(chat_ckpt[0])
    text = ("Hello World! 12345 naïve café — 東京で会いましょう。 def f(x):\n\treturn x**2  \n\n"
            "<|im_start|>user\nHi<|im_end|>\n<think>\n</think> Ünïcödé 🤖 ")
    assert ours.encode(text) == original.encode(text)
    ids = original.encode(text)
    assert ours.decode(ids) == original.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == original.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids[0] in original.eos_token_ids and ours.pad_token_id == original.pad_token_id
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
        original.apply_chat_template(chat, add_generation_prompt=True)
    assert ours.generation_defaults["top_k"] == 20 and np.isclose(ours.generation_defaults["top_p"], 0.95)


def differences(ours, theirs) -> list[str]:
    """What differs between two GGUF files: tensors (name, type, shape, bytes) and metadata (the model's name aside)."""
    a, b = FileReader(ours, "r"), FileReader(theirs, "r")
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    found = [f"tensors {sorted(set(ta) ^ set(tb))}"] if set(ta) != set(tb) else []
    found += [f"tensor {n}" for n in ta if n in tb and (ta[n].tensor_type != tb[n].tensor_type or
              list(ta[n].shape) != list(tb[n].shape) or not np.array_equal(ta[n].data, tb[n].data))]
    named = {"general.name", "general.size_label", "general.type"}
    keys = {k for k in set(a.fields) | set(b.fields) if not k.startswith("GGUF.")} - named  # GGUF.*: counts
    found += [f"key {k}" for k in sorted(keys) if k not in a.fields or k not in b.fields
              or a.fields[k].types != b.fields[k].types or a.fields[k].contents() != b.fields[k].contents()]
    return found


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_convert_writes_what_llama_cpps_converter_writes(tiny_files, kind, tmp_path):
    ours = export_gguf("qwenrt-tiny", tmp_path / "tiny.gguf", kind)
    # the built-in model has attention every third layer (both write attention.recurrent_layers; the converter's
    # interval is the config's default, 4); qwenrt states add_bos/add_eos false where the converter copies
    # tokenizer_config's flags (this one has none) and its bos token
    assert differences(ours, tiny_files[kind]) == ["key qwen35.full_attention_interval",
                                                   "key tokenizer.ggml.add_bos_token",
                                                   "key tokenizer.ggml.add_eos_token",
                                                   "key tokenizer.ggml.bos_token_id"]
    reference = qwenrt.load()[0] if kind == "bf16" else qwenrt.load(tiny_files[kind])[0]
    assert relative(logits(qwenrt.load(ours)[0]), logits(reference)) == 0.0


def test_convert_of_a_moe_with_an_mtp_head_is_the_converters_file(moe_ckpt, tmp_path):
    ours = export_gguf(moe_ckpt, tmp_path / "ours.gguf", "bf16")
    assert differences(ours, convert(moe_ckpt, tmp_path / "theirs.gguf", "bf16", "qwen35")) == [
        "key tokenizer.ggml.add_bos_token", "key tokenizer.ggml.add_eos_token"]  # stated false, see above


def test_convert_to_q4_k_m_keeps_the_sensitive_tensors_at_8_bits(tmp_path):
    out = export_gguf("qwenrt-tiny", tmp_path / "tiny.gguf", "q4_k_m")
    types = {t.name: t.tensor_type.name for t in FileReader(out, "r").tensors}
    # the built-in model's rows are 128 wide, not 256-value super-blocks: Q6_K falls back to Q8_0, Q4_K to Q5_0
    assert types["token_embd.weight"] == types["blk.2.attn_v.weight"] == "Q8_0"  # tied head; every third layer
    assert types["blk.1.attn_qkv.weight"] == types["blk.1.attn_gate.weight"] == "Q5_0"
    assert types["blk.1.ssm_out.weight"] == types["blk.1.ssm_alpha.weight"] == "Q8_0"
    assert types["blk.0.ssm_a"] == types["blk.0.attn_norm.weight"] == "F32"
    for name, tied, wanted in (("token_embd.weight", True, "Q6_K"), ("token_embd.weight", False, "Q4_K"),
                               ("output.weight", False, "Q6_K"), ("blk.0.ffn_down_exps.weight", False, "Q6_K"),
                               ("blk.5.ffn_down_exps.weight", False, "Q4_K"), ("blk.5.attn_q.weight", False, "Q4_K"),
                               ("blk.5.ssm_beta.weight", False, "Q8_0")):
        assert tensor_type(name, (512, 256), "q4_k_m", 40, tied).name == wanted, name
    model, _ = qwenrt.load(out, dtype=torch.float32)
    reference = qwenrt.load(dtype=torch.float32)[0]
    assert relative(logits(model), logits(reference)) < 0.2  # 5-bit blocks on a 128-wide model: 0.12
    assert out.stat().st_size < 0.5 * export_gguf("qwenrt-tiny", tmp_path / "bf16.gguf", "bf16").stat().st_size


@pytest.mark.parametrize("bits", [8, 4])
def test_convert_of_a_quantized_checkpoint_writes_the_weights_it_runs(bits, tmp_path):
    """A `qwenrt quantize` checkpoint (int4: a format per weight, its DeltaNet a/b at int8) converts from the values
    its kernels multiply by (its stored pieces dequantized): as an F32 file it gives its own fp32 logits."""
    from qwenrt.convert import quantize_checkpoint

    quantized = quantize_checkpoint(default_model_path(), tmp_path / f"int{bits}", bits)
    gguf = export_gguf(quantized, tmp_path / f"int{bits}.gguf", "f32")
    model, _ = qwenrt.load(gguf, dtype=torch.float32)
    reference, _ = qwenrt.load(quantized, dtype=torch.float32)
    assert model.mtp is not None and relative(logits(model), logits(reference)) <= 1e-6


def test_quantize_refuses_a_gguf_file_before_writing(tiny_files, tmp_path):
    from qwenrt.convert import quantize_checkpoint

    with pytest.raises(QwenrtError, match="a GGUF file runs as it is .*quantize takes a checkpoint directory"):
        quantize_checkpoint(tiny_files["q8_0"], tmp_path / "int8", 8)
    assert not any(tmp_path.iterdir())


def test_convert_is_all_or_nothing(tmp_path, monkeypatch):
    import qwenrt.gguf.export as export

    calls = []

    def failing(t, kind):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return encode(t, kind)

    encode = export.encode
    monkeypatch.setattr(export, "encode", failing)
    with pytest.raises(KeyboardInterrupt):
        export_gguf("qwenrt-tiny", tmp_path / "cut.gguf", "q8_0")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    for bad, message in ((("qwenrt-tiny", tmp_path / "x.gguf", "q3_k"), "unknown GGUF type 'q3_k'"),
                         (("qwenrt-tiny", tmp_path / "x.bin", "bf16"), "the output's name must end in .gguf")):
        with pytest.raises(QwenrtError, match=message):
            export_gguf(*bad)
