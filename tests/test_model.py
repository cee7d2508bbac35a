"""The decoder against transformers 5.23 on tiny random checkpoints, and its cache invariants."""

import pytest
import torch

import qwenrt
from tests.checkpoints import VOCAB
from tests.hostile import one_line_error
from tests.numerics import rel_err

KINDS = ["dense_ckpt", "moe_ckpt", "vlm_ckpt", "published_ckpt"]


def reference_logits(ref, ids):
    with torch.no_grad():
        return ref(input_ids=ids).logits.float()


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_reference(kind, request):
    path, ref = request.getfixturevalue(kind)
    model, _ = qwenrt.load(path, dtype="float32")
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(0))  # > two DeltaNet chunks
    ours = model(ids)
    assert ours.shape == (2, 150, VOCAB) and ours.dtype == torch.float32
    assert rel_err(ours, reference_logits(ref, ids)) <= 1e-4


@pytest.mark.parametrize("kind", ["dense_ckpt", "moe_ckpt"])
def test_split_prefill_then_decode_equals_full_forward(kind, request):
    path, _ = request.getfixturevalue(kind)
    model, _ = qwenrt.load(path, dtype="float32")
    ids = torch.randint(0, VOCAB, (2, 140), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = model.new_cache(batch_size=2, capacity=16)  # small capacity: growth is exercised too
    pieces, start = [], 0
    for n in (33, 1, 64, 30):
        pieces.append(model(ids[:, start:start + n], cache=cache))
        start += n
    while start < ids.shape[1]:
        pieces.append(model(ids[:, start:start + 1], cache=cache))
        start += 1
    assert cache.lengths == [140, 140]
    assert rel_err(torch.cat(pieces, dim=1), full) <= 1e-4


def test_kv_stores_grow_by_a_quarter_up_to_the_limit(dense_ckpt):
    model, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    seq = model.new_sequence(capacity=16, limit=1100)
    seq.length = 10
    for length, capacity in ((17, 256), (300, 320), (330, 400), (900, 900), (1000, 1100)):
        seq.reserve(length)
        assert seq.capacity == capacity
    assert all(k.shape[2] == 1100 for k in seq.keys if k is not None)


@pytest.mark.parametrize("kind", ["dense_ckpt", "moe_ckpt", "published_ckpt"])
def test_greedy_decode_matches_reference_generate(kind, request):
    path, ref = request.getfixturevalue(kind)
    model, _ = qwenrt.load(path, dtype="float32")
    prompt = torch.randint(0, VOCAB, (1, 37), generator=torch.Generator().manual_seed(2))
    steps = 32
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                pad_token_id=0)[0, prompt.shape[1]:].tolist()
    cache = model.new_cache(1)
    logits = model(prompt, cache=cache, logits_to_keep=1)
    tokens = []
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token.item())
        logits = model(token, cache=cache)
    assert tokens == expected


