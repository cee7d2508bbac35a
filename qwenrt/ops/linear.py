"""Linear maps: the native matrix-vector kernels at decode (a few rows), torch's GEMM otherwise.

`project` runs several maps that share their input (q/k/v, the DeltaNet input projections) in one native call, and
`swiglu` the MLP's gate and up projections with its activation, so a decode step makes a few calls per layer
instead of one per weight and elementwise op. On CPUs without bf16 arithmetic the GEMM runs in fp32 (`gemm`): the
native one on x86 (kernels/cpu_gemm.cpp), else torch's on fp32 slices of the weight.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.kernels import cpu_level, inference_kernels, native_bf16_matmul

MAX_KERNEL_ROWS = 8  # the kernels stream each weight once for up to this many activation rows
GEMV_GEMM_ROWS = 64  # without the native GEMM, up to this many rows go through the GEMV kernels 8 at a time: faster
# than widening the whole weight to fp32 for torch's GEMM (bench/README.md: 85 vs 70 GFLOP/s at 64 rows)
NATIVE_GEMM_LEVELS = ("avx2", "avx512")  # where kernels/cpu_gemm.cpp's fp32 tiles beat torch's fp32 GEMM (above 8
# rows: 12 rows tie with the GEMV, 16 rows 40 vs 37 GMAC/s; 512 rows 55-59 vs 45-53, AVX2 EPYC, 2 threads); the
# portable build's would not beat an ARM BLAS
SLICE = 1 << 22  # weight elements converted to fp32 at a time, in one buffer kept per thread (16 MB)


def by_row_groups(call, x2: torch.Tensor) -> list[torch.Tensor] | None:
    """call(rows [<= MAX_KERNEL_ROWS, K]) -> a list of outputs [rows, N_i] (or None), over x2 [M, K] a group of
    MAX_KERNEL_ROWS rows at a time (each group one pass over the weights): the outputs [M, N_i], or None where the
    call has no kernel for these inputs."""
    if x2.shape[0] <= MAX_KERNEL_ROWS:
        return call(x2)
    first = call(x2[:MAX_KERNEL_ROWS])
    if first is None:
        return None
    groups = [first] + [call(x2[i:i + MAX_KERNEL_ROWS]) for i in range(MAX_KERNEL_ROWS, x2.shape[0], MAX_KERNEL_ROWS)]
    return [torch.cat(outs) for outs in zip(*groups)]


def decode_kernels(x: torch.Tensor, *weights: torch.Tensor):
    """The native kernels when x [..., K] is a decode-sized CPU input (at most MAX_KERNEL_ROWS rows) and autograd
    need not see through x or `weights`, else None."""
    if x.is_cpu and x.numel() <= MAX_KERNEL_ROWS * x.shape[-1]:
        return inference_kernels(x, *weights)
    return None


def _native(x: torch.Tensor, modules: list[nn.Module], mode: str) -> list[torch.Tensor] | None:
    """The modules' native decode call on x [..., K] (outputs [..., N_i]), or None where there is none."""
    kernels = decode_kernels(x, *(p for m in modules for p in m.parameters(recurse=False)))
    first = modules[0]
    if kernels is None or x.dtype != torch.bfloat16 or any(type(m) is not type(first) for m in modules):
        return None
    ys = first.decode_many(kernels, x.reshape(-1, x.shape[-1]).contiguous(), modules, mode)
    return None if ys is None else [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]


def project(x: torch.Tensor, modules: list[nn.Module]) -> list[torch.Tensor]:
    """[m(x) for m in modules], in one native call at decode when the modules share a weight format."""
    return _native(x, modules, "bf16") or [m(x) for m in modules]


def swiglu(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module) -> torch.Tensor:
    """silu(gate_proj(x))·up_proj(x), one native call at decode (rounded where torch's bf16 ops round)."""
    fused = _native(x, [gate_proj, up_proj], "swiglu")
    if fused is not None:
        return fused[0]
    return F.silu(gate_proj(x)) * up_proj(x)


