"""Speculative decoding in the engine: the MTP head loads with the model and drafts through its own cache; a
verification of several tokens keeps exactly the accepted ones (DeltaNet state rolled back, KV overwritten); greedy
output with drafts == without, token for token, and sampling keeps the target distribution."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

import qwenrt
from qwenrt import QwenrtError
from qwenrt.cache import HybridCache
from qwenrt.engine import Engine, Request
from qwenrt.engine.core import MAX_PENDING, _pend
from qwenrt.engine.request import Sequence
from qwenrt.engine.runner import ModelRunner
from qwenrt.engine.speculative import DraftPolicy
from qwenrt.inspect import inspect_checkpoint
from qwenrt.decode_plan import MTPPlan
from qwenrt.kernels import cpu_kernels
from qwenrt.mtp import chained_hidden, draft_head, mtp_hidden
from qwenrt.ops.linear import MAX_KERNEL_ROWS
from qwenrt.prompt import prepare_prompt
from qwenrt.sampling import SamplingParams, greedy
from tests.checkpoints import VOCAB, add_mtp_head
from tests.test_engine import picture, run, tokens_of

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 100, 200], [5] * 20]


@pytest.fixture(scope="module")
def mtp_dense(dense_ckpt, tmp_path_factory):
    return add_mtp_head(dense_ckpt[0], tmp_path_factory.mktemp("mtp") / "dense")


@pytest.fixture(scope="module")
def mtp_moe(moe_ckpt, tmp_path_factory):
    return add_mtp_head(moe_ckpt[0], tmp_path_factory.mktemp("mtp") / "moe")  # per-expert mtp.* names


def oracle_drafts(engine: Engine, plain: dict[tuple, list[int]]):
    """Replace the engine's drafts (still computed by the MTP head, by the separate draft or within a native cycle)
    by the plain run's next tokens, one of them made wrong every other step: accepted and rejected drafts both
    occur."""
    draft, cycle, calls = engine.runner.draft, engine.runner.cycle, {}

    def fixed(s, done: int, count: int) -> list[int]:
        """The plain run's `count` tokens after its first `done`, one made wrong every other call."""
        want = list(plain[tuple(s.prompt.ids)][done:done + count])
        calls[s.request_id] = n = calls.get(s.request_id, 0) + 1
        if want and n % 2:
            want[n % len(want)] = (want[n % len(want)] + 1) % VOCAB
        return want

    def oracle(seqs, ks):
        return [fixed(s, len(s.tokens), len(r)) for s, r in zip(seqs, draft(seqs, ks))]

    def oracle_cycle(seqs, drafts, ks):
        out = cycle(seqs, drafts, ks)
        for s, c in zip(seqs, out or ()):  # the sequence takes its accepted drafts and one more token
            c.drafts = fixed(s, len(s.tokens) + c.accepted + 1, len(c.drafts))
        return out

    engine.runner.draft, engine.runner.cycle = oracle, oracle_cycle


def generate_all(model, tok, prompts, k, oracle=None, n=30, **engine_options) -> tuple[list[list[int]], list]:
    engine = Engine(model, tok, speculative_tokens=k, prefix_cache_size=0, **engine_options)
    if oracle is not None:
        oracle_drafts(engine, oracle)
    requests = [Request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p in prompts]
    outputs = run(engine, {i: [r] for i, r in enumerate(requests)})  # arriving at successive steps
    assert engine.num_running == 0 and engine.scheduler.reserved == 0
    return [tokens_of(outputs[r.request_id]) for r in requests], [outputs[r.request_id][-1] for r in requests]


