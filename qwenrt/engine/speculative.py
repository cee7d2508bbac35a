"""Speculative decoding, the parts that do not run the model: proposing draft tokens from what a sequence already
holds (prompt lookup) and deciding which drafts the target model accepts.

Acceptance is lossless. Greedy: a draft is kept while it equals what `sample` picks at its position (penalties
included), so the output is token for token the plain one. Sampling: a draft x (a point proposal, as vLLM's and
SGLang's greedy drafters) is kept with probability p(x), p being the target's distribution after penalties and
filters; on rejection the token is drawn from p with x removed, which leaves every emitted token distributed as p.
"""

from __future__ import annotations

import torch

from qwenrt.sampling import SamplingParams, TokenCounts, probabilities, sample


def propose_ngram(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens (the longest
    n in [min_n, max_n] that occurs): prompt lookup, for text that repeats what came before."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def accept(logits: torch.Tensor, drafts: list[int], params: SamplingParams, history: TokenCounts | None,
           generator: torch.Generator) -> tuple[list[int], int]:
    """logits [T, V] at the verified positions (the last sampled token, then each draft: T = len(drafts) + 1).

    Returns (the tokens to emit: the accepted drafts then one drawn at the first rejection, or after all of them,
    number of drafts accepted). `history` (penalties) takes each emitted token as it is decided.
    """
    out = []
    for j, draft in enumerate(drafts):
        row = logits[j:j + 1]
        if params.greedy:
            token = int(sample(row, params, history, generator))
            keep = token == draft
        else:
            p = probabilities(row, params, history)[0]  # [V]
            keep = bool(torch.rand((), generator=generator, device=p.device) < p[draft])
            if not keep:  # the residual of a point proposal: p without the draft
                p[draft] = 0.0
                token = int(torch.multinomial(p / p.sum(), 1, generator=generator))
        emitted = draft if keep else token
        out.append(emitted)
        if history is not None:
            history.update(torch.tensor([emitted], device=logits.device))
        if not keep:
            return out, j
    token = int(sample(logits[len(drafts):], params, history, generator))  # every draft kept: one more
    if history is not None:
        history.update(torch.tensor([token], device=logits.device))
    return out + [token], len(drafts)
