"""Prefix caching: a request that restores a cached prefix gets the logits and tokens it gets without the cache."""

import contextlib
import dataclasses
import hashlib
import os
import shutil
import stat
import subprocess
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwenrt.engine import Engine, Request
from qwenrt.engine.core import MIN_BRANCH_GAIN
from qwenrt.engine.prefix_store import PrefixStore, model_identity
from qwenrt.engine.request import new_request_id
from qwenrt.prompt import prepare_prompt
from qwenrt.sampling import SamplingParams
from tests.hostile import one_line_error
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
    images_are_part_of_the_key(model, tok, monkeypatch)


def test_images_are_part_of_the_key_with_deepstack(qwen3_vl_ckpt, monkeypatch):
    """Qwen3-VL: a restored prefix ends inside or after the image; the rest of its DeepStack features still join."""
    import qwenrt

    model, tok = qwenrt.load(qwen3_vl_ckpt[0], dtype="float32")
    images_are_part_of_the_key(model, tok, monkeypatch)


def images_are_part_of_the_key(model, tok, monkeypatch):
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


# ---- the folder on disk as an attack surface: links, FIFOs, modes, forged and poisoned snapshots -------------------

def prefix_engine(model, tok, folder):
    return Engine(model, tok, prefix_cache_dir=folder)


def write_snapshots(model, tok, folder, request):
    engine = prefix_engine(model, tok, folder)
    finish(engine, [request])
    engine.prefix_cache.store.flush()
    return sorted(folder.rglob("*.safetensors"))


def test_a_linked_model_folder_is_refused_and_its_target_untouched(chat_model, tmp_path):
    """`<dir>/<identity>` (predictable for a known model) linked to someone's folder: that folder's *.safetensors
    were removed as foreign snapshots."""
    model, tok, _ = chat_model
    victim = tmp_path / "victim"
    victim.mkdir()
    precious = [victim / n for n in ("thesis.safetensors", "a" * 40 + ".safetensors", "b" * 40 + ".tmp")]
    for f in precious:
        f.write_bytes(b"precious")
    folder = tmp_path / "prefix"
    folder.mkdir()
    (folder / model_identity(model)).symlink_to(victim)
    one_line_error(lambda: prefix_engine(model, tok, folder), "is a symbolic link", "prefix_cache_dir")
    assert all(f.read_bytes() == b"precious" for f in precious)


def test_folder_and_key_modes(chat_model, ids, tmp_path, monkeypatch):
    model, tok, _ = chat_model
    folder = tmp_path / "fresh" / "prefix"
    files = write_snapshots(model, tok, folder, greedy(ids[:20]))
    mine = folder / model_identity(model)
    mode = {p: stat.S_IMODE(p.stat().st_mode) for p in [folder, mine, mine / ".key", *files]}
    assert mode[folder] == mode[mine] == 0o700 and set(mode.values()) == {0o700, 0o600}
    (mine / ".key").chmod(0o644)  # a key others can read signs nothing
    one_line_error(lambda: prefix_engine(model, tok, folder), "prefix cache key", "mode 0600; it is 0644")
    (mine / ".key").chmod(0o600)
    mine.chmod(0o777)
    one_line_error(lambda: prefix_engine(model, tok, folder), "is writable by others (mode 0777)", "chmod go-w")
    mine.chmod(0o755)
    prefix_engine(model, tok, folder)  # readable by others is the user's choice
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # the tests run as root: another user, simulated
    one_line_error(lambda: prefix_engine(model, tok, folder), f"is owned by uid {mine.stat().st_uid}, not by you")


@contextlib.contextmanager
def fifos_released_after(seconds, *fifos):
    """Fail when the body runs past `seconds`. An open() stuck on a FIFO inside native code (safetensors) retries
    through signals and holds the GIL, so `no_hang` cannot stop it: a shell opens each FIFO for writing after
    `seconds`, which lets such an open return."""
    script = 'sleep "$1"; shift; for f in "$@"; do timeout 2 sh -c \'exec 3>"$1"\' _ "$f"; done'
    releaser = subprocess.Popen(["sh", "-c", script, "_", str(seconds), *map(str, fifos)])
    began = time.monotonic()
    try:
        yield
    finally:
        releaser.kill()
        releaser.wait()
    assert time.monotonic() - began < seconds, f"hung for more than {seconds} s"


