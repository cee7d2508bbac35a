"""The K-quantizers write llama.cpp's own bytes: tests/data/kquants_golden.npz holds test tensors and the blocks
`llama-quantize --pure` made of them (bench/kquants_check.py, which also checks against a llama.cpp build directly);
the blocks dequantize (with the gguf package) to within the format's step, and edge cases stay finite."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from qwenrt.gguf.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k

GOLDEN = np.load(Path(__file__).parent / "data" / "kquants_golden.npz")
KINDS = sorted(key.removeprefix("input.") for key in GOLDEN if key.startswith("input."))
QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
# largest |dequantized - x| over a 256-block's spread (max(x, 0) - min(x, 0)): about one step of the format
STEP = {"Q4_K": 1 / 15, "Q5_K": 1 / 31, "Q6_K": 1 / 48}
# rows the format cannot hold (fp16 d underflows): checked for finiteness and size only
UNDERFLOW = ("edge", "tiny")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", QUANTIZERS)
def test_blocks_equal_llama_quantize(qtype, kind):
    ours = QUANTIZERS[qtype](GOLDEN[f"input.{kind}"])
    theirs = GOLDEN[f"{qtype}.{kind}"]
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    differ = np.flatnonzero((ours != theirs).any(axis=1))
    assert differ.size == 0, f"rows {differ} differ from llama.cpp's"


@pytest.mark.parametrize("qtype", QUANTIZERS)
def test_blocks_dequantize_within_a_step(qtype):
    for kind in KINDS:
        values = GOLDEN[f"input.{kind}"]
        restored = quants.dequantize(QUANTIZERS[qtype](values), Q[qtype])
        assert restored.shape == values.shape and np.isfinite(restored).all(), kind
        blocks, error = values.reshape(-1, 256), np.abs(restored - values).reshape(-1, 256).max(axis=1)
        spread = np.maximum(blocks.max(axis=1), 0) - np.minimum(blocks.min(axis=1), 0)
        bound = (2.0 if kind in UNDERFLOW else STEP[qtype]) * spread
        assert (error <= bound).all(), (kind, np.flatnonzero(error > bound))


@pytest.mark.parametrize("qtype", QUANTIZERS)
def test_zero_and_constant_rows(qtype):
    rows = np.zeros((3, 512), dtype=np.float32)
    rows[1], rows[2] = 0.37, -1e-30
    restored = quants.dequantize(QUANTIZERS[qtype](rows), Q[qtype])
    assert (restored[0] == 0).all() and (restored[2] == 0).all()
    assert np.allclose(restored[1], 0.37, rtol=1e-3)


def test_shapes_and_refusals():
    experts = np.random.default_rng(0).standard_normal((2, 3, 512)).astype(np.float32)
    blocks = quantize_q6_k(experts)  # [E, N, K] -> [E, N, K / 256 * 210], each expert as its own rows
    assert blocks.shape == (2, 3, 420)
    assert (blocks[1] == quantize_q6_k(experts[1])).all()
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((2, 300), dtype=np.float32))
    broken = np.zeros((4, 256), dtype=np.float32)
    broken[2, 7] = np.nan
    with pytest.raises(ValueError, match="a non-finite value in row 2"):
        quantize_q5_k(broken)
