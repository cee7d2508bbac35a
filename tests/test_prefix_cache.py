"""Prefix caching: a request that restores a cached prefix gets the logits and tokens it gets without the cache."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from qwenrt.engine import Engine, Request
from qwenrt.engine.core import MIN_BRANCH_GAIN
from qwenrt.engine.request import new_request_id
from qwenrt.prompt import prepare_prompt
from qwenrt.sampling import SamplingParams
from tests.numerics import rel_err


class Recorder:
    """Every logits row an engine samples from, per request id."""

    def __init__(self, engine: Engine, monkeypatch):
        self.logits = {}
        sample = engine._sample

        def recording(seq, logits, outputs):
            self.logits.setdefault(seq.request_id, []).append(logits.detach().clone())
            return sample(seq, logits, outputs)

        monkeypatch.setattr(engine, "_sample", recording)


def finish(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    outputs = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r, outputs[r.request_id].append)
    while engine.has_work:
        engine.step()
    return {rid: [t for o in outs for t in o.token_ids][:outs[-1].generation_tokens] for rid, outs in outputs.items()}


def greedy(prompt, n=8):
    return Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))


def uncached(model, tok, request: Request, monkeypatch, **options):
    """(tokens, logits rows) of the request on an engine without a prefix cache."""
    engine = Engine(model, tok, prefix_cache_size=0, **options)
    rec = Recorder(engine, monkeypatch)
    fresh = dataclasses.replace(request, request_id=new_request_id())
    tokens = finish(engine, [fresh])[fresh.request_id]
    return tokens, rec.logits[fresh.request_id]


def check_same(engine, rec, model, tok, request, monkeypatch, tokens):
    ref_tokens, ref_logits = uncached(model, tok, request, monkeypatch)
    assert tokens[request.request_id] == ref_tokens
    ours = rec.logits[request.request_id]
    assert len(ours) == len(ref_logits)
    # fp32; a prompt cut at other points sums its chunks in another order (the project's bound: 1e-4 of the largest)
    assert max(rel_err(a, b) for a, b in zip(ours, ref_logits)) <= 1e-4


@pytest.fixture
def ids(chat_model):
    _, tok, _ = chat_model
    return tok.encode("The history of the river valley begins long before the first farmers arrived, " * 8)


def test_hits_at_chunk_boundaries_and_between(chat_model, ids, monkeypatch):
    model, tok, _ = chat_model
    engine = Engine(model, tok, max_batched_tokens=16, snapshot_interval=16)
    rec = Recorder(engine, monkeypatch)
    first = greedy(ids[:70])
    finish(engine, [first])
    assert engine.prefix_cache.hits == 0 and len(engine.prefix_cache) >= 5  # 16, 32, 48, 64, 70 and the output
    cases = [(greedy(ids[:53] + tok.encode(" and then")), 48),  # between boundaries: back to the one at 48
             (greedy(ids[:75]), 70),  # past the previous prompt's (odd) end
             (greedy(ids[:32] + tok.encode(" ok")), 32)]  # exactly at a boundary
    for request, expected in cases:
        hit_tokens = engine.prefix_cache.hit_tokens
        tokens = finish(engine, [request])
        assert engine.prefix_cache.hit_tokens - hit_tokens == expected
        check_same(engine, rec, model, tok, request, monkeypatch, tokens)


def test_identical_prompt_needs_no_prefill(chat_model, ids, monkeypatch):
    model, tok, _ = chat_model
    engine = Engine(model, tok)
    rec = Recorder(engine, monkeypatch)
    finish(engine, [greedy(ids[:40])])
    prefills = []
    real = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda seq, n: prefills.append(n) or real(seq, n))
    again = greedy(ids[:40])
    tokens = finish(engine, [again])
    assert prefills == [] and engine.prefix_cache.hit_tokens == 40
    check_same(engine, rec, model, tok, again, monkeypatch, tokens)


def test_continuing_an_output(chat_model, ids, monkeypatch):
    """The next call that repeats prompt + output (an agent loop, a re-rendered turn) starts after both."""
    model, tok, _ = chat_model
    engine = Engine(model, tok)
    rec = Recorder(engine, monkeypatch)
    first = greedy(ids[:30], 10)
    out = finish(engine, [first])[first.request_id]
    follow = greedy(ids[:30] + out + tok.encode(" Next question?"))
    tokens = finish(engine, [follow])
    assert engine.prefix_cache.hit_tokens == 30 + len(out) - 1  # the last sampled token was never fed
    check_same(engine, rec, model, tok, follow, monkeypatch, tokens)


def test_chat_turn_reuses_the_previous_turn(chat_model, monkeypatch):
    model, tok, _ = chat_model
    engine = Engine(model, tok)
    rec = Recorder(engine, monkeypatch)
    history = [{"role": "system", "content": "You answer in one short sentence."},
               {"role": "user", "content": "What is the tallest mountain on Earth?"}]
    first = Request(history, SamplingParams(max_tokens=12), enable_thinking=False)
    answer = tok.decode(finish(engine, [first])[first.request_id])
    history = history + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the second?"}]
    second = Request(history, SamplingParams(max_tokens=12), enable_thinking=False)
    tokens = finish(engine, [second])
    previous = tok.encode(tok.apply_chat_template(history[:2], add_generation_prompt=False))
    assert engine.prefix_cache.hit_tokens >= len(previous)  # at least everything before the previous answer
    check_same(engine, rec, model, tok, second, monkeypatch, tokens)


def test_shared_system_prompt_conversations_stay_apart(chat_model, monkeypatch):
    model, tok, _ = chat_model
    engine = Engine(model, tok)
    rec = Recorder(engine, monkeypatch)
    system = {"role": "system", "content": "You are a careful assistant who explains things step by step. " * 3}
    requests = [Request([system, {"role": "user", "content": q}], SamplingParams(max_tokens=10),
                        enable_thinking=False) for q in ("Why is the sky blue?", "How do magnets work?",
                                                         "What is rain?")]
    tokens = finish(engine, requests[:1])
    tokens.update(finish(engine, requests[1:2]))  # finds the system prompt as KV: snapshots the branch point
    tokens.update(finish(engine, requests[2:]))  # restores that branch point
    assert engine.prefix_cache.hits >= 1
    for r in requests:
        check_same(engine, rec, model, tok, r, monkeypatch, tokens)


def test_hits_in_a_batch(chat_model, ids, monkeypatch):
    model, tok, _ = chat_model
    engine = Engine(model, tok, max_batched_tokens=24)
    rec = Recorder(engine, monkeypatch)
    finish(engine, [greedy(ids[:40])])
    batch = [greedy(ids[:40] + tok.encode(tail)) for tail in (" one", " two two", " three three three")]
    tokens = finish(engine, batch)
    assert engine.prefix_cache.hits == 3
    for r in batch:
        check_same(engine, rec, model, tok, r, monkeypatch, tokens)


def test_tiny_budget_evicts_and_stays_exact(chat_model, ids, monkeypatch):
    model, tok, _ = chat_model
    probe = Engine(model, tok)
    budget = int(1.5 * (probe.state_bytes + 60 * probe.kv_token_bytes))  # about one snapshot of a prompt
    engine = Engine(model, tok, prefix_cache_size=budget, snapshot_interval=16, max_batched_tokens=16)
    rec = Recorder(engine, monkeypatch)
    sizes = []
    real = engine.prefix_cache.insert

    def insert(*args, **kw):
        real(*args, **kw)
        sizes.append((engine.prefix_cache.nbytes, len(engine.prefix_cache)))

    monkeypatch.setattr(engine.prefix_cache, "insert", insert)
    requests = [greedy(ids[:n]) for n in (50, 45, 60, 50, 20)]
    tokens = {}
    for r in requests:
        tokens.update(finish(engine, [r]))
    assert max(n for n, _ in sizes) <= budget and max(k for _, k in sizes) <= 3  # of 20 snapshots taken
    assert engine.prefix_cache.hits >= 1  # something was still found between evictions
    for r in requests:
        check_same(engine, rec, model, tok, r, monkeypatch, tokens)


def picture(seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8))


LOOK = "Look carefully at every part of this picture, its colours and shapes, then answer briefly. " * 2


def test_images_are_part_of_the_key(vlm_chat, monkeypatch):
    model, tok, _, _ = vlm_chat
    engine = Engine(model, tok)
    rec = Recorder(engine, monkeypatch)

    def ask(seed, text):
        return Request([{"role": "user", "content": [{"type": "image", "image": picture(seed)},
                                                     {"type": "text", "text": LOOK + text}]}],
                       SamplingParams(max_tokens=6))

    requests = [ask(0, "Describe this."), ask(0, "What colour dominates?"), ask(0, "Is it dark?"),
                ask(1, "Describe this.")]
    ids = prepare_prompt(model, tok, requests[0].prompt).ids
    image_end = len(ids) - ids[::-1].index(model.config.image_token_id)
    assert len(tok.encode(LOOK)) >= MIN_BRANCH_GAIN
    tokens = finish(engine, requests[:1])
    tokens.update(finish(engine, requests[1:2]))  # finds the picture as KV and snapshots after the shared text
    tokens.update(finish(engine, requests[2:3]))
    hit = engine.prefix_cache.hit_tokens
    assert hit >= image_end  # past the picture
    tokens.update(finish(engine, requests[3:]))
    assert engine.prefix_cache.hit_tokens == hit  # another picture: nothing past its start is reused
    for r in requests[1:]:
        check_same(engine, rec, model, tok, r, monkeypatch, tokens)


def test_snapshots_on_disk_survive_a_restart(chat_ckpt, chat_model, ids, tmp_path, monkeypatch, capsys):
    model, tok, _ = chat_model
    folder = tmp_path / "prefix"
    first = Engine(model, tok, prefix_cache_dir=folder)
    finish(first, [greedy(ids[:40])])
    first.prefix_cache.store.flush()
    files = sorted(folder.rglob("*.safetensors"))
    assert files and not list(folder.rglob("*.tmp"))

    restarted = Engine(model, tok, prefix_cache_dir=folder)  # empty memory: only the disk has them
    rec = Recorder(restarted, monkeypatch)
    request = greedy(ids[:40] + tok.encode(" and so on"))
    tokens = finish(restarted, [request])
    assert restarted.prefix_cache.hit_tokens >= 39
    check_same(restarted, rec, model, tok, request, monkeypatch, tokens)

    import qwenrt
    other, _ = qwenrt.load(chat_ckpt[0], dtype="bfloat16")  # another dtype: another identity, never read
    elsewhere = Engine(other, tok, prefix_cache_dir=folder)
    finish(elsewhere, [greedy(ids[:40] + tok.encode(" and so on"))])
    assert elsewhere.prefix_cache.hit_tokens == 0

    for i, f in enumerate(files):  # cut short or flip a byte: each is ignored with a warning and removed
        data = bytearray(f.read_bytes())
        if i % 2:
            data[-3] ^= 0xFF
        f.write_bytes(bytes(data) if i % 2 else bytes(data[: len(data) // 2]))
    capsys.readouterr()
    broken = Engine(model, tok, prefix_cache_dir=folder)
    request = greedy(ids[:40] + tok.encode(" again"))
    rec = Recorder(broken, monkeypatch)
    tokens = finish(broken, [request])
    warnings = capsys.readouterr().err
    assert warnings.count("ignoring and removing") == len(files) and all(not f.exists() for f in files)
    assert broken.prefix_cache.hit_tokens == 0
    check_same(broken, rec, model, tok, request, monkeypatch, tokens)


def test_a_model_without_deltanet_layers(tmp_path, monkeypatch):
    """A config whose layers are all full attention: snapshots hold no DeltaNet state, hits still restore the KV."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    import qwenrt
    from tests.checkpoints import DENSE, randomize

    config = Qwen3_5TextConfig(**dict(DENSE, num_hidden_layers=2, layer_types=["full_attention"] * 2))
    randomize(Qwen3_5ForCausalLM(config).eval()).save_pretrained(tmp_path)
    model, _ = qwenrt.load(tmp_path, dtype="float32")
    engine = Engine(model, None, max_batched_tokens=16, snapshot_interval=16)
    rec = Recorder(engine, monkeypatch)
    prompt = [int(t) for t in torch.randint(1, 500, (40,), generator=torch.Generator().manual_seed(3))]
    finish(engine, [greedy(prompt)])
    again = greedy(prompt[:35] + [7, 8])
    tokens = finish(engine, [again])
    assert engine.prefix_cache.hit_tokens == 32
    check_same(engine, rec, model, None, again, monkeypatch, tokens)