def check_lossless(model, tok, prompts, n=30):
    plain, _ = generate_all(model, tok, prompts, 0, n=n)
    oracle = {tuple(p): t for p, t in zip(prompts, plain)} if isinstance(prompts[0], list) else None
    for k in (1, 2, 3):
        got, last = generate_all(model, tok, prompts, k, oracle=oracle, n=n)
        assert got == plain, f"k={k}"
        counts = [o.drafts for o in last]
        assert all(c is not None and c.rounds > 0 for c in counts)
        if oracle is not None:  # both paths taken: drafts kept and drafts rejected
            assert 0 < sum(c.accepted_tokens for c in counts) < sum(c.draft_tokens for c in counts)


def test_mtp_head_loads_with_the_model(mtp_dense, mtp_moe, published_ckpt):
    for path in (mtp_dense, mtp_moe, published_ckpt[0]):
        model, _ = qwenrt.load(path)
        assert model.mtp is not None and model.mtp.layers[0].self_attn.layer_idx == 0
        assert inspect_checkpoint(path)["mtp"] and inspect_checkpoint(path)["params_mtp"] > 0
    assert hasattr(model.mtp.layers[0].mlp, "experts")  # the published MoE's head is a MoE layer
    quantized, _ = qwenrt.load(mtp_dense, dtype="bfloat16", quantize="int8")
    assert type(quantized.mtp.fc).__name__ == "QuantLinear"  # quantized with the rest


