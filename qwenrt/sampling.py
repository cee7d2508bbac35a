"""Next-token sampling: parameters, penalties, HF-order filtering, seeded draws, stop strings.

Shapes: B rows (sequences), V vocabulary, N candidate tokens kept for filtering (N <= V).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qwenrt.constraints import AllowedTokens, Constraint, constraint_of
from qwenrt.errors import QwenrtError
from qwenrt.kernels import cpu_kernels

_NEG_INF = float("-inf")
_NEG_INF_SCALAR = torch.tensor(_NEG_INF)
_FLOAT_MAX = torch.finfo(torch.float32).max
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's rule): dividing by them overflows float32
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # outside it the penalized logits leave float32's range
# Stop strings are searched for at every token, on the engine thread every request shares: at these caps a token's
# matching takes ~0.1 ms on average, and at most ~7 ms when a long held-back prefix breaks.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token; one instance is shared by every row of a batch.

    temperature 0 (or under GREEDY_BELOW) means greedy (argmax after penalties). top_k 0, top_p 1 and min_p 0 are off.
    repetition_penalty follows transformers (prompt + output, multiplicative); presence_penalty and
    frequency_penalty follow OpenAI/vLLM (output only, additive). seed makes draws reproducible. max_tokens 0 generates
    nothing: the engine takes it only from a request that scores its prompt (`Request.prompt_logprobs`).

    At most one output constraint (qwenrt/constraints.py): json_schema (a dict, JSON text or a pydantic model class;
    kept as JSON text), json_object (any JSON object), regex, or grammar (a Lark grammar in llguidance's
    dialect). With thinking on it applies after `</think>`.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens (stop_token_ids still stop)
    json_schema: object = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    constraint: Constraint | None = field(init=False, repr=False, compare=False)  # made from the four above

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise QwenrtError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.temperature < 0:
            raise QwenrtError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise QwenrtError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise QwenrtError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise QwenrtError(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise QwenrtError(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off), got "
                              f"{self.repetition_penalty:g}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise QwenrtError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise QwenrtError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise QwenrtError(f"max_tokens must be an integer >= 1 (0: only score the prompt, with prompt_logprobs), "
                              f"got {self.max_tokens!r}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise QwenrtError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        constraint = constraint_of(self.json_schema, self.json_object, self.regex, self.grammar)
        object.__setattr__(self, "constraint", constraint)
        if constraint is not None and constraint.kind == "json_schema":
            object.__setattr__(self, "json_schema", constraint.source)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        """True when sample() needs a TokenCounts history."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def check_generates(params: SamplingParams) -> None:
    """Refuse max_tokens 0 where output is wanted (only a request that scores its prompt takes it)."""
    if params.max_tokens == 0:
        raise QwenrtError("max_tokens must be an integer >= 1, got 0 (0 only scores a prompt: with prompt_logprobs)")


def _stop_strings(stop) -> tuple[str, ...]:
    """stop as a tuple of non-empty strings, counted before anything looks at them."""
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)):
        raise QwenrtError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise QwenrtError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    if not all(isinstance(s, str) and s for s in stop):
        raise QwenrtError(f"stop must be non-empty strings, got {stop!r:.80}")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise QwenrtError(f"stop strings take at most {MAX_STOP_CHARS} characters each, got one of {len(longest)}")
    return tuple(stop)


