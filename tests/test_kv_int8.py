"""The 8-bit KV cache (--kv-cache-dtype int8): rows of int8 values with an fp32 scale per token and head. The native
kernels read it exactly as its dequantized values (tiled prefill, decode step), torch paths agree, and it flows
through the engine: batched == single, prefix cache hits, speculative == plain, admission counts its bytes."""

import os

import pytest
import torch

import qwenrt
import qwenrt.model
from qwenrt import QwenrtError
from qwenrt.cache import SCALE_BYTES, dequantize_kv, kv_bytes_per_token, quantize_kv
from qwenrt.engine import Engine, Request
from qwenrt.kernels import cpu_kernels
from qwenrt.sampling import SamplingParams
from tests.checkpoints import VOCAB, add_mtp_head
from tests.numerics import rel_err
from tests.test_engine import run, tokens_of
from tests.test_tiled_attention import reference

native = pytest.mark.skipif(os.environ.get("QWENRT_KERNELS") == "0", reason="QWENRT_KERNELS=0: torch paths only")


def test_rows_hold_values_and_their_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    x[1, 2] = 0  # a zero row: scale 0, values 0
    q = quantize_kv(x)
    assert q.shape == (3, 5, 64 + SCALE_BYTES) and q.dtype == torch.int8
    scale = q[..., 64:].contiguous().view(torch.float32)[..., 0]  # [3, 5]
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    assert q[..., :64].abs().max() == 127 and scale[1, 2] == 0 and not q[1, 2].any()
    err = (dequantize_kv(q, torch.float32) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-6)).all()  # rounding to the nearest step


def int8_stores(Hkv: int, cap: int, D: int, g: torch.Generator, filled: int):
    """8-bit keys, values [1, Hkv, cap, Dh + 4] of random rows, bytes 0xFF after `filled` (NaN scales: never read)."""
    keys = torch.full((1, Hkv, cap, D + SCALE_BYTES), -1, dtype=torch.int8)
    values = keys.clone()
    keys[:, :, :filled] = quantize_kv(torch.randn(1, Hkv, filled, D, generator=g))
    values[:, :, :filled] = quantize_kv(torch.randn(1, Hkv, filled, D, generator=g))
    return keys, values


@native
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("T, start, H, Hkv, D", [(1, 0, 4, 4, 64), (7, 1500, 4, 2, 256), (65, 1935, 8, 2, 64),
                                                 (300, 64, 2, 1, 256), (9, 20, 4, 2, 48)])
def test_tiled_prefill_reads_the_rows_as_their_values(T, start, H, Hkv, D, dtype, bound):
    """Tiles of 8-bit rows == float64 attention over the keys and values they hold, dequantized to the queries'
    dtype as the torch path does (bf16: also one rounding of each output)."""
    g = torch.Generator().manual_seed(T + start)
    keys, values = int8_stores(Hkv, start + T + 5, D, g, start + T)
    q = (3 * torch.randn(T, H, D, generator=g)).to(dtype)
    out = cpu_kernels().attention_prefill(q, keys, values, start)
    assert out.shape == (T, H, D) and out.dtype == dtype
    assert rel_err(out, reference(q, dequantize_kv(keys[0], dtype), dequantize_kv(values[0], dtype), start)) < bound


