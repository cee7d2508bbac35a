"""What a caller asks of the engine (`Request`), what it gets back after each step (`RequestOutput`), and the
engine's record of one request in flight (`Sequence`: its tokens, text, stops, sampler state, cache)."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qwenrt.cache import SequenceState
from qwenrt.constraints import TokenMask
from qwenrt.errors import QwenrtError
from qwenrt.prompt import PreparedPrompt
from qwenrt.sampling import SamplingParams, StopStringMatcher, TokenCounts
from qwenrt.tokenizer import IncrementalDetokenizer
from qwenrt.vision.media import DEFAULT_POLICY, MediaPolicy

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


@dataclass
class Request:
    """One generation: a prompt (raw text, chat messages with optional image/video parts, or token ids) and how to
    sample its continuation."""

    prompt: object
    params: SamplingParams = field(default_factory=SamplingParams)
    enable_thinking: bool | None = None  # chat messages only: the template's thinking switch (None: its default)
    tools: list | None = None  # chat messages only: tool definitions for the template (and for typing tool calls)
    # "auto" (None), "none", "required" (a call to one of the tools is forced), or {"type": "function", "function":
    # {"name": NAME}} (a call to NAME is forced); parallel_tool_calls: a forced answer may hold several calls
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    logprobs: int | None = None  # None: no log-probabilities; n >= 0: the sampled token's and the n most likely
    # None: none; n >= 0: each prompt token's (after the first) given those before it, and the n most likely there.
    # Such a prompt is computed whole (no prefix-cache restore); with it, max_tokens 0 scores the prompt only
    prompt_logprobs: int | None = None
    prefill_chunk: int | None = None  # at most this many prompt tokens per engine step (None: the engine's budget)
    max_context: int | None = None  # context limit for this request (None: the engine's; at most the engine's)
    media_policy: MediaPolicy = DEFAULT_POLICY  # how images/videos may be read (a server passes a strict one)
    on_prefill: Callable[[int, int], None] | None = None  # (prompt tokens done, prompt tokens) after each chunk
    speculative_tokens: int | str | None = None  # drafts verified per step: 0 off, k, "auto"; None: the engine's
    adapter: str | None = None  # the served LoRA adapter to run with, by name (None: the model's default, if any)
    # prefill only: the output carries the final-normed hidden state of the last prompt token (`hidden`, what a
    # classification head reads) and no token is generated; the prefix cache is not used
    hidden_only: bool = False
    request_id: str = field(default_factory=new_request_id)


def forced_function(request: Request) -> bool | str | None:
    """What the request's tool_choice forces: None (nothing), True (a call to any of its tools) or a function's
    name."""
    choice = request.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    if not isinstance(request.parallel_tool_calls, bool):
        raise QwenrtError(f"parallel_tool_calls must be true or false, got {request.parallel_tool_calls!r}",
                          "parallel_tool_calls")
    if choice == "required":
        name = True
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
            isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
    else:
        raise QwenrtError(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": NAME}}}}, got {choice!r:.80}", "tool_choice")
    if not request.tools:
        raise QwenrtError(f"tool_choice {choice!r:.80} needs tools", "tool_choice")
    return name


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens, (token, logprob), most likely first


@dataclass
class DraftCounts:
    """Speculative decoding of one request (or an engine): drafts proposed and accepted, per draft position."""

    rounds: int = 0  # verifications that carried drafts
    drafted: list[int] = field(default_factory=list)  # drafted[i]: rounds with a draft at position i
    accepted: list[int] = field(default_factory=list)  # accepted[i]: of which the draft at position i was kept

    def add(self, drafts: int, accepted: int) -> None:
        if not drafts:
            return
        grow = drafts - len(self.drafted)
        if grow > 0:
            self.drafted += [0] * grow
            self.accepted += [0] * grow
        self.rounds += 1
        for i in range(drafts):
            self.drafted[i] += 1
            self.accepted[i] += i < accepted

    @property
    def draft_tokens(self) -> int:
        return sum(self.drafted)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance(self) -> float:
        """Accepted drafts / drafts."""
        return self.accepted_tokens / max(self.draft_tokens, 1)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification that carried drafts (1 + accepted drafts), vLLM's mean acceptance length."""
        return 1 + self.accepted_tokens / max(self.rounds, 1)

    def per_position(self) -> list[float]:
        return [a / max(d, 1) for a, d in zip(self.accepted, self.drafted)]

    def summary(self) -> str:
        """"acceptance 72% (86/70/59 by position), 2.2 tokens per step", or "" without drafts."""
        if not self.rounds:
            return ""
        by = "/".join(f"{100 * p:.0f}" for p in self.per_position())
        return f"drafts accepted {100 * self.acceptance:.0f}% ({by} by position), " \
               f"{self.mean_accepted_length:.2f} tokens per step"


