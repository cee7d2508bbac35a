"""llama.cpp's K-quantizers without an importance matrix (Q4_K, Q5_K, Q6_K) in numpy, byte for byte as
`llama-quantize` writes them: ggml-quants.c's quantize_row_q{4,5,6}_K_ref with every float32 operation in C's
order (sums accumulated left to right, no fused multiply-adds: ggml-base is built for baseline x86-64),
nearest_int's 1.5·2^23 rounding trick and GGML_FP32_TO_FP16's round to nearest even. Identical for any finite
input (bench/kquants_check.py; magnitudes from 1e-45 to 1e38 checked against ggml's functions themselves).

The per-sub-block searches (make_qkx2_quants, make_qx_quants) step through their candidate scales once for all
sub-blocks of a slice of rows at a time: values are held as [n, S] (n = 32 or 16 values of each of S sub-blocks),
so every C loop over a sub-block becomes n numpy operations over S.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256
Q4_K_BYTES = 144  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit quants
Q5_K_BYTES = 176  # as Q4_K plus 32 bytes of fifth bits
Q6_K_BYTES = 210  # 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d (fp16)
GROUP_MAX_EPS = np.float32(1e-15)
MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: adding it leaves the rounded integer in the low mantissa bits
CHUNK = 1 << 18  # values per slice: the search's ~20 live temporaries stay a few MiB for any tensor
F32 = np.float32


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[..., K] floats (K % 256 == 0) -> [..., K / 256 * 144] uint8: Q4_K blocks as llama.cpp writes them."""
    return _quantize(weights, Q4_K_BYTES, _q4_k_blocks)


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """[..., K] floats (K % 256 == 0) -> [..., K / 256 * 176] uint8: Q5_K blocks as llama.cpp writes them."""
    return _quantize(weights, Q5_K_BYTES, _q5_k_blocks)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """[..., K] floats (K % 256 == 0) -> [..., K / 256 * 210] uint8: Q6_K blocks as llama.cpp writes them."""
    return _quantize(weights, Q6_K_BYTES, _q6_k_blocks)


