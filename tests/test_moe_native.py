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
from qwenrt.quant import QuantExperts, QuantLinear, QuantSpec, dequantize_weight, quantize_weight
from tests.checkpoints import MOE
from tests.numerics import int8_groups, rel_err

needs_kernels = pytest.mark.skipif(os.environ.get("QWENRT_KERNELS") == "0", reason="QWENRT_KERNELS=0: torch paths only")
FORMATS = {"bf16": None, "int8": QuantSpec(8), "int4": QuantSpec(4, 32)}


def random_block(shape: dict, std: float, seed: int, ties: bool, spec: QuantSpec | None) -> SparseMoeBlock:
    """A bf16 MoE block of MOE's config with `shape` over it, weights N(0, std²), experts in `spec` (None: bf16).
    ties: router rows in equal pairs, so every token's expert logits tie."""
    c = parse_config(dict(MOE, model_type="qwen3_5_moe_text") | shape, where="test").text
    g = torch.Generator().manual_seed(seed)
    m = SparseMoeBlock(c)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
        if ties:
            m.gate.weight[1::2] = m.gate.weight[0::2]
    m = m.bfloat16().requires_grad_(False)
    if spec is not None:
        m.experts = QuantExperts(quantized(m.experts.gate_up_proj, spec), quantized(m.experts.down_proj, spec))
    return m


def quantized(w: torch.Tensor, spec: QuantSpec) -> QuantLinear:
    return QuantLinear.from_stored(quantize_weight(w, spec), spec, torch.bfloat16)


# Qwen3-VL-MoE's block: no shared expert (its rotary covers the whole head: sections summing to head_dim / 2)
UNSHARED = {"model_type": "qwen3_vl_moe_text", "rope_parameters": {"mrope_section": [6, 5, 5]}}


def block(fmt: str, ties: bool = False, seed: int = 0, shared: bool = True) -> SparseMoeBlock:
    """A bf16 MoE block of the test checkpoints' shape (8 experts, top 3), experts in `fmt`; shared: with a shared
    expert (Qwen3.5's), else without (Qwen3-VL-MoE's)."""
    return random_block({} if shared else UNSHARED, 0.2, seed, ties, FORMATS[fmt])


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ties, shared", [(False, True), (True, True), (False, False)])
def test_native_moe_equals_the_module(fmt, ties, shared):
    """1, 3 and 8 rows (rows sharing experts; with 3 of 8 experts per row some get none): the native block gives
    the modules' output bit for bit, also where router logits tie (top-k's order decides between equal experts)
    and without a shared expert; the block's forward is the native one."""
    m = block(fmt, ties, shared=shared)
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
@pytest.mark.parametrize("fmt, shared", [(fmt, True) for fmt in FORMATS] + [("int4", False)])
def test_native_moe_matches_the_torch_path(fmt, shared, monkeypatch):
    """Against the block on torch's ops alone (no native kernel anywhere): 11 rows (more than one kernel call's)
    and 300 (a prefill chunk's, experts taking many rows each: int4 goes through the grouped kernel), within
    bf16's rounding; with and without a shared expert."""
    m = block(fmt, seed=3, shared=shared)
    g = torch.Generator().manual_seed(3)
    hs = [torch.randn(rows, m.gate.in_features, generator=g).bfloat16() for rows in (11, 300)]
    ours = [m(h) for h in hs]
    for module in (qwenrt.ops.linear, qwenrt.quant, qwenrt.moe, qwenrt.native):
        for name in ("cpu_kernels", "inference_kernels"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *tensors: None)
    reference = block(fmt, seed=3, shared=shared)
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


# ---- prefill sizes: the int4 experts grouped (kernels/cpu_moe_gemm.cpp) -----------------------------------------

GROUPED = dict(hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8,
               num_experts_per_tok=4)  # whole panels of the kernel's vectors; 4 of 8 experts: every row count > 8


