"""The native tiled prefill attention (kernels.attention_prefill) against a float64 reference: tile sizes that do and
do not divide the context, causal rows across chunk boundaries, grouped-query heads, bf16 and fp32 stores."""

import os

import pytest
import torch

import qwenrt
import qwenrt.model
from qwenrt.kernels import cpu_kernels
from tests.checkpoints import VOCAB
from tests.numerics import rel_err

pytestmark = pytest.mark.skipif(os.environ.get("QWENRT_KERNELS") == "0", reason="QWENRT_KERNELS=0: torch paths only")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, H, Dh], keys/values [Hkv, >= start + T, Dh] -> [T, H, Dh] in float64: row t sees keys 0..start+t."""
    T, H, D = q.shape
    Hkv = keys.shape[0]
    k = keys[:, : start + T].double().repeat_interleave(H // Hkv, 0)  # [H, S, Dh]
    v = values[:, : start + T].double().repeat_interleave(H // Hkv, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * D ** -0.5  # [H, T, S]
    visible = torch.arange(start + T)[None, :] <= start + torch.arange(T)[:, None]  # [T, S]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)  # [T, H, Dh]


def stores(Hkv: int, cap: int, D: int, dtype, g: torch.Generator, filled: int):
    """keys, values [1, Hkv, cap, Dh] with the first `filled` positions random and NaN after (never read)."""
    keys = torch.full((1, Hkv, cap, D), float("nan"), dtype=dtype)
    values = torch.full((1, Hkv, cap, D), float("nan"), dtype=dtype)
    keys[:, :, :filled] = torch.randn(1, Hkv, filled, D, generator=g).to(dtype)
    values[:, :, :filled] = torch.randn(1, Hkv, filled, D, generator=g).to(dtype)
    return keys, values


# (T, start, H, Hkv, Dh): T 1/7/64/65/300 against contexts of 1 to ~2000 keys, tiles of 64 dividing them or not;
# Dh 48: a head dim that is not a multiple of 32 (the bf16 path's half vectors)
CASES = [(1, 0, 4, 4, 64), (1, 1999, 8, 2, 256), (7, 0, 8, 4, 64), (7, 1500, 4, 2, 256), (64, 0, 8, 2, 256),
         (64, 1000, 4, 1, 64), (65, 0, 4, 4, 256), (65, 1935, 8, 2, 64), (300, 0, 8, 2, 256), (300, 1700, 8, 4, 64),
         (300, 64, 2, 1, 256), (33, 31, 16, 1, 64), (9, 20, 4, 2, 48)]


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("T, start, H, Hkv, D", CASES)
def test_tiled_attention_matches_fp64_reference(T, start, H, Hkv, D, dtype, bound):
    g = torch.Generator().manual_seed(T * 7919 + start)
    keys, values = stores(Hkv, start + T + 5, D, dtype, g, start + T)
    q = (3 * torch.randn(T, H, D, generator=g)).to(dtype)  # peaked rows: the running max moves between tiles
    out = cpu_kernels().attention_prefill(q, keys, values, start)
    assert out.shape == (T, H, D) and out.dtype == dtype
    assert rel_err(out, reference(q, keys[0], values[0], start)) < bound  # bf16: one rounding of each output


def test_chunks_of_a_prefill_equal_one_call():
    """Rows in chunks of 50 (not a tile multiple) after a 90-token start == one call over all of them."""
    g = torch.Generator().manual_seed(3)
    keys, values = stores(2, 400, 256, torch.float32, g, 390)
    q = torch.randn(300, 8, 256, generator=g)
    whole = cpu_kernels().attention_prefill(q, keys, values, 90)
    chunks = torch.cat([cpu_kernels().attention_prefill(q[i:i + 50].contiguous(), keys, values, 90 + i)
                        for i in range(0, 300, 50)])
    assert rel_err(chunks, whole) < 1e-6


def test_bad_shapes_are_refused():
    kernels = cpu_kernels()
    keys = torch.zeros(1, 2, 10, 64)
    with pytest.raises(RuntimeError, match="start \\+ T <= cap"):
        kernels.attention_prefill(torch.zeros(4, 4, 64), keys, keys, 7)
    with pytest.raises(RuntimeError, match="H % Hkv"):
        kernels.attention_prefill(torch.zeros(4, 3, 64), keys, keys, 0)
    with pytest.raises(RuntimeError, match="keys and values q.s dtype or int8"):
        kernels.attention_prefill(torch.zeros(4, 4, 64, dtype=torch.bfloat16), keys, keys, 0)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_model_prefill_in_chunks_native_equals_torch_attention(dense_ckpt, dtype, bound, monkeypatch):
    """A model's chunked prefill and decode through the tiled kernel == through torch's SDPA with a mask."""
    model, _ = qwenrt.load(dense_ckpt[0], dtype=dtype)
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(4))

    def chunked():
        cache = model.new_cache(capacity=16)
        return torch.cat([model(ids[:, i:i + n], cache=cache) for i, n in ((0, 70), (70, 64), (134, 65), (199, 1))],
                         1)

    native = chunked()
    calls = []
    monkeypatch.setattr(qwenrt.model, "_prefill_kernels", lambda *t: calls.append(1))
    reference_path = chunked()
    assert calls and rel_err(native, reference_path) < bound
