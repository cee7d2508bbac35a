"""GGUF's quantized blocks held exactly (qwenrt/gguf/blocks.py): for every block type qwenrt maps, codes·scale + zero
of the stored pieces is bit for bit the value gguf.quants' dequantization (llama.cpp's formulas) gives, on random
blocks covering every code, scale and bit position."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants

from qwenrt.gguf.blocks import INT4_G32, INT4_Q4K, SPECS, stored_blocks
from qwenrt.quant import dequantize_weight

# the fp16 fields of each block (byte offsets): set to real scales, the other bytes left random
FP16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
               Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def random_blocks(kind: Q, rows: int, K: int, seed: int) -> np.ndarray:
    """[rows, K / block · bytes] uint8: random bits, fp16 fields holding scales of 1e-4 .. 1e-1 of either sign."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * K // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        values = (rng.uniform(1e-4, 1e-1, len(data)) * rng.choice([-1, 1], len(data))).astype(np.float16)
        data[:, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(SPECS), ids=lambda k: k.name)
def test_blocks_dequantize_bit_for_bit_as_llama_cpp(kind):
    rows, K = 6, 512
    data = random_blocks(kind, rows, K, int(kind))
    spec, stored = stored_blocks(kind, data, (rows, K))
    assert spec == SPECS[kind] and set(stored) == set(spec.pieces)
    expected = torch.from_numpy(quants.dequantize(data, kind).reshape(rows, K))
    assert torch.equal(dequantize_weight(stored, spec), expected)


@pytest.mark.parametrize("spec", [INT4_Q4K, INT4_G32], ids=["q4_k-headers", "fp32-groups"])
def test_expert_banks_decode_per_expert_rows(spec):
    """A 3-D tensor [E, N, K] (MoE experts) keeps its leading axis in every piece; Q4_K held with its own headers
    (16 bytes per 256 columns) or, where rows are cut between headers, fp32 scales and zeros: the same values."""
    data = random_blocks(Q.Q4_K, 2 * 3, 512, 5)
    spec, stored = stored_blocks(Q.Q4_K, data.reshape(2, 3, -1), (2, 3, 512), spec)
    assert stored["qweight"].shape == (2, 3, 256)
    assert stored["scales"].shape == ((2, 3, 32) if spec.q4k else (2, 3, 16))
    expected = torch.from_numpy(quants.dequantize(data, Q.Q4_K)).reshape(2, 3, 512)
    assert torch.equal(dequantize_weight(stored, spec), expected)
