"""Weight-only int8 / int4 quantization: the stored format, QuantLinear, and the module swap.

Stored format (what checkpoints hold, the same on every machine), for a weight W [*E, N, K] (E: MoE experts):
    int8  qweight int8 [*E, N, K];   scales bf16 [*E, N]                  W ≈ q·s        (symmetric, per output row)
    int4  qweight uint8 [*E, N, K/2]; scales, zeros bf16 [*E, N, K/G]     W ≈ (q - 8)·s + z  (min-max, per G columns)
          byte j of a group holds column j (low nibble) and column j + G/2 (high nibble), as GGUF's Q4_0.
In memory both stay as stored, used in place by the native kernels (qwenrt/kernels/cpu_gemv.cpp) at decode and
dequantized per matrix for prefill's GEMM (to fp32, a slice at a time, where bf16 products are emulated); without
the native kernels int4 is repacked into torch's CPU layout for `_weight_int4pack_mm_for_cpu`.
Norms, A_log, dt_bias, conv1d, the MoE router and the shared-expert gate stay in full precision, and so does the
embedding lookup of an untied model (a tied one reads the quantized head's rows, see `QuantEmbedding`). A format may
hold some weights in another (`INT4_OVERRIDES`), said in `quantization_config.overrides`.

fp32 groups (`QuantSpec.fp32_groups`): GGUF's quantized blocks as they are (qwenrt.gguf.blocks), no value rounded:
    int8  qweight int8 [*E, N, K];    scales (, zeros) fp32 [*E, N, K/G], G = 16 or 32   W = q·s + z
    int4  qweight uint8 [*E, N, K/2]; scales, zeros fp32 [*E, N, K/32] (the int4 layout)  W = q·s + z
    Q4_K  qweight as int4; scales uint8 [*E, N, K/16]: Q4_K's 16-byte header per 256 columns (fp16 d, dmin; 6-bit sc,
          m per 32), W = q·d·sc - dmin·m, expanded per row inside the kernels (Q4_K held in its own size)
    Q4_0  qweight as int4; scales fp16 [*E, N, K/32]: Q4_0's d, W = (q - 8)·d, expanded per row inside the kernels
The native kernels multiply them in place; fp32 activations multiply by exact fp32 slices of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.errors import QwenrtError
from qwenrt.kernels import cpu_kernels
from qwenrt.mlp import Experts, dispatch_experts
from qwenrt.ops.linear import MAX_KERNEL_ROWS, by_row_groups, emulated_bf16, fp32_gemm, frozen_product, needs_input_grad

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
QUANT_METHOD = "qwenrt"
# routers pick and weigh the experts: a flipped choice costs more than their few bytes save
KEEP_PRECISE = ("mlp.gate", "mlp.shared_expert_gate")
# int4 holds these weights (path suffixes, see `spec_for`) at 8 bits. bench/quality.py --tasks on the built-in model,
# mean KL vs fp32 of int4 g64 everywhere 0.0391: DeltaNet's decay / beta projections in_proj_a/b at int8 0.0388 (no
# measurable change, +0.1% of the 35B-A3B's bytes per token: kept for long contexts the built-in model cannot test);
# out_proj int8 0.0377 (within noise, +6.5% bytes per token) and lm_head int8 0.0252 (+13%; +26% on the 0.8B): int4
INT4_OVERRIDES = {"linear_attn.in_proj_a": 8, "linear_attn.in_proj_b": 8}
EMBEDDING = "model.embed_tokens"
# up to this many rows the packed kernels win; above, dequantize + GEMM (bench/kernels.py, M = 1..512)
SMALL_M = 16
# where bf16 products are emulated, up to this many rows go through the GEMVs 8 rows per weight pass, more through
# the GEMM (kernels/cpu_gemm.cpp, which packs the weight first): the 0.8B's layers, 2 threads, AVX2 EPYC, GEMV vs
# GEMM GMAC/s: int8 66 vs 49 at 32 rows, 62 vs 67 at 64, 72 vs 85 at 128; int4 60 vs 51, 63 vs 73, 62 vs 90
QUANT_GEMV_ROWS = 32
CHUNK = 1 << 22  # elements per slice when (de)quantizing: bounded temporaries for the 248K-row head
TINY = 1e-12  # scale floor for all-zero rows / groups


@dataclass(frozen=True)
class QuantSpec:
    """bits 8 (per output channel) or 4 (per group of `group_size` input columns), bf16 scales: qwenrt's own.
    fp32_groups: a GGUF block type held exactly, fp32 scales per group of 16 or 32 (int8) or 32 (int4) and fp32
    zeros (int4 always, int8 where `zeros`), W = q·s + z."""

    bits: int
    group_size: int | None = None
    fp32_groups: bool = False
    zeros: bool = False
    q4k: bool = False  # int4 whose scales and zeros are Q4_K's headers
    q40: bool = False  # int4 whose scales are Q4_0's fp16 d (zeros -8·d)

    def __post_init__(self):
        if type(self.bits) is not int or self.bits not in BITS:
            raise QwenrtError(f"quantization bits must be 8 or 4, got {self.bits!r}")
        if self.fp32_groups:
            if self.group_size not in ((16, 32) if self.bits == 8 else (32,)) or (self.zeros and self.bits == 4) \
                    or (self.block_headers and self.bits != 4) or (self.q4k and self.q40):
                raise QwenrtError(f"no fp32-group format int{self.bits} g{self.group_size}")
            return
        if self.block_headers:
            raise QwenrtError("Q4_K and Q4_0 headers are GGUF block formats (fp32_groups)")
        if self.zeros:
            raise QwenrtError("zeros are part of the int4 and fp32-group formats only")
        if self.bits == 4 and self.group_size not in GROUP_SIZES:
            sizes = ", ".join(map(str, GROUP_SIZES))
            raise QwenrtError(f"int4 group size must be one of {sizes}, got {self.group_size!r}")
        if self.bits == 8 and self.group_size is not None:
            raise QwenrtError("int8 quantization is per output channel: it takes no group size")

    @classmethod
    def parse(cls, value, group_size: int | None = None) -> QuantSpec:
        """"int8" | "int4" | 8 | 4 | a QuantSpec -> QuantSpec (int4 defaults to groups of 64)."""
        if isinstance(value, QuantSpec):
            return value
        if isinstance(value, str):
            if value not in ("int8", "int4"):
                raise QwenrtError(f"unknown quantization {value!r} (use int8 or int4)")
            value = int(value[3:])
        return cls(value, (group_size or DEFAULT_GROUP_SIZE) if value == 4 else group_size)

    def config(self, not_converted: list[str], overrides: dict[str, QuantSpec]) -> dict:
        """The `quantization_config` entry of config.json (`overrides` only where there are some: a single-format
        checkpoint's reads as before them)."""
        config = {"quant_method": QUANT_METHOD, "bits": self.bits, "group_size": self.group_size,
                  "modules_not_converted": not_converted}
        if overrides:
            config["overrides"] = {suffix: {"bits": o.bits} | ({"group_size": o.group_size} if o.group_size else {})
                                   for suffix, o in overrides.items()}
        return config

    @property
    def pieces(self) -> tuple[str, ...]:
        """Names of the stored tensors of one quantized weight."""
        return ("qweight", "scales", "zeros") if (self.bits == 4 and not self.block_headers) or self.zeros else \
            ("qweight", "scales")

    @property
    def block_headers(self) -> bool:
        """Whether the scales (and zeros) are a GGUF block type's own headers (Q4_K's, Q4_0's): held in its size."""
        return self.q4k or self.q40

    @property
    def kernel_format(self) -> str:
        """The native kernels' name of the format: q8 | q4 (bf16 scales), q8g | q4g (fp32 groups), q4k (block
        headers: Q4_K's, Q4_0's)."""
        return "q4k" if self.block_headers else f"q{self.bits}" + ("g" if self.fp32_groups else "")

    @property
    def short(self) -> str:
        """"int4 g64", "int8", "int8 g16 fp32", "int4 Q4_K": for load lines."""
        if self.block_headers:
            return "int4 Q4_K" if self.q4k else "int4 Q4_0"
        return f"int{self.bits}" + (f" g{self.group_size}" if self.group_size else "") + \
            (" fp32" if self.fp32_groups else "")

    def __str__(self) -> str:
        if self.block_headers:
            return f"int4 ({'Q4_K' if self.q4k else 'Q4_0'}'s scales, groups of 32)"
        if self.fp32_groups:
            return f"int{self.bits} (fp32-scaled groups of {self.group_size})"
        return f"int{self.bits}" + (f" (groups of {self.group_size})" if self.group_size else "")


def default_overrides(spec: QuantSpec) -> dict[str, QuantSpec]:
    """The weights `spec` holds in another format: module path suffix -> that format."""
    if spec.bits != 4 or spec.fp32_groups:
        return {}
    return {suffix: QuantSpec.parse(bits) for suffix, bits in INT4_OVERRIDES.items()}


def spec_for(path: str, spec: QuantSpec, overrides: dict[str, QuantSpec]) -> QuantSpec:
    """The format of the weight at `path` (a Linear's module path; an expert bank's + .gate_up_proj / .down_proj):
    that of the longest override suffix it ends with (whole names: "out_proj" is no suffix of "x_out_proj"), else
    `spec`."""
    matches = [suffix for suffix in overrides if path == suffix or path.endswith("." + suffix)]
    return overrides[max(matches, key=len)] if matches else spec


def stored_spec(raw_config: dict, where: str = "config.json"
                ) -> tuple[QuantSpec, list[str], dict[str, QuantSpec]] | None:
    """A checkpoint's `quantization_config` -> (spec, modules kept in full precision, overrides: module path suffix
    -> the format of its weights), or None if not quantized. Errors name `where`."""
    try:
        return _stored_spec(raw_config)
    except QwenrtError as e:
        raise QwenrtError(f"{where}: {e}") from None


def _stored_spec(raw_config: dict) -> tuple[QuantSpec, list[str], dict[str, QuantSpec]] | None:
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise QwenrtError(f"quantization method {method!r} is not supported (qwenrt reads its own: '{QUANT_METHOD}')")
    kept = q.get("modules_not_converted", [])
    if not isinstance(kept, list) or not all(isinstance(m, str) for m in kept):
        raise QwenrtError(f"quantization_config.modules_not_converted must be a list of module names, got {kept!r:.60}")
    return QuantSpec(q.get("bits"), q.get("group_size")), kept, _stored_overrides(q.get("overrides", {}))


def _stored_overrides(raw) -> dict[str, QuantSpec]:
    """`quantization_config.overrides`: {"module path suffix": {"bits": 8 | 4(, "group_size": G)}} -> QuantSpecs."""
    usage = 'must map module path suffixes to formats such as {"bits": 8}'
    if not isinstance(raw, dict):
        raise QwenrtError(f"quantization_config.overrides {usage}, got {raw!r:.60}")
    overrides = {}
    for suffix, fmt in raw.items():
        if not suffix or not isinstance(fmt, dict) or not set(fmt) <= {"bits", "group_size"}:
            raise QwenrtError(f"quantization_config.overrides {usage}, got {suffix!r:.60}: {fmt!r:.60}")
        try:
            overrides[suffix] = QuantSpec(fmt.get("bits"), fmt.get("group_size"))
        except QwenrtError as e:
            raise QwenrtError(f"quantization_config.overrides[{suffix!r:.60}]: {e}") from None
    return overrides


# ---- the stored format ------------------------------------------------------------------------------------------

def storage_entries(shape: tuple[int, ...], spec: QuantSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Stored tensors of a quantized weight [*E, N, K]: suffix -> (shape, dtype)."""
    *lead, N, K = shape
    if spec.q4k:  # Q4_K's 16-byte header per 256 columns
        return {"qweight": ((*lead, N, K // 2), torch.uint8), "scales": ((*lead, N, K // 16), torch.uint8)}
    if spec.q40:  # Q4_0's fp16 d per 32 columns
        return {"qweight": ((*lead, N, K // 2), torch.uint8), "scales": ((*lead, N, K // 32), torch.float16)}
    if spec.fp32_groups:
        groups = (*lead, N, K // spec.group_size)
        codes = ((*lead, N, K), torch.int8) if spec.bits == 8 else ((*lead, N, K // 2), torch.uint8)
        return {"qweight": codes, **{piece: (groups, torch.float32) for piece in spec.pieces[1:]}}
    if spec.bits == 8:
        return {"qweight": ((*lead, N, K), torch.int8), "scales": ((*lead, N), torch.bfloat16)}
    groups = (*lead, N, K // spec.group_size)
    return {"qweight": ((*lead, N, K // 2), torch.uint8), "scales": (groups, torch.bfloat16),
            "zeros": (groups, torch.bfloat16)}


def _quantize_rows(w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """w [R, K] fp32 -> stored tensors for these rows. Scales are rounded to bf16 first, then q is fit to them."""
    if spec.bits == 8:
        s = (w.abs().amax(-1) / 127).clamp(min=TINY).to(torch.bfloat16)  # [R]
        return {"qweight": (w / s.float()[:, None]).round().clamp(-127, 127).to(torch.int8), "scales": s}
    R, K = w.shape
    G = spec.group_size
    g = w.reshape(R, K // G, G)
    lo, hi = g.amin(-1), g.amax(-1)  # [R, K/G]
    s = ((hi - lo) / 15).clamp(min=TINY).to(torch.bfloat16)
    z = (lo + 8 * s.float()).to(torch.bfloat16)  # the value of the middle code, q = 8
    q = ((g - z.float()[..., None]) / s.float()[..., None] + 8).round().clamp(0, 15).to(torch.uint8)  # [R, K/G, G]
    packed = q[..., : G // 2] | (q[..., G // 2:] << 4)  # [R, K/G, G/2]
    return {"qweight": packed.reshape(R, K // 2), "scales": s, "zeros": z}


def quantize_weight(w: torch.Tensor, spec: QuantSpec, name: str = "weight") -> dict[str, torch.Tensor]:
    """W [*E, N, K] in any float dtype -> its stored tensors {'qweight', 'scales'(, 'zeros')}."""
    if spec.fp32_groups:
        raise QwenrtError(f"{spec} is read from GGUF files, not written by qwenrt's quantizer")
    K = w.shape[-1]
    if spec.bits == 4 and K % spec.group_size:
        raise QwenrtError(f"int4 group size {spec.group_size} does not divide the {K} input features of {name}")
    flat = w.reshape(-1, K)  # [R, K]
    out = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in storage_entries(flat.shape, spec).items()}
    step = max(1, CHUNK // K)
    for start in range(0, flat.shape[0], step):
        for key, value in _quantize_rows(flat[start:start + step].float(), spec).items():
            out[key][start:start + step] = value
    return {key: out[key].reshape(shape) for key, (shape, _) in storage_entries(tuple(w.shape), spec).items()}


def _unpack_int4(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Stored int4 bytes [..., K/2] -> codes [..., K] uint8 in 0..15."""
    p = qweight.reshape(*qweight.shape[:-1], -1, group_size // 2)  # [..., K/G, G/2]
    return torch.cat([p & 15, p >> 4], dim=-1).reshape(*qweight.shape[:-1], -1)


def dequantize_weight(stored: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """The stored tensors -> W [*E, N, K] fp32, exactly what the kernels multiply by."""
    if spec.block_headers:
        s, z = q4k_scales(stored["scales"]) if spec.q4k else (stored["scales"].float(), -8 * stored["scales"].float())
        stored = {"qweight": stored["qweight"], "scales": s, "zeros": z}
    s = stored["scales"].float()
    if spec.fp32_groups:
        q = stored["qweight"].float() if spec.bits == 8 else _unpack_int4(stored["qweight"], spec.group_size).float()
        w = q.reshape(*s.shape, spec.group_size) * s[..., None]  # [..., N, K/G, G]
        if "zeros" in stored:
            w += stored["zeros"][..., None]
        return w.flatten(-2)
    if spec.bits == 8:
        return stored["qweight"].float() * s[..., None]
    q = _unpack_int4(stored["qweight"], spec.group_size).float()
    q = q.reshape(*s.shape, spec.group_size)  # [..., N, K/G, G]
    return ((q - 8) * s[..., None] + stored["zeros"].float()[..., None]).flatten(-2)


def q4k_scales(headers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K headers [..., K/16] uint8 (per 256 columns: fp16 d, dmin, then 12 bytes of 6-bit scales and mins) ->
    the fp32 scale d·sc and zero -dmin·m of each group of 32 [..., K/32], as llama.cpp's get_scale_min_k4."""
    h = headers.reshape(*headers.shape[:-1], -1, 16)  # [..., K/256, 16]
    d, dmin = (h[..., i:i + 2].contiguous().view(torch.float16).float() for i in (0, 2))  # [..., K/256, 1]
    q = h[..., 4:].to(torch.int32)  # [..., K/256, 12]
    sc = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)  # [..., K/256, 8]
    m = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return (d * sc.float()).flatten(-2), (-(dmin * m.float())).flatten(-2)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself, or a copy at a 64-byte boundary: `_weight_int8pack_mm` (torch 2.13, CPU) uses aligned vector
    loads and crashes on a weight or input that is not 32-byte aligned (safetensors offsets need not be)."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def _int4_kernel_layout(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Stored int4 [N, K/2] -> torch's packed CPU layout (same shape; order depends on the CPU's vector width)."""
    N, half = qweight.shape
    out = torch.empty_like(qweight)
    step = max(64, CHUNK // (2 * half) // 64 * 64)  # whole 64-row blocks per slice: packing works per row block
    for start in range(0, N, step):
        codes = _unpack_int4(qweight[start:start + step], group_size).to(torch.int32)
        out[start:start + step] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)  # 2: unused on CPU
    return out


# ---- the module -------------------------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """y = x·dequant(W)ᵀ for a weight-only quantized W [*E, N, K] (E experts: call with `expert`).

    Buffers: int8 qweight int8 [*E, N, K], scales bf16 [*E, N] (as stored). int4 with the native kernels: as stored,
    qweight uint8 [*E, N, K/2], scales and zeros bf16 [*E, N, K/G]; without them, torch's packed CPU layout for
    `_weight_int4pack_mm_for_cpu`: qweight [*E, N, K/2] reordered, scales = scale-and-zero [*E, K/G, N, 2].
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, spec: QuantSpec, in_features: int,
                 zeros: torch.Tensor | None = None):
        super().__init__()
        self.spec = spec
        self.in_features, self.out_features = in_features, qweight.shape[-2]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)  # int4 in the stored layout only

    @property
    def torch_int4(self) -> bool:
        """int4 held in torch's packed layout (no zeros buffer: they sit in `scales`)."""
        return self.spec.bits == 4 and self.zeros is None and not self.spec.fp32_groups

    @classmethod
    def from_stored(cls, stored: dict[str, torch.Tensor], spec: QuantSpec, dtype: torch.dtype) -> QuantLinear:
        q = stored["qweight"]
        if spec.fp32_groups:  # as stored, whatever the kernels: the fallback multiplies by fp32 slices of it
            K = q.shape[-1] * (2 if spec.bits == 4 else 1)
            return cls(q.contiguous(), stored["scales"].contiguous(), spec, K,
                       stored["zeros"].contiguous() if "zeros" in stored else None)
        if spec.bits == 8:
            return cls(_aligned(q.contiguous()), stored["scales"].contiguous(), spec, q.shape[-1])
        N, half = q.shape[-2:]
        if cpu_kernels() is not None:  # the native kernels read the stored layout: used in place
            return cls(q.contiguous(), stored["scales"].contiguous(), spec, 2 * half, stored["zeros"].contiguous())
        packed = torch.stack([_int4_kernel_layout(w, spec.group_size) for w in q.reshape(-1, N, half)])
        sz = torch.stack([stored["scales"], stored["zeros"]], dim=-1).transpose(-3, -2)  # [*E, K/G, N, 2]
        return cls(packed.reshape(q.shape), sz.to(dtype).contiguous(), spec, 2 * half)

    @classmethod
    def placeholder(cls, shape: tuple[int, ...], spec: QuantSpec) -> QuantLinear:
        """A shapes-only (meta) module for a weight of `shape` (stored layout), replaced by the loaded one."""
        with torch.device("meta"):
            pieces = [torch.empty(sh, dtype=d) for sh, d in storage_entries(shape, spec).values()]
        return cls(pieces[0], pieces[1], spec, shape[-1], zeros=pieces[2] if len(pieces) == 3 else None)

    def _weights(self, expert: int | None):
        if expert is None:
            return self.qweight, self.scales, self.zeros
        return self.qweight[expert], self.scales[expert], None if self.zeros is None else self.zeros[expert]

    def forward(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        w, s, z = self._weights(expert)
        if needs_input_grad(x):  # a QLoRA base: frozen, but earlier adapters need its input's gradient
            return frozen_product(x, lambda v: self.forward(v, expert), self.out_features, self._fill_rows(w, s, z))
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        kernels = cpu_kernels()
        rows = x2.shape[0]
        if kernels is not None and (rows <= MAX_KERNEL_ROWS or (rows <= QUANT_GEMV_ROWS and emulated_bf16(x2))):
            y = by_row_groups(lambda part: self._native(kernels, part, [(w, s, z)], "bf16"), x2)
            if y is not None:
                return y[0].reshape(*x.shape[:-1], self.out_features)
        if self.spec.fp32_groups:
            if kernels is not None and x2.dtype == torch.bfloat16:  # prefill in integer sums (kernels/cpu_gemm.cpp):
                # int8 with x in 16-bit fixed point, int4 with x in 8 bits per group (as llama.cpp's blocks take it)
                y = kernels.gemm_q8g(x2, w, s, z, self.spec.group_size) if self.spec.bits == 8 else \
                    kernels.gemm_q4k(x2, w, s) if self.spec.block_headers else kernels.gemm_q4g(x2, w, s, z)
            else:  # fp32 slices of the exact weight through torch's fp32 GEMM, rounded once
                y = fp32_gemm(x2, self.out_features, self._fill_rows(w, s, z))
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.torch_int4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, self.spec.group_size, s.to(x.dtype))
        elif self.spec.bits == 8 and x2.shape[0] <= SMALL_M:
            y = torch.ops.aten._weight_int8pack_mm(_aligned(x2), _aligned(w), s.to(x.dtype))
        elif emulated_bf16(x2) and kernels is not None:  # prefill in int32 block sums (kernels/cpu_gemm.cpp)
            if self.spec.bits == 8:
                y = kernels.gemm_q8(x2, w, s)
            else:
                y = kernels.gemm_q4(x2, w, s, z, self.spec.group_size)
        elif emulated_bf16(x2):  # the same without the kernels (int8; int4 is in torch's layout then): fp32 slices of
            # the weight, dequantized exactly (int8 -> fp32, times the fp32 scale), through torch's fp32 GEMM
            y = fp32_gemm(x2, self.out_features, lambda n0, n1, out: out.copy_(w[n0:n1]).mul_(s[n0:n1, None].float()))
        elif self.spec.bits == 4:  # prefill: dequantize this one matrix natively and use the GEMM
            dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
            dense = kernels.dequantize_q4(w, s, z, self.spec.group_size,
                                          torch.empty(w.shape[0], self.in_features, dtype=dtype))
            y = F.linear(x2, dense.to(x.dtype))
        else:  # prefill: dequantize this one matrix and use the GEMM (about 2.5x the int8 kernel at M = 512)
            y = F.linear(x2, w * s.to(x.dtype)[:, None])  # int8 · bf16 promotes to bf16 in one pass, exactly
        return y.reshape(*x.shape[:-1], self.out_features)

    def _fill_rows(self, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None):
        """A fill(n0, n1, out) writing rows [n0, n1) of the weight in fp32, exactly its stored value, natively where
        it can: fp32_gemm's slices of GGUF blocks, and the backward of a frozen base."""
        if self.torch_int4:
            raise QwenrtError("training through an int4 weight needs the native kernels (torch's packed layout has "
                              "no dequantization)")
        kernels = cpu_kernels()
        rows = None if kernels is None else \
            kernels.dequantize_group_rows if self.spec.fp32_groups else kernels.dequantize_rows

        def fill(n0: int, n1: int, out: torch.Tensor) -> None:
            if rows is not None and w.is_cpu:
                rows(torch.arange(n0, n1), w, s, z, self.spec.group_size or 0, out)
            else:
                part = {"qweight": w[n0:n1], "scales": s[n0:n1]} | ({} if z is None else {"zeros": z[n0:n1]})
                out.copy_(dequantize_weight(part, self.spec))
        return fill

    def _native(self, kernels, x2: torch.Tensor, weights: list[tuple], mode: str) -> list[torch.Tensor] | None:
        """x2 [M <= 8, K] through each (qweight, scales, zeros) with the native kernel, or None where it has none
        (the kernels take bf16 activations; fp32 ones go through torch's kernels, exact to the dequantized weight)."""
        if x2.dtype != torch.bfloat16:
            return None
        if self.spec.fp32_groups:
            qs, scales = [w for w, _, _ in weights], [s for _, s, _ in weights]
            zeros = [z for _, _, z in weights if z is not None]
            if self.spec.bits == 8:
                return kernels.gemv_q8g(x2, qs, scales, zeros, self.spec.group_size, mode)
            if self.spec.block_headers:
                return kernels.gemv_q4k(x2, qs, scales, mode)
            return kernels.gemv_q4g(x2, qs, scales, zeros, mode)
        if self.spec.bits == 8:
            return kernels.gemv_q8(x2, [w for w, _, _ in weights], [s for _, s, _ in weights], mode)
        if not self.torch_int4:
            return kernels.gemv_q4(x2, [w for w, _, _ in weights], [s for _, s, _ in weights],
                                   [z for _, _, z in weights], self.spec.group_size, mode)
        return None

    @staticmethod
    def decode_many(kernels, x2: torch.Tensor, modules: list[QuantLinear], mode: str) -> list[torch.Tensor] | None:
        """x2 [M, K] through several QuantLinears of one format in one native call, or None."""
        if any(m.spec != modules[0].spec or m.qweight.dim() != 2 for m in modules):
            return None
        return modules[0]._native(kernels, x2, [(m.qweight, m.scales, m.zeros) for m in modules], mode)

    def extra_repr(self) -> str:
        lead = f"experts={self.qweight.shape[0]}, " if self.qweight.dim() == 3 else ""
        return f"{lead}in_features={self.in_features}, out_features={self.out_features}, {self.spec}"


class QuantExperts(nn.Module):
    """MoE experts with quantized fused weights (QuantLinear over E experts); routing as in `Experts`."""

    def __init__(self, gate_up_proj: QuantLinear, down_proj: QuantLinear):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def expert(self, e: int, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, e).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, e)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dispatch_experts(self.expert, x, index, weight)


class QuantEmbedding(nn.Module):
    """The token lookup of a tied embedding, served from the quantized head's table: only the looked-up rows are
    dequantized, so the full-precision table is not kept beside it. `stored` holds the head's tensors in the stored
    layout (the same tensors where the head uses that layout), as a plain attribute: the head owns them. An untied
    table stored quantized (a GGUF file's) is looked up the same way from its own tensors."""

    def __init__(self, stored: dict[str, torch.Tensor], spec: QuantSpec, dtype: torch.dtype):
        super().__init__()
        self.stored, self.spec, self.dtype = stored, spec, dtype  # stored: qweight [V, D or D/2], scales(, zeros)

    @property
    def device(self) -> torch.device:
        return self.stored["qweight"].device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [*] -> rows [*, D] in the compute dtype."""
        kernels = cpu_kernels()
        if kernels is None or self.dtype not in (torch.bfloat16, torch.float32) or self.device.type != "cpu":
            return dequantize_weight({key: t[ids] for key, t in self.stored.items()}, self.spec).to(self.dtype)
        # natively, the same values: the torch ops took 120 us of a ~700 us int4 decode step on qwenrt-tiny
        q = self.stored["qweight"]
        flat = ids.reshape(-1).long().contiguous()
        out = torch.empty(flat.numel(), q.shape[-1] * (2 if self.spec.bits == 4 else 1), dtype=self.dtype)
        rows = kernels.dequantize_group_rows if self.spec.fp32_groups else kernels.dequantize_rows
        rows(flat, q, self.stored["scales"], self.stored.get("zeros"), self.spec.group_size or 0, out)
        return out.reshape(*ids.shape, -1)


def weight_format(model: nn.Module) -> str:
    """How the model holds its linear weights, for load lines: "int4 g64", "int8", or the dtype ("bf16")."""
    specs = list(dict.fromkeys(m.spec for m in model.modules() if isinstance(m, QuantLinear)))
    if specs:
        return " + ".join(spec.short for spec in specs)
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(model.dtype, str(model.dtype))


# ---- which weights, and the swap --------------------------------------------------------------------------------

def default_predicate(path: str, module: nn.Module) -> bool:
    """Quantize every linear map and expert bank but the MoE router and shared-expert gate."""
    return not path.endswith(KEEP_PRECISE)


def _weights(path: str, module: nn.Module) -> dict[str, nn.Parameter]:
    """The quantizable weights of a module: weight path -> parameter."""
    if isinstance(module, Experts):
        return {f"{path}.gate_up_proj": module.gate_up_proj, f"{path}.down_proj": module.down_proj}
    return {path: module.weight}


class Planned(NamedTuple):
    """A weight to quantize: its source parameter's name, its shape [*E, N, K] and its format."""

    source: str
    shape: tuple[int, ...]
    spec: QuantSpec


def plan_units(model: nn.Module, spec: QuantSpec, predicate: Callable[[str, nn.Module], bool] = default_predicate,
               overrides: dict[str, QuantSpec] | None = None):
    """Which weights to quantize: ({module path: {weight path: Planned}}, modules kept precise). Each weight takes
    its override's format (`spec_for`; overrides None: the format's own, `default_overrides`), the rest `spec`.

    A module stays in full precision (and is listed) where its format cannot hold a weight of it: int4 needs
    N % 16 == 0 (torch's packed layout) and K divisible by the group size. A tied LM head is a unit of its own whose
    source is the embedding, which is then looked up in the quantized table (see `QuantEmbedding`).
    """
    overrides = default_overrides(spec) if overrides is None else overrides
    names = {id(p): n for n, p in model.named_parameters()}
    units, kept = {}, []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Experts)):
            continue
        weights = _weights(path, module)
        specs = {p: spec_for(p, spec, overrides) for p in weights}
        fits = all(specs[p].bits == 8 or (w.shape[-2] % 16 == 0 and w.shape[-1] % specs[p].group_size == 0)
                   for p, w in weights.items())
        if not (fits and predicate(path, module)):
            kept.append(path)
            continue
        units[path] = {p: Planned(names[id(w)], tuple(w.shape), specs[p]) for p, w in weights.items()}
    if not tied_head(model, units):
        kept.insert(0, "model.embed_tokens")
    return units, kept