def norm_rope(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Zero-centred RMSNorm of each head x [B, N, Dh] (scale 1 + w), then NeoX RoPE over the first R channels."""
    x = x.double()
    normed = x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * (1 + w.double())
    R = cos.shape[-1]
    rot, rest = normed[..., :R], normed[..., R:]
    half = torch.cat([-rot[..., R // 2:], rot[..., : R // 2]], -1)
    return torch.cat([rot * cos.double()[:, None] + half * sin.double()[:, None], rest], -1)


@native
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_step_writes_rows_as_torch_and_attends_over_their_values(dtype, bound):
    """The decode step quantizes the new key (normed, rotated, rounded to the compute dtype) and value exactly as
    quantize_kv does, and attends over the dequantized rows, its own included: == a float64 reference (the rows of
    B successive tokens of one sequence, each seeing the ones before it)."""
    kernels, g = cpu_kernels(), torch.Generator().manual_seed(1)
    B, H, Hkv, D, R, start = 3, 8, 2, 256, 64, 700
    qg = torch.randn(B, H, 2 * D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, D, generator=g).to(dtype) for _ in range(2))
    qn, kn = (0.1 * torch.randn(D, generator=g) for _ in range(2))
    angle = torch.rand(B, R, generator=g) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    lengths = torch.arange(start, start + B)
    keys, values = int8_stores(Hkv, start + 10, D, g, start)
    plain_k, plain_v = dequantize_kv(keys, dtype), dequantize_kv(values, dtype)
    out = kernels.attention_decode_step(qg, k, v, qn, kn, cos, sin, keys, values, lengths, 1e-6)
    kernels.attention_decode_step(qg, k, v, qn, kn, cos, sin, plain_k, plain_v, lengths, 1e-6)
    new = slice(start, start + B)
    assert torch.equal(keys[0, :, new], quantize_kv(plain_k[0, :, new]))  # the rotated keys a plain store holds
    assert torch.equal(values[0, :, new], quantize_kv(v.transpose(0, 1)))
    q = norm_rope(qg[..., :D], qn, cos, sin)  # [B, H, Dh]
    exact = reference(q, dequantize_kv(keys[0], torch.float64), dequantize_kv(values[0], torch.float64), start)
    exact = exact * torch.sigmoid(qg[..., D:].double())
    assert rel_err(out, exact.reshape(B, H * D)) < bound


@native
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_model_with_int8_kv_native_equals_torch_paths(dense_ckpt, dtype, bound, monkeypatch):
    """Chunked prefill and decode of a model over an 8-bit cache: native kernels == torch's attention over the
    dequantized stores."""
    model, _ = qwenrt.load(dense_ckpt[0], dtype=dtype)
    ids = torch.randint(0, VOCAB, (1, 205), generator=torch.Generator().manual_seed(4))

    def chunked():
        cache = model.new_cache(capacity=16, kv_dtype=torch.int8)
        out = [model(ids[:, i:i + n], cache=cache) for i, n in ((0, 70), (70, 64), (134, 65))]
        out += [model(ids[:, i:i + 1], cache=cache) for i in range(199, 205)]
        assert cache.sequences[0].keys[model.config.text.full_attention_layers[0]].dtype == torch.int8
        return torch.cat(out, 1)

    fast = chunked()
    calls = []
    monkeypatch.setattr(qwenrt.model, "_prefill_kernels", lambda *t: calls.append(1))
    monkeypatch.setattr(qwenrt.model, "inference_kernels", lambda *t: calls.append(2))
    slow = chunked()
    assert 1 in calls and 2 in calls and rel_err(fast, slow) < bound


def test_int8_kv_logits_stay_near_the_full_cache(chat_model):
    """A tiny fp32 model with the real vocabulary over an 8-bit cache: logits within 1% of the largest, the same top
    tokens."""
    model, tok, _ = chat_model
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Italy is Rome. " * 6)])

    def logits(kv_dtype):
        cache = model.new_cache(kv_dtype=kv_dtype)
        return torch.cat([model(ids[:, i:i + 32], cache=cache) for i in range(0, ids.shape[1], 32)], 1)

    full, eight = logits(None), logits(torch.int8)
    assert 0 < rel_err(eight, full) < 1e-2
    assert torch.equal(eight.argmax(-1), full.argmax(-1))


def greedy(engine: Engine, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    requests = [Request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p in prompts]
    outputs = run(engine, {i: [r] for i, r in enumerate(requests)})  # arriving at successive steps
    assert engine.num_running == 0 and engine.scheduler.reserved == 0
    return [tokens_of(outputs[r.request_id]) for r in requests]


PROMPTS = [[1, 2, 3, 4, 5, 6, 7] * 9, [9, 8, 7, 100, 200], [5] * 40]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_int8_kv_batched_single_cached_and_speculative_agree(dense_ckpt, tmp_path, dtype):
    """Greedy through the engine over an 8-bit cache: the model's own loop over one == batched requests == each alone
    == a prefix-cache hit (the snapshot's 8-bit rows restored) == with MTP drafts (k 1-3)."""
    model, _ = qwenrt.load(add_mtp_head(dense_ckpt[0], tmp_path / "mtp"), dtype=dtype)
    options = dict(kv_cache_dtype="int8", prefix_cache_size=0)
    engine = Engine(model, speculative_tokens=0, **options)
    allocate, states = engine.runner.allocate, []
    engine.runner.allocate = lambda seq: states.append(allocate(seq)) or states[-1]
    batched = greedy(engine, PROMPTS)
    assert len(states) == 3 and all(s.quantized_kv for s in states)
    alone = [greedy(Engine(model, speculative_tokens=0, **options), [p])[0] for p in PROMPTS]
    assert batched == alone
    cache = model.new_cache(kv_dtype=torch.int8)
    token = model(torch.tensor([PROMPTS[0]]), cache=cache, logits_to_keep=1)[0, -1].argmax()
    loop = [token.item()]
    for _ in range(23):
        loop.append(model(token.view(1, 1), cache=cache)[0, -1].argmax().item())
        token = torch.tensor(loop[-1])
    assert loop == alone[0]
    cached = Engine(model, speculative_tokens=0, kv_cache_dtype="int8")
    assert greedy(cached, [PROMPTS[0]]) == greedy(cached, [PROMPTS[0]]) == [alone[0]]
    assert cached.prefix_cache.hits == 1 and cached.prefix_cache.hit_tokens > 0
    for k in (1, 2, 3):
        assert greedy(Engine(model, speculative_tokens=k, **options), PROMPTS) == alone, f"k={k}"


def test_admission_counts_the_int8_bytes(dense_ckpt):
    model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
    c = model.config.text
    full, eight = (Engine(model, kv_cache_dtype=kv) for kv in ("auto", "int8"))
    per_head = 2 * len(c.full_attention_layers) * c.num_key_value_heads
    assert full.kv_token_bytes == per_head * c.head_dim * 2 == kv_bytes_per_token(c, torch.bfloat16)
    assert eight.kv_token_bytes == per_head * (c.head_dim + SCALE_BYTES)
    assert eight.prefix_cache.kv_token_bytes == eight.kv_token_bytes


def test_bad_kv_cache_dtypes_are_one_line_errors(dense_ckpt):
    model, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    for bad in ("fp8", "INT8", 8):
        with pytest.raises(QwenrtError, match="kv cache dtype must be one of auto, int8"):
            Engine(model, kv_cache_dtype=bad)
    with pytest.raises(QwenrtError, match="kv_dtype must be the model's dtype or torch.int8"):
        model.new_cache(kv_dtype=torch.float16)
