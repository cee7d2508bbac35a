"""Speculative decoding: draft proposals and lossless acceptance."""

import torch

from qwenrt.engine.speculative import accept, propose_ngram
from qwenrt.sampling import SamplingParams, TokenCounts, probabilities, sample


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert propose_ngram(tokens, 3) == [8, 9, 1]  # after the earlier "6 7"
    assert propose_ngram(tokens + [8], 2) == [9, 1]  # "6 7 8" matches too: the longest n wins
    assert propose_ngram([1, 2, 3], 4) == []
    assert propose_ngram([4, 4, 4, 4], 5) == [4]  # what follows the most recent earlier occurrence


def test_greedy_acceptance_is_what_plain_sampling_picks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3)
    plain_history = TokenCounts.from_prompts([[1, 2, 3]], 50)
    plain = []
    for j in range(4):
        token = int(sample(logits[j:j + 1], params, plain_history))
        plain_history.update(torch.tensor([token]))
        plain.append(token)
    for wrong_at in (0, 1, 2, 3):
        drafts = plain[:3] if wrong_at == 3 else plain[:wrong_at] + [(plain[wrong_at] + 1) % 50] + [0] * 2
        drafts = drafts[:3]
        history = TokenCounts.from_prompts([[1, 2, 3]], 50)
        out, n = accept(logits, drafts, params, history, g)
        assert out == plain[:len(out)] and n == min(wrong_at, 3) and len(out) == n + 1
        assert torch.equal(history.counts, _counts_of([1, 2, 3], out, 50))


def _counts_of(prompt, out, vocab):
    h = TokenCounts.from_prompts([prompt], vocab)
    for t in out:
        h.update(torch.tensor([t]))
    return h.counts


def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * samples.numel()
    keep = expected > 0
    assert observed[~keep].sum() == 0  # nothing outside the support
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_acceptance_keeps_the_target_distribution():
    """Every emitted token is distributed as the target's (processed) distribution, whatever the draft: a chi-square
    test on the first token, and on the one after an accepted draft, that a biased rule fails."""
    torch.manual_seed(0)
    V, trials = 6, 12000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0], [0.0, 1.0, 0.5, 2.0, -0.5, 0.1]])
    params = SamplingParams(temperature=0.8, top_k=5)
    p0, p1 = probabilities(logits[:1], params)[0], probabilities(logits[1:], params)[0]
    g = torch.Generator().manual_seed(1)
    bound = 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    for draft in (0, 3):  # a likely and an unlikely draft
        first, second = [], []
        for _ in range(trials):
            out, n = accept(logits, [draft], params, None, g)
            first.append(out[0])
            if n == 1:
                second.append(out[1])
        assert chi_square(torch.tensor(first), p0) < bound
        assert chi_square(torch.tensor(second), p1) < bound
    biased = torch.where(torch.rand(trials, generator=g) < torch.clamp(2 * p0[3], max=1.0), 3,
                         torch.multinomial(p0, trials, replacement=True, generator=g))
    assert chi_square(biased, p0) > 10 * bound  # accepting too often is caught