def test_fifos_directories_and_links_in_the_folder_are_left_alone(chat_model, ids, tmp_path, monkeypatch, capsys):
    """A FIFO named x.safetensors blocked the start for ever, a directory x.tmp or x.safetensors raised."""
    model, tok, _ = chat_model
    folder = tmp_path / "prefix"
    mine = folder / model_identity(model)
    mine.mkdir(parents=True, mode=0o700)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"someone else's")
    fifos = [mine / ("a" * 40 + ".safetensors"), mine / "x.safetensors", tmp_path / "ckpt" / "extra.safetensors"]
    for fifo in fifos[:2]:
        os.mkfifo(fifo)
    for name in ("x.tmp", "b" * 40 + ".tmp", "c" * 40 + ".safetensors"):
        (mine / name).mkdir()
    (mine / ("d" * 40 + ".safetensors")).symlink_to(outside)
    strays = sorted(p.name for p in mine.iterdir() if p.name != ".key")
    checkpoint = tmp_path / "ckpt"  # and a FIFO beside the weights the identity samples
    shutil.copytree(model.checkpoint_path, checkpoint)
    os.mkfifo(fifos[2])
    monkeypatch.setattr(model, "checkpoint_path", checkpoint)
    capsys.readouterr()
    with fifos_released_after(20, *fifos):
        files = write_snapshots(model, tok, folder, greedy(ids[:20]))
    assert "leaving alone 6 entries" in capsys.readouterr().err
    written = [f.name for f in files if f.is_file() and not f.is_symlink()]
    assert written and sorted(f.name for f in mine.iterdir() if f.name not in (".key", *written)) == strays
    assert outside.read_bytes() == b"someone else's"


def plain_sha256(tensors):
    """The unkeyed checksum snapshots carried, which anyone can recompute."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_a_forged_snapshot_is_not_used(chat_model, ids, tmp_path, monkeypatch, capsys):
    model, tok, _ = chat_model
    folder = tmp_path / "prefix"
    request = greedy(ids[:40])
    expected, _ = uncached(model, tok, request, monkeypatch)
    forged = 0
    for f in write_snapshots(model, tok, folder, request):
        with safe_open(f, "pt") as handle:
            meta, tensors = handle.metadata(), {n: handle.get_tensor(n) for n in handle.keys()}
        if "logits" in tensors:  # the attacker's token comes first
            tensors["logits"] = torch.full_like(tensors["logits"], -100.0)
            tensors["logits"][(expected[0] + 1) % tensors["logits"].numel()] = 100.0
            save_file(tensors, f, metadata={**meta, "sha256": plain_sha256(tensors)})
            forged += 1
    assert forged
    capsys.readouterr()
    again = greedy(ids[:40])
    assert finish(prefix_engine(model, tok, folder), [again])[again.request_id] == expected
    assert "ignoring and removing" in capsys.readouterr().err


def test_a_snapshot_holding_nan_is_not_used(chat_model, ids, tmp_path, monkeypatch, capsys):
    """Planted through the store's own writer (so signed as it signs): NaN states broke every request of the prompt."""
    model, tok, _ = chat_model
    folder = tmp_path / "prefix"
    request = greedy(ids[:40])
    expected, _ = uncached(model, tok, request, monkeypatch)
    snapshots = []
    for f in write_snapshots(model, tok, folder, request):
        snapshots.append(load_file(f))
        f.unlink()
    planter = PrefixStore(folder, model_identity(model), 1 << 30)
    for tensors in snapshots:
        key = tensors.pop("key").tolist()
        for name in {"recurrent", "logits"} & tensors.keys():
            tensors[name].fill_(float("nan"))
        planter.write(key, tensors)
    planter.flush()
    capsys.readouterr()
    again = greedy(ids[:40])
    assert finish(prefix_engine(model, tok, folder), [again])[again.request_id] == expected
    assert "NaN" in capsys.readouterr().err


@pytest.mark.parametrize("folder, fragment", [
    ("bad\0dir", "NUL"), ("\ud800", "not valid Unicode"), (123, "must be a str or an os.PathLike"),
    (b"/tmp/x", "must be a str or an os.PathLike")])
def test_a_prefix_cache_dir_that_is_no_path_is_one_line(chat_model, folder, fragment):
    """Was a ValueError, UnicodeEncodeError or TypeError from the OS layer (and "" used the current directory)."""
    model, tok, _ = chat_model
    one_line_error(lambda: Engine(model, tok, prefix_cache_dir=folder), "prefix_cache_dir", fragment)


def test_a_long_prompt_holds_its_kv_once_across_its_snapshots(chat_model, ids, tmp_path, monkeypatch):
    """A prompt snapshotted every 16 tokens: the tree holds each token's KV once (every edge its own tokens, not the
    prefix again) plus one DeltaNet state per snapshot; on disk (a file holds the whole prefix's KV) a snapshot
    larger than the folder's budget is not written at all."""
    model, tok, _ = chat_model
    engine = Engine(model, tok, max_batched_tokens=16, snapshot_interval=16, prefix_cache_dir=tmp_path / "p")
    cache = engine.prefix_cache
    state = sum(cache.shapes[k][0] * int(np.prod(cache.shapes[k][1:])) * 4 for k in ("conv", "recurrent"))
    cache.store.budget = 48 * cache.kv_token_bytes + state  # a 48-token prefix's snapshot, no longer
    written = []
    monkeypatch.setattr(cache.store, "write", lambda key, tensors: written.append(len(key)))
    finish(engine, [greedy(ids[:100], 1)])
    ends = [16, 32, 48, 64, 80, 96, 100]  # interval points, the prompt's end (with logits; one token: no more fed)
    assert len(cache) == len(ends)
    assert cache.nbytes == 100 * cache.kv_token_bytes + len(ends) * state + model.config.text.vocab_size * 4
    assert written == [16, 32, 48]
