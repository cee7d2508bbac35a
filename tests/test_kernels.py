"""Native CPU kernels and fast paths against the torch reference paths they replace."""

import copy
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

import qwenrt
import qwenrt.decode_plan
import qwenrt.deltanet
import qwenrt.model
import qwenrt.ops.linear
import qwenrt.quant
from qwenrt.config import TextConfig
from qwenrt.decode_plan import DecodePlan
from qwenrt.kernels import cpu_kernels, cpu_level, inference_kernels
from qwenrt.ops.attention import decode_attention
from qwenrt.ops.linear import MAX_KERNEL_ROWS
from qwenrt.ops.rope import apply_rope
from qwenrt.quant import QuantSpec, dequantize_weight, quantize_weight
from tests.checkpoints import VOCAB
from tests.numerics import int8_groups, rel_err, teacher_forced_logits

# Every CPU gets a kernel level (the portable one at least); only turning them off leaves torch paths alone.
needs_kernels = pytest.mark.skipif(os.environ.get("QWENRT_KERNELS") == "0", reason="QWENRT_KERNELS=0: torch paths only")
SHAPES = [(13, 100), (1027, 1024), (40, 1088), (512, 3584)]  # odd rows, tails of every kernel's column blocks


@needs_kernels
def test_kernels_are_the_build_of_this_level():
    """One build per level, named by it (QWENRT_ISA caps the level: the lower-level runs in test_kernel_levels)."""
    assert cpu_kernels().__name__.startswith(f"qwenrt_cpu_kernels_{cpu_level()}_")


def torch_paths_only(monkeypatch):
    """Make every caller see no native kernels, as on a CPU without them."""
    for module in (qwenrt.model, qwenrt.deltanet, qwenrt.ops.linear, qwenrt.quant, qwenrt.decode_plan):
        for name in ("cpu_kernels", "inference_kernels"):  # each module imports one of the two
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *tensors: None)


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8])
def test_gemv_bf16_several_weights_match_fp64_reference(M):
    g = torch.Generator().manual_seed(M)
    for N, K in SHAPES:
        x = torch.randn(M, K, generator=g).bfloat16()
        ws = [torch.randn(n, K, generator=g).bfloat16() for n in (N, 7, 64)]
        outs = cpu_kernels().gemv_bf16(x, ws, "fp32")
        for w, y in zip(ws, outs):
            ref = x.double() @ w.double().t()
            assert y.dtype == torch.float32 and y.shape == (M, w.shape[0])
            assert rel_err(y, ref) < 1e-6  # exact products, fp32 sums
        rounded = cpu_kernels().gemv_bf16(x, ws, "bf16")
        held = cpu_kernels().gemv_bf16(x, ws, "bf16_fp32")  # the same values, kept in fp32 (the logits)
        for y, r, h in zip(outs, rounded, held):
            assert r.dtype == torch.bfloat16 and torch.equal(r, y.bfloat16())
            assert h.dtype == torch.float32 and torch.equal(h, r.float())
        gate_up = [ws[0], torch.randn(N, K, generator=g).bfloat16()]
        gate, up = cpu_kernels().gemv_bf16(x, gate_up, "bf16")
        fused = cpu_kernels().gemv_bf16(x, gate_up, "swiglu")[0]  # rounded as torch's bf16 ops round
        assert torch.equal(fused, F.silu(gate) * up)


def int4_within_8bit_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, G: int) -> None:
    """y: an int4 product that takes x [M, K] in 8 bits per row and group of G (as llama.cpp's Q4_0 x Q8_0), w the
    dequantized weight [N, K] fp64. Its integer sums are exact, so y is the fp64 product of that x within fp32 sums
    and y's own rounding; against the bf16 x it is off by what the rounding of x implies, at most Σ|W|·d/2 per
    output (and it is off: the test sees the path)."""
    x8, d = int8_groups(x, G)
    ref8 = x8 @ w.t()
    tolerance = (2 ** -8 if y.dtype == torch.bfloat16 else 1e-6) * ref8.abs() + 1e-5 * ref8.abs().max()
    assert ((y.double() - ref8).abs() <= tolerance).all()
    exact = x.double() @ w.t()
    bound = (d.double().repeat_interleave(G, 1) / 2) @ w.abs().t()  # [M, N]: Σ_k |W_nk|·d_k/2
    assert ((y.double() - exact).abs() <= bound + tolerance).all()
    assert (x8 != x.double()).any()


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("spec", [QuantSpec(8), QuantSpec(4, 32), QuantSpec(4, 64), QuantSpec(4, 128)], ids=str)
def test_quantized_gemv_matches_its_dequantized_weight(M, spec):
    """x·dequant(W)ᵀ in fp64 vs the kernels. int8 puts x in 16-bit fixed point per 256 columns (error ≤ 2^-16 of a
    block's largest element): within 5e-5 of the largest output. int4 takes x in 8 bits per group, as the int4
    prefill GEMM does (int4_within_8bit_rounding), except on the avx512bf16 level, whose GEMV multiplies the bf16 x
    (unpacking the codes to bf16 128 + n and subtracting 136·s·Σx per group: fp32 cancellation, within 5e-5)."""
    g = torch.Generator().manual_seed(M * spec.bits)
    kernels = cpu_kernels()
    for N, K in SHAPES:
        if spec.bits == 4 and K % spec.group_size:
            continue
        x = torch.randn(M, K, generator=g).bfloat16()
        pieces = [quantize_weight(torch.randn(n, K, generator=g) * 0.02, spec) for n in (N, 16)]
        if spec.bits == 8:
            outs = kernels.gemv_q8(x, [p["qweight"] for p in pieces], [p["scales"] for p in pieces], "fp32")
        else:
            outs = kernels.gemv_q4(x, [p["qweight"] for p in pieces], [p["scales"] for p in pieces],
                                   [p["zeros"] for p in pieces], spec.group_size, "fp32")
        for p, y in zip(pieces, outs):
            w = dequantize_weight(p, spec).double()
            if spec.bits == 4 and cpu_level() != "avx512bf16":
                int4_within_8bit_rounding(y, x, w, spec.group_size)
            else:
                assert rel_err(y, x.double() @ w.t()) < 5e-5, (N, K)