def _quantize(weights: np.ndarray, block_bytes: int, quantize_blocks: Callable) -> np.ndarray:
    width = weights.shape[-1]
    if weights.ndim == 0 or width % QK_K:
        raise ValueError(f"K-quant rows must be a multiple of {QK_K} values, not shape {weights.shape}")
    rows = weights.reshape(-1, width)
    out = np.empty((rows.shape[0], width // QK_K * block_bytes), dtype=np.uint8)
    step = max(1, CHUNK // width)
    with np.errstate(all="ignore"):  # flat and all-zero sub-blocks divide by zero, then take C's fallback
        for start in range(0, rows.shape[0], step):
            chunk = np.asarray(rows[start:start + step], dtype=F32)
            if not np.isfinite(chunk).all():  # llama-quantize refuses these too
                row = start + np.flatnonzero(~np.isfinite(chunk).all(axis=1))[0]
                raise ValueError(f"a non-finite value in row {row}")
            out[start:start + step] = quantize_blocks(chunk.reshape(-1, QK_K)).reshape(-1, out.shape[1])
    return out.reshape(*weights.shape[:-1], out.shape[1])


def _nearest_int(values: np.ndarray) -> np.ndarray:
    """C's nearest_int, wrap-around beyond ±2^22 included: float32 -> int32, ties to even."""
    return ((values + MAGIC).view(np.int32) & 0x007FFFFF) - 0x00400000


def _levels(scaled: np.ndarray, low: int, high: int) -> np.ndarray:
    return np.clip(_nearest_int(scaled), low, high).astype(F32)


def _serial_sum(terms: np.ndarray, from_zero: bool = True) -> np.ndarray:
    """[n, S] -> [S]: terms added in order, in float32, as C's `sum += ...` loop does (from 0 or from terms[0])."""
    total = np.zeros(terms.shape[1], dtype=F32) + terms[0] if from_zero else terms[0].copy()
    for term in terms[1:]:
        total += term
    return total


def _to_fp16(values: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: to nearest even, through fp16's subnormals, overflow to inf (numpy's cast does the same)."""
    return values.astype(np.float16)


def _sub_blocks(blocks: np.ndarray, size: int) -> np.ndarray:
    """[nb, 256] -> [size, nb * 256 / size]: column s is sub-block s (block s // (256 / size))."""
    return np.ascontiguousarray(blocks.reshape(-1, size).T)


def _from_sub_blocks(levels: np.ndarray) -> np.ndarray:
    return levels.T.reshape(-1, QK_K)


# ---- Q4_K / Q5_K: 8 sub-blocks of 32, an affine (scale, min) pair each, both 6-bit against fp16 d and dmin

def _q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] float32 -> [nb, 144] uint8."""
    d, dmin, scales, levels = _qkx_blocks(blocks, 15, F32(-1.0), F32(0.1), 20)
    pairs = levels.reshape(-1, 4, 2, 32)  # 64 values per 32 bytes: low nibble first 32, high nibble next 32
    quants = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales, quants], axis=1)


def _q5_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] float32 -> [nb, 176] uint8."""
    d, dmin, scales, levels = _qkx_blocks(blocks, 31, F32(-0.5), F32(0.1), 15)
    pairs = levels.reshape(-1, 4, 2, 32)
    quants = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(-1, 128)
    # qh byte j: bit 2n is the fifth bit of value j of 64-chunk n, bit 2n + 1 that of its value 32 + j
    fifth = (pairs >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
    high = np.bitwise_or.reduce(fifth.reshape(-1, 8, 32), axis=1).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales, high, quants], axis=1)


def _qkx_blocks(blocks: np.ndarray, nmax: int, rmin: F32, rdelta: F32, nstep: int):
    """quantize_row_q{4,5}_K_ref up to the bit packing: d, dmin fp16 [nb]; packed scales [nb, 12]; levels [nb, 256]."""
    values = _sub_blocks(blocks, 32)  # [32, S]
    weights = np.sqrt(_serial_sum(values * values) / F32(32)) + np.abs(values)
    scales, mins, levels = _qkx2_quants(values, weights, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale = np.fmax(np.fmax.reduce(scales, axis=1), 0)  # C's `scale > max_scale` from 0: NaN skipped
    max_min = np.fmax(np.fmax.reduce(mins, axis=1), 0)
    scale_codes = _six_bit_codes(scales, max_scale)  # [nb, 8]
    min_codes = _six_bit_codes(mins, max_min)
    d, dmin = _to_fp16(max_scale / F32(63)), _to_fp16(max_min / F32(63))

    step = (d.astype(F32)[:, None] * scale_codes.astype(F32)).reshape(-1)  # [S]
    offset = (dmin.astype(F32)[:, None] * min_codes.astype(F32)).reshape(-1)
    final = _levels((values + offset) / step, 0, nmax)
    levels = np.where(step != 0, final, levels).astype(np.uint8)  # a zero step keeps the search's levels
    return d, dmin, _pack_scales(scale_codes, min_codes), _from_sub_blocks(levels)


def _six_bit_codes(values: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """[nb, 8] -> uint8 codes: MIN(63, (uint8_t) nearest_int(63 / peak * value)), 0 where peak is 0."""
    inverse = np.where(peak > 0, F32(63) / peak, F32(0))
    return np.minimum(_nearest_int(inverse[:, None] * values) & 0xFF, 63).astype(np.uint8)


def _pack_scales(scale_codes: np.ndarray, min_codes: np.ndarray) -> np.ndarray:
    """get_scale_min_k4's layout: sub-blocks 0-3 in bytes 0-7, 4-7 split into low nibbles and top 2 bits."""
    first = scale_codes[:, :4] | ((scale_codes[:, 4:] >> 4) << 6)
    second = min_codes[:, :4] | ((min_codes[:, 4:] >> 4) << 6)
    third = (scale_codes[:, 4:] & 15) | ((min_codes[:, 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=1)


def _qkx2_quants(values, weights, nmax: int, rmin: F32, rdelta: F32, nstep: int):
    """make_qkx2_quants(32, nmax, x, weights, ..., use_mad=false) for each column of values [32, S]:
    scale [S], the_min [S] (= -min), levels [32, S]."""
    low = first_low = np.minimum(values.min(axis=0), 0)  # [S]
    high = values.max(axis=0)
    sum_w = _serial_sum(weights, from_zero=False)
    sum_x = _serial_sum(weights * values, from_zero=False)

    iscale = F32(nmax) / (high - low)
    scale = F32(1) / iscale
    levels = _levels(iscale * (values - low), 0, nmax)
    best_error = _weighted_error(levels, scale, low, values, weights)
    best_iscale, best_low = iscale, low  # what the kept levels were rounded with
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + F32(nmax)) / (high - low)
        levels = _levels(iscale * (values - low), 0, nmax)
        weighted = weights * levels
        sum_l, sum_l2, sum_xl = _serial_sum(weighted), _serial_sum(weighted * levels), _serial_sum(weighted * values)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        error = _weighted_error(levels, this_scale, this_min, values, weights)
        better = (det > 0) & (error < best_error)
        best_error = np.where(better, error, best_error)
        scale = np.where(better, this_scale, scale)
        best_iscale, best_low = np.where(better, iscale, best_iscale), np.where(better, low, best_low)
        low = np.where(better, this_min, low)  # C moves `min` too: later candidates round against it

    flat = high == first_low  # C: max == min, all levels 0
    levels = np.where(flat, F32(0), _levels(best_iscale * (values - best_low), 0, nmax))
    return np.where(flat, F32(0), scale), -np.where(flat, first_low, low), levels.astype(np.uint8)


def _weighted_error(levels, scale, low, values, weights) -> np.ndarray:
    diff = scale * levels + low - values
    return _serial_sum(weights * (diff * diff))


# ---- Q6_K: 16 sub-blocks of 16, a symmetric int8 scale each against an fp16 d

def _q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] float32 -> [nb, 210] uint8."""
    values = _sub_blocks(blocks, 16)  # [16, S]
    scales, levels = _qx_quants(values)
    scales = scales.reshape(-1, 16)
    magnitude = np.nan_to_num(np.abs(scales), nan=0.0)  # C's `abs_scale > max_abs_scale` skips a NaN scale
    peak = scales[np.arange(len(scales)), magnitude.argmax(axis=1)]  # the first largest |scale|, signed
    peak = np.where(magnitude.max(axis=1) > 0, peak, F32(0))
    silent = np.abs(peak) < GROUP_MAX_EPS
    iscale = F32(-128) / peak
    d = _to_fp16(F32(1) / iscale)
    codes = (np.minimum(_nearest_int(iscale[:, None] * scales), 127) & 0xFF).astype(np.uint8).view(np.int8)

    step = (d.astype(F32)[:, None] * codes.astype(F32)).reshape(-1)  # [S]
    final = _levels(values / step, -32, 31) + F32(32)
    levels = _from_sub_blocks(np.where(step != 0, final, levels).astype(np.uint8))
    quarters = levels.reshape(-1, 2, 4, 32)  # two halves of 128, four runs of 32
    low_bits = quarters & 15
    ql = np.concatenate([low_bits[:, :, 0] | (low_bits[:, :, 2] << 4),
                         low_bits[:, :, 1] | (low_bits[:, :, 3] << 4)], axis=2).reshape(-1, 128)
    top = (quarters >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce(top, axis=2).astype(np.uint8).reshape(-1, 64)
    out = np.concatenate([ql, qh, codes.view(np.uint8), _fp16_bytes(d)], axis=1)
    out[silent] = 0  # C: memset, d = 0
    return out


def _qx_quants(values):
    """make_qx_quants(16, 32, x, L, rmse_type=1, NULL) for each column of values [16, S]: scale [S], levels [16, S]
    (stored as l + 32)."""
    columns = np.arange(values.shape[1])
    peak = values[np.abs(values).argmax(axis=0), columns]  # C keeps the first x of the largest |x|
    silent = np.abs(peak) < GROUP_MAX_EPS
    weights = values * values
    weighted_x = weights * values

    iscale = F32(-32) / peak
    sum_lx, sum_l2 = _qx_sums(iscale, values, weights, weighted_x)
    scale = np.where(sum_l2 != 0, sum_lx / sum_l2, F32(0))
    best = scale * sum_lx
    best_iscale = iscale
    for step in (*range(-9, 0), *range(1, 10)):
        iscale = -(F32(32) + F32(0.1) * F32(step)) / peak
        sum_lx, sum_l2 = _qx_sums(iscale, values, weights, weighted_x)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = np.where(better, sum_lx / sum_l2, scale)
        best = np.where(better, scale * sum_lx, best)
        best_iscale = np.where(better, iscale, best_iscale)

    levels = _levels(best_iscale * values, -32, 31) + F32(32)
    return np.where(silent, F32(0), scale), np.where(silent, F32(0), levels).astype(np.uint8)


def _qx_sums(iscale, values, weights, weighted_x):
    levels = _levels(iscale * values, -32, 31)
    return _serial_sum(weighted_x * levels), _serial_sum(weights * levels * levels)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """[nb] float16 -> [nb, 2] uint8, little-endian as in the file."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)
