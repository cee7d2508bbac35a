"""Sampling: filtered distributions and penalties against transformers' processors, draws, stops."""
import itertools

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from qwenrt.constraints import AllowedTokens
from qwenrt.errors import QwenrtError
from qwenrt.sampling import (
    SamplingParams,
    StopStringMatcher,
    TokenCounts,
    apply_penalties,
    filter_logits,
    make_generator,
    probabilities,
    sample,
)


def hf_warpers(p: SamplingParams) -> LogitsProcessorList:
    """The warper chain transformers' generate() builds for these parameters (same order)."""
    chain = LogitsProcessorList()
    if p.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k != 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        chain.append(MinPLogitsWarper(p.min_p))
    return chain


def assert_same_filter(ours: torch.Tensor, ref: torch.Tensor) -> None:
    kept = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), kept)
    torch.testing.assert_close(ours[kept], ref[kept], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), rtol=1e-5, atol=1e-7)


FILTER_CASES = [
    dict(temperature=0.7, top_k=20, top_p=0.9),
    dict(temperature=1.0, top_k=20, top_p=0.95),          # Qwen3.5 generation_config
    dict(temperature=1.0, top_p=0.5),                      # top-p alone sorts the vocabulary
    dict(temperature=1.3, top_k=5000),                     # top_k > V is a no-op
    dict(temperature=1.0, top_p=1e-9),                     # tiny top_p keeps exactly one token
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.5, min_p=0.1),
    dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.05),
    dict(temperature=2.0, top_p=0.999, min_p=1.0),         # min_p 1 keeps only the top token
    dict(temperature=0.9),
]