def tied_head(model: nn.Module, units: dict) -> bool:
    """The LM head is quantized and tied to the embedding, whose lookup then reads the quantized table."""
    return "lm_head" in units and model.config.text.tie_word_embeddings


def install(model: nn.Module, path: str, weights: dict[str, QuantLinear]) -> None:
    """Swap in the QuantLinear(s) of module `path`: a Linear is replaced, an Experts bank becomes QuantExperts."""
    parent, _, attr = path.rpartition(".")
    if isinstance(model.get_submodule(path), Experts):
        module = QuantExperts(weights[f"{path}.gate_up_proj"], weights[f"{path}.down_proj"])
    else:
        module = weights[path]
    setattr(model.get_submodule(parent), attr, module)


def quantizable_weights(model: nn.Module) -> dict[str, str]:
    """The weights `default_predicate` quantizes, whatever the format: weight path -> its parameter's name (a tied
    head's is the embedding's)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {p: names[id(w)] for path, module in model.named_modules()
            if isinstance(module, (nn.Linear, Experts)) and default_predicate(path, module)
            for p, w in _weights(path, module).items()}


def install_placeholders(model: nn.Module, spec: QuantSpec, not_converted: list[str],
                         overrides: dict[str, QuantSpec]) -> dict[str, tuple[int, ...]]:
    """Swap in meta placeholders for a checkpoint stored quantized (`stored_spec`'s reading of it); returns its
    stored names -> shapes.

    A tied embedding is looked up in the quantized head unless the checkpoint keeps it (older files list it as
    not converted)."""
    units, _ = plan_units(model, spec, lambda path, _: path not in not_converted, overrides)
    return install_stored(model, {p: w.spec for weights in units.values() for p, w in weights.items()},
                          EMBEDDING in not_converted)


def install_stored(model: nn.Module, specs: dict[str, QuantSpec], embedding_kept: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    """Swap in meta placeholders for the weights stored quantized, each in its own format (specs: weight path ->
    spec, every weight of a module listed, and "model.embed_tokens" for an untied table stored quantized); returns
    the stored names -> shapes. A tied embedding is looked up in a quantized head unless `embedding_kept`."""
    stored = {}
    for path, module in list(model.named_modules()):
        weights = _weights(path, module) if isinstance(module, (nn.Linear, Experts)) else {}
        if not weights or not all(p in specs for p in weights):
            continue
        install(model, path, {p: QuantLinear.placeholder(tuple(w.shape), specs[p]) for p, w in weights.items()})
        stored.update({f"{p}.{key}": shape for p, w in weights.items()
                       for key, (shape, _) in storage_entries(tuple(w.shape), specs[p]).items()})
    if "lm_head" in specs and model.config.text.tie_word_embeddings and not embedding_kept:
        head = model.lm_head  # its meta buffers stand for the table until the loader builds the real lookup
        model.model.embed_tokens = QuantEmbedding({key: getattr(head, key) for key in head.spec.pieces}, head.spec,
                                                  model.dtype)
    elif EMBEDDING in specs:  # an untied table stored quantized: looked up as stored
        spec, shape = specs[EMBEDDING], tuple(model.model.embed_tokens.weight.shape)
        with torch.device("meta"):
            pieces = {key: torch.empty(sh, dtype=d) for key, (sh, d) in storage_entries(shape, spec).items()}
        model.model.embed_tokens = QuantEmbedding(pieces, spec, model.dtype)
        stored.update({f"{EMBEDDING}.{key}": tuple(t.shape) for key, t in pieces.items()})
    return stored


@torch.no_grad()
def quantize_model(model: nn.Module, bits: int | str = 8, group_size: int | None = None,
                   predicate: Callable[[str, nn.Module], bool] = default_predicate,
                   overrides: dict[str, QuantSpec] | None = None) -> list[str]:
    """Quantize a loaded model in place, module by module (overrides: as `plan_units`). Returns the modules kept in
    full precision."""
    spec = QuantSpec.parse(bits, group_size)
    if model.device.type != "cpu":
        raise QwenrtError(f"weight-only quantization runs on the CPU; the model is on {model.device}")
    units, kept = plan_units(model, spec, predicate, overrides)
    params, dtype = dict(model.named_parameters()), model.dtype
    planned = {p: w for weights in units.values() for p, w in weights.items()}
    stored = {p: quantize_weight(params[w.source], w.spec, p) for p, w in planned.items()}
    for path, weights in units.items():
        install(model, path, {p: QuantLinear.from_stored(stored[p], planned[p].spec, dtype) for p in weights})
    if tied_head(model, units):
        model.model.embed_tokens = QuantEmbedding(stored["lm_head"], planned["lm_head"].spec, dtype)
    return kept


class LoadQuantizer:
    """The loader's side: builds QuantLinears while a checkpoint is read, from stored pieces or by quantizing.

    spec None: the model holds placeholders (see `install_stored`), each with its format, and the checkpoint their
    pieces; otherwise each unit's full-precision source weight is quantized to `spec` as it is read. Every claimed
    tensor is consumed here (a tied embedding included: its lookup reads the quantized head).
    """

    def __init__(self, model: nn.Module, spec: QuantSpec | None, dtype: torch.dtype):
        self.stored, self.dtype = spec is None, dtype
        if self.stored:  # each placeholder's own format
            self.specs = {path: m.spec for path, m in model.named_modules() if isinstance(m, QuantLinear)}
            self.units = {path: {path: None} for path in self.specs}
            embed = model.model.embed_tokens
            self.lookup = isinstance(embed, QuantEmbedding) and tied_head(model, self.specs)
            if isinstance(embed, QuantEmbedding) and not self.lookup:  # an untied table stored quantized (GGUF)
                self.specs[EMBEDDING] = embed.spec
            self.claimed = {f"{path}.{key}": path for path, spec in self.specs.items() for key in spec.pieces}
        else:
            self.units, _ = plan_units(model, spec)
            self.specs = {p: w.spec for weights in self.units.values() for p, w in weights.items()}
            self.claimed = {}
            for weights in self.units.values():
                for path, w in weights.items():
                    self.claimed.setdefault(w.source, []).append(path)
            self.lookup = tied_head(model, self.units)
        self.pieces: dict[str, dict[str, torch.Tensor]] = {}
        self.ready: dict[str, QuantLinear] = {}
        self.head: dict[str, torch.Tensor] | None = None  # the head's stored tensors, for a quantized lookup
        self.table: dict[str, torch.Tensor] | None = None  # an untied embedding's stored tensors

    def claims(self, name: str) -> bool:
        return name in self.claimed

    @torch.no_grad()
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take a claimed tensor (read as stored)."""
        if self.stored:
            path = self.claimed[name]
            pieces = self.pieces.setdefault(path, {})
            pieces[name[len(path) + 1:]] = tensor
            if len(pieces) == len(self.specs[path].pieces):
                self._build(path, self.pieces.pop(path))
            return
        for path in self.claimed[name]:
            self._build(path, quantize_weight(tensor, self.specs[path], path))

    def _build(self, path: str, stored: dict[str, torch.Tensor]) -> None:
        if path == EMBEDDING:
            self.table = stored
            return
        self.ready[path] = QuantLinear.from_stored(stored, self.specs[path], self.dtype)
        if path == "lm_head" and self.lookup:
            self.head = stored

    def finish(self, model: nn.Module) -> None:
        """Swap every built QuantLinear in (all pieces have been read: the loader's accounting made sure)."""
        for path, weights in self.units.items():
            install(model, path, {p: self.ready.pop(p) for p in weights})
        if self.lookup:
            model.model.embed_tokens = QuantEmbedding(self.head, self.specs["lm_head"], self.dtype)
        if self.table is not None:
            model.model.embed_tokens = QuantEmbedding(self.table, self.specs[EMBEDDING], self.dtype)
