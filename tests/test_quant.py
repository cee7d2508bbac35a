"""Weight-only quantization: kernels exact to their own dequantized weights, bounded quality loss, a stored
checkpoint that reloads to the same logits, precise parts untouched, and clear errors for bad arguments."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
import torch.nn.functional as F
from torch import nn

import qwenrt
from qwenrt.cli import main
from qwenrt.convert import quantize_checkpoint
from qwenrt.decode_plan import CyclePlan, DecodePlan
from qwenrt.default_model import default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.kernels import cpu_kernels
from qwenrt.quant import (QuantEmbedding, QuantExperts, QuantLinear, QuantSpec, default_predicate, dequantize_weight,
                          quantize_model, quantize_weight)
from tests.checkpoints import VOCAB
from tests.numerics import rel_err, teacher_forced_logits

SPECS = [QuantSpec(8), QuantSpec(4, 32), QuantSpec(4, 64), QuantSpec(4, 128)]
PROMPTS = torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantlinear_equals_its_dequantized_weight(spec, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 48, 256, generator=g)  # 3 experts; [1:] also serves as a plain weight
    stored = quantize_weight(w, spec)
    exact = dequantize_weight(stored, spec)  # [3, 48, 256] fp32
    bank = QuantLinear.from_stored(stored, spec, dtype)
    single = QuantLinear.from_stored({k: v[1] for k, v in stored.items()}, spec, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output is rounded to bf16
    # the GEMV kernels (small M; up to QUANT_GEMV_ROWS rows 8 at a time where bf16 products are emulated), and the
    # prefill GEMM (kernels/cpu_gemm.cpp where bf16 products are emulated, else dequantize + torch's GEMM)
    for m in (1, 5, 20, 40):
        x = torch.randn(2, m, 256, generator=g).to(dtype)
        ref = x.float() @ exact[1].T
        assert rel_err(single(x), ref) <= tol
        assert rel_err(bank(x, 2), x.float() @ exact[2].T) <= tol
        assert single(x).dtype == dtype and single(x).shape == (2, m, 48)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_rounding_error_at_most_half_a_step(spec):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    stored = quantize_weight(w, spec)
    err = (dequantize_weight(stored, spec) - w).abs()
    step = stored["scales"].float()
    if spec.bits == 4:
        step = step.repeat_interleave(spec.group_size, dim=-1)
    else:
        step = step[:, None]
    assert (err <= 0.5 * step * 1.02 + 1e-6).all()  # 2%: the zero point is rounded to bf16


def logit_stats(logits, reference):
    """(top-1 agreement, mean KL(reference || logits)) over every position."""
    kl = F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(), kl.mean().item()


def no_shared_expert(path, module):
    """The tiny MoE's shared expert has 48 features, which no int4 group size divides."""
    return default_predicate(path, module) and ".shared_expert." not in path


# Measured on these fixed random checkpoints (fp32 compute, 4 x 48 tokens): top-1 / KL(full || quantized)
#   dense: bf16 alone 1.00 / 2.3e-8; int8 1.00 / 2.5e-8; int4 g32 1.00 / 5.7e-5 (its tied embedding is looked up in
#   the quantized head: 7.5e-7 when it was kept in full precision)
#   MoE:   bf16 alone 0.98 / 1.0e-5; int8 0.99 / 9.5e-6; int4 g32 0.86 / 1.6e-3
# The bounds leave ~10x on KL and a few points of top-1: a wrong layout, scale or zero point breaks them by orders
# of magnitude, a small change in rounding does not.
BOUNDS = {("dense_ckpt", 8): (0.95, 1e-6), ("dense_ckpt", 4): (0.95, 5e-4),
          ("moe_ckpt", 8): (0.95, 1e-4), ("moe_ckpt", 4): (0.75, 2e-2)}


@pytest.mark.parametrize("kind", ["dense_ckpt", "moe_ckpt"])
@pytest.mark.parametrize("spec", [QuantSpec(8), QuantSpec(4, 32)], ids=str)
def test_quantized_logits_close_to_full_precision(kind, spec, request):
    path, _ = request.getfixturevalue(kind)
    full, _ = qwenrt.load(path, dtype="float32")
    reference = full(PROMPTS)
    quantize_model(full, spec.bits, spec.group_size, no_shared_expert)
    top1, kl = logit_stats(full(PROMPTS), reference)
    min_top1, max_kl = BOUNDS[kind, spec.bits]
    assert top1 >= min_top1 and kl <= max_kl, (top1, kl)