def _stop_token_ids(ids) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)):
        raise QwenrtError(f"stop_token_ids must be a list of integers, got {type(ids).__name__}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise QwenrtError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise QwenrtError(f"stop_token_ids must be integers >= 0, got {tuple(ids)!r:.80}")
    return tuple(ids)


class TokenCounts:
    """Per-row token history for the penalties, updated in place once per decoded token.

    seen:   [B, V] bool   token occurred in the prompt or the output (repetition penalty)
    counts: [B, V] int32  occurrences in the generated output (presence / frequency penalty)
    """

    def __init__(self, seen: torch.Tensor, counts: torch.Tensor) -> None:
        self.seen = seen
        self.counts = counts

    @classmethod
    def from_prompts(cls, prompts: Sequence[Sequence[int] | torch.Tensor], vocab_size: int,
                     device: torch.device | str | None = None) -> TokenCounts:
        """History for B prompts (token id lists or 1-D tensors, lengths may differ); no output yet."""
        seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
        for row, ids in enumerate(prompts):
            ids = torch.as_tensor(ids, dtype=torch.long, device=device)
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
                raise QwenrtError(f"prompt {row} has token ids outside [0, {vocab_size}): "
                                  f"min {int(ids.min())}, max {int(ids.max())}")
            seen[row, ids] = True
        counts = torch.zeros(len(prompts), vocab_size, dtype=torch.int32, device=device)
        return cls(seen, counts)

    def update(self, tokens: torch.Tensor) -> None:
        """Record one generated token per row; tokens: [B] int64."""
        col = tokens.view(-1, 1)  # [B, 1]
        self.seen.scatter_(1, col, True)
        self.counts.scatter_add_(1, col, torch.ones_like(col, dtype=torch.int32))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: TokenCounts) -> torch.Tensor:
    """Repetition (HF), then frequency and presence (OpenAI/vLLM) penalties; logits [B, V] fp32."""
    if params.repetition_penalty != 1.0:
        p = params.repetition_penalty
        penalized = torch.where(logits < 0, logits * p, logits / p).clamp_(-_FLOAT_MAX, _FLOAT_MAX)  # [B, V], finite
        logits = torch.where(history.seen, penalized, logits)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * history.counts
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (history.counts > 0)
    return logits