def grouped_block(G: int, ties: bool = False, shared_int4: bool = True, seed: int = 0,
                  experts: str = "int4") -> SparseMoeBlock:
    """A bf16 block of GROUPED's shape with int4 experts in groups of G (or `experts` in FORMATS) and the shared
    expert in int4 too, unless not shared_int4. ties: router rows in equal pairs."""
    m = random_block(GROUPED, 0.1, seed, ties, QuantSpec(4, G) if experts == "int4" else FORMATS[experts])
    spec = QuantSpec(4, G)
    if shared_int4:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(m.shared_expert, name, quantized(getattr(m.shared_expert, name).weight, spec))
    return m


def exact_weight(layer: QuantLinear) -> torch.Tensor:
    return dequantize_weight({"qweight": layer.qweight, "scales": layer.scales, "zeros": layer.zeros},
                             layer.spec).double()


def expert_within(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, G: int) -> tuple:
    """An expert on rows x [n, D] bf16 (gate_up [2I, D], down [D, I] fp64) -> [n, D] fp64 each:
    exact     its output, and `bound` how far the grouped kernel may be from it: its x in 8 bits per group is off by
              d/2 per element (d = amax/127), so gate and up by Σ|W|·d/2; silu is 1.1-Lipschitz, so silu(g)·u by
              1.1·e_g·(|u| + e_u) + |silu(g)|·e_u; the SwiGLU in 8 bits per group again (its d at most
              (amax|act| + the error's)/127), and down sums both errors times |W|;
    emulated  the kernel's arithmetic in fp64 (x and the SwiGLU put in 8 bits as it puts them), and `tight` how far
              it may be from that: fp32 sums (1e-5 of Σ|terms|) and, where the fp32 SwiGLU lies within 2e-3 of a
              rounding boundary of its 8 bits, one step d of it."""
    gate, up = gate_up.chunk(2)
    xd = x.double()
    x8, dx = int8_groups(x, G)
    x_err = dx.double().repeat_interleave(G, 1) / 2
    g, u = xd @ gate.t(), xd @ up.t()
    e_g = x_err @ gate.abs().t() + 1e-5 * xd.abs() @ gate.abs().t()
    e_u = x_err @ up.abs().t() + 1e-5 * xd.abs() @ up.abs().t()
    silu = torch.nn.functional.silu(g)
    act = silu * u
    e_act = 1.1 * e_g * (u.abs() + e_u) + silu.abs() * e_u + 1e-5 * act.abs()
    amax = (act.abs() + e_act).view(len(x), -1, G).amax(-1)  # [n, I/G]
    act_err = e_act + (amax / 127).repeat_interleave(G, 1) / 2
    exact = act @ down.t()
    bound = act_err @ down.abs().t() + 1e-5 * (act.abs() + e_act) @ down.abs().t()
    act8 = torch.nn.functional.silu(x8 @ gate.t()) * (x8 @ up.t())
    q8, d8 = int8_groups(act8.float(), G)
    step = d8.double().repeat_interleave(G, 1)
    scaled = act8.abs() / step
    near = ((scaled - scaled.floor() - 0.5).abs() < 2e-3).double()
    tight = (near * step + 1e-5 * act8.abs()) @ down.abs().t() + 1e-5 * q8.abs() @ down.abs().t()
    return exact, bound, q8 @ down.t(), tight