# The decode path (bf16 activations through the native GEMVs; int8 puts them in 16-bit fixed point), scored like
# the test above against fp32 logits over positions 8-47. Measured (top-1 / KL): dense bf16 alone 1.00 / 2.7e-8,
# int8 1.00 / 3.4e-8, int4 g32 1.00 / 7.1e-5 (quantized lookup); MoE bf16 alone 0.98 / 1.1e-5, int8 0.96 / 2.0e-5.
# Bounds: ~10x KL.
DECODE_BOUNDS = {("dense_ckpt", None): (0.95, 3e-7), ("dense_ckpt", 8): (0.95, 3e-7), ("dense_ckpt", 4): (0.95, 7e-4),
                 ("moe_ckpt", None): (0.9, 2e-4), ("moe_ckpt", 8): (0.9, 2e-4)}


@pytest.mark.parametrize("kind, spec", [("dense_ckpt", None), ("dense_ckpt", QuantSpec(8)),
                                        ("dense_ckpt", QuantSpec(4, 32)), ("moe_ckpt", None),
                                        ("moe_ckpt", QuantSpec(8))], ids=str)
def test_quantized_decode_close_to_full_precision(kind, spec, request):
    path, _ = request.getfixturevalue(kind)
    full, _ = qwenrt.load(path, dtype="float32")
    reference = full(PROMPTS)[:, 7:]
    model, _ = qwenrt.load(path, dtype="bfloat16", quantize=spec)
    top1, kl = logit_stats(teacher_forced_logits(model, PROMPTS, 8), reference)
    min_top1, max_kl = DECODE_BOUNDS[kind, spec.bits if spec else None]
    assert top1 >= min_top1 and kl <= max_kl, (top1, kl)


@pytest.mark.parametrize("kind, spec", [("dense_ckpt", QuantSpec(4, 32)), ("moe_ckpt", QuantSpec(8)),
                                        ("published_ckpt", QuantSpec(8))])
def test_saved_checkpoint_reloads_to_identical_logits(kind, spec, request, tmp_path):
    """Per-expert (transformers) and fused, VLM-prefixed (published) layouts; MTP and vision tensors copied."""
    path, _ = request.getfixturevalue(kind)
    dst = quantize_checkpoint(path, tmp_path / "q", spec.bits, spec.group_size)
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "qwenrt" and config["bits"] == spec.bits
    tied = kind == "dense_ckpt"  # a tied embedding is looked up in the quantized head, not stored again
    assert ("model.embed_tokens" in config["modules_not_converted"]) != tied
    assert ("model.embed_tokens.weight" in safe_open(next(dst.glob("*.safetensors")), "pt").keys()) != tied
    stored, _ = qwenrt.load(dst)
    in_memory, _ = qwenrt.load(path, quantize=spec)
    assert isinstance(stored.lm_head, QuantLinear)
    assert isinstance(stored.model.embed_tokens, QuantEmbedding) == tied
    layers = [m for m in stored.modules() if isinstance(m, QuantLinear)]
    assert all(m.qweight.data_ptr() % 64 == 0 for m in layers)  # aligned in the file: used in place by the kernels
    assert stored.extra_tensors == in_memory.extra_tensors
    assert torch.equal(stored(PROMPTS), in_memory(PROMPTS))


