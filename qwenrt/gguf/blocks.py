"""GGUF quantized blocks -> qwenrt's exact group formats (qwenrt.quant, `QuantSpec.fp32_groups`), no value rounded.

Every block type qwenrt holds natively is, per group of 16 or 32 weights, integer codes times an fp32 scale plus an
fp32 zero, W = q·s + z, with s and z exact in fp32 (an fp16 number times a 6- or 8-bit integer):
    Q8_0    int8 g32   q                 s = d
    Q6_K    int8 g16   q - 32            s = d·sc (sc int8 per 16)
    Q5_0    int8 g32   q - 16            s = d
    Q5_1    int8 g32   q (0..31)         s = d,       z = m
    Q5_K    int8 g32   q (0..31)         s = d·sc,    z = -dmin·m (6-bit sc, m per 32)
    IQ4_NL  int8 g32   kvalues[q]        s = d
    IQ4_XS  int8 g32   kvalues[q]        s = d·(ls - 32)
    Q4_0    int4 g32   q (0..15)         s = d,       z = -8·d      (held as the int4 codes and Q4_0's own fp16 d)
    Q4_1    int4 g32   q                 s = d,       z = m
    Q4_K    int4 g32   q                 s = d·sc,    z = -dmin·m   (held as the int4 codes and Q4_K's own
                                                                      16-byte headers, expanded in the kernels)
q·s + z in fp32 is then the value llama.cpp's dequantization gives, bit for bit (gguf.quants computes the same
products; the test checks every type against it). Decoding follows gguf.quants' layouts; it runs a bounded slice of
rows at a time. A Q4_K tensor whose rows must be cut between headers (the DeltaNet output's head reorder when the
value head is under 256 wide) is held with fp32 scales and zeros instead (INT4_G32). Q4_0 and Q4_K are so held
in their files' size (0.5625 bytes per weight), Q4_1 at 0.75.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import IQ4_NL, Q4_K

from qwenrt.quant import QuantSpec

INT8_G32, INT8_G16 = QuantSpec(8, 32, fp32_groups=True), QuantSpec(8, 16, fp32_groups=True)
INT8_G32_ZEROS, INT4_G32 = QuantSpec(8, 32, fp32_groups=True, zeros=True), QuantSpec(4, 32, fp32_groups=True)
INT4_Q4K, INT4_Q40 = QuantSpec(4, 32, fp32_groups=True, q4k=True), QuantSpec(4, 32, fp32_groups=True, q40=True)
SPECS = {Q.Q8_0: INT8_G32, Q.Q6_K: INT8_G16, Q.Q5_0: INT8_G32, Q.Q5_1: INT8_G32_ZEROS, Q.Q5_K: INT8_G32_ZEROS,
         Q.IQ4_NL: INT8_G32, Q.IQ4_XS: INT8_G32, Q.Q4_0: INT4_Q40, Q.Q4_1: INT4_G32, Q.Q4_K: INT4_Q4K}
SLICE_BYTES = 1 << 24  # block bytes decoded at a time: bounded temporaries for the 248K-row tables
KVALUES = np.array(IQ4_NL.kvalues, dtype=np.int8)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n] fp32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """bytes [..., B] -> [..., 2, B]: their low nibbles, then their high ones."""
    return np.stack([qs & 15, qs >> 4], axis=-2)


def _repack4(codes: np.ndarray) -> np.ndarray:
    """codes [n, 32] (0..15) -> qwenrt's int4 bytes [n, 16]: byte j holds code j (low nibble) and j + 16 (high)."""
    return (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)