def fp32_group_pieces(N: int, K: int, spec: QuantSpec, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random stored tensors of a GGUF block format (`QuantSpec.fp32_groups`): codes over their whole range, scales
    fp16 numbers as GGUF's are (so code·scale is exact in fp32), zeros of ~0.02."""
    groups = (N, K // spec.group_size)
    codes = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8) if spec.bits == 8 else \
        torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    if spec.q4k:  # Q4_K headers: fp16 d and dmin, then random 6-bit scales and mins
        headers = torch.randint(0, 256, (N, K // 256, 16), generator=g, dtype=torch.uint8)
        d = (torch.rand(N, K // 256, 2, generator=g) * 1e-5).half()  # d·sc of ~2e-4 at most, as above
        headers[..., :4] = d.view(torch.uint8)
        return {"qweight": codes, "scales": headers.reshape(N, K // 16)}
    if spec.q40:  # Q4_0's fp16 d per 32 columns
        return {"qweight": codes, "scales": (torch.rand(groups, generator=g) * 2e-4).half()}
    pieces = {"qweight": codes, "scales": (torch.rand(groups, generator=g) * 2e-4).half().float()}
    if "zeros" in spec.pieces:
        pieces["zeros"] = torch.randn(groups, generator=g) * 0.02
    return pieces


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("spec", [QuantSpec(8, 32, fp32_groups=True), QuantSpec(8, 16, fp32_groups=True),
                                  QuantSpec(8, 32, fp32_groups=True, zeros=True), QuantSpec(4, 32, fp32_groups=True),
                                  QuantSpec(4, 32, fp32_groups=True, q4k=True),
                                  QuantSpec(4, 32, fp32_groups=True, q40=True)], ids=str)
def test_gguf_block_gemv_matches_its_exact_weight(M, spec):
    """GGUF blocks held exactly (int8 codes with fp32 scales per 16 or 32 columns, zeros or not; int4 with fp32
    scales and zeros): the GEMVs against x·W in fp64, with the bounds of the int8 and int4 GEMVs above (int4 below
    avx512bf16 takes x in 8 bits per group). Several weights in one call, each with its own result."""
    g = torch.Generator().manual_seed(M * spec.group_size + spec.bits)
    kernels = cpu_kernels()
    for N, K in SHAPES:
        if K % (256 if spec.q4k else 32):
            continue
        x = torch.randn(M, K, generator=g).bfloat16()
        pieces = [fp32_group_pieces(n, K, spec, g) for n in (N, 16)]
        qs, scales = [p["qweight"] for p in pieces], [p["scales"] for p in pieces]
        zeros = [p["zeros"] for p in pieces if "zeros" in p]
        if spec.bits == 8:
            outs = kernels.gemv_q8g(x, qs, scales, zeros, spec.group_size, "fp32")
        elif spec.block_headers:
            outs = kernels.gemv_q4k(x, qs, scales, "fp32")
        else:
            outs = kernels.gemv_q4g(x, qs, scales, zeros, "fp32")
        for p, y in zip(pieces, outs):
            w = dequantize_weight(p, spec).double()
            if spec.bits == 4 and cpu_level() != "avx512bf16":
                int4_within_8bit_rounding(y, x, w, spec.group_size)
            else:
                assert rel_err(y, x.double() @ w.t()) < 5e-5, (N, K)


@needs_kernels
@pytest.mark.parametrize("spec", [QuantSpec(8, 16, fp32_groups=True), QuantSpec(8, 32, fp32_groups=True, zeros=True),
                                  QuantSpec(4, 32, fp32_groups=True), QuantSpec(4, 32, fp32_groups=True, q4k=True),
                                  QuantSpec(4, 32, fp32_groups=True, q40=True)], ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_gguf_block_rows_and_slices_are_the_exact_weight(spec, native, monkeypatch):
    """A token lookup in a table of GGUF blocks and QuantLinear's prefill / fp32 path (fp32 slices of the weight)
    give q·s + z exactly, natively and through torch ops."""
    g = torch.Generator().manual_seed(7)
    pieces = fp32_group_pieces(96, 256, spec, g)
    w = dequantize_weight(pieces, spec)
    ids = torch.tensor([5, 0, 95, 5])
    out = torch.empty(4, 256)
    cpu_kernels().dequantize_group_rows(ids, pieces["qweight"], pieces["scales"], pieces.get("zeros"),
                                        spec.group_size, out)
    assert torch.equal(out, w[ids])
    if not native:
        torch_paths_only(monkeypatch)
    lookup = qwenrt.quant.QuantEmbedding(pieces, spec, torch.bfloat16)
    assert torch.equal(lookup(ids[None])[0], w[ids].bfloat16())
    layer = qwenrt.quant.QuantLinear.from_stored(pieces, spec, torch.float32)
    x = torch.randn(20, 256, generator=g)
    assert torch.equal(layer(x), x @ w.t())


PREFILL_SHAPES = [(1, 16, 256), (7, 37, 384), (70, 100, 640), (129, 33, 1024), (9, 4200, 1024)]  # M, N, K: rows
# past whole tiles, columns past whole panels and blocks, more weight rows than one packed slice holds (4096 at 1024)


@needs_kernels
def test_int8_prefill_gemm_matches_its_dequantized_weight_and_the_gemv():
    """The int8 prefill GEMM takes x in the GEMV's fixed point and sums each block of 256 columns exactly in int32:
    within one bf16 rounding of the fp64 product with the dequantized weight, and equal to the GEMV's rows but for
    summation order (one bf16 ulp at most)."""
    g = torch.Generator().manual_seed(8)
    kernels = cpu_kernels()
    for M, N, K in PREFILL_SHAPES:
        x = torch.randn(M, K, generator=g).bfloat16()
        stored = quantize_weight(torch.randn(N, K, generator=g) * 0.02, QuantSpec(8))
        y = kernels.gemm_q8(x, stored["qweight"], stored["scales"])
        rows = kernels.gemv_q8(x[:8].contiguous(), [stored["qweight"]], [stored["scales"]], "bf16")
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        ref = x.double() @ dequantize_weight(stored, QuantSpec(8)).double().t()
        assert rel_err(y, ref) < 4e-3, (M, N, K)  # one bf16 rounding of each output
        assert torch.allclose(y[:8].float(), rows[0].float(), rtol=2 ** -7, atol=1e-6), (M, N, K)


@needs_kernels
@pytest.mark.parametrize("spec", [QuantSpec(8, 16, fp32_groups=True), QuantSpec(8, 32, fp32_groups=True, zeros=True)],
                         ids=str)
def test_gguf_int8_prefill_gemm_matches_its_exact_weight_and_the_gemv(spec):
    """The prefill GEMM of int8 GGUF blocks takes x in the GEMV's fixed point and sums each group exactly in int32:
    within 5e-5 of x·W (fp64), and within 2 bf16 steps of the GEMV's bf16 outputs."""
    g = torch.Generator().manual_seed(spec.group_size)
    kernels = cpu_kernels()
    for M, N, K in PREFILL_SHAPES:
        x = torch.randn(M, K, generator=g).bfloat16()
        pieces = fp32_group_pieces(N, K, spec, g)
        zeros = pieces.get("zeros")
        y = kernels.gemm_q8g(x, pieces["qweight"], pieces["scales"], zeros, spec.group_size)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert rel_err(y, x.double() @ dequantize_weight(pieces, spec).double().t()) < 5e-3  # y's own bf16 rounding
        gemv = torch.cat([kernels.gemv_q8g(x[i:i + 8], [pieces["qweight"]], [pieces["scales"]],
                                           [] if zeros is None else [zeros], spec.group_size, "fp32")[0]
                          for i in range(0, M, 8)])
        assert ((y.float() - gemv).abs() <= 2 * 2 ** -8 * gemv.abs() + 1e-5 * gemv.abs().max()).all()


@needs_kernels
@pytest.mark.parametrize("G", [32, 64, 128])
def test_int4_prefill_gemm_sums_8bit_activations_exactly(G):
    """The int4 prefill GEMM takes x in 8 bits per row and group, as the GEMV does (int4_within_8bit_rounding)."""
    g = torch.Generator().manual_seed(G)
    kernels = cpu_kernels()
    for M, N, K in PREFILL_SHAPES:
        x = torch.randn(M, K, generator=g).bfloat16()
        stored = quantize_weight(torch.randn(N, K, generator=g) * 0.02, QuantSpec(4, G))
        y = kernels.gemm_q4(x, stored["qweight"], stored["scales"], stored["zeros"], G)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        int4_within_8bit_rounding(y, x, dequantize_weight(stored, QuantSpec(4, G)).double(), G)
        if G == 32:  # GGUF's 4-bit blocks: fp32 scales and zeros, W = code·s + z
            spec = QuantSpec(4, 32, fp32_groups=True)
            pieces = fp32_group_pieces(N, K, spec, g)
            y = kernels.gemm_q4g(x, pieces["qweight"], pieces["scales"], pieces["zeros"])
            int4_within_8bit_rounding(y, x, dequantize_weight(pieces, spec).double(), G)
            if K % 256 == 0:  # Q4_K's headers as scales and zeros
                spec = QuantSpec(4, 32, fp32_groups=True, q4k=True)
                pieces = fp32_group_pieces(N, K, spec, g)
                y = kernels.gemm_q4k(x, pieces["qweight"], pieces["scales"])
                int4_within_8bit_rounding(y, x, dequantize_weight(pieces, spec).double(), G)


@needs_kernels
def test_q4_0_scales_are_the_fp32_groups_they_stand_for():
    """Q4_0 held as its codes and fp16 d (the file's size) multiplies as the fp32 scales d and zeros -8·d did, bit for
    bit: GEMV at 1-8 rows, prefill GEMM, row lookup; a header tensor of the wrong size is refused."""
    g = torch.Generator().manual_seed(40)
    kernels = cpu_kernels()
    held = fp32_group_pieces(48, 512, QuantSpec(4, 32, fp32_groups=True, q40=True), g)
    d = held["scales"].float()
    q, fp32 = held["qweight"], {"scales": d, "zeros": -8 * d}
    for M in (1, 3, 8, 40):
        x = torch.randn(M, 512, generator=g).bfloat16()
        if M <= 8:
            assert torch.equal(kernels.gemv_q4k(x, [q], [held["scales"]], "fp32")[0],
                               kernels.gemv_q4g(x, [q], [fp32["scales"]], [fp32["zeros"]], "fp32")[0])
        assert torch.equal(kernels.gemm_q4k(x, q, held["scales"]), kernels.gemm_q4g(x, q, fp32["scales"], fp32["zeros"]))
    ids, out, expected = torch.tensor([3, 47, 0]), torch.empty(3, 512), torch.empty(3, 512)
    kernels.dequantize_group_rows(ids, q, held["scales"], None, 32, out)
    kernels.dequantize_group_rows(ids, q, fp32["scales"], fp32["zeros"], 32, expected)
    assert torch.equal(out, expected)
    with pytest.raises(RuntimeError, match="Q4_0 scales"):
        kernels.gemv_q4k(x[:1], [q], [held["scales"][:, :-1].contiguous()], "fp32")


@needs_kernels
def test_bf16_prefill_gemm_sums_in_fp32():
    """The bf16 prefill GEMM: fp32 products and sums rounded once, so within one bf16 ulp of torch's fp32 GEMM on the
    widened operands and one rounding of the fp64 product; rows past whole tiles (6 on AVX2), columns past whole
    panels, more weight rows than one packed slice holds (496 at K = 4200)."""
    g = torch.Generator().manual_seed(5)
    kernels = cpu_kernels()
    for M, N, K in [(1, 16, 8), (7, 37, 384), (70, 100, 640), (129, 33, 1000), (9, 1100, 4200)]:
        x = torch.randn(M, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
        y = kernels.gemm_bf16(x, w)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert rel_err(y, x.double() @ w.double().t()) < 4e-3, (M, N, K)
        assert torch.allclose(y.float(), (x.float() @ w.float().t()).bfloat16().float(), rtol=2 ** -7, atol=1e-6)
    with pytest.raises(RuntimeError, match="gemm_bf16: x must be contiguous bf16"):
        kernels.gemm_bf16(torch.zeros(4, 9, dtype=torch.bfloat16), w)


@needs_kernels
@pytest.mark.parametrize("G", [32, 64, 128])
def test_int4_dequantization_kernel_equals_reference(G):
    pieces = quantize_weight(torch.randn(48, 512, generator=torch.Generator().manual_seed(G)), QuantSpec(4, G))
    exact = dequantize_weight(pieces, QuantSpec(4, G))
    args = (pieces["qweight"], pieces["scales"], pieces["zeros"], G)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full(exact.shape, float("nan"), dtype=dtype)
        cpu_kernels().dequantize_q4(*args, out)
        assert torch.equal(out, exact.to(dtype))


def test_linear_dispatch_equals_f_linear():
    g = torch.Generator().manual_seed(0)
    layer = qwenrt.ops.linear.Linear(256, 300)
    layer.weight.data = torch.randn(300, 256, generator=g).bfloat16()
    # up to 8 rows the GEMV kernel; beyond, a GEMM (where bf16 products are emulated, the native one on x86, else
    # the GEMV kernel 8 rows at a time up to GEMV_GEMM_ROWS and torch's in fp32 beyond)
    for shape in [(1, 256), (2, 1, 256), (4, 256), (5, 256), (3, 7, 256), (40, 256), (3, 30, 256)]:
        x = torch.randn(*shape, generator=g).bfloat16()
        ours, ref = layer(x), F.linear(x, layer.weight)
        assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
        # both accumulate in fp32 and round once; summation order may flip the last bit
        assert torch.allclose(ours.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("ragged", [False, True])
def test_torch_decode_attention_matches_sdpa(ragged):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 8, 1, 32, generator=g), torch.randn(2, 2, 50, 32, generator=g), torch.randn(2, 2, 50, 32, generator=g)
    mask = None
    if ragged:
        mask = torch.ones(2, 1, 1, 50, dtype=torch.bool)
        mask[1, ..., 30:] = False
    ours = decode_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(ours, ref, atol=1e-5)


def _norm(x, w, eps=1e-6):  # the decoder's zero-centred RMSNorm, as qwenrt.model.RMSNorm computes it
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)).to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_native_attention_step_matches_torch_ops(dtype, bound, gated):
    """q/k norm, partial RoPE, cache write, attention over ragged rows and the output gate, vs torch ops; ungated
    (Qwen3-VL): the query alone in qg, rotary over the whole head, no gate."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, D, cap = 2, 8, 2, 64, 96
    R = 16 if gated else D
    qg = torch.randn(B, H, 2 * D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, D, generator=g).to(dtype) for _ in range(2))
    qw, kw = torch.randn(D, generator=g) * 0.1, torch.randn(D, generator=g) * 0.1
    angles = torch.randn(B, R // 2, generator=g) * 3
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))  # [B, R]
    keys, values = (torch.randn(B, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
    lengths = torch.tensor([70, 33])  # the stores hold stale entries past each row's length
    ref_keys, ref_values = keys.clone(), values.clone()
    query = qg if gated else qg[..., :D].contiguous()
    out = cpu_kernels().attention_decode_step(query, k, v, qw, kw, cos, sin, keys, values, lengths, 1e-6, gated)
    for b, n in enumerate(lengths.tolist()):
        c, s = cos[b:b + 1, None], sin[b:b + 1, None]  # [1, 1, R]
        q = apply_rope(_norm(qg[b:b + 1, :, None, :D], qw), c, s)  # [1, H, 1, D]
        kb = apply_rope(_norm(k[b:b + 1, :, None], kw), c, s)
        ref_keys[b, :, n], ref_values[b, :, n] = kb[0, :, 0], v[b]
        o = F.scaled_dot_product_attention(q.float(), ref_keys[b:b + 1, :, :n + 1].float(),
                                           ref_values[b:b + 1, :, :n + 1].float(), enable_gqa=True).to(dtype)
        ref = o[0, :, 0] * torch.sigmoid(qg[b, :, D:]) if gated else o[0, :, 0]  # [H, D]
        assert (out[b].view(H, D).float() - ref.float()).abs().max().item() < bound
    assert torch.equal(values, ref_values)  # copied as they come
    assert (keys.float() - ref_keys.float()).abs().max().item() < bound  # normed (sum order) and rotated


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_of_one_sequence_in_one_call_equal_row_by_row(dtype):
    """Successive tokens of one sequence in one call (stores [1, ...], the speculative verification's form): each
    row attends to the rows before it and not after; the outputs and stores equal one call per row, bit for bit."""
    g = torch.Generator().manual_seed(4)
    T, H, Hkv, D, R, cap, start = 4, 8, 2, 64, 16, 48, 30
    qg = torch.randn(T, H, 2 * D, generator=g).to(dtype)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    qw, kw = torch.randn(D, generator=g) * 0.1, torch.randn(D, generator=g) * 0.1
    angles = torch.randn(T, R // 2, generator=g) * 3
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    keys, values = (torch.randn(1, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
    row_keys, row_values = keys.clone(), values.clone()
    kernels = cpu_kernels()
    together = kernels.attention_decode_step(qg, k, v, qw, kw, cos, sin, keys, values,
                                             torch.arange(start, start + T), 1e-6)
    one_by_one = torch.cat([kernels.attention_decode_step(qg[t:t + 1], k[t:t + 1], v[t:t + 1], qw, kw, cos[t:t + 1],
                                                          sin[t:t + 1], row_keys, row_values,
                                                          torch.tensor([start + t]), 1e-6) for t in range(T)])
    assert torch.equal(together, one_by_one) and torch.equal(keys, row_keys) and torch.equal(values, row_values)
    with pytest.raises(RuntimeError, match="successive positions"):
        kernels.attention_decode_step(qg[:2], k[:2], v[:2], qw, kw, cos[:2], sin[:2], keys, values,
                                      torch.tensor([start, start + 2]), 1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("H, Hkv, D", [(12, 2, 96), (4, 4, 48), (8, 2, 256)])
def test_native_attention_step_over_thousands_of_keys_matches_float64(dtype, bound, H, Hkv, D):
    """A decode step over 9,001 keys: three units of up to 4,096 keys (the last odd) merged, query heads in blocks of
    4 and 2 (G 6), one (G 1), and 4; dims in passes of 64 and 32 (96), 48 (not a multiple of 32: the fp32-product
    path at every level) and 256 (Qwen3.5's). Against float64 attention over the stored rows, relative to the
    largest output (a peaked softmax: one wrong unit or head moves it far)."""
    g = torch.Generator().manual_seed(H + D)
    S, R = 9001, 16
    qg = torch.randn(1, H, 2 * D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, D, generator=g).to(dtype) for _ in range(2))
    qw, kw = torch.full((D,), 1.0), torch.zeros(D)  # queries' norm x2: scores ~ N(0, 4)
    cos, sin = torch.ones(1, R, dtype=dtype), torch.zeros(1, R, dtype=dtype)
    keys, values = (torch.randn(1, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    out = cpu_kernels().attention_decode_step(qg, k, v, qw, kw, cos, sin, keys, values, torch.tensor([S - 1]),
                                              1e-6, True)
    q = _norm(qg[:, :, None, :D], qw)[0, :, 0].double()  # [H, D]
    kd, vd = (x[0].double().repeat_interleave(H // Hkv, 0) for x in (keys, values))  # [H, S, D]
    probs = torch.softmax((kd @ q[:, :, None])[..., 0] / D ** 0.5, -1)  # [H, S]
    ref = (probs[:, None, :] @ vd)[:, 0] * torch.sigmoid(qg[0, :, D:].double())
    assert (out.view(H, D).double() - ref).abs().max().item() / ref.abs().max().item() < bound


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_step_does_not_depend_on_the_batch_or_threads(dtype):
    """A long row's keys are split into units over the threads and merged in a fixed order: its output is the same,
    bit for bit, alone or beside another row, on 1 thread or 2."""
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, D, R, cap = 2, 8, 2, 64, 16, 10000
    qg = torch.randn(B, H, 2 * D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, D, generator=g).to(dtype) for _ in range(2))
    qw, kw = torch.randn(D, generator=g) * 0.1, torch.randn(D, generator=g) * 0.1
    cos, sin = torch.ones(B, R, dtype=dtype), torch.zeros(B, R, dtype=dtype)
    keys, values = (torch.randn(B, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
    lengths = torch.tensor([9000, 5000])
    kernels, threads = cpu_kernels(), torch.get_num_threads()

    def step(rows: slice, n: int):
        torch.set_num_threads(n)
        try:
            return kernels.attention_decode_step(qg[rows], k[rows], v[rows], qw, kw, cos[rows], sin[rows],
                                                 keys[rows].clone(), values[rows].clone(), lengths[rows], 1e-6)
        finally:
            torch.set_num_threads(threads)

    both = step(slice(0, 2), 2)
    assert torch.equal(both, step(slice(0, 2), 1))
    assert torch.equal(both[:1], step(slice(0, 1), 2)) and torch.equal(both[1:], step(slice(1, 2), 1))


def deltanet(Dk: int, Dv: int, dtype, taps: int = 4) -> qwenrt.deltanet.GatedDeltaNet:
    """A DeltaNet layer with every weight random (norm and conv included), 2 key heads shared by 4 value heads, a
    short conv of `taps` (Qwen3.5's 4, which the native step compiles for, or any other)."""
    config = TextConfig(model_type="qwen3_5_text", vocab_size=8, hidden_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, layer_types=("linear_attention",),
                        linear_key_head_dim=Dk, linear_value_head_dim=Dv, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_conv_kernel_dim=taps)
    layer = qwenrt.deltanet.GatedDeltaNet(config, 0)
    g = torch.Generator().manual_seed(Dk + Dv)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
    return layer.to(dtype)


@needs_kernels
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("Dk, Dv, taps", [(128, 128, 4), (32, 40, 4), (32, 32, 3)],
                         ids=["published", "value-tail", "3-tap-conv"])
def test_native_deltanet_steps_match_torch_ops(Dk, Dv, taps, dtype, bound, monkeypatch):
    """Prefill 6 tokens (native short conv) and decode 5 (fused step: conv, norms, delta rule, gated norm) on a batch
    of 2, against the layer's torch ops from the same states. Under inference mode, as the engine runs: with grad on,
    the kernels stand aside for autograd (the test once compared torch ops with themselves that way)."""
    layer = deltanet(Dk, Dv, dtype, taps)
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    C = layer.in_proj_qkv.out_features
    fused = []
    step = layer.fused_decode_step
    monkeypatch.setattr(layer, "fused_decode_step", lambda *args: fused.append(1) or step(*args))

    def run(native: bool):
        monkeypatch.setattr(qwenrt.deltanet, "inference_kernels", inference_kernels if native else lambda *t: None)
        conv, rec = torch.zeros(2, C, taps - 1), torch.zeros(2, 4, Dk, Dv)
        with torch.inference_mode():
            out, conv, rec = layer(x[:, :6], conv, rec)
            outs = [out]
            for t in range(6, 11):
                out, conv, rec = layer(x[:, t:t + 1], conv, rec)
                outs.append(out)
        return torch.cat(outs, 1), rec

    (ours, our_state), (ref, ref_state) = run(True), run(False)
    assert len(fused) == 5  # every decode step went through the native kernel
    assert rel_err(ours, ref) < bound and rel_err(our_state, ref_state) < bound


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltanet_steps_in_one_call_equal_single_steps_and_keep_each_state(dtype):
    """T successive tokens of one sequence in one call (a speculative verification): the outputs and final state
    equal T single steps, and the state saved after token t equals the single steps' state after it, bit for bit."""
    layer = deltanet(32, 40, dtype)
    T, C = 4, layer.in_proj_qkv.out_features
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, 64, generator=g).to(dtype)
    mixed, z, b, a = (p(x).contiguous() for p in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b,
                                                  layer.in_proj_a))
    conv0, rec0 = torch.randn(1, C, 3, generator=g), torch.randn(1, 4, 32, 40, generator=g) * 0.1
    kernels = cpu_kernels()
    conv, rec, outs, states = conv0.clone(), rec0.clone(), [], []
    with torch.inference_mode():
        for t in range(T):
            outs.append(layer.native_step(kernels, mixed[t:t + 1], z[t:t + 1], b[t:t + 1], a[t:t + 1], conv, rec))
            states.append((conv.clone(), rec.clone()))
        conv_all, rec_all = conv0.clone(), rec0.clone()
        saved_conv, saved_rec = torch.empty(T - 1, C, 3), torch.empty(T - 1, 4, 32, 40)
        out = layer.native_steps(kernels, mixed, z, b, a, conv_all, rec_all, saved_conv, saved_rec)
    assert torch.equal(out, torch.cat(outs)) and torch.equal(conv_all, conv) and torch.equal(rec_all, rec)
    for t in range(T - 1):
        assert torch.equal(saved_conv[t:t + 1], states[t][0]) and torch.equal(saved_rec[t:t + 1], states[t][1])


@needs_kernels
def test_prefill_conv_silu_rounds_as_torch_in_bf16():
    """The native short conv + SiLU over a bf16 chunk == torch's conv1d (fp32 sums) rounded, then torch's bf16 SiLU,
    element for element: its e^x is within an ulp of torch's (one 4x too coarse flipped 1 rounding in ~1,300).
    The portable level has no FMA (products and sums rounded apart, e^x too): there a rare rounding flips, one bf16
    ulp of the conv's sum, relatively large where its 4 products nearly cancel."""
    g = torch.Generator().manual_seed(0)
    T, C, K = 64, 1024, 4
    x = (torch.randn(1, T, C, generator=g) * 2).bfloat16()
    w = torch.randn(C, K, generator=g) * 0.5
    y = cpu_kernels().causal_conv1d_silu(x, torch.zeros(1, C, K - 1), w)
    sums = F.conv1d(x.float().transpose(1, 2), w[:, None], padding=K - 1, groups=C)[..., :T]
    reference = F.silu(sums.bfloat16()).transpose(1, 2)
    if cpu_level() != "portable":
        assert torch.equal(y, reference)
    else:
        apart = y != reference
        assert apart.sum() <= y.numel() // 1000
        assert ((y - reference).float().abs() <= reference.float().abs() * 2 ** -6 + 1e-6).all()


@needs_kernels
def test_argmax_rows_picks_what_torch_argmax_picks():
    """Each row's first largest, ties in other lanes, blocks and the tail included; a NaN wins (the first), as do
    infinities; rows shorter than a vector and of every length modulo it."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(V, generator=g) for V in (1, 3, 8, 17, 100, 1031, 248_320)]
    rows += [torch.randint(-3, 4, (V,), generator=g).float() for V in (9, 64, 1000, 4099)]  # many ties
    x = torch.randn(5003, generator=g)  # 3 past whole blocks of 8 or 16 lanes
    for places in ([5002], [4995, 5001], [5001, 5002], [7, 15], [3000, 11], [12, 4]):  # tail, lanes, blocks
        y = x.clone()
        y[places] = 9.0
        rows.append(y)
    for special in (float("nan"), float("inf"), -float("inf")):
        for places in ([0], [20], [5002], [20, 40]):
            y = x.clone()
            y[places] = special
            rows.append(y)
    rows += [torch.full((37,), -float("inf")), torch.full((37,), float("nan"))]
    for row in rows:
        assert cpu_kernels().argmax_rows(row[None]).tolist() == [int(row.argmax())], row.numel()
    batch = torch.randn(4, 1031, generator=g)
    assert torch.equal(cpu_kernels().argmax_rows(batch), batch.argmax(-1))


@needs_kernels
def test_argmax_allowed_rows_picks_what_a_masked_torch_argmax_picks():
    """An output constraint's pick from its packed mask (bit i of word i // 32 for token i) against torch.where(mask,
    row, -inf).argmax(): sparse and dense masks, one allowed token in the tail or one lane, ties split by the mask,
    nothing allowed, a NaN or infinity inside and outside the mask, vocabularies of every length modulo a vector."""
    g = torch.Generator().manual_seed(1)

    def packed(mask: torch.Tensor) -> torch.Tensor:  # [V] bool -> [ceil(V / 32)] int32
        bits = torch.zeros((mask.numel() + 31) // 32 * 32, dtype=torch.int64)
        bits[:mask.numel()] = mask.long()
        words = (bits.view(-1, 32) << torch.arange(32)).sum(1)  # [W], < 2^32
        return torch.where(words >= 2 ** 31, words - 2 ** 32, words).int()

    cases = []
    for V in (1, 5, 16, 33, 100, 1031, 5003, 248_320):
        row = torch.randn(V, generator=g)
        for p in (0.001, 0.3, 0.97, 1.0):
            cases.append((row, torch.rand(V, generator=g) < p))
        cases += [(row, torch.arange(V) == V - 1), (row, torch.arange(V) == V // 3), (row, torch.zeros(V, dtype=bool))]
    ties = torch.randint(-2, 3, (4099,), generator=g).float()  # many ties: the mask decides which comes first
    cases += [(ties, torch.rand(4099, generator=g) < p) for p in (0.05, 0.5)]
    x = torch.randn(5003, generator=g)
    for special in (float("nan"), float("inf"), -float("inf")):
        for place in (0, 20, 5002):
            y = x.clone()
            y[place] = special
            allow = torch.rand(5003, generator=g) < 0.5
            cases += [(y, allow | (torch.arange(5003) == place)), (y, allow & (torch.arange(5003) != place))]
    for row, mask in cases:
        expected = int(torch.where(mask, row, -torch.inf).argmax())
        assert cpu_kernels().argmax_allowed_rows(row[None], packed(mask)).tolist() == [expected], (row.numel(), mask.sum())
    batch, mask = torch.randn(4, 1031, generator=g), torch.rand(1031, generator=g) < 0.2
    assert torch.equal(cpu_kernels().argmax_allowed_rows(batch, packed(mask)), torch.where(mask, batch, -torch.inf).argmax(-1))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_residual_norm_matches_torch_ops(dtype):
    g = torch.Generator().manual_seed(9)
    x, h = (torch.randn(3, 5, 1000, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(1000, generator=g) * 0.1
    total, normed = cpu_kernels().rms_norm(x, h, w, 1e-6)
    assert torch.equal(total, x + h)  # rounded once, as torch adds
    assert (normed.float() - _norm(x + h, w).float()).abs().max() <= (1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("kind, dtype, quantize, bound", [
    ("dense_ckpt", "float32", None, 1e-5), ("dense_ckpt", "bfloat16", None, 1e-2), ("moe_ckpt", "bfloat16", None, 1e-2),
    ("dense_ckpt", "bfloat16", QuantSpec(8), 1e-2), ("moe_ckpt", "bfloat16", QuantSpec(8), 1e-2),
    ("dense_ckpt", "bfloat16", QuantSpec(4, 32), 1e-2), ("dense_ckpt", "float32", QuantSpec(4, 32), 1e-5),
    ("qwen3_vl_ckpt", "bfloat16", None, 1e-2), ("qwen3_vl_ckpt", "float32", None, 1e-5),
    ("qwen3_vl_moe_ckpt", "bfloat16", None, 1e-2)])
def test_native_decode_matches_torch_paths(kind, dtype, quantize, bound, request, monkeypatch):
    """Decode through every native kernel (fused projections, DeltaNet step, attention step, quantized GEMVs) vs the
    torch ops they replace, same weights, same rounding points: a batch of 2, 20 prompt and 12 decoded tokens."""
    path = request.getfixturevalue(kind)[0]
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    native, _ = qwenrt.load(path, dtype=dtype, quantize=quantize)
    ours = teacher_forced_logits(native, ids, 20)
    torch_paths_only(monkeypatch)
    reference, _ = qwenrt.load(path, dtype=dtype, quantize=quantize)  # int4: torch's packed layout
    err = rel_err(ours, teacher_forced_logits(reference, ids, 20))
    assert err < bound, err


@needs_kernels
@pytest.mark.parametrize("kind, quantize", [("dense_ckpt", None), ("moe_ckpt", None), ("dense_ckpt", "int8"),
                                           ("dense_ckpt", "int4"), ("moe_ckpt", "int8"), ("moe_ckpt", "int4"),
                                           ("qwen3_vl_ckpt", None), ("qwen3_vl_ckpt", "int4"),
                                           ("qwen3_vl_moe_ckpt", None), ("qwen3_vl_moe_ckpt", "int4")])
def test_decode_plan_equals_the_modules_native_path(kind, quantize, request):
    """The bound plan runs the same kernels on the same inputs as the modules: identical logits. The layers run as
    one native call per step (LayerStack), an MoE block inside it as one native object (router, the used experts,
    the shared expert). int4 keeps the DeltaNet layers' 4-row b and a projections in bf16: their input projections
    are two runs, one int4 GEMV and one bf16. A batch of 4: rows share experts, and some experts get none."""
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(4))
    model, _ = qwenrt.load(request.getfixturevalue(kind)[0], dtype="bfloat16", quantize=quantize)
    planned = teacher_forced_logits(model, ids, 16)
    assert DecodePlan.for_model(model) is not None
    assert torch.equal(planned, teacher_forced_logits(model, ids, 16, modules=True))


@needs_kernels
def test_decode_plan_takes_batches_beyond_the_kernel_rows(dense_ckpt):
    """A batch larger than one kernel call takes (MAX_KERNEL_ROWS) goes through in groups: each sequence's logits
    as in a batch of its own."""
    ids = torch.randint(0, VOCAB, (MAX_KERNEL_ROWS + 2, 16), generator=torch.Generator().manual_seed(8))
    model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
    whole = teacher_forced_logits(model, ids, 8)
    parts = torch.cat([teacher_forced_logits(model, ids[i:i + 5], 8) for i in range(0, len(ids), 5)])
    assert rel_err(whole, parts) < 1e-2


@needs_kernels
def test_decode_plan_follows_module_swaps(dense_ckpt):
    """A plan built before the model's modules are swapped (here: quantized in place) is rebuilt."""
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
    full = teacher_forced_logits(model, ids, 16)
    plan = DecodePlan.for_model(model)
    qwenrt.quant.quantize_model(model, 8)
    assert DecodePlan.for_model(model) is not plan
    quantized = teacher_forced_logits(model, ids, 16)
    assert torch.equal(quantized, teacher_forced_logits(model, ids, 16, modules=True))
    assert not torch.equal(full, quantized)


def test_loaded_and_run_under_inference_mode(dense_ckpt):
    """Weights created under torch.inference_mode (no version counters) decode the same as normal ones."""
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
    expected = teacher_forced_logits(model, ids, 6)
    with torch.inference_mode():
        model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
        assert torch.equal(teacher_forced_logits(model, ids, 6), expected)


@needs_kernels
def test_decoded_model_copies_and_pickles(dense_ckpt):
    """The decode plan lives beside the model, not in it: a model that has decoded deep-copies and pickles."""
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(7))
    model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
    expected = teacher_forced_logits(model, ids, 6)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(teacher_forced_logits(clone, ids, 6), expected)


@needs_kernels
def test_lora_rows_match_fp64_and_leave_other_rows():
    """lora_add_rows (served adapters at decode): each listed row y + scale·B·(A·x) within one bf16 rounding of the
    fp64 value (K and N off the vector width: the tails), the other rows untouched, a row's result the same alone."""
    k = cpu_kernels()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 70, generator=g).bfloat16()
    y = torch.randn(5, 37, generator=g).bfloat16()
    A, Bt = torch.randn(3, 70, generator=g), torch.randn(3, 37, generator=g)
    out = y.clone()
    k.lora_add_rows(x, out, A, Bt, 0.5, torch.tensor([1, 3, 4]))
    exact = y.double() + 0.5 * (x.double() @ A.double().t()) @ Bt.double()
    rows = [1, 3, 4]
    assert torch.equal(out[[0, 2]], y[[0, 2]])
    assert ((out[rows].double() - exact[rows]).abs() <= exact[rows].abs() * 2 ** -8 + 1e-6).all()
    assert not torch.equal(out[rows], y[rows])
    alone = y.clone()
    k.lora_add_rows(x, alone, A, Bt, 0.5, torch.tensor([3]))
    assert torch.equal(alone[3], out[3])