def test_precision_critical_parts_stay_untouched(moe_ckpt, dense_ckpt):
    for path, _ in (moe_ckpt, dense_ckpt):
        full, _ = qwenrt.load(path, dtype="bfloat16")
        quant, _ = qwenrt.load(path, dtype="bfloat16", quantize="int8")
        precise = dict(full.named_parameters())
        for name, p in quant.named_parameters():
            assert torch.equal(p, precise[name]), name  # every parameter left is the full-precision one
            assert name.endswith(("norm.weight", "A_log", "dt_bias", "conv1d.weight", "mlp.gate.weight",
                                  "shared_expert_gate.weight", "embed_tokens.weight")), name
        assert quant.model.layers[0].linear_attn.A_log.dtype == torch.float32
        linears = [n for n, m in quant.named_modules() if isinstance(m, nn.Linear)]
        assert all(n.endswith(("mlp.gate", "shared_expert_gate")) for n in linears), linears
        assert isinstance(quant.lm_head, QuantLinear)
    dense, _ = qwenrt.load(dense_ckpt[0], quantize="int8")
    assert isinstance(dense.model.embed_tokens, QuantEmbedding)  # tied: rows dequantized from the quantized head
    ids = torch.tensor([[0, 5, 511]])
    assert torch.equal(dense.model.embed_tokens(ids), dequantize_weight(
        {k: v[ids] for k, v in dense.model.embed_tokens.stored.items()}, QuantSpec(8)))
    assert dense.model.embed_tokens.stored["qweight"] is dense.lm_head.qweight  # one table, not two
    moe, _ = qwenrt.load(moe_ckpt[0], quantize="int8")
    assert isinstance(moe.model.layers[0].mlp.experts, QuantExperts)
    assert moe.model.layers[0].mlp.experts.gate_up_proj.qweight.shape == (8, 64, 64)  # quantized per expert row


def test_int4_holds_its_overrides_at_8_bits_and_keeps_unpackable_weights_precise(dense_ckpt, tmp_path, capsys):
    """int4 stores DeltaNet's a/b projections at int8 (INT4_OVERRIDES, said in quantization_config.overrides); what
    its layout cannot hold stays in full precision (torch's int4 layout needs N % 16 == 0 and the group size must
    divide K: with groups of 64 the 96-wide down_proj). `inspect` says both."""
    dst = quantize_checkpoint(dense_ckpt[0], tmp_path / "q", 4, 64)
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["overrides"] == {"linear_attn.in_proj_a": {"bits": 8}, "linear_attn.in_proj_b": {"bits": 8}}
    kept = config["modules_not_converted"]
    assert "model.layers.0.mlp.down_proj" in kept and "model.layers.0.mlp.up_proj" not in kept
    assert not any("in_proj" in path for path in kept)
    tensors = load_file(dst / "model.safetensors")
    b, qkv = "model.layers.0.linear_attn.in_proj_b", "model.layers.0.linear_attn.in_proj_qkv"
    assert tensors[f"{b}.qweight"].dtype == torch.int8 and tensors[f"{b}.qweight"].shape == (4, 64)
    assert tensors[f"{b}.scales"].shape == (4,) and f"{b}.zeros" not in tensors
    assert tensors[f"{qkv}.qweight"].dtype == torch.uint8 and tensors[f"{qkv}.zeros"].shape[-1] == 1  # 64 / 64
    assert main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert f"int4 g64 (int8: linear_attn.in_proj_a, linear_attn.in_proj_b), {len(kept)} modules kept" in out
    model, _ = qwenrt.load(dst)
    layer = model.model.layers[0]
    assert layer.linear_attn.in_proj_b.spec == QuantSpec(8) and layer.linear_attn.in_proj_qkv.spec == QuantSpec(4, 64)
    assert isinstance(layer.mlp.down_proj, nn.Linear)


def quantized_buffers(model) -> dict[str, tuple]:
    """Every QuantLinear's format and stored tensors: path -> (spec, qweight, scales, zeros)."""
    return {path: (m.spec, m.qweight, m.scales, m.zeros) for path, m in model.named_modules()
            if isinstance(m, QuantLinear)}