class Linear(nn.Linear):
    """nn.Linear (no bias) whose decode-sized calls take the native bf16 kernel."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _native(x, [self], "bf16")
        return y[0] if y is not None else gemm(x, self.weight)

    @staticmethod
    def decode_many(kernels, x2: torch.Tensor, modules: list[Linear], mode: str) -> list[torch.Tensor] | None:
        """bf16 x2 [M, K] through each module's weight in one native call, or None unless the weights are bf16."""
        if any(m.weight.dtype != torch.bfloat16 for m in modules):
            return None
        return kernels.gemv_bf16(x2, [m.weight for m in modules], mode)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ -> [..., N] without a module (MoE experts' weight slices)."""
    kernels = decode_kernels(x, weight)
    if kernels is not None and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        y = kernels.gemv_bf16(x.reshape(-1, x.shape[-1]).contiguous(), [weight], "bf16")[0]
        return y.view(*x.shape[:-1], weight.shape[0])
    return gemm(x, weight)


def emulated_bf16(x: torch.Tensor) -> bool:
    """Whether x [..., K] is a bf16 CPU input of more than a few rows on a CPU that only emulates bf16 products:
    then fp32 GEMMs are several times faster (a few rows read the weight once either way: torch's bf16 kernel)."""
    return (x.dtype == torch.bfloat16 and x.is_cpu and x.numel() > MAX_KERNEL_ROWS * x.shape[-1]
            and not native_bf16_matmul())


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ -> [..., N] by a GEMM: torch's, except where `emulated_bf16`: there the native
    fp32 one (NATIVE_GEMM_LEVELS), else up to GEMV_GEMM_ROWS rows the GEMV kernels (a group of MAX_KERNEL_ROWS rows
    per weight pass) and beyond torch's fp32 GEMM on slices of the weight."""
    if emulated_bf16(x) and weight.dtype == torch.bfloat16:
        if needs_input_grad(x, weight):  # the fp32 slices reuse one buffer, which autograd cannot keep
            return frozen_product(x, lambda v: gemm(v, weight), weight.shape[0],
                                  lambda n0, n1, w: w.copy_(weight[n0:n1]))
        x2 = x.reshape(-1, x.shape[-1])
        kernels = inference_kernels(x, weight) if weight.is_contiguous() else None
        if kernels is not None and cpu_level() in NATIVE_GEMM_LEVELS:
            return kernels.gemm_bf16(x2.contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
        if kernels is not None and x2.shape[0] <= GEMV_GEMM_ROWS:
            y = by_row_groups(lambda rows: kernels.gemv_bf16(rows, [weight], "bf16"), x2.contiguous())[0]
            return y.view(*x.shape[:-1], weight.shape[0])
        return fp32_gemm(x, weight.shape[0], lambda n0, n1, w: w.copy_(weight[n0:n1]))
    return F.linear(x, weight)


def needs_input_grad(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether autograd needs d/dx through a product with frozen `weights` (a LoRA or QLoRA base)."""
    return torch.is_grad_enabled() and x.requires_grad and not any(w.requires_grad for w in weights)


class _FrozenProduct(torch.autograd.Function):
    """y = product(x) = x · Wᵀ for a frozen W [N, K], through whatever fast path `product` takes (the native kernels
    have no backward); dx = dy · W in fp32, W's rows written `fill_fp32(n0, n1, out)` a slice at a time."""

    @staticmethod
    def forward(ctx, x, product, N: int, fill_fp32):
        ctx.product_shape, ctx.dtype, ctx.N, ctx.fill = x.shape, x.dtype, N, fill_fp32
        return product(x)  # autograd is off in here: the native paths apply

    @staticmethod
    def backward(ctx, dy):
        K = ctx.product_shape[-1]
        dy32 = dy.reshape(-1, ctx.N).float()  # [M, N]
        dx = torch.zeros(dy32.shape[0], K)
        step = min(ctx.N, max(1, SLICE // K))
        buffer = _slice_buffer(step * K)
        for n0 in range(0, ctx.N, step):
            n1 = min(ctx.N, n0 + step)
            w = buffer[:(n1 - n0) * K].view(n1 - n0, K)
            ctx.fill(n0, n1, w)
            dx.addmm_(dy32[:, n0:n1], w)
        return dx.view(ctx.product_shape).to(ctx.dtype), None, None, None


def frozen_product(x: torch.Tensor, product, N: int, fill_fp32) -> torch.Tensor:
    """product(x) [..., N] = x [..., K] · Wᵀ with autograd through x only: W is frozen and `fill_fp32(n0, n1, out)`
    writes its rows n0..n1 in fp32 for the backward (fp32_gemm's fill)."""
    return _FrozenProduct.apply(x, product, N, fill_fp32)


_slices = threading.local()


def _slice_buffer(numel: int) -> torch.Tensor:
    """This thread's fp32 buffer for weight slices, at least numel elements. Reused because a fresh buffer of tens
    of MB per matrix costs its page faults each time: in a 0.8B prefill that made a 6144 x 1024 bf16 -> fp32 copy
    ~27 ms instead of ~4 (AVX2 EPYC, torch profiler), 7-16% of the prefill."""
    buffer = getattr(_slices, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
            buffer = _slices.buffer = torch.empty(numel)
    return buffer[:numel]


def fp32_gemm(x: torch.Tensor, N: int, fill_fp32) -> torch.Tensor:
    """x [..., K] · W [N, K]ᵀ -> [..., N] in x's dtype, computed in fp32 a slice of rows at a time:
    `fill_fp32(n0, n1, w)` writes W[n0:n1] in fp32 into w [n1 - n0, K]. The sums are torch's fp32 GEMM's, rounded
    once: as a bf16 GEMM rounds, at the FMA rate of the CPU's fp32 units rather than of emulated bf16
    (bench/README.md: ~5x the prefill on AVX2)."""
    K = x.shape[-1]
    x32 = x.reshape(-1, K).float()  # [M, K]
    step = min(N, max(1, SLICE // K))
    buffer = _slice_buffer(step * K)
    out = torch.empty(x32.shape[0], N, dtype=x.dtype)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        w = buffer[:(n1 - n0) * K].view(n1 - n0, K)
        fill_fp32(n0, n1, w)
        out[:, n0:n1] = x32 @ w.t()
    return out.view(*x.shape[:-1], N)
