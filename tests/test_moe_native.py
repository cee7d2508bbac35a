"""The native MoE block (kernels.MoE: router, the used experts, the shared expert in one call) against the block
through its modules (a call per used expert): bit-identical at decode sizes in every expert format, ties in the
router included, and within bf16's rounding of the torch path (kernels off)."""

import os

import pytest
import torch

import qwenrt.moe
import qwenrt.native
import qwenrt.ops.linear
import qwenrt.quant
from qwenrt.config import parse_config
from qwenrt.kernels import cpu_kernels
from qwenrt.moe import SparseMoeBlock, native_block
from qwenrt.quant import QuantExperts, QuantLinear, QuantSpec, quantize_weight
from tests.checkpoints import MOE
from tests.numerics import rel_err

needs_kernels = pytest.mark.skipif(os.environ.get("QWENRT_KERNELS") == "0", reason="QWENRT_KERNELS=0: torch paths only")
FORMATS = {"bf16": None, "int8": QuantSpec(8), "int4": QuantSpec(4, 32)}


def block(fmt: str, ties: bool = False, seed: int = 0) -> SparseMoeBlock:
    """A bf16 MoE block of the test checkpoints' shape (8 experts, top 3), experts in `fmt`. ties: router rows in
    equal pairs, so every token's expert logits tie."""
    c = parse_config(dict(MOE, model_type="qwen3_5_moe_text"), where="test").text
    g = torch.Generator().manual_seed(seed)
    m = SparseMoeBlock(c)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if ties:
            m.gate.weight[1::2] = m.gate.weight[0::2]
    m = m.bfloat16().requires_grad_(False)
    spec = FORMATS[fmt]
    if spec is not None:
        def quantized(w):
            return QuantLinear.from_stored(quantize_weight(w, spec), spec, torch.bfloat16)

        m.experts = QuantExperts(quantized(m.experts.gate_up_proj), quantized(m.experts.down_proj))
    return m


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ties", [False, True])
def test_native_moe_equals_the_module(fmt, ties):
    """1, 3 and 8 rows (rows sharing experts; with 3 of 8 experts per row some get none): the native block gives
    the modules' output bit for bit, also where router logits tie (top-k's order decides between equal experts);
    the block's forward is the native one."""
    m = block(fmt, ties)
    native = native_block(m)
    assert native is not None
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8):
        h = torch.randn(rows, m.gate.in_features, generator=g).bfloat16()
        assert torch.equal(native(h), m.dispatched(h))
        assert torch.equal(m(h[:, None])[:, 0], native(h))


@needs_kernels
def test_router_zero_weights_tie_every_expert():
    """All expert logits equal: every row takes the same top-k (torch's choice among ties) natively too."""
    m = block("int8")
    m.gate.weight.zero_()
    h = torch.randn(5, m.gate.in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(native_block(m)(h), m.dispatched(h))


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_moe_matches_the_torch_path(fmt, monkeypatch):
    """Against the block on torch's ops alone (no native kernel anywhere): 11 rows (more than one kernel call's)
    and 300 (a prefill chunk's, experts taking many rows each), within bf16's rounding."""
    m = block(fmt, seed=3)
    g = torch.Generator().manual_seed(3)
    hs = [torch.randn(rows, m.gate.in_features, generator=g).bfloat16() for rows in (11, 300)]
    ours = [m(h) for h in hs]
    for module in (qwenrt.ops.linear, qwenrt.quant, qwenrt.moe, qwenrt.native):
        for name in ("cpu_kernels", "inference_kernels"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *tensors: None)
    reference = block(fmt, seed=3)
    assert native_block(reference) is None
    for h, out in zip(hs, ours):
        assert rel_err(out, reference(h)) < 1e-2


@needs_kernels
def test_unbindable_experts_leave_the_module_path():
    """fp32 experts have no native format: no native block (the model then runs through its modules)."""
    m = block("bf16").float()
    assert native_block(m) is None


@needs_kernels
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_swiglu_over_several_pairs_equals_each_pair_alone(fmt):
    """The GEMV's swiglu mode over three (gate, up) pairs of different row counts (an MoE token's experts in one
    call): each pair's output as from a call of its own."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 128, generator=g).bfloat16()
    pairs = [[torch.randn(rows, 128, generator=g).bfloat16() * 0.1 for _ in range(2)] for rows in (48, 32, 80)]
    k = cpu_kernels()
    if fmt == "bf16":
        def call(weights):
            return k.gemv_bf16(x, weights, "swiglu")
    else:
        spec = QuantSpec(4, 32)
        stored = {id(w): quantize_weight(w, spec) for pair in pairs for w in pair}

        def call(weights):
            pieces = [stored[id(w)] for w in weights]
            return k.gemv_q4(x, [p["qweight"] for p in pieces], [p["scales"] for p in pieces],
                             [p["zeros"] for p in pieces], 32, "swiglu")
    together = call([w for pair in pairs for w in pair])
    assert len(together) == 3
    for out, pair in zip(together, pairs):
        assert torch.equal(out, call(pair)[0])