def test_an_incomplete_mtp_head_is_refused(mtp_dense, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    shutil.copytree(mtp_dense, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["mtp.norm.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(QwenrtError, match="mtp.norm.weight"):
        qwenrt.load(tmp_path / "m")


def test_mtp_head_with_its_cache_equals_the_whole_sequence(mtp_dense):
    model, _ = qwenrt.load(mtp_dense, dtype="float32")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    whole = mtp_hidden(model, model.mtp, ids)  # [1, 11, D]
    hidden = model.hidden_states(ids)
    state = model.mtp.new_state(model.config.text, model.dtype, "cpu", 4, None)  # grows while used
    parts = []
    for a, b in ((0, 5), (5, 6), (6, 11)):
        cos, sin = model.rotary(torch.arange(a, b)[None], model.dtype)
        parts.append(model.mtp(hidden[:, a:b], model.model.embed_tokens(ids[:, a + 1:b + 1]), cos, sin,
                               HybridCache([state])))
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-5)
    assert state.length == 11


def test_chained_depths_equal_the_head_drafting_with_its_cache(mtp_dense):
    """What the trainer fits for further drafts (mtp.chained_hidden) is what the engine runs: at a row p the head
    over the rows up to p, then over its own output and the next token at p+1, then again at p+2, each into its
    cache. Depth 1 is mtp_hidden; rows of different depths see different keys, so a wrong mask fails this."""
    model, _ = qwenrt.load(mtp_dense, dtype="float32")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    hidden = model.hidden_states(ids)
    depths = chained_hidden(model, model.mtp, ids, 3, hidden)  # 3 x [1, 11, D]
    assert torch.allclose(depths[0], mtp_hidden(model, model.mtp, ids, hidden), atol=1e-6)
    embed = model.model.embed_tokens
    for p in (0, 4, 8):
        state = model.mtp.new_state(model.config.text, model.dtype, "cpu", 16, None)
        cos, sin = model.rotary(torch.arange(p + 1)[None], model.dtype)
        h = model.mtp(hidden[:, :p + 1], embed(ids[:, 1:p + 2]), cos, sin, HybridCache([state]))[:, -1:]
        for d in (2, 3):  # the draft at depth d - 1 is the true token ids[p + d]
            cos, sin = model.rotary(torch.tensor([[p + d - 1]]), model.dtype)
            h = model.mtp(h, embed(ids[:, p + d:p + d + 1]), cos, sin, HybridCache([state]))
            assert torch.allclose(h[0, 0], depths[d - 1][0, p], atol=1e-5), (p, d)
            assert not torch.allclose(h[0, 0], depths[d - 2][0, p], atol=1e-3)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_native_draft_plan_equals_the_heads_modules(mtp_dense, quantize):
    """The MTP head's bound native plan (what the engine drafts with on the CPU) runs the kernels the modules run
    one position at a time: the same outputs and draft logits, several rows per sequence or one."""
    model, _ = qwenrt.load(mtp_dense, dtype="bfloat16", quantize=quantize)
    plan = MTPPlan.for_model(model, VOCAB // 2)
    if cpu_kernels() is None:
        assert plan is None
        return
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    hidden, n = model.hidden_states(ids)[0], ids.shape[1] - 1  # [T, D]
    modules, planned = (model.mtp.new_state(model.config.text, model.dtype, "cpu", 16, None) for _ in range(2))
    expected = []
    for t in range(n):
        cos, sin = model.rotary(torch.tensor([[t]]), model.dtype)
        expected.append(model.mtp(hidden[None, t:t + 1], model.model.embed_tokens(ids[:, t + 1:t + 2]), cos, sin,
                                  HybridCache([modules]))[0, 0])
    planned.reserve(n)
    first = plan.hidden(hidden[:5], ids[0, 1:6], [planned], [5], [0])  # five rows of one sequence
    planned.length += 5
    rest = []
    for t in range(5, n):
        rest.append(plan.hidden(hidden[t:t + 1], ids[0, t + 1:t + 2], [planned], [1], [t])[0])
        planned.length += 1
    out = torch.cat([first, torch.stack(rest)])
    assert torch.equal(out, torch.stack(expected))
    head = draft_head(model.lm_head, VOCAB // 2)
    for rows in (out[:MAX_KERNEL_ROWS], out[MAX_KERNEL_ROWS:]):  # the module's decode-sized calls (more rows of an
        assert torch.equal(plan.logits(rows), head(rows))  # int8 head take torch's GEMM where bf16 is native)
    assert plan.logits(out).shape == (n, VOCAB // 2)


@pytest.mark.parametrize("dtype,quantize", [("float32", None), ("bfloat16", None), ("bfloat16", "int8"),
                                            ("bfloat16", "int4")])
def test_greedy_with_drafts_equals_plain_dense(mtp_dense, dtype, quantize):
    model, _ = qwenrt.load(mtp_dense, dtype=dtype, quantize=quantize)
    check_lossless(model, None, PROMPTS)


def test_greedy_with_drafts_equals_plain_moe(mtp_moe, published_ckpt):
    for path, dtype in ((mtp_moe, "float32"), (published_ckpt[0], "bfloat16")):
        model, _ = qwenrt.load(path, dtype=dtype)
        check_lossless(model, None, PROMPTS)


def test_image_prompt_with_drafts(vlm_chat, tmp_path):
    _, tok, _, path = vlm_chat
    model, tok = qwenrt.load(add_mtp_head(path, tmp_path / "vlm-mtp"))
    image = [{"role": "user", "content": [{"type": "image", "image": picture(64, 96, 0)},
                                          {"type": "text", "text": "What is this?"}]}]
    prompts = [image, "Hello there"]
    plain, _ = generate_all(model, tok, prompts, 0, n=12)
    for k in (1, 3):
        got, last = generate_all(model, tok, prompts, k, n=12)
        assert got == plain
        assert last[0].drafts.rounds > 0


def test_rejected_drafts_leave_the_state_of_the_accepted_tokens(mtp_dense):
    """A verification of [t, d1, d2, d3] that keeps t and d1 leaves the cache as decoding t, d1 one by one does."""
    model, _ = qwenrt.load(mtp_dense, dtype="bfloat16")
    runner = ModelRunner(model, 32)
    prompt = [11, 22, 33, 44, 55]

    def prefilled():
        request = Request(prompt, SamplingParams(max_tokens=20))
        seq = Sequence(request, prepare_prompt(model, None, prompt, None, None, 64, request.media_policy), None,
                       set(), 64, lambda out: None, model.device)
        seq.state = runner.allocate(seq)
        runner.prefill(seq, len(prompt))
        seq.tokens = [66]
        return seq

    one_by_one, verified = prefilled(), prefilled()
    runner.decode([one_by_one])
    one_by_one.tokens.append(77)
    logits_after = runner.decode([one_by_one])[0]  # the step after t, d1
    v = runner.verify([verified], [[77, 88, 99]])[0]
    runner.commit(verified, v, 2)
    a, b = one_by_one.state, verified.state
    assert a.length == b.length == len(prompt) + 2
    for i in model.config.text.linear_attention_layers:
        assert torch.allclose(a.conv[i], b.conv[i], atol=1e-6) and torch.allclose(a.recurrent[i], b.recurrent[i],
                                                                                   atol=1e-6)
    for i in model.config.text.full_attention_layers:
        assert torch.equal(a.keys[i][:, :, :a.length], b.keys[i][:, :, :b.length])
    assert torch.allclose(v.logits[1], logits_after[0], atol=1e-5)  # what the step after d1 predicts
    for seq in (one_by_one, verified):
        seq.tokens.append(123)
    assert torch.allclose(runner.decode([verified])[0], runner.decode([one_by_one])[0], atol=1e-5)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_native_cycle_equals_the_separate_calls(mtp_dense, quantize):
    """The greedy cycle in one native call (runner.cycle) against verify, the greedy picks, commit and the head's
    draft one call each: the same tokens, accepted counts and drafts, and caches equal tensor for tensor (model and
    MTP head), round after round: the head's pending prompt row first, drafts partly accepted, all accepted, then
    kept back to fewer inputs (the sequence ended among them). int4: the tied tokens looked up in the quantized
    head."""
    model, _ = qwenrt.load(mtp_dense, dtype="bfloat16", quantize=quantize)
    if cpu_kernels() is None:
        return
    runner = ModelRunner(model, VOCAB // 2)
    prompt = [11, 22, 33, 44, 55]

    def prefilled():
        request = Request(prompt, SamplingParams(max_tokens=40))
        seq = Sequence(request, prepare_prompt(model, None, prompt, None, None, 64, request.media_policy), None,
                       set(), 64, lambda out: None, model.device)
        seq.max_drafts = 2
        seq.state = runner.allocate(seq)
        runner.prefill(seq, len(prompt))
        seq.tokens = [66]
        return seq

    plain = prefilled()
    for _ in range(16):
        plain.tokens.append(int(runner.decode([plain])[0].argmax()))
    greedy_tokens = plain.tokens  # [66, then the model's own continuation]
    separate, native = prefilled(), prefilled()

    def same_caches():
        a, b = separate.state, native.state
        assert a.length == b.length
        for i in model.config.text.linear_attention_layers:
            assert torch.equal(a.conv[i], b.conv[i]) and torch.equal(a.recurrent[i], b.recurrent[i])
        for i in model.config.text.full_attention_layers:
            assert torch.equal(a.keys[i][:, :, :a.length], b.keys[i][:, :, :b.length])
        assert separate.mtp_entries == native.mtp_entries and separate.mtp_index == native.mtp_index
        n = separate.mtp_entries
        assert torch.equal(separate.draft_state.keys[0][:, :, :n], native.draft_state.keys[0][:, :, :n])

    wrong = (greedy_tokens[2] + 1) % VOCAB
    for drafts, k in (([greedy_tokens[1], wrong], 2), (None, 1), (greedy_tokens[2:4], 2), (None, 2)):
        drafts = native.drafts if drafts is None else drafts  # None: the head's own drafts from the round before
        first = separate.state.length
        v = runner.verify([separate], [drafts])[0]
        picks = greedy(v.logits).tolist()
        accepted = next((j for j, d in enumerate(drafts) if picks[j] != d), len(drafts))
        runner.commit(separate, v, accepted + 1)
        _pend(separate, first, v.hidden[:accepted + 1])
        cycle = runner.cycle([native], [drafts], [k])[0]
        assert cycle.picks == picks and cycle.accepted == accepted
        for seq in (separate, native):
            seq.tokens += picks[:accepted + 1]
        assert native.tokens == greedy_tokens[:len(native.tokens)]  # greedy: the plain continuation
        assert runner.draft([separate], [k])[0] == cycle.drafts
        native.drafts = cycle.drafts
        same_caches()
    # a cycle that accepts both drafts, then keeps only its first input, as a commit of one does
    drafts = greedy_tokens[len(native.tokens):len(native.tokens) + 2]
    last = runner.cycle([native], [drafts], [1])[0]
    v = runner.verify([separate], [drafts])[0]
    assert last.accepted == 2 and last.picks == greedy(v.logits).tolist()
    runner.commit(separate, v, 1)
    runner.keep(native, last, 1)
    assert separate.state.length == native.state.length
    for i in model.config.text.linear_attention_layers:
        assert torch.equal(separate.state.conv[i], native.state.conv[i])
        assert torch.equal(separate.state.recurrent[i], native.state.recurrent[i])


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_greedy_engine_steps_take_the_native_cycle(mtp_dense, quantize):
    """Greedy requests of a bf16 dense model with an MTP head verify and draft in one native call per step, its
    weights quantized or not."""
    model, _ = qwenrt.load(mtp_dense, dtype="bfloat16", quantize=quantize)
    engine = Engine(model, speculative_tokens=2, prefix_cache_size=0)
    cycle, fused = engine.runner.cycle, []
    engine.runner.cycle = lambda *args: fused.append(cycle(*args)) or fused[-1]
    for _ in engine.submit(Request(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))):
        pass
    assert fused and all(c is not None for c in fused) == (cpu_kernels() is not None)


def test_sampling_with_drafts_keeps_the_distribution(mtp_dense):
    """With drafts that are often right (the model's own greedy choice), the sampled tokens are distributed as
    without drafts: a two-sample chi-square over the third generated token, the first one verified (drafts are made
    from the second step on)."""
    model, _ = qwenrt.load(mtp_dense, dtype="float32")
    params = dict(max_tokens=5, temperature=1.0, top_k=3, ignore_eos=True)

    def sample(k: int) -> list[int]:
        engine = Engine(model, speculative_tokens=k, prefix_cache_size=0, max_running=64, max_queue=400)
        if k:
            def greedy_drafts(seqs, ks):
                out = []
                for s, kk in zip(seqs, ks):
                    ids = s.prompt.ids + s.tokens
                    drafts = []
                    for _ in range(kk):
                        drafts.append(int(model(torch.tensor([ids + drafts]))[0, -1].argmax()))
                    out.append(drafts)
                return out
            engine.runner.draft = greedy_drafts
        requests = [Request([7, 8, 9], SamplingParams(seed=i, **params)) for i in range(300)]
        outputs = run(engine, {0: requests})
        return [tokens_of(outputs[r.request_id])[2] for r in requests], engine.draft_counts

    plain, _ = sample(0)
    drafted, counts = sample(2)
    assert counts.accepted_tokens > 50  # the accept path is really taken
    bins = sorted(set(plain) | set(drafted))
    stat = sum((plain.count(t) - drafted.count(t)) ** 2 / (plain.count(t) + drafted.count(t)) for t in bins)
    df = len(bins) - 1
    assert stat < df + 4 * math.sqrt(2 * df) + 6, (stat, df)  # far beyond p = 0.001 for these df


def test_prompt_lookup_drafts_without_an_mtp_head(dense_ckpt):
    model, _ = qwenrt.load(dense_ckpt[0])
    assert getattr(model, "mtp", None) is None
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [5] * 20]
    plain, _ = generate_all(model, None, prompts, 0)
    got, last = generate_all(model, None, prompts, 3)
    assert got == plain and all(o.drafts.rounds > 0 for o in last)
    auto, last = generate_all(model, None, prompts, "auto")  # auto speculates only with an MTP head
    assert auto == plain and all(o.drafts is None for o in last)


def test_a_cached_prompt_with_drafts(mtp_dense):
    """A prompt restored whole from the prefix cache has no MTP pairs yet: drafting starts after its first step."""
    model, _ = qwenrt.load(mtp_dense, dtype="bfloat16")
    engine = Engine(model, speculative_tokens=2)
    first, second = (Request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True)) for _ in range(2))
    a = tokens_of(run(engine, {0: [first]})[first.request_id])
    out = run(engine, {0: [second]})[second.request_id]
    assert out[-1].cached_tokens == len(PROMPTS[0]) and tokens_of(out) == a
    assert a == generate_all(model, None, [PROMPTS[0]], 0, n=20)[0][0]


def test_the_head_takes_the_positions_of_plain_steps(mtp_dense):
    """While `auto` decodes plainly the MTP head is not run, but it gets those positions at its next draft: that
    draft comes from a head that saw every position (its cache holds one entry per position), equal to the head's
    guess over the whole sequence at once."""
    model, _ = qwenrt.load(mtp_dense, dtype="float32")
    engine = Engine(model, speculative_tokens="auto", prefix_cache_size=0)
    choices = iter([0] * 10 + [1] * 100)  # ten plain steps, then one draft per step
    engine.draft_policy.choose = lambda batch: next(choices)
    draft, seen = engine.runner.draft, []

    def spy(seqs, ks):
        out = draft(seqs, ks)
        seen.append((seqs[0].prompt.ids + seqs[0].tokens, out[0], seqs[0].draft_state.length))
        return out

    engine.runner.draft = spy
    run(engine, {0: [Request(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]})
    ids, drafted, entries = seen[0]
    assert len(ids) == len(PROMPTS[0]) + 12 and entries == len(ids) - 1  # prefill, 10 plain steps, a verify
    with torch.inference_mode():
        whole = mtp_hidden(model, model.mtp, torch.tensor([ids]))  # [1, T-1, D]: row t guesses ids[t+2]
        assert drafted == [int(engine.runner.draft_logits(whole[:, -1]).argmax())]


def simulate_auto(policy: DraftPolicy, steps: int, accepted, cost=None) -> list[int]:
    """Drive `policy` as the engine does: a step verifies the drafts chosen one step before and drafts the ones
    chosen now; it costs cost(i, verified, drafted) seconds, by default 1 s, 0.1 s per verified draft and 0.05 s per
    draft made, 3 s more the first time (a first call's setup). accepted(k) -> drafts kept of k. Returns the counts
    verified at each step."""
    if cost is None:
        def cost(i, verified, drafted):
            return 1.0 + 0.1 * verified + 0.05 * drafted + (3.0 if i == 0 else 0.0)
    verified, out = 0, []
    for i in range(steps):
        k = policy.choose(1)
        if verified:
            policy.record(verified, accepted(verified))
        policy.observe(1, verified, k, cost(i, verified, k))
        out.append(verified)
        verified = k
    return out


def test_auto_turns_speculation_off_where_it_does_not_pay():
    off = simulate_auto(DraftPolicy(3), 400, lambda k: 0)  # nothing accepted: a slow first step must not mislead it
    assert off[100:].count(0) > 280  # off, but for a probe now and then
    assert 0 < sum(off[100:]) < 20
    on = simulate_auto(DraftPolicy(3), 400, lambda k: k)  # everything accepted
    assert on[-100:].count(3) > 85


def test_auto_finds_further_drafts_that_pay_where_one_does_not():
    """Every draft accepted; the first draft of a cycle costs 0.5 plain steps to verify and as much to make, each
    further one 0.1 (qwenrt-tiny's shape: the head's first pass and the verification's fixed costs dominate). One
    draft breaks even, three pay 1.7x. `auto` once guessed the counts it had not timed from one draft's cost (3 plain
    steps for three drafts) and stayed off; it now times each count that could beat the best so far."""
    def cost(i, verified, drafted):
        return 1 + (0.4 if verified else 0) + 0.1 * verified + (0.4 if drafted else 0) + 0.1 * drafted

    steps = simulate_auto(DraftPolicy(3), 200, lambda k: k, cost)
    assert 3 in steps[:20] and steps[40:].count(3) > 140  # found within 20 steps; probes apart, kept


def test_auto_returns_to_more_drafts_after_a_hard_stretch():
    """The first two drafts kept 97% of the time and the third 90%, but for 40 verifications the third always
    fails: `auto` drops to two drafts there and must come back once it passes. At two drafts only probes see the
    third position, so its figure (a short moving average) once stayed low for thousands of steps, and a single miss
    of the first draft (0.97 -> 0.82) turned speculation off."""
    def cost(i, verified, drafted):
        return 1 + (0.4 if verified else 0) + 0.25 * verified + (0.3 if drafted else 0) + 0.15 * drafted

    for seed in range(3):
        rng, verifications = random.Random(seed), [0]

        def accepted(k):
            verifications[0] += 1
            hard = 300 <= verifications[0] < 340
            kept = 0
            while kept < k and rng.random() < (0.0 if hard and kept == 2 else 0.97 if kept < 2 else 0.9):
                kept += 1
            return kept

        steps = simulate_auto(DraftPolicy(3), 1200, accepted, cost)
        assert steps[300:450].count(0) <= 6, seed  # probes only: the third draft failing leaves two that pay
        assert steps[500:].count(3) > 600, seed  # back to three


def test_auto_times_are_the_least_of_the_recent_ones():
    """A count's time (cached between steps) is the least of its cycles within HORIZON steps, else of its newest
    MIN_SAMPLES, whatever the order of the samples and the gaps between them."""
    rng, policy, verified = random.Random(1), DraftPolicy(3), 0

    def least(k):
        samples = policy.cost.get((1, k), ())
        if len(samples) < policy.MIN_SAMPLES:
            return None
        recent = [t for step, t in samples if step > policy.steps - policy.HORIZON]
        return min(recent or [t for _, t in list(samples)[-policy.MIN_SAMPLES:]])

    for i in range(6000):
        steady = i % 2000 >= 1400  # one count every step, slower each time: its least leaves the window first
        k = 3 if steady else policy.choose(1) if rng.random() < 0.9 else rng.randrange(4)
        if verified:
            policy.record(verified, rng.randrange(verified + 1))
        policy.observe(1, verified, k, 1 + i / 1000 if steady else rng.random())
        verified = k
        if steady:
            policy.steps += 1
        elif rng.random() < 0.3:
            policy.steps += rng.randrange(100)  # a stretch at another batch size: this one's samples age
        assert all(policy._time(1, k) == least(k) for k in range(4))


def test_auto_takes_an_unreached_position_as_accepted_as_the_one_before():
    policy = DraftPolicy(3)
    for _ in range(20):
        policy.record(1, 1)  # one draft at a time, always kept: positions 2 and 3 never verified
    a = policy.acceptance[0]
    assert a > 0.95 and policy.expected_tokens(3) == pytest.approx(1 + a + a * a + a ** 3)
    policy.record(3, 1)  # position 2 reached and missed once: no longer taken on trust
    first, second = policy.acceptance[:2]
    assert second < 0.9 and policy.expected_tokens(3) == pytest.approx(1 + first + first * second * (1 + second))


def test_auto_probes_less_often_while_they_find_nothing():
    off = simulate_auto(DraftPolicy(3), 3000, lambda k: 0)
    probes = [i for i in range(1, len(off)) if off[i] and not off[i - 1]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 4 * gaps[0], gaps
    assert gaps[-1] <= DraftPolicy.PROBE_OFF_MAX + 2 * DraftPolicy.PROBE_OFF_STEPS


def test_auto_waits_longer_when_its_start_found_drafting_slower():
    """Nothing accepted: the cycles timed at the start count as a probe that found drafting slower, so the first
    probe waits twice PROBE_OFF (at 64 steps it cost the 0.8B's random head 1.2% of a 96-token bench run)."""
    steps = simulate_auto(DraftPolicy(3), 300, lambda k: 0)
    first = next(i for i in range(20, 300) if steps[i])
    assert first > 2 * DraftPolicy.PROBE_OFF, first


def test_auto_stays_off_where_speculation_breaks_even():
    """Every draft accepted, but a cycle of k drafts costs as much as k + 1 plain steps (qwenrt-tiny's case), with
    up to 10% noise: drafting gains nothing, and each switch costs, so `auto` must not flip on with the noise (it did,
    and ran at 0.89x of plain decoding there)."""
    rng = random.Random(0)
    steps = simulate_auto(DraftPolicy(3), 2000, lambda k: k,
                          lambda i, verified, drafted: (1 + drafted) * (1 + 0.1 * rng.random()))
    assert sum(1 for k in steps[200:] if k) < 20  # probes only


def test_auto_times_only_whole_cycles(mtp_dense):
    """A step near a request's end verifies its drafts but drafts none (no room left): it must not count as a cycle
    of k. It is cheaper, and `auto` takes the least of recent cycle times: on qwenrt-tiny such steps made a cycle of
    one draft look like 1.45 plain steps when it cost 2.3, and `auto` ran at 0.76x of plain decoding."""
    model, _ = qwenrt.load(mtp_dense)
    engine = Engine(model, speculative_tokens="auto", prefix_cache_size=0)
    engine.draft_policy.choose = lambda batch: 1  # always one draft
    seen = []
    engine.draft_policy.observe = lambda batch, verified, drafted, seconds: seen.append((verified, drafted))
    for _ in engine.submit(Request(PROMPTS[0], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))):
        pass
    assert seen.count((1, 1)) >= 3  # cycles were timed
    # what a step says it drafted is what the next one verifies; near its end the request has no room for drafts
    assert all(after[0] == before[1] for before, after in zip(seen, seen[1:])), seen


def test_speculative_tokens_are_checked(mtp_dense):
    model, _ = qwenrt.load(mtp_dense)
    for bad in (9, -1, "fast", 1.5, True):
        with pytest.raises(QwenrtError, match="speculative_tokens"):
            Engine(model, speculative_tokens=bad)
        with pytest.raises(QwenrtError, match="speculative_tokens"):
            qwenrt.generate(model, None, [1, 2], max_tokens=2, speculative_tokens=bad)
    assert len(qwenrt.complete(model, None, [1, 2, 3], max_tokens=6, ignore_eos=True,
                               speculative_tokens=2).tokens) == 6


def test_pending_pairs_keep_the_newest_within_the_bound():
    """While `auto` decodes plainly each step queues its hidden state for the head's next draft: at most
    MAX_PENDING of them, the newest, with the index of the first kept."""
    seq = SimpleNamespace(mtp_pending=[], mtp_count=0, mtp_index=None)
    rows = torch.arange(3 * MAX_PENDING, dtype=torch.float32)[:, None].repeat(1, 4)  # row i holds i
    _pend(seq, 10, rows[:5])
    for i in range(5, len(rows), 3):  # chunks of 3 rows, as steps verifying two drafts queue them
        _pend(seq, 10 + i, rows[i:i + 3])
    assert seq.mtp_count == MAX_PENDING == sum(len(r) for r in seq.mtp_pending)
    assert torch.equal(torch.cat(seq.mtp_pending), rows[-MAX_PENDING:])
    assert seq.mtp_index == 10 + len(rows) - MAX_PENDING