def test_every_producer_writes_the_same_mixed_int4(dense_ckpt, tmp_path):
    """`qwenrt quantize`, load-time quantize and quantize_model hold the same format per weight (int8 a/b among int4)
    in identical buffers; the decode plan binds the mixed projection list (int4 qkv, z then int8 b, a: two runs in
    one native call) and decodes exactly as the modules do."""
    path, spec = dense_ckpt[0], QuantSpec(4, 32)
    dst = quantize_checkpoint(path, tmp_path / "q", 4, 32)
    stored, _ = qwenrt.load(dst, dtype="float32")
    at_load, _ = qwenrt.load(path, dtype="float32", quantize=spec)
    in_place, _ = qwenrt.load(path, dtype="float32")
    quantize_model(in_place, 4, 32)
    reference = quantized_buffers(stored)
    assert reference["model.layers.0.linear_attn.in_proj_a"][0] == QuantSpec(8)
    assert reference["model.layers.0.mlp.down_proj"][0] == spec  # 96 columns: 3 groups of 32
    for other in (at_load, in_place):
        buffers = quantized_buffers(other)
        assert buffers.keys() == reference.keys()
        for name, (fmt, *tensors) in reference.items():
            assert buffers[name][0] == fmt and all(map(_same, tensors, buffers[name][1:])), name
    if cpu_kernels() is None:
        return
    model, _ = qwenrt.load(dst, dtype="bfloat16")
    assert DecodePlan.for_model(model) is not None
    assert torch.equal(teacher_forced_logits(model, PROMPTS[:2, :16], 8),
                       teacher_forced_logits(model, PROMPTS[:2, :16], 8, modules=True))


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b is None or (a is not None and b is not None and torch.equal(a, b))


def test_single_format_checkpoint_of_older_versions_still_loads(dense_ckpt, tmp_path):
    """Written without overrides (as before them: no `overrides` entry, the 4-row a/b projections kept in full
    precision), an int4 checkpoint loads as it was written, to the logits of the same quantization in memory."""
    dst = quantize_checkpoint(dense_ckpt[0], tmp_path / "q", 4, 32, overrides={})
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert "overrides" not in config and "model.layers.0.linear_attn.in_proj_b" in config["modules_not_converted"]
    stored, _ = qwenrt.load(dst, dtype="float32")
    assert isinstance(stored.model.layers[0].linear_attn.in_proj_b, nn.Linear)
    in_memory, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    quantize_model(in_memory, 4, 32, overrides={})
    assert torch.equal(stored(PROMPTS), in_memory(PROMPTS))