def grouped_within(m: SparseMoeBlock, h: torch.Tensor) -> tuple:
    """The block on h [N, D] for the routing the native block takes (its router's logits, the same torch ops
    after): Σ over a row's experts of weight·expert_within's four, plus the shared expert's at sigmoid(gate), plus
    one bf16 rounding of the fp32 sum -> (exact, bound, emulated, tight) [N, D] fp64."""
    router = qwenrt.native.bind(cpu_kernels(), [m.gate, m.shared_expert_gate])
    logits, shared_logit = router(h, "bf16")
    top, index = logits.softmax(-1, dtype=torch.float32).topk(m.top_k, -1)
    weight = (top / top.sum(-1, keepdim=True)).bfloat16().double()
    G = m.experts.gate_up_proj.spec.group_size
    gate_up, down = exact_weight(m.experts.gate_up_proj), exact_weight(m.experts.down_proj)
    sums = [torch.zeros(h.shape, dtype=torch.float64) for _ in range(4)]
    for n in range(len(h)):
        for a in range(m.top_k):
            terms = expert_within(h[n:n + 1], gate_up[index[n, a]], down[index[n, a]], G)
            for total, term in zip(sums, terms):
                total[n] += weight[n, a] * term[0]
    shared = m.shared_expert
    sigma = shared_logit.float().sigmoid().double()
    terms = expert_within(h, torch.cat([exact_weight(shared.gate_proj), exact_weight(shared.up_proj)]),
                          exact_weight(shared.down_proj), G)
    for total, term in zip(sums, terms):
        total += sigma * term
    exact, bound, emulated, tight = sums
    return exact, bound + 2 ** -8 * (exact.abs() + bound), emulated, tight + 2 ** -8 * (emulated.abs() + tight)


@needs_kernels
@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize("ties", [False, True])
def test_grouped_int4_experts_within_their_8bit_rounding(G, ties):
    """9, 33 and 300 rows (rows sharing experts; 300 rows of 8 experts, 9 rows leaving some with none; ties in the
    router): each output within grouped_within's bound of the exact block (the error of 8-bit x and SwiGLU) and
    within fp32 sums and one bf16 rounding of its emulation; not the per-expert path's bits; deterministic."""
    m = grouped_block(G, ties)
    native, per_expert = native_block(m), bound_per_expert(cpu_kernels(), m)
    g = torch.Generator().manual_seed(G)
    for rows in (9, 33, 300):
        h = torch.randn(rows, m.gate.in_features, generator=g).bfloat16()
        out = native(h)
        exact, bound, emulated, tight = grouped_within(m, h)
        assert ((out.double() - exact).abs() <= bound).all()
        assert ((out.double() - emulated).abs() <= tight).all()
        assert not torch.equal(out, per_expert(h))
        assert torch.equal(out, native(h))  # deterministic


def bound_per_expert(kernels, m: SparseMoeBlock):
    """The block bound as kernels.MoE with the grouped path off: an expert's GEMV calls on its rows."""
    banks = [qwenrt.native.expert_bank(kernels, w) for w in (m.experts.gate_up_proj, m.experts.down_proj)]
    shared = m.shared_expert
    return kernels.MoE(qwenrt.native.bind(kernels, [m.gate, m.shared_expert_gate]), *banks,
                       qwenrt.native.bind(kernels, [shared.gate_proj, shared.up_proj], one_format=True),
                       qwenrt.native.bind(kernels, [shared.down_proj]), m.top_k, grouped=False)


@needs_kernels
def test_grouped_int4_experts_with_a_bf16_shared_expert():
    """A shared expert the grouped kernel does not take (bf16) is added after it: within bf16's rounding of the
    torch path."""
    m = grouped_block(64, shared_int4=False, seed=1)
    h = torch.randn(40, m.gate.in_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = native_block(m)(h)
    assert rel_err(out, m.dispatched(h)) < 2e-2 and not torch.equal(out, bound_per_expert(cpu_kernels(), m)(h))


@needs_kernels
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_prefill_rows_do_not_depend_on_the_other_rows(fmt):
    """A row's output is the same bits whichever rows share the call (a prefill in chunks == in one): row subsets
    of more than 8 rows, shuffled, against the whole call; int4 grouped, bf16 and int8 by expert."""
    m = grouped_block(64, seed=2, experts=fmt)
    native = native_block(m)
    h = torch.randn(300, m.gate.in_features, generator=torch.Generator().manual_seed(5)).bfloat16()
    whole = native(h)
    for subset in (torch.arange(100, 140), torch.randperm(300, generator=torch.Generator().manual_seed(6))[:9],
                   torch.arange(0, 300, 7)):
        assert torch.equal(native(h[subset]), whole[subset])