@pytest.mark.parametrize("kwargs", FILTER_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_filter_matches_transformers(kwargs):
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    params = SamplingParams(**kwargs)
    ref = hf_warpers(params)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    assert_same_filter(filter_logits(logits, params), ref)


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0, top_k=10), dict(temperature=0.8, top_k=7, min_p=0.2)])
def test_top_k_keeps_ties_like_transformers(kwargs):
    # Low-precision logits collide; transformers keeps every token tied with the k-th score.
    torch.manual_seed(1)
    logits = torch.randint(-40, 40, (6, 300)).float() / 4
    params = SamplingParams(**kwargs)
    kth = torch.topk(logits, params.top_k).values[:, -1:]
    assert ((logits >= kth).sum(-1) > params.top_k).any(), "test data must contain boundary ties"
    ref = hf_warpers(params)(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    assert_same_filter(filter_logits(logits, params), ref)


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(2)
    vocab = 64
    logits = torch.randn(3, vocab) * 2
    prompts = [[1, 2, 3, 3], [5], [7, 8, 9, 10, 11, 63]]
    steps = torch.tensor([[4, 5, 7], [4, 4, 4], [0, 63, 20]])  # [B, steps]
    history = TokenCounts.from_prompts(prompts, vocab)
    for step in steps.T:
        history.update(step)
    for penalty in (1.3, 0.7):
        params = SamplingParams(repetition_penalty=penalty)
        ours = apply_penalties(logits, params, history)
        proc = RepetitionPenaltyLogitsProcessor(penalty)
        for row, prompt in enumerate(prompts):
            ids = torch.tensor([prompt + steps[row].tolist()])
            ref = proc(ids, logits[row:row + 1].clone())
            torch.testing.assert_close(ours[row:row + 1], ref, rtol=0, atol=0)


def test_presence_and_frequency_penalties_by_hand():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    history = TokenCounts.from_prompts([[0, 4]], vocab_size=5)  # prompt tokens are not penalised
    for token in (1, 1, 2, 1):
        history.update(torch.tensor([token]))
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # token 1: 2 - 0.25*3 - 0.5 = 0.75; token 2: -1 - 0.25 - 0.5 = -1.75
    expected = torch.tensor([[1.0, 0.75, -1.75, 0.5, 3.0]])
    torch.testing.assert_close(apply_penalties(logits, params, history), expected)
    assert history.counts.tolist() == [[0, 3, 1, 0, 0]]
    assert history.seen.tolist() == [[True, True, True, False, True]]


def test_greedy_is_argmax_after_penalties():
    torch.manual_seed(3)
    logits = torch.randn(5, 200)
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    history = TokenCounts.from_prompts([logits[i].topk(3).indices for i in range(5)], 200)
    params = SamplingParams(repetition_penalty=5.0)
    picked = sample(logits, params, history)
    assert torch.equal(picked, apply_penalties(logits, params, history).argmax(-1))
    assert not torch.equal(picked, logits.argmax(-1))


def test_sampling_under_a_mask_draws_only_allowed_tokens():
    """Greedy (the native pick from the packed bits, tested against torch in test_kernels.py) and sampled rows, with
    penalties, under a mask: every pick is an allowed token, greedy the masked scores' first largest."""
    torch.manual_seed(5)
    vocab = 77  # not a multiple of 32
    logits = torch.randn(1, vocab)
    logits[0, [10, 40, 70]] = 9.0  # a three-way tie for the best
    history = TokenCounts.from_prompts([torch.tensor([10, 3])], vocab)
    for allowed_ids in ([10], [40, 70], [70], [3, 5], list(range(vocab)), list(range(11, vocab)), [76]):
        bits = np.zeros(96, dtype=np.uint8)
        bits[allowed_ids] = 1
        allowed = AllowedTokens(vocab)
        allowed.words[:] = np.packbits(bits, bitorder="little").view(np.uint32)
        for params in (SamplingParams(), SamplingParams(repetition_penalty=3.0)):
            scores = apply_penalties(logits, params, history) if params.uses_penalties else logits
            expected = max(allowed_ids, key=lambda t: (float(scores[0, t]), -t))
            assert sample(logits, params, history, allowed=allowed).tolist() == [expected]
        params = SamplingParams(temperature=2.0, seed=1)
        generator = make_generator(params)
        drawn = {int(sample(logits, params, history, generator, allowed)) for _ in range(30)}
        assert drawn <= set(allowed_ids) and (len(drawn) > 1 or len(allowed_ids) == 1), drawn


def test_penalties_need_history():
    with pytest.raises(QwenrtError, match="TokenCounts"):
        sample(torch.randn(1, 10), SamplingParams(presence_penalty=1.0))


def test_prompt_ids_outside_vocab_are_refused():
    with pytest.raises(QwenrtError, match=r"outside \[0, 10\)"):
        TokenCounts.from_prompts([[1, 2, 10]], vocab_size=10)


def draw_sequence(params: SamplingParams, steps: int = 40) -> list[int]:
    torch.manual_seed(4)  # same logits for every call
    logits = torch.randn(steps, 1, 500)
    gen = make_generator(params)
    return [int(sample(step, params, generator=gen)) for step in logits]


def test_same_seed_same_tokens_different_seed_differs():
    params = SamplingParams(temperature=1.0, top_k=100, top_p=0.95, seed=1234)
    assert draw_sequence(params) == draw_sequence(params)
    assert draw_sequence(params) != draw_sequence(SamplingParams(temperature=1.0, top_k=100, top_p=0.95, seed=1235))
    assert make_generator(SamplingParams()) is None


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_empirical_frequencies_match_filtered_softmax(kwargs):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(seed=7, **kwargs)
    n = 40000
    tokens = sample(logits.expand(n, -1), params, generator=make_generator(params))
    observed = torch.bincount(tokens, minlength=8).double()
    ref = hf_warpers(params)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    expected = ref.softmax(-1).double() * n
    assert observed[expected == 0].sum() == 0, "a filtered token was drawn"
    live = expected > 0
    chi2 = ((observed[live] - expected[live]) ** 2 / expected[live]).sum().item()
    assert chi2 < 24.3  # chi-square, 7 dof, p = 0.001


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(temperature=-0.1), r"temperature must be >= 0"),
    (dict(temperature=float("nan")), r"temperature must be a finite number, got nan"),
    (dict(top_k=-1), r"top_k must be an integer >= 0"),
    (dict(top_k=2.5), r"top_k must be an integer >= 0"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(repetition_penalty=0), r"repetition_penalty must be in \[0.01, 100\] \(1 = off\), got 0"),
    (dict(repetition_penalty=1e-300), r"repetition_penalty must be in \[0.01, 100\] \(1 = off\), got 1e-300"),
    (dict(repetition_penalty=1e300), r"repetition_penalty must be in \[0.01, 100\]"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3.0"),
    (dict(seed=-1), r"seed must be None or an integer"),
    (dict(max_tokens=-1), r"max_tokens must be an integer >= 1 \(0: only score the prompt, with prompt_logprobs\), got -1"),
    (dict(stop=["ok", ""]), r"stop must be non-empty strings"),
    (dict(stop_token_ids=[1, -2]), r"stop_token_ids must be integers >= 0"),
    (dict(stop_token_ids=[True]), r"stop_token_ids must be integers >= 0"),
    (dict(stop=5), r"stop must be a string or a list of strings, got int"),
    (dict(stop_token_ids=7), r"stop_token_ids must be a list of integers, got int"),
    # counted before any matching: 100,000 stop strings cost every request in the batch ~50 ms a token
    (dict(stop=[f"s{i}" for i in range(100_000)]), r"^stop takes at most 64 strings, got 100000$"),
    (dict(stop=["ok", "x" * 257]), r"^stop strings take at most 256 characters each, got one of 257$"),
    (dict(stop_token_ids=list(range(257))), r"^stop_token_ids takes at most 256 ids, got 257$"),
])
def test_parameter_validation(kwargs, message):
    with pytest.raises(QwenrtError, match=message):
        SamplingParams(**kwargs)