@dataclass
class RequestOutput:
    """What one engine step produced for one request. The last output of a request has finish_reason set; with
    Request.prompt_logprobs its first carries the prompt's (all of them, computed chunk by chunk meanwhile)."""

    request_id: str
    text: str  # the text this step completed (held back while a character or a stop string is incomplete)
    token_ids: list[int]  # tokens sampled this step; a stop token ends the request and adds no text
    finish_reason: str | None  # None while running; "stop", "length", "abort" (cancelled) or "error"
    prompt_tokens: int
    generation_tokens: int  # generated so far, stop tokens excluded
    arrival_time: float  # time.perf_counter() clock
    first_token_time: float | None
    prefill_start_time: float | None  # when its first prompt chunk was scheduled
    time: float  # when this output was made
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when the request asked for them
    error: str | None = None  # finish_reason "error": what went wrong
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of computed
    drafts: DraftCounts | None = None  # speculative decoding so far (None: not speculating)
    # with Request.prompt_logprobs, on the request's first output (its first token's, or the only one with max_tokens
    # 0): one per prompt token, the first None (nothing comes before it), and the prompt's ids they refer to
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None
    hidden: torch.Tensor | None = None  # a hidden_only request's last output: the last prompt token's [D]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The engine's record of one request: prompt, progress, sampling and output state, and its cache."""

    def __init__(self, request: Request, prompt: PreparedPrompt, tokenizer, stop_ids: set[int], limit: int,
                 sink: Callable[[RequestOutput], None], device: torch.device):
        self.request, self.prompt, self.sink = request, prompt, sink
        self.params = request.params
        self.stop_ids, self.limit = stop_ids, limit  # limit: the most tokens (prompt + output) this sequence holds
        self.status = Status.WAITING
        self.state: SequenceState | None = None  # allocated when admitted, dropped when finished
        self.computed = 0  # prompt tokens in the cache
        self.cached = 0  # of which restored from the prefix cache
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopStringMatcher(self.params.stop)
        seed = self.params.seed
        if seed is None:  # drawn from torch's global RNG, so torch.manual_seed makes unseeded runs repeatable
            seed = int(torch.randint(0, 2**62, (1,)))
        self.generator = torch.Generator(device=device).manual_seed(seed)  # one per request: draws independent of the batch
        self.history: TokenCounts | None = None  # penalties' token counts, made at the first sample
        self.mask: TokenMask | None = None  # the output constraint, set by the engine
        self.vision_embeds = None  # the prompt's multimodal.VisionInputs while an image/video prompt is prefilled
        self.key: list[int] = prompt.ids  # the prompt as the prefix cache knows it (images by content, adapter)
        self.adapter = 0  # the slot of the served adapter it runs with (qwenrt.served_adapters; 0: none)
        self.snapshots: list[int] = [self.prompt_len]  # prompt lengths where a prefix snapshot is taken, ascending
        # speculative decoding (set by the engine): most drafts per step, whether `auto` picks the count, the drafts
        # for the next step; the MTP head's cache, the index of its next (hidden, next token) pair, the final-normed
        # hidden states of the pairs waiting for it (their next tokens now known: chunks [n, D], mtp_count rows in
        # all), its committed entries
        self.max_drafts, self.auto_drafts, self.drafts = 0, False, []
        self.draft_state: SequenceState | None = None
        self.mtp_index: int | None = None
        self.mtp_pending: list[torch.Tensor] = []
        self.mtp_count = 0
        self.mtp_entries = 0
        self.draft_counts: DraftCounts | None = None
        # with prompt_logprobs: the entries of the prompt computed so far, handed out with the first output
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if request.prompt_logprobs is not None else None
        self.arrival_time = time.perf_counter()
        self.prefill_start_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    def next_boundary(self) -> int:
        """Where the current prompt chunk must end at the latest: the next snapshot point (or the prompt's end)."""
        return next((p for p in self.snapshots if p > self.computed), self.prompt_len)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def accept(self, token: int) -> str:
        """Take one sampled token; return the text it completes. Sets finish_reason when the sequence ends."""
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self._drain()
        self.tokens.append(token)
        emit, stopped = self.stops.feed(self.detok.add(token) if self.detok is not None else "")
        self.text += emit
        if stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.params.max_tokens or self.prompt_len + len(self.tokens) >= self.limit:
            self.finish_reason = "length"
            emit += self._drain()
        return emit

    def _drain(self) -> str:
        """What was held back (an incomplete character, a possible stop-string prefix) once generation ends."""
        tail, _ = self.stops.feed(self.detok.flush() if self.detok is not None else "")
        tail += self.stops.flush()
        self.text += tail
        return tail

    def output(self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None = None,
               error: str | None = None) -> RequestOutput:
        out = RequestOutput(self.request_id, text, token_ids, self.finish_reason, self.prompt_len, len(self.tokens),
                            self.arrival_time, self.first_token_time, self.prefill_start_time, time.perf_counter(),
                            logprobs, error, self.cached, self.draft_counts)
        if self.prompt_logprobs is not None and not self.prefilling:  # once, complete
            out.prompt_logprobs, out.prompt_token_ids = self.prompt_logprobs, self.prompt.ids
            self.prompt_logprobs = None
        return out
