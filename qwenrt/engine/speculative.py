"""Speculative decoding, the parts that do not run the model: proposing draft tokens from what a sequence already
holds (prompt lookup) and deciding which drafts the target model accepts.

Acceptance is lossless. Greedy: a draft is kept while it equals what `sample` picks at its position (penalties
included), so the output is token for token the plain one. Sampling: a draft x (a point proposal, as vLLM's and
SGLang's greedy drafters) is kept with probability p(x), p being the target's distribution after penalties and
filters; on rejection the token is drawn from p with x removed, which leaves every emitted token distributed as p.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from qwenrt.constraints import TokenMask
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
           generator: torch.Generator, mask: TokenMask | None = None) -> tuple[list[int], int]:
    """logits [T, V] at the verified positions (the last sampled token, then each draft: T = len(drafts) + 1).

    Returns (the tokens to emit: the accepted drafts then one drawn at the first rejection, or after all of them,
    number of drafts accepted). `history` (penalties) and `mask` (an output constraint: each position is judged
    under the mask that follows the tokens before it, so a draft it forbids is rejected) take each emitted token
    as it is decided.
    """
    out = []
    for j, draft in enumerate(drafts):
        row, allowed = logits[j:j + 1], mask.allowed() if mask is not None else None
        if params.greedy:
            token = int(sample(row, params, history, generator, allowed))
            keep = token == draft
        else:
            p = probabilities(row, params, history, allowed)[0]  # [V]
            keep = bool(torch.rand((), generator=generator, device=p.device) < p[draft])
            if not keep:  # the residual of a point proposal: p without the draft
                p[draft] = 0.0
                token = int(torch.multinomial(p / p.sum(), 1, generator=generator))
        emitted = draft if keep else token
        out.append(emitted)
        _take(emitted, history, mask, logits.device)
        if not keep:
            return out, j
    allowed = mask.allowed() if mask is not None else None
    token = int(sample(logits[len(drafts):], params, history, generator, allowed))  # every draft kept: one more
    _take(token, history, mask, logits.device)
    return out + [token], len(drafts)


def _take(token: int, history: TokenCounts | None, mask: TokenMask | None, device: torch.device) -> None:
    if history is not None:
        history.update(torch.tensor([token], device=device))
    if mask is not None:
        mask.advance(token)


class DraftPolicy:
    """`auto`: how many drafts to verify next, from the measured acceptance per draft position and the measured time of
    a step with k drafts at this batch size; 0 where speculation does not pay.

    A step verifies the drafts chosen one step earlier and drafts the ones chosen now, so only a step whose two
    counts agree times a cycle of k (one that switches is not counted). A count's time is the least of its steps
    within the last HORIZON steps (of its newest MIN_SAMPLES where it has none that recent): other work only ever
    slows a step (a first call, a cache growing, the machine busy for a moment), so the least is the step's own
    cost, and slow steps, even several, do not settle the choice; and the counts compared were timed in the same
    stretch (a shared machine's speed drifts: a plain step's time from a quiet minute against drafting's from a busy
    one turned speculation off where it paid 1.3x).

    Only timed counts are compared. One draft and plain decoding are timed first; a further count is timed (for
    MIN_SAMPLES cycles, at once) when, costing no more than the largest timed count below it, it would beat the
    best timed one: so the counts that might pay are all measured within a few steps of the start, and none whose
    drafts are not accepted is. (Counts were once guessed from one draft's cost and timed by probes of one cycle
    each: on qwenrt-tiny `auto` sat off, at one draft or at two for hundreds of steps where three paid 1.6x, and
    the least of a probed count's few samples against the least of the chosen count's every step favoured the
    chosen one: now every count keeps its samples of the last HORIZON steps.) Speculation is turned on only where
    it promises MARGIN_ON more tokens per second than plain decoding, and kept on while it promises MARGIN more: a
    count that merely breaks even would flip on and off with the timing noise, and each switch costs; a choice to
    draft stands for RECHECK steps (choosing every step cost 2% of a cycle on qwenrt-tiny). Now and then
    it tries another count for PROBE_STEPS steps, so that every figure stays current: while on, the other counts in
    turn every PROBE_ON steps; while off, the most promising count for PROBE_OFF_STEPS after PROBE_OFF steps, the
    wait doubling (up to PROBE_OFF_MAX) while probes (and the cycles that turned it off) find drafting slower than
    plain decoding."""

    PROBE_ON, PROBE_OFF, PROBE_OFF_MAX = 32, 64, 1024
    PROBE_STEPS = 2  # a probe's first step drafts, its second verifies and drafts again: one counted cycle
    PROBE_OFF_STEPS = 4  # while off: 3 counted cycles (MIN_SAMPLES)
    MIN_SAMPLES = 3  # steps timed before a count's time is trusted
    HORIZON = 256  # steps: a count's time is the least of its times this recent (its most kept, one per step)
    ALPHA = 0.05  # moving-average weight of a new acceptance figure (0.15 swung a 0.97 position to 0.82 at one miss)
    DRIFT = 1 / 128  # per verification that drafted fewer: a position's figure moves so far toward the one's before
    PRIOR = 0.5  # acceptance assumed of the first position before any is seen, worth one verification
    MARGIN_ON, MARGIN = 0.10, 0.02  # gain over plain decoding that turns speculation on / keeps it on
    RECHECK = 8  # steps a choice to draft stands

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.acceptance = [self.PRIOR] * max_k  # P(draft i accepted | drafts before it accepted)
        self.seen = [0] * max_k  # verifications that reached position i
        self._expected: list[float] | None = None  # expected_tokens(k) for each k, until the acceptance changes
        self.cost: dict[tuple[int, int], deque[tuple[int, float]]] = {}  # (batch, k) -> latest (step, seconds)
        self.least: dict[tuple[int, int], tuple[float, float]] = {}  # (batch, k) -> (its time, the step timed)
        self.chosen: dict[int, int] = {}  # batch -> the count chosen last outside probes
        self.recheck: dict[int, int] = {}  # batch -> the step at which a choice to draft is made again
        self.steps = 0
        self.wait = self.PROBE_OFF  # steps between probes while off
        self.next_probe = self.PROBE_OFF
        self.probe = 1  # the count a probe while off tries

    def expected_tokens(self, k: int) -> float:
        """Tokens one step with k drafts yields on average (the sampled one, then each accepted draft). A later
        draft is taken to be accepted no more often than the one before it, and a position not yet reached as often
        (so the counts beyond one are tried as soon as the first draft pays, and not while it fails)."""
        if self._expected is None:
            self._expected, reach, a = [1.0], 1.0, 1.0
            for i in range(self.max_k):
                if i == 0 or self.seen[i]:
                    a = min(a, self.acceptance[i])
                reach *= a
                self._expected.append(self._expected[-1] + reach)
        return self._expected[k]

    def _time(self, batch: int, k: int) -> float | None:
        """Seconds of a step with k drafts at this batch size (see the class), None before MIN_SAMPLES; cached."""
        least = self.least.get((batch, k))
        if least is None or least[1] <= self.steps - self.HORIZON:  # the least sample left the horizon: look again
            samples = self.cost.get((batch, k), ())
            if len(samples) < self.MIN_SAMPLES:
                return None
            recent = [(seconds, step) for step, seconds in samples if step > self.steps - self.HORIZON]
            least = min(recent) if recent else (min(s for _, s in list(samples)[-self.MIN_SAMPLES:]), math.inf)
            self.least[batch, k] = least
        return least[0]

    def _rates(self, times: dict[int, float]) -> dict[int, float]:
        """Tokens per second of each timed count with drafts (a step with drafts never costs less than a plain
        one: a faster sample is noise)."""
        return {k: self.expected_tokens(k) / max(t, times[0]) for k, t in times.items() if k}

    def _untimed(self, times: dict[int, float], rates: dict[int, float]) -> int | None:
        """The least count not yet timed that, costing no more than the largest timed count below it, would beat
        the best timed count (`rates`, _rates of `times`) and plain decoding by MARGIN_ON."""
        best = max([(1 + self.MARGIN_ON) / times[0], *rates.values()])
        for k in range(2, self.max_k + 1):
            if k not in times and self.expected_tokens(k) / times[max(j for j in times if j < k)] > best:
                return k
        return None

    def choose(self, batch: int) -> int:
        self.steps += 1
        chosen = self.chosen.get(batch)
        if chosen == 0 and self.steps < self.next_probe:
            return 0  # off: nothing new is known about drafting until the next probe
        if chosen and self.steps < self.recheck.get(batch, 0):
            return self._on(chosen)
        times = {k: t for k in range(self.max_k + 1) if (t := self._time(batch, k)) is not None}
        for k in (1, 0):  # measure speculation and plain decoding first
            if k not in times:
                return k
        rates = self._rates(times)
        if (k := self._untimed(times, rates)) is not None:
            return k
        best = max(rates, key=rates.get)
        gain = rates[best] * times[0]
        if gain < 1 + (self.MARGIN if chosen else self.MARGIN_ON):
            best = 0
        self.chosen[batch] = best
        if best:
            self.wait, self.next_probe = self.PROBE_OFF, self.steps + self.PROBE_OFF
            self.recheck[batch] = self.steps + self.RECHECK
            return self._on(best)
        if chosen != 0:  # just turned off (or off from the start): what showed it counts as a probe
            if gain < 1:
                self.wait = min(2 * self.wait, self.PROBE_OFF_MAX)
            self.next_probe = self.steps + self.wait
            return 0
        if self.steps < self.next_probe:
            return 0
        if self.steps == self.next_probe:
            self.probe = max(rates, key=rates.get)  # the count that came closest
        if self.steps < self.next_probe + self.PROBE_OFF_STEPS:
            return self.probe
        if gain < 1:  # the probe found drafting slower than plain decoding: look again less often
            self.wait = min(2 * self.wait, self.PROBE_OFF_MAX)
        self.next_probe = self.steps + self.wait
        return 0

    def _on(self, best: int) -> int:
        """While on: `best`, or in turn every PROBE_ON steps another count for PROBE_STEPS."""
        if self.steps % self.PROBE_ON < self.PROBE_STEPS:
            return (best + self.steps // self.PROBE_ON) % (self.max_k + 1)
        return best

    def observe(self, batch: int, verified: int, drafted: int, seconds: float) -> None:
        """A step of `batch` sequences verified `verified` drafts each and drafted `drafted` for the next one in
        `seconds`; it times a cycle of k drafts when the two agree."""
        if verified == drafted:
            times = self.cost.get((batch, verified))
            if times is None:
                times = self.cost[batch, verified] = deque(maxlen=self.HORIZON)
            times.append((self.steps, seconds))  # at most one a step: what leaves the window left the horizon
            least = self.least.get((batch, verified))
            if least is not None and least[1] == math.inf:  # the least of stale samples: no longer what counts
                del self.least[batch, verified]
            elif least is not None and seconds <= least[0]:
                self.least[batch, verified] = (seconds, self.steps)

    def record(self, drafted: int, accepted: int) -> None:
        """One sequence's verification: `accepted` of its `drafted` drafts kept. A position's acceptance is the
        mean of what it saw (the prior counting once) until that weighs less than ALPHA, then a moving average. A
        position beyond the drafts drifts toward the one before it: below the chosen count only probes see it, so a
        figure a hard stretch left low would otherwise hold the choice down long after (a 40-step stretch where the
        third draft failed kept `auto` at two drafts for thousands of steps in a simulation)."""
        for i in range(min(drafted, accepted + 1)):  # position i was reached; kept when i < accepted
            self.seen[i] += 1
            weight = max(self.ALPHA, 1 / (self.seen[i] + 1))
            self.acceptance[i] = (1 - weight) * self.acceptance[i] + weight * float(i < accepted)
        for i in range(max(drafted, 1), self.max_k):
            if self.seen[i]:
                self.acceptance[i] += self.DRIFT * (self.acceptance[i - 1] - self.acceptance[i])
        self._expected = None