def test_caps_admit_their_limits():
    params = SamplingParams(stop=["x" * 256] * 64, stop_token_ids=list(range(256)))
    assert len(params.stop) == 64 and len(params.stop_token_ids) == 256


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 9e-6])
def test_a_temperature_under_the_epsilon_is_greedy(temperature):
    """Dividing by such a temperature overflows float32 (multinomial then saw inf/NaN: an HTTP 500)."""
    torch.manual_seed(5)
    logits = torch.randn(3, 100)
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy and params.temperature == temperature
    assert torch.equal(sample(logits, params, generator=make_generator(params)), logits.argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-5), SamplingParams(temperature=1e-5, top_p=0.5),
                                    SamplingParams(temperature=0.5, repetition_penalty=0.01)],
                         ids=["temperature", "temperature+top_p", "repetition_penalty"])
def test_overflowing_scores_stay_a_distribution(params):
    """Logits near float32's limit over a small temperature (or a penalty) overflow: the sampler keeps them finite
    rather than handing inf/NaN to multinomial."""
    logits = torch.tensor([[3e38, 2e38, -3e38, 1.0], [-3e38, -2e38, -3e38, -3e38]])
    history = TokenCounts.from_prompts([[0, 1], [1]], vocab_size=4)
    probs = probabilities(logits, params, history)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert sample(logits, params, history, make_generator(SamplingParams(seed=3))).tolist()[0] in (0, 1)


def test_parameter_normalisation():
    p = SamplingParams(temperature=1, stop="</s>", stop_token_ids=[248046, 248044])
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.stop == ("</s>",) and p.stop_token_ids == (248046, 248044)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert p.greedy is False and SamplingParams().greedy is True
    assert not p.uses_penalties and SamplingParams(presence_penalty=1.5).uses_penalties


def stop_oracle(text: str, stops: list[str]) -> tuple[str, bool]:
    """Character by character: stop as soon as a stop string completes, cut before its start."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[:end - max(map(len, done))], True
    return text, False


STOP_CASES = [
    ("Hello world</s>tail", ["</s>"]),
    ("abcabd", ["abd"]),
    ("aaab", ["aab"]),
    ("xabcx", ["abc", "b"]),          # "b" completes first
    ("xyab", ["yab", "ab"]),          # both complete together: cut at the earlier start
    ("no stop here <", ["<stop>"]),   # held-back prefix is released by flush()
    ("<st<stop>", ["<stop>"]),
    ("plain text", []),
]


@pytest.mark.parametrize("text, stops", STOP_CASES)
def test_stop_matcher_every_split(text, stops):
    want, want_stop = stop_oracle(text, stops)
    cuts = range(len(text) + 1)
    for i, j in itertools.combinations_with_replacement(cuts, 2):
        matcher = StopStringMatcher(stops)
        emitted, stopped = "", False
        for piece in (text[:i], text[i:j], text[j:]):
            out, stopped = matcher.feed(piece)
            emitted += out
            assert want.startswith(emitted), (i, j, emitted)
            assert not any(s in emitted for s in stops)
            if stopped:
                break
        if not stopped:
            emitted += matcher.flush()
        assert (emitted, stopped) == (want, want_stop), (i, j)
        if want_stop:
            assert matcher.feed("more") == ("", True)


def test_stop_matcher_holds_back_only_a_stop_prefix():
    matcher = StopStringMatcher(["<|im_end|>", "STOP"])
    assert matcher.feed("Hello <|im") == ("Hello ", False)
    assert matcher.feed("_x ST") == ("<|im_x ", False)
    assert matcher.feed("OP and more") == ("", True)
    assert matcher.flush() == ""