def test_bf16_close_to_fp32(dense_ckpt):
    """Random tiny models amplify rounding (transformers' own bf16 drifts as far), so the bound is relative to it."""
    from transformers import Qwen3_5ForCausalLM

    path, ref = dense_ckpt
    fp32, _ = qwenrt.load(path, dtype="float32")
    bf16, _ = qwenrt.load(path, dtype=torch.bfloat16)
    assert bf16.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].linear_attn.A_log.dtype == torch.float32  # precision-critical params stay fp32
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(3))
    exact = fp32(ids)
    ref_bf16 = reference_logits(Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16), ids)

    def rms_err(x):
        return ((x - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()

    def top1(x):
        return (x.argmax(-1) == exact.argmax(-1)).float().mean().item()

    ours = bf16(ids)
    assert rms_err(ours) <= 1.25 * rms_err(ref_bf16) + 1e-3, (rms_err(ours), rms_err(ref_bf16))
    assert top1(ours) >= top1(ref_bf16) - 0.03
    assert rel_err(ours[:, :1], exact[:, :1]) < 0.05  # the first position has no history to amplify rounding


def test_float16_decodes_through_torch_ops(dense_ckpt):
    """The native decode kernels take bf16 or fp32; a float16 model (an F16 GGUF file at "auto", --dtype float16)
    decodes through torch's ops: its cached steps give the logits of the whole sequence at once."""
    model, _ = qwenrt.load(dense_ckpt[0], dtype="float16")
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        whole = model(ids)
        cache = model.new_cache(1)
        steps = torch.cat([model(ids[:, :8], cache=cache)] + [model(ids[:, i:i + 1], cache=cache)
                                                             for i in range(8, 12)], 1)
    assert model.dtype == torch.float16 and rel_err(steps, whole) < 1e-2


def test_bf16_decode_state_stays_fp32(dense_ckpt):
    path, _ = dense_ckpt
    model, _ = qwenrt.load(path, dtype="bfloat16")
    cache = model.new_cache(1)
    model(torch.tensor([[1, 2, 3]]), cache=cache)
    layer = model.config.text.linear_attention_layers[0]
    assert cache.sequences[0].recurrent[layer].dtype == torch.float32
    assert cache.sequences[0].keys[model.config.text.full_attention_layers[0]].dtype == torch.bfloat16


def test_published_layout_loads_mtp_and_keeps_vision_aside(published_ckpt):
    path, _ = published_ckpt
    model, _ = qwenrt.load(path)  # auto dtype: stored bf16
    assert model.dtype == torch.bfloat16
    assert model.mtp.fc.weight.dtype == torch.bfloat16 and not any(n.startswith("mtp.") for n in model.extra_tensors)
    assert any(n.startswith("model.visual.") for n in model.extra_tensors)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)


def test_forward_refuses_bad_inputs_before_any_work(dense_ckpt):
    model, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    cache = model.new_cache(2)
    for ids, fragment in [
        (torch.tensor([[1, VOCAB]]), f"input_ids hold {VOCAB}, outside the vocabulary [0, {VOCAB})"),
        (torch.tensor([[1, -3]]), "input_ids hold -3, outside the vocabulary"),
        (torch.tensor([[1.0, 2.0]]), "int64 or int32 tensor, got torch.float32"),
        (torch.tensor([[True]]), "int64 or int32 tensor, got torch.bool"),
        (torch.tensor([[1]], dtype=torch.uint8), "got torch.uint8"),
        (torch.zeros(1, 0, dtype=torch.long), "non-empty [B, T] tensor, got shape [1, 0]"),
        (torch.tensor([1, 2]), "non-empty [B, T] tensor, got shape [2]"),
        ([[1, 2]], "input_ids must be a torch.Tensor, got list"),
    ]:
        one_line_error(lambda: model(ids), fragment)
        one_line_error(lambda: model(ids, cache=cache), fragment)
    assert cache.lengths == [0, 0]  # nothing was written
    ids = torch.tensor([[1, 2]])
    one_line_error(lambda: model(), "pass input_ids or inputs_embeds")
    one_line_error(lambda: model(ids, inputs_embeds=torch.zeros(1, 2, 64)), "not both or neither")
    one_line_error(lambda: model(inputs_embeds=torch.zeros(1, 2, 7)), "inputs_embeds must be floats [B, T, 64]")
    one_line_error(lambda: model(ids, cache="cache"), "cache must be a HybridCache")
    one_line_error(lambda: model(ids, logits_to_keep=-1), "logits_to_keep must be an integer >= 0")
    short = qwenrt.model.HybridCache([model.new_sequence(limit=2)])
    one_line_error(lambda: model(torch.tensor([[1, 2, 3]]), cache=short), "holds at most 2 tokens")
    assert model(ids, logits_to_keep=1).shape == (1, 1, VOCAB)


@pytest.mark.parametrize("options, fragment", [
    (dict(batch_size=-1), "batch_size must be an integer >= 1, got -1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(batch_size=1.5), "batch_size must be an integer >= 1, got 1.5"),
    (dict(batch_size=True), "batch_size must be an integer >= 1, got True"),
    (dict(capacity=0), "capacity must be an integer >= 1, got 0"),
    (dict(capacity=2.5), "capacity must be an integer >= 1, got 2.5"),
    (dict(capacity=10 ** 15), "capacity must be at most the model's context"),  # was the allocator's error
])
def test_new_cache_refuses_bad_sizes(dense_ckpt, options, fragment):
    model, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    one_line_error(lambda: model.new_cache(**options), fragment)