def _decode(kind: Q, b: np.ndarray):
    """blocks [n, bytes] of one type -> (codes [n·per_block] int8 or int4 bytes, scales [groups], zeros | None),
    groups in the blocks' order."""
    n = b.shape[0]
    if kind == Q.Q8_0:
        return b[:, 2:].view(np.int8).reshape(-1), _f16(b[:, :2]), None
    if kind in (Q.Q4_0, Q.Q4_1, Q.IQ4_NL):
        d, qs = _f16(b[:, :2]), b[:, 4 if kind == Q.Q4_1 else 2:]
        if kind == Q.IQ4_NL:
            return KVALUES[_nibbles(qs).reshape(n, 32)].reshape(-1), d, None
        zeros = _f16(b[:, 2:4]) if kind == Q.Q4_1 else -8 * d
        return qs.reshape(-1), d, zeros  # qwenrt's int4 layout already
    if kind in (Q.Q5_0, Q.Q5_1):
        d, rest = _f16(b[:, :2]), b[:, 4 if kind == Q.Q5_1 else 2:]
        high = np.unpackbits(rest[:, :4], axis=1, bitorder="little")  # [n, 32]: bit 4 of each code
        codes = (_nibbles(rest[:, 4:]).reshape(n, 32) | (high << 4)).astype(np.int16)
        if kind == Q.Q5_0:
            return (codes - 16).astype(np.int8).reshape(-1), d, None
        return codes.astype(np.int8).reshape(-1), d, _f16(b[:, 2:4])
    if kind in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [n, 8] each
        scales, zeros = (d * sc.astype(np.float32)).reshape(-1), -(dmin * m.astype(np.float32)).reshape(-1)
        if kind == Q.Q4_K:
            codes = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n * 8, 32)  # chunk c: groups 2c (low), 2c+1 (high)
            return _repack4(codes).reshape(-1), scales, zeros
        high = np.unpackbits(b[:, 16:48].reshape(n, 1, 32), axis=1, count=8, bitorder="little")  # [n, 8, 32]
        low = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
        return (low | (high << 4)).astype(np.int8).reshape(-1), scales, zeros
    if kind == Q.Q6_K:
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
        # element 32·j + l of a 128-element half: j = 0, 1 the low nibbles of bytes l, 32 + l; j = 2, 3 the high
        low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 2, 4, 32)  # [n, half, j, l]
        high = np.stack([(qh.reshape(n, 2, 32) >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [n, half, j, l]
        codes = (low | (high << 4)).astype(np.int16) - 32
        return codes.astype(np.int8).reshape(-1), (d[:, None] * sc.astype(np.float32)).reshape(-1), None
    if kind == Q.IQ4_XS:
        d, high, low = _f16(b[:, :2])[:, None], b[:, 2:4].copy().view(np.uint16), b[:, 4:8]
        ls_low = _nibbles(low).transpose(0, 2, 1).reshape(n, 8)  # group 2i: low nibble of byte i, 2i+1: high
        ls_high = (high.reshape(n, 1) >> (2 * np.arange(8, dtype=np.uint16))) & 3
        ls = (ls_low | (ls_high.astype(np.uint8) << 4)).astype(np.int16) - 32
        codes = KVALUES[_nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32)]
        return codes.reshape(-1), (d * ls.astype(np.float32)).reshape(-1), None
    raise ValueError(f"no exact qwenrt format for {kind.name}")


def _q4k_pieces(flat: np.ndarray, lead: list[int], K: int) -> dict[str, torch.Tensor]:
    """Q4_K blocks [rows, K/256 · 144] -> qwenrt's int4 codes and the blocks' own 16-byte headers [rows, K/16]."""
    blocks = flat.reshape(-1, 144)
    codes = np.empty((flat.shape[0], K // 2), dtype=np.uint8)
    step = max(1, SLICE_BYTES // flat.shape[1]) * (K // 256)  # whole rows of blocks
    for b0 in range(0, len(blocks), step):
        part = blocks[b0:b0 + step, 16:].reshape(-1, 4, 32)  # chunk c of a block: groups 2c (low), 2c + 1 (high)
        codes.reshape(-1, 16)[b0 * 8:(b0 + len(part)) * 8] = _repack4(_nibbles(part).reshape(-1, 32))
    headers = np.ascontiguousarray(blocks[:, :16]).reshape(flat.shape[0], K // 16)
    return {"qweight": torch.from_numpy(codes).reshape(*lead, K // 2),
            "scales": torch.from_numpy(headers).reshape(*lead, K // 16)}


def _q40_pieces(flat: np.ndarray, lead: list[int], K: int) -> dict[str, torch.Tensor]:
    """Q4_0 blocks [rows, K/32 · 18] -> their int4 codes (qwenrt's layout already) and fp16 scales d [rows, K/32]."""
    blocks = flat.reshape(flat.shape[0], K // 32, 18)
    codes = np.ascontiguousarray(blocks[:, :, 2:]).reshape(flat.shape[0], K // 2)
    d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(flat.shape[0], K // 32)
    return {"qweight": torch.from_numpy(codes).reshape(*lead, K // 2),
            "scales": torch.from_numpy(d).reshape(*lead, K // 32)}


def stored_blocks(kind: Q, data: np.ndarray, shape: tuple[int, ...], spec: QuantSpec | None = None
                  ) -> tuple[QuantSpec, dict[str, torch.Tensor]]:
    """A tensor's blocks (data: the file's bytes, [*rows, bytes per row]) of PyTorch shape [*, N, K] -> its spec
    (SPECS', or INT4_G32 for Q4_K or Q4_0 when asked) and stored tensors {'qweight', 'scales'(, 'zeros')}
    (qwenrt.quant.storage_entries' layout)."""
    spec = spec or SPECS[kind]
    block, size = GGML_QUANT_SIZES[kind]
    *lead, K = shape
    rows = int(np.prod(lead))
    flat = np.asarray(data).reshape(rows, -1)  # [rows, K / block · size]
    if spec.q4k:
        return spec, _q4k_pieces(flat, lead, K)
    if spec.q40:
        return spec, _q40_pieces(flat, lead, K)
    groups = K // spec.group_size
    codes = np.empty((rows, K // 2 if spec.bits == 4 else K), dtype=np.uint8 if spec.bits == 4 else np.int8)
    scales = np.empty((rows, groups), dtype=np.float32)
    zeros = np.empty((rows, groups), dtype=np.float32) if spec.pieces[-1] == "zeros" else None
    step = max(1, SLICE_BYTES // flat.shape[1])
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q, s, z = _decode(kind, flat[r0:r1].reshape(-1, size))
        codes[r0:r1] = q.reshape(r1 - r0, -1)
        scales[r0:r1] = s.reshape(r1 - r0, groups)
        if zeros is not None:
            zeros[r0:r1] = z.reshape(r1 - r0, groups)
    stored = {"qweight": torch.from_numpy(codes).reshape(*lead, -1), "scales": torch.from_numpy(scales).reshape(
        *lead, groups)}
    if zeros is not None:
        stored["zeros"] = torch.from_numpy(zeros).reshape(*lead, groups)
    return spec, stored