def _top_p_desc(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter on rows sorted descending, [B, N]; HF's ascending-cumsum rule, keeps >= 1."""
    asc = scores.flip(-1)  # HF accumulates from the least likely token; same order, same rounding
    cum = asc.softmax(-1).cumsum(-1)
    remove = cum <= 1 - top_p
    remove[:, -1] = False
    return asc.masked_fill(remove, _NEG_INF).flip(-1)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens below min_p x the top probability; the top token always survives."""
    probs = scores.softmax(-1)  # [B, N]
    return scores.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), _NEG_INF)


def _candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature -> top-k -> top-p -> min-p in transformers' order.

    Returns scores [B, N] (filtered entries -inf) and their token ids [B, N], or ids None when the
    scores are the whole vocabulary in id order. With top-k the later steps run over N ~ k tokens;
    top-p without top-k sorts all V like transformers (~20 ms per row on one CPU core at V = 248k).
    """
    if params.temperature != 1.0:  # kept finite: a huge logit over a small temperature would make the softmax NaN
        logits = (logits / params.temperature).clamp_(-_FLOAT_MAX, _FLOAT_MAX)
    vocab = logits.shape[-1]
    ids = None
    if 0 < params.top_k < vocab:
        top, ids = torch.topk(logits, params.top_k)  # [B, k], sorted descending
        kth = top[:, -1:]  # [B, 1]
        # HF keeps every token tied with the k-th score (bf16 logits tie often); widening needs one sync.
        width = int((logits >= kth).sum(-1).max())
        if width > params.top_k:
            top, ids = torch.topk(logits, width)  # [B, width]
            top = top.masked_fill(top < kth, _NEG_INF)
        logits = top
    elif params.top_p < 1.0:
        logits, ids = torch.sort(logits, descending=True)
    if params.top_p < 1.0:
        logits = _top_p_desc(logits, params.top_p)
    if params.min_p > 0.0:
        logits = _min_p(logits, params.min_p)
    return logits, ids


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores transformers' Temperature/TopK/TopP/MinP warpers produce, [B, V], removed = -inf."""
    scores, ids = _candidates(logits.float(), params)
    if ids is None:
        return scores
    return torch.full_like(logits, _NEG_INF, dtype=torch.float32).scatter_(1, ids, scores)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from params.seed, to create once per request and pass to every sample()
    call; None (torch's global RNG) when there is no seed."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def check_finite(logits: torch.Tensor) -> None:
    """Refuse NaN/Inf logits [B, V] with a QwenrtError: sampling from them would pick garbage silently."""
    # they show in the min or the max (NaN propagates), exactly, in one pass (the whole tensor's: torch's per-row
    # aminmax is ~20x slower)
    if not all(math.isfinite(v) for v in torch.stack(torch.aminmax(logits)).tolist()):
        rows = (~torch.isfinite(logits)).any(-1).nonzero().view(-1).tolist()
        raise QwenrtError(f"the model produced NaN/Inf logits (batch rows {rows[:8]}): its weights or activations "
                          "overflow in this dtype (try dtype='float32')")


def _checked_scores(logits: torch.Tensor, params: SamplingParams, history: TokenCounts | None,
                    allowed: AllowedTokens | None = None) -> torch.Tensor:
    """logits [B, V] in fp32, refused when not finite, with the penalties applied and the tokens `allowed` (an output
    constraint's, the same for every row) does not allow at -inf."""
    logits = logits.float()
    check_finite(logits)
    if params.uses_penalties:
        if history is None:
            raise QwenrtError("repetition/presence/frequency penalties need a TokenCounts history, got None")
        logits = apply_penalties(logits, params, history)
    return logits if allowed is None else _masked(logits, allowed)


def sample(logits: torch.Tensor, params: SamplingParams, history: TokenCounts | None = None,
           generator: torch.Generator | None = None, allowed: AllowedTokens | None = None) -> torch.Tensor:
    """Pick one token per row from logits [B, V]; returns [B] int64.

    Penalties -> the constraint's mask (`allowed`, the same for every row) -> argmax when greedy, else temperature
    -> top-k -> top-p -> min-p -> a draw with `generator`. `history` is required when params.uses_penalties; update
    it with the result. NaN/Inf logits are refused with a QwenrtError rather than sampled.
    """
    if params.greedy:
        return greedy(_checked_scores(logits, params, history), allowed)
    scores, ids = _candidates(_checked_scores(logits, params, history, allowed), params)
    choice = torch.multinomial(scores.softmax(-1), 1, generator=generator)  # [B, 1]
    return (choice if ids is None else ids.gather(1, choice)).view(-1)


def _masked(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """logits [B, V] with the tokens `allowed` does not allow at -inf (torch.where: ~2x masked_fill's speed)."""
    return torch.where(allowed.tensor().to(logits.device), logits, _NEG_INF_SCALAR)


def greedy(logits: torch.Tensor, allowed: AllowedTokens | None = None) -> torch.Tensor:
    """logits [B, V] fp32 -> [B] int64, each row's first largest (torch.argmax; the native kernel on the CPU); with
    `allowed`, the first largest of the tokens it allows (on the CPU read from its packed bits in the same pass)."""
    kernels = cpu_kernels() if logits.device.type == "cpu" else None
    if kernels is None:
        return (logits if allowed is None else _masked(logits, allowed)).argmax(-1)
    if allowed is None:
        return kernels.argmax_rows(logits.contiguous())
    return kernels.argmax_allowed_rows(logits.contiguous(), allowed.packed)


def probabilities(logits: torch.Tensor, params: SamplingParams, history: TokenCounts | None = None,
                  allowed: AllowedTokens | None = None) -> torch.Tensor:
    """The distribution `sample` draws from (temperature > 0), [B, V] fp32: penalties, the mask, the filters."""
    return filter_logits(_checked_scores(logits, params, history, allowed), params).softmax(-1)


class StopStringMatcher:
    """Cuts a streamed completion just before the first stop string.

    feed(delta) returns (text safe to emit, stopped). Text that could be the start of a stop string
    is held back until the next delta decides it; nothing of a stop string is ever emitted. When
    several stops complete, the one that ends first wins (ties: the one that starts first), which
    is what a token-by-token check sees, so the result does not depend on how the text is split.
    After a stop every feed returns ("", True). Call flush() when generation ends without a stop
    to release the held-back tail.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            stops = (stops,)
        if not all(isinstance(s, str) and s for s in stops):
            raise QwenrtError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return the part that is now safe to emit and whether a stop was hit."""
        if self.stopped:
            return "", True
        text = self._held + delta
        hits = [(i + len(s), i) for s in self.stops if (i := text.find(s)) != -1]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)[1]], True
        keep = self._prefix_tail(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """Release the held-back tail (generation ended for another reason)."""
        held, self._held = self._held, ""
        return held

    def _prefix_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