def test_malformed_overrides_are_one_line_errors(dense_ckpt, tmp_path, capsys):
    dst = quantize_checkpoint(dense_ckpt[0], tmp_path / "q", 8)
    config = json.loads((dst / "config.json").read_text())
    for overrides, message in (
            (["linear_attn.out_proj"], 'overrides must map module path suffixes to formats such as {"bits": 8}'),
            ({"linear_attn.out_proj": 8}, "overrides must map module path suffixes"),
            ({"": {"bits": 8}}, "overrides must map module path suffixes"),
            ({"linear_attn.out_proj": {"bits": 8, "zeros": True}}, "overrides must map module path suffixes"),
            ({"linear_attn.out_proj": {"bits": 3}}, "overrides['linear_attn.out_proj']: quantization bits must be 8"),
            ({"lm_head": {"bits": 4, "group_size": 48}}, "overrides['lm_head']: int4 group size must be one of")):
        config["quantization_config"]["overrides"] = overrides
        (dst / "config.json").write_text(json.dumps(config))
        assert main(["inspect", str(dst)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"qwenrt: error: {dst / 'config.json'}: "), err
        assert f"quantization_config.{message}" in err, err


def test_int4_copy_of_the_builtin_model_decodes_natively(tmp_path):
    """qwenrt-tiny stores its norms in fp32: its int4 copy loaded as "auto" once took their dtype, and then decoded
    through the modules in fp32 (5 tok/s against bf16's ~550). It loads in bf16 and decodes on the native path,
    its int8 DeltaNet b/a projections included, exactly as the modules do."""
    dst = quantize_checkpoint(default_model_path(), tmp_path / "q", 4)
    model, _ = qwenrt.load(dst)
    assert model.dtype == torch.bfloat16
    assert model.model.layers[0].linear_attn.in_proj_b.spec == QuantSpec(8)
    if cpu_kernels() is None:
        return
    ids = torch.randint(0, model.config.text.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    planned = teacher_forced_logits(model, ids, 8)
    assert DecodePlan.for_model(model) is not None and CyclePlan.for_model(model, 64) is not None
    assert torch.equal(planned, teacher_forced_logits(model, ids, 8, modules=True))


def test_quantized_lookup_equals_its_dequantized_rows(dense_ckpt):
    """A tied model's tokens are looked up in its quantized head, natively where the kernels run: the rows
    dequantize_weight gives, in the compute dtype."""
    for spec, dtype in ((QuantSpec(8), "bfloat16"), (QuantSpec(4, 32), "bfloat16"), (QuantSpec(4, 64), "float32")):
        model, _ = qwenrt.load(dense_ckpt[0], dtype=dtype, quantize=spec)
        lookup = model.model.embed_tokens
        ids = torch.tensor([[0, 5, VOCAB - 1], [7, 7, 1]])
        rows = dequantize_weight({k: v[ids] for k, v in lookup.stored.items()}, spec).to(model.dtype)
        assert torch.equal(lookup(ids), rows) and lookup(ids).shape == (2, 3, model.config.text.hidden_size)


def test_bad_arguments_are_clear_errors(dense_ckpt, tmp_path, capsys):
    path = dense_ckpt[0]
    with pytest.raises(QwenrtError, match="bits must be 8 or 4, got 3"):
        quantize_checkpoint(path, tmp_path / "a", 3)
    with pytest.raises(QwenrtError, match="group size must be one of 32, 64, 128, got 48"):
        QuantSpec(4, 48)
    with pytest.raises(QwenrtError, match="unknown quantization 'int3'"):
        qwenrt.load(path, quantize="int3")
    assert not list(tmp_path.iterdir())  # nothing written half-way
    assert main(["quantize", str(path), str(tmp_path / "c"), "--bits", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "qwenrt: error: quantization bits must be 8 or 4, got 3"
    dst = quantize_checkpoint(path, tmp_path / "d", 8)
    with pytest.raises(QwenrtError, match="already quantized"):
        qwenrt.load(dst, quantize="int8")
    with pytest.raises(QwenrtError, match="already exists"):
        quantize_checkpoint(path, dst, 8)


def test_stored_quantized_checkpoint_is_strictly_accounted(dense_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = quantize_checkpoint(dense_ckpt[0], tmp_path / "q", 8)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(QwenrtError, match="missing 1 tensor.*model.layers.1.mlp.up_proj.scales"):
        qwenrt.load(dst)


@pytest.mark.parametrize("kind, spec", [("published_ckpt", QuantSpec(4, 32)), ("published_ckpt", QuantSpec(8)),
                                        ("dense_ckpt", QuantSpec(4, 32))], ids=str)
def test_streamed_quantize_writes_what_the_in_memory_quantize_holds(kind, spec, request, tmp_path):
    """`qwenrt quantize` (tensor by tensor from the file) stores, byte for byte, the buffers `quantize_model` gives
    the loaded model: fused experts, the MTP head and a tied head included; the kept modules alike."""
    path, _ = request.getfixturevalue(kind)
    dst = quantize_checkpoint(path, tmp_path / "q", spec.bits, spec.group_size)
    written = {}
    for file in dst.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            written.update({name: f.get_tensor(name) for name in f.keys()})
    model, _ = qwenrt.load(path)  # as stored (bf16 here), as quantize reads it
    kept = quantize_model(model, spec.bits, spec.group_size)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["modules_not_converted"] == kept
    modules = {path: m for path, m in model.named_modules() if isinstance(m, QuantLinear)}
    published = kind == "published_ckpt"
    assert any(p.startswith("mtp.") for p in modules) == any(p.endswith("gate_up_proj") for p in modules) == published
    for path, module in modules.items():
        if module.torch_int4:  # held in torch's packed layout (no native kernels): not the stored one
            continue
        for key in module.spec.pieces:  # each weight's own format (int4 keeps some at int8)
            stored, held = written.pop(f"{path}.{key}"), getattr(module, key)
            assert stored.dtype == held.dtype and torch.equal(stored, held), f"{path}.{key}"
    params = dict(model.named_parameters())  # the modules kept precise; the vision tower's tensors are copied
    assert written.keys() - set(model.extra_tensors) == params.keys()
    assert all(torch.equal(written[name], p) for name, p in params.items())
