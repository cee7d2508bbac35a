"""The engine: requests join at any time (from any thread), every step admits, prefills in chunks and decodes all
running sequences in one batched forward, samples each with its own parameters, and hands each request its
outputs. `generate`, `stream_generate`, the CLI and the server are fronts on this one loop.

Two ways to drive it: `step()` from the caller's thread (the Python API does this while it waits for its own
request, so several threads may share one engine), or `start()` a loop thread (the server).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qwenrt.cache import deltanet_state_bytes, kv_bytes_per_token, parse_kv_cache_dtype
from qwenrt.constraints import Constraint, GrammarCompiler, TokenMask
from qwenrt.engine.prefix_cache import Match, PrefixCache, prompt_key
from qwenrt.engine.prefix_store import PrefixStore, model_identity
from qwenrt.engine.request import (DraftCounts, Request, RequestOutput, Sequence, Status, TokenLogprob,
                                   forced_function)
from qwenrt.engine.runner import Cycle, ModelRunner, Verified
from qwenrt.engine.scheduler import Scheduler, SchedulerConfig
from qwenrt.engine.speculative import DraftPolicy, accept, propose_ngram
from qwenrt.errors import QueueFullError, QwenrtError
from qwenrt.meminfo import meminfo
from qwenrt.model import Qwen35ForCausalLM
from qwenrt.mtp import DEFAULT_DRAFT_VOCAB
from qwenrt.prompt import prepare_prompt
from qwenrt.sampling import TokenCounts, check_finite, check_generates, sample
from qwenrt.served_adapters import prefix_key
from qwenrt.tool_grammar import tool_call_grammar
from qwenrt.validation import check_flag, check_request

DEFAULT_MAX_RUNNING = 8
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BATCHED_TOKENS = 512  # per step at most
DEFAULT_STEP_TARGET = 0.5  # seconds: prompt chunks are sized so a step takes about this long (streams keep flowing)
MIN_CHUNK = 32  # prompt tokens per step at least, whatever the step target
MAX_LOGPROBS = 20
DEFAULT_SNAPSHOT_INTERVAL = 1024  # prompt tokens between prefix-cache snapshots inside a long prompt
MIN_BRANCH_GAIN = 32  # a shared prefix found as KV only gets its own snapshot when it is at least this long
MAX_DRAFTS = 8  # speculative_tokens at most
AUTO_MAX_DRAFTS = 4  # the most drafts `auto` verifies per step (qwenrt-tiny: 4 drafts 1.63x, 3 1.57x)
MAX_PENDING = 256  # positions queued for the MTP head's next draft at most (while it does not draft)
_engines = weakref.WeakKeyDictionary()  # model -> its default engine (Engine.for_model)


def default_memory_budget() -> int:
    """Half the memory available now (the weights are loaded by then), at least 1 GiB; 4 GiB where unknown."""
    available = meminfo("MemAvailable")
    return 4 << 30 if available is None else max(1 << 30, available // 2)


def default_prefix_cache_size() -> int:
    """A tenth of the machine's memory, at most 8 GiB; 1 GiB where unknown."""
    total = meminfo("MemTotal")
    return 1 << 30 if total is None else min(8 << 30, total // 10)


def _last_index(ids: list[int], token: int | None) -> int:
    """Index of the last occurrence of token in ids (0 when absent)."""
    if token is None:
        return 0
    return next((i for i in range(len(ids) - 1, 0, -1) if ids[i] == token), 0)


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _fill_masks(seqs: list[Sequence]) -> None:
    """Compute the constrained rows' masks one after another, before sampling any row: the first warms the
    grammar's tables (cold after the forward) for the others (built-in model, batch 8: 22 us per mask, 40 us
    interleaved with sampling). A failed fill leaves its mask unfilled: its row's `allowed` raises, in `_sample`."""
    for seq in seqs:
        if seq.mask is not None and seq.mask.active:
            try:
                seq.mask.fill()
            except QwenrtError:
                pass


def _pend(seq: Sequence, first: int, rows: torch.Tensor) -> None:
    """Queue pairs for the MTP head: the hidden states rows [n, D] of the inputs at indices first.. (whose next
    tokens are taken). Its next draft runs over them in one call; beyond MAX_PENDING it skips the oldest."""
    if not seq.mtp_count:
        seq.mtp_index = first
    seq.mtp_pending.append(rows)  # joined when the head reads them: a plain step only appends
    seq.mtp_count += len(rows)
    while seq.mtp_count > MAX_PENDING:
        skip = min(seq.mtp_count - MAX_PENDING, len(seq.mtp_pending[0]))
        seq.mtp_index += skip
        seq.mtp_count -= skip
        seq.mtp_pending[0] = seq.mtp_pending[0][skip:]
        if not len(seq.mtp_pending[0]):
            seq.mtp_pending.pop(0)


def _start_history(seq: Sequence, logits: torch.Tensor) -> None:
    """The penalties' token counts, made at a sequence's first sample (logits [T, V])."""
    if seq.params.uses_penalties and seq.history is None:
        seq.history = TokenCounts.from_prompts([seq.prompt.ids], logits.shape[-1], logits.device)


def _check_logprobs(name: str, value) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and
                                  0 <= value <= MAX_LOGPROBS):
        raise QwenrtError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")


def _check_kind(model, request: Request) -> None:
    """A classifier only scores prompts (hidden_only requests); prompt logprobs need an LM head too."""
    check_flag(request.hidden_only, "hidden_only")
    if model.lm_head is None and not request.hidden_only:
        raise QwenrtError("this model is a sequence classifier: it has no LM head to generate with (classify texts "
                          "with `qwenrt classify` or POST /classify)")
    if request.hidden_only and request.prompt_logprobs is not None:
        raise QwenrtError("prompt_logprobs cannot be combined with hidden_only")


def _speculative_tokens(value) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DRAFTS):
        return value
    raise QwenrtError(f"speculative_tokens must be 0 (off), 1..{MAX_DRAFTS} or \"auto\", got {value!r}")


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise QwenrtError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass
class RequestHandle:
    """A request the engine accepted."""

    request_id: str
    prompt_tokens: int
    thinking_started: bool  # the prompt ends inside an open <think> block (for splitting reasoning from content)


class RequestStream(RequestHandle):
    """A request's outputs, iterated in the calling thread; iterating drives the engine when no loop thread does.
    Leaving the iteration early cancels the request."""

    def __init__(self, engine: Engine, handle: RequestHandle, outputs: queue.SimpleQueue):
        super().__init__(handle.request_id, handle.prompt_tokens, handle.thinking_started)
        self._engine, self._outputs = engine, outputs

    def __iter__(self) -> Iterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = self._engine._wait(self._outputs)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._engine.abort(self.request_id)


class Engine:
    """Continuous batching over one model.

    max_running: sequences decoded together at most. max_queue: requests waiting at most (more are refused with
    QueueFullError). max_model_len: context limit of every request (default: the model's). max_batched_tokens:
    tokens per step at most (one per decoding sequence; the rest goes to prompt chunks). step_target: seconds a step
    should take while several sequences run: prompt chunks are sized from the measured prefill speed so that
    running streams keep producing tokens and a new request's first token does not wait long behind a long prompt
    (None, or a prompt alone: max_batched_tokens). memory_budget: bytes of cache
    (KV + DeltaNet state) the running sequences may reserve together (default: half the available memory).
    prefix_cache_size: bytes of prefix snapshots kept for later requests (default: a tenth of the machine's memory;
    0: no prefix cache). prefix_cache_dir: also keep the snapshots in this folder (as much again on disk), so a
    restart keeps them. snapshot_interval: prompt tokens between snapshots inside a long prompt.
    speculative_tokens: draft tokens verified per decode step by default (a request may ask otherwise): 0 off, k,
    or "auto" (the default: the count that pays, from measured acceptance and step times; off without an MTP
    head). Drafts come from the model's MTP head, or without one from earlier text (prompt lookup). draft_vocab: the
    MTP head drafts among the first this many token ids (its share of the LM head's weight reads).
    kv_cache_dtype: "auto" (keys and values in the model's dtype) or "int8" (8 bits per value and an fp32 scale per
    token and head: about half a bf16 cache).
    """

    def __init__(self, model, tokenizer=None, *, max_running: int = DEFAULT_MAX_RUNNING,
                 max_queue: int = DEFAULT_MAX_QUEUE, max_model_len: int | None = None,
                 max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS, step_target: float | None = DEFAULT_STEP_TARGET,
                 memory_budget: int | None = None,
                 prefix_cache_size: int | None = None, prefix_cache_dir: str | None = None,
                 snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL, speculative_tokens: int | str = "auto",
                 draft_vocab: int = DEFAULT_DRAFT_VOCAB, kv_cache_dtype: str = "auto"):
        if not isinstance(model, Qwen35ForCausalLM):
            raise QwenrtError(f"model must be the model qwenrt.load returned, got {type(model).__name__}")
        c = model.config.text
        limit = c.context_limit
        if max_model_len is not None and _positive("max_model_len", max_model_len) > limit:
            raise QwenrtError(f"max_model_len {max_model_len} exceeds the model's context limit {limit}")
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = max_model_len or limit
        self.max_queue = _positive("max_queue", max_queue)
        self.memory_budget = _positive("memory_budget", memory_budget) if memory_budget is not None else (
            default_memory_budget())
        self.state_bytes = deltanet_state_bytes(c)
        self.kv_dtype = parse_kv_cache_dtype(kv_cache_dtype) or model.dtype
        self.kv_token_bytes = kv_bytes_per_token(c, self.kv_dtype)
        self.eos_ids = set(tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_id)
        self.speculative_tokens = _speculative_tokens(speculative_tokens)
        self.runner = ModelRunner(model, _positive("draft_vocab", draft_vocab), self.kv_dtype)
        self.draft_policy = DraftPolicy(AUTO_MAX_DRAFTS)
        self.draft_counts = DraftCounts()  # every request's, for metrics
        # the MTP head's KV for one token, and the DeltaNet states a verification keeps per draft
        self.draft_token_bytes = self.kv_token_bytes // max(len(c.full_attention_layers), 1)
        size = default_prefix_cache_size() if prefix_cache_size is None else prefix_cache_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise QwenrtError(f"prefix_cache_size must be a number of bytes >= 0 (0 = off), got {size!r}")
        store = (PrefixStore(prefix_cache_dir, model_identity(model, self.kv_dtype), size)
                 if size and prefix_cache_dir else None)
        self.prefix_cache = PrefixCache(size, c, self.kv_dtype, store) if size else None
        self.snapshot_interval = _positive("snapshot_interval", snapshot_interval)
        if step_target is not None and not (isinstance(step_target, (int, float)) and step_target > 0):
            raise QwenrtError(f"step_target must be a number of seconds > 0 (or None), got {step_target!r}")
        self.step_target = step_target
        self._prefill_rate: float | None = None  # prompt tokens per second, a moving average
        self._turn_token = tokenizer.token_to_id("<|im_start|>") if tokenizer is not None else None
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._grammars_lock = threading.Lock()
        self.scheduler = Scheduler(SchedulerConfig(_positive("max_running", max_running),
                                                   _positive("max_batched_tokens", max_batched_tokens),
                                                   self.memory_budget), self.reservation)
        self._sequences: dict[str, Sequence] = {}  # every unfinished request
        self._inbox: deque[Sequence] = deque()  # added, not yet seen by a step
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()  # guards _sequences and the queue-length check
        self._step_lock = threading.Lock()  # one step at a time
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def for_model(cls, model, tokenizer=None, **options) -> Engine:
        """The model's default engine, made on first use (or anew with `options`) with the options `qwenrt.load` was
        given; the Python API's fronts use it."""
        engine = _engines.get(model)
        if engine is None or engine.tokenizer is not tokenizer or options:
            options = {**getattr(model, "engine_options", {}), **options}
            try:
                engine = _engines[model] = cls(model, tokenizer, **options)
            except TypeError as e:
                raise QwenrtError(f"unknown engine option: {e}") from None
        return engine

    # ---- what callers use ----

    def reservation(self, seq: Sequence) -> int:
        """Cache bytes a sequence reserves while it runs: DeltaNet state + KV for every token it may hold; with
        speculation also the MTP head's KV and the states a verification keeps."""
        need = self.state_bytes + self.kv_token_bytes * seq.limit
        if seq.max_drafts:
            need += self.state_bytes * seq.max_drafts
            if self.runner.mtp is not None:
                need += self.draft_token_bytes * (seq.limit + 2 * seq.max_drafts + 2)
        return need

    def _check_fits(self, seq: Sequence, prompt_len: int) -> None:
        """Refuse, in one line, a request whose reservation can never fit the cache budget: what it needs, what
        fits, and what to change."""
        need = self.reservation(seq)
        if need <= self.memory_budget:
            return
        per_token = self.reservation_per_token(seq)
        fixed = need - per_token * seq.limit  # DeltaNet state (and the states speculation keeps)
        fits = max(0, (self.memory_budget - fixed) // per_token)  # tokens of context the budget holds
        fix = (f"lower max_tokens to {fits - prompt_len} or less" if fits > prompt_len else
               f"shorten the prompt to under {fits} tokens (max_model_len / --max-model-len bounds it)")
        raise QwenrtError(f"the request needs {_size(need)} of cache (KV {_size(need - fixed)} for {seq.limit} "
                          f"tokens = prompt {prompt_len} + max_tokens {seq.limit - prompt_len}, DeltaNet state "
                          f"{_size(fixed)}), over the engine's cache budget of {_size(self.memory_budget)}: {fix}, "
                          "or raise the budget (Engine memory_budget=, serve --kv-cache-memory-bytes)", "max_tokens")

    def reservation_per_token(self, seq: Sequence) -> int:
        """The bytes `reservation` adds per token of the sequence's limit."""
        return self.kv_token_bytes + (self.draft_token_bytes if seq.max_drafts and self.runner.mtp is not None else 0)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    def adapters_in_use(self) -> tuple[set[str], set[str]]:
        """The served adapters (names) of the running requests and of the waiting ones; callable from any thread."""
        def names(seqs) -> set[str]:
            return {s.request.adapter for s in seqs if s.request.adapter is not None}
        return names(list(self.scheduler.running)), names([*self._inbox, *self.scheduler.waiting])

    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.scheduler.has_work)

    def add_request(self, request: Request, sink: Callable[[RequestOutput], None]) -> RequestHandle:
        """Check and tokenize a request and queue it; `sink` receives its outputs (called from the stepping thread).

        Raises QwenrtError for a bad request (one that can never run included), QueueFullError when the queue is full.
        """
        limit = check_request([request.prompt], vocab_size=self.model.config.text.vocab_size,
                              model_limit=self.max_model_len, tools=request.tools, max_context=request.max_context)
        if request.prefill_chunk is not None:
            _positive("prefill_chunk", request.prefill_chunk)
        if request.enable_thinking is not None:
            check_flag(request.enable_thinking, "enable_thinking")
        _check_logprobs("logprobs", request.logprobs)
        _check_logprobs("prompt_logprobs", request.prompt_logprobs)
        params = request.params
        _check_kind(self.model, request)
        if request.prompt_logprobs is None and not request.hidden_only:
            check_generates(params)
        prompt = prepare_prompt(self.model, self.tokenizer, request.prompt, request.enable_thinking, request.tools,
                                limit, request.media_policy)
        if prompt.vision is not None and request.prompt_logprobs is not None:
            raise QwenrtError("prompt_logprobs is not supported with image or video prompts")
        stop_ids = (set() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids)
        generated = 0 if request.hidden_only else params.max_tokens
        seq = Sequence(request, prompt, self.tokenizer, stop_ids, min(limit, len(prompt.ids) + generated), sink,
                       self.model.device)
        served = self.model.served_adapters
        if served is not None:
            seq.adapter = served.slot(request.adapter)
        elif request.adapter is not None:
            raise QwenrtError(f"adapter {request.adapter!r:.80}: this model serves no adapters (load it with "
                              "adapters={name: directory})", "adapter")
        seq.key = prefix_key(prompt_key(prompt, self.model.config), served, seq.adapter)
        if not request.hidden_only:
            seq.mask = self._token_mask(request, prompt.thinking_started)
            self._set_speculation(seq, request.speculative_tokens)
        self._check_fits(seq, len(prompt.ids))
        with self._lock:
            if request.request_id in self._sequences:
                raise QwenrtError(f"a request with id {request.request_id!r} is already running")
            if self.num_waiting >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); try again later")
            self._sequences[request.request_id] = seq
            self._inbox.append(seq)
        self._wake.set()
        return RequestHandle(request.request_id, len(prompt.ids), prompt.thinking_started)

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of this engine's output constraints, made at the first use (its token tables take ~3 s at a
        248K vocabulary: a server makes it at start)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise QwenrtError("constrained output (a response format or a forced tool call) needs the "
                                      "tokenizer: give the engine one")
                self._grammars = GrammarCompiler(self.tokenizer, self.model.config.text.vocab_size)
            return self._grammars

    def _token_mask(self, request: Request, thinking_started: bool) -> TokenMask | None:
        """The request's output constraint (its params' one, or the tool call its tool_choice forces), compiled in
        the calling thread; with thinking on it starts after `</think>`."""
        constraint, forced = request.params.constraint, forced_function(request)
        if constraint is None and forced is None:
            return None
        if constraint is not None and forced is not None:
            raise QwenrtError(f"tool_choice {request.tool_choice!r} forces a tool call; it cannot be combined with "
                              f"an output constraint ({constraint.kind})", "tool_choice")
        compiler = self.grammar_compiler()
        if forced is not None:
            def token(text: str) -> str:
                return compiler.token_rule(text, self.tokenizer.token_to_id(text))
            lark = tool_call_grammar(request.tools, token, None if forced is True else forced,
                                     request.parallel_tool_calls)
            grammar, field = Constraint("grammar", lark).grammar(), "tool_choice"
        else:
            try:
                grammar, field = constraint.grammar(thinking_started), constraint.kind
            except ValueError as e:
                raise QwenrtError(f"{constraint.kind}: {e}", constraint.kind) from None
        after = self.tokenizer.token_to_id("</think>") if thinking_started else None
        return TokenMask(compiler.matcher(grammar, field), self.model.config.text.vocab_size, after)

    def submit(self, request: Request) -> RequestStream:
        """add_request with the outputs queued for iteration in the calling thread."""
        outputs = queue.SimpleQueue()
        return RequestStream(self, self.add_request(request, outputs.put), outputs)

    def abort(self, request_id: str) -> None:
        """Cancel a request (waiting or running): it ends with finish_reason "abort" and its memory is freed at the
        next step, or at once when no step is running. Unknown or finished ids are ignored."""
        self._aborts.append(request_id)
        self._wake.set()
        if self._step_lock.acquire(blocking=False):
            try:
                self._take_new([])
            finally:
                self._step_lock.release()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns every output it made (each was also given to its request's sink)."""
        with self._step_lock:
            return self._step()

    def start(self) -> None:
        """Run steps in a loop thread until stop(); callers then only add, abort and wait."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="qwenrt-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping = True
            self._wake.set()
            thread.join()

    # ---- the loop ----

    def _loop(self) -> None:
        while not self._stopping:
            if not self.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # _step already failed the requests involved; the loop must live on
                traceback.print_exc()

    def _wait(self, outputs: queue.SimpleQueue) -> RequestOutput:
        """The next output from `outputs`, stepping the engine meanwhile unless a loop thread (or another caller
        holding the step) does."""
        while True:
            try:
                return outputs.get_nowait()
            except queue.Empty:
                pass
            if self._thread is None and self._step_lock.acquire(blocking=False):
                try:
                    self._step()
                finally:
                    self._step_lock.release()
                continue
            try:
                return outputs.get(timeout=None if self._thread is not None else 0.01)
            except queue.Empty:
                pass

    def _take_new(self, outputs: list) -> None:
        """Queue the requests added since the last step; end the cancelled ones."""
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        while self._aborts:
            seq = self._sequences.get(self._aborts.popleft())
            if seq is not None and seq.status is not Status.FINISHED:
                seq.finish_reason = "abort"
                self._emit(seq, "", [], outputs)

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._take_new(outputs)
        involved = self.scheduler.admit()
        try:
            for seq in list(involved):
                self._run(outputs, [seq], lambda s=seq: self._start(s, outputs))
            plan = self.scheduler.schedule(self._step_tokens())
            involved += plan.decode + [s for s, _ in plan.prefill]
            if plan.decode:
                self._run(outputs, plan.decode, lambda: self._decode(plan.decode, outputs))
            for seq, n in plan.prefill:
                if seq.status is Status.RUNNING:
                    self._run(outputs, [seq], lambda s=seq, k=n: self._prefill(s, k, outputs))
        except BaseException:  # e.g. Ctrl-C in the middle of a forward: these caches are half-updated
            for seq in involved:
                if seq.status is Status.RUNNING:
                    self._fail(seq, outputs, "interrupted")
            raise
        return outputs

    def _step_tokens(self) -> int:
        """This step's token budget: what the measured prefill speed does in step_target seconds, where other
        sequences share the step; a prompt alone gets max_batched_tokens (an MoE model reads most of
        its experts per chunk: the 35B-A3B prefilled 512 tokens at 10-15 tok/s in step-target chunks of 32, 29-33
        in one chunk)."""
        if self.step_target is None or self._prefill_rate is None or len(self.scheduler.running) <= 1:
            return self.scheduler.config.max_batched_tokens
        return max(MIN_CHUNK, int(self._prefill_rate * self.step_target))

    def _start(self, seq: Sequence, outputs: list) -> None:
        """Give an admitted sequence its cache, restoring the longest cached prefix of its prompt; choose where its
        prefill takes snapshots. A prompt cached whole (with its logits) samples its first token at once. A request
        for prompt logprobs restores nothing (the cache has no logits of the positions it covers)."""
        seq.state = self.runner.allocate(seq)
        if seq.request.hidden_only:
            seq.snapshots = []
        if self.prefix_cache is None or seq.request.hidden_only:
            return
        hit = self.prefix_cache.match(seq.key) if seq.request.prompt_logprobs is None else Match(0, None, 0)
        if hit.length:
            self.prefix_cache.restore(hit, seq.state)
            seq.computed = seq.cached = hit.length
        points = {seq.prompt_len, *range(self.snapshot_interval, seq.prompt_len, self.snapshot_interval)}
        turn = _last_index(seq.prompt.ids, self._turn_token)
        if turn:  # the next chat turn's prompt repeats everything before the generation prompt
            points.add(turn)
        if hit.matched - hit.length >= MIN_BRANCH_GAIN:  # a prefix others share, cached so far as KV only
            points.add(min(hit.matched, seq.prompt_len))
        seq.snapshots = sorted(p for p in points if p > seq.computed)
        if hit.length == seq.prompt_len:
            if seq.prompt.vision is not None:
                seq.state.rope_delta = seq.prompt.vision.rope_delta
            self._sample(seq, hit.logits[None], outputs)

    def _run(self, outputs: list, seqs: list[Sequence], work: Callable[[], None]) -> None:
        """Run one piece of a step; an Exception ends just the sequences it involved, with the error."""
        try:
            work()
        except Exception as e:
            if not isinstance(e, QwenrtError):
                traceback.print_exc(file=sys.stderr)
            for seq in seqs:
                if seq.status is Status.RUNNING:
                    self._fail(seq, outputs, str(e) or type(e).__name__)

    def _fail(self, seq: Sequence, outputs: list, message: str) -> None:
        seq.finish_reason = "error"
        self._emit(seq, "", [], outputs, error=message)

    def _decode(self, seqs: list[Sequence], outputs: list) -> None:
        start = time.perf_counter()
        auto = any(s.auto_drafts for s in seqs)
        choice = self.draft_policy.choose(len(seqs)) if auto else 0  # drafts `auto` makes for the next step
        drafts = [s.drafts for s in seqs]
        made = 0  # drafts made for the next step: fewer than `choice` where sequences ended or ran out of room
        if not (choice or any(drafts) or any(s.max_drafts and not s.auto_drafts for s in seqs)):
            # nothing to verify and nothing to draft: a plain step. Its hidden states still go to the MTP head (at
            # its next draft, in one call): a head that skipped them would draft a probe from a gapped context
            inputs = [s.prompt_len + len(s.tokens) - 1 for s in seqs]  # each input's index
            logits, hidden = self.runner.decode(seqs)  # [B, V], [B, D]
            _fill_masks(seqs)
            for b, seq in enumerate(seqs):
                self._run(outputs, [seq], lambda s=seq, row=logits[b:b + 1]: self._sample(s, row, outputs))
                if seq.draft_state is not None and seq.finish_reason is None:
                    _pend(seq, inputs[b], hidden[b:b + 1])
        elif (cycles := self._cycle(seqs, drafts, choice)) is not None:
            for seq, d, c in zip(seqs, drafts, cycles):
                self._run(outputs, [seq], lambda s=seq, d=d, c=c: self._take_cycle(s, d, c, outputs))
            made = max((len(s.drafts) for s in seqs if s.status is Status.RUNNING), default=0)
        else:
            verified = self.runner.verify(seqs, drafts)
            for seq, d, v in zip(seqs, drafts, verified):
                self._run(outputs, [seq], lambda s=seq, d=d, v=v: self._take_verified(s, d, v, outputs))
            live = [s for s in seqs if s.status is Status.RUNNING and s.max_drafts]
            if live:
                self._run(outputs, live, lambda: self._propose(live, choice))
                made = max((len(s.drafts) for s in live if s.status is Status.RUNNING), default=0)
        if auto:  # a step that drafted less than it verified is cheaper than a cycle (one per request, at its end)
            self.draft_policy.observe(len(seqs), max(len(d) for d in drafts), made, time.perf_counter() - start)

    def _take_verified(self, seq: Sequence, drafts: list[int], verified: Verified, outputs: list) -> None:
        """Emit what a verification decided for seq (its accepted drafts and one more token), keep those in its
        cache, and queue the new (hidden, next token) pairs for the MTP head."""
        first = seq.prompt_len + len(seq.tokens) - 1  # index of the verification's first input
        _start_history(seq, verified.logits)
        emitted, kept = accept(verified.logits, drafts, seq.params, seq.history, seq.generator, seq.mask)
        self._record_drafts(seq, len(drafts), kept)
        text, taken, logprobs = "", [], [] if seq.request.logprobs is not None else None
        for r, token in enumerate(emitted):
            if logprobs is not None:
                logprobs.append(self._logprob(seq, verified.logits[r], token))
            taken.append(token)
            text += seq.accept(token)
            if seq.finish_reason is not None:
                break
        # the cache keeps the inputs whose successors were taken (like plain decoding, not the newest token)
        keep = min(kept + 1, len(taken))
        self.runner.commit(seq, verified, keep)
        if seq.draft_state is not None and seq.finish_reason is None:
            _pend(seq, first, verified.hidden[:keep])
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        self._emit(seq, text, taken, outputs, logprobs=logprobs)

    def _record_drafts(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verification's outcome for the statistics (the request's and the engine's) and for `auto`."""
        if seq.draft_counts is not None:
            seq.draft_counts.add(drafted, accepted)
        self.draft_counts.add(drafted, accepted)
        if seq.auto_drafts:
            self.draft_policy.record(drafted, accepted)

    def _cycle(self, seqs: list[Sequence], drafts: list[list[int]], choice: int):
        """A step's verification and next drafts in one native call (runner.cycle) where every sequence picks
        greedily with nothing else to compute from its logits and drafts with the MTP head; None otherwise. The
        drafts' room assumes every input is kept."""
        if self.runner.mtp is None or any(not s.params.greedy or s.params.uses_penalties or not s.max_drafts
                                          or s.request.logprobs is not None or s.mask is not None for s in seqs):
            return None
        return self.runner.cycle(seqs, drafts, self._drafts_to_make(seqs, choice, [1 + len(d) for d in drafts]))

    def _take_cycle(self, seq: Sequence, drafts: list[int], cycle: Cycle, outputs: list) -> None:
        """_take_verified for a cycle: its tokens were picked and its cache kept natively."""
        first = seq.prompt_len + len(seq.tokens) - 1  # index of the cycle's first input
        check_finite(cycle.logits)
        self._record_drafts(seq, len(drafts), cycle.accepted)
        text, taken = "", []
        for token in cycle.picks[:cycle.accepted + 1]:
            taken.append(token)
            text += seq.accept(token)
            if seq.finish_reason is not None:
                break
        self.runner.keep(seq, cycle, len(taken))
        if seq.finish_reason is None:
            seq.drafts = cycle.drafts
            if not cycle.drafts:  # the head drafts nothing now: these rows wait for its next draft
                _pend(seq, first, cycle.hidden[:len(taken)])
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        self._emit(seq, text, taken, outputs)

    @staticmethod
    def _drafts_to_make(seqs: list[Sequence], choice: int, ahead: list[int] | None = None) -> list[int]:
        """Drafts for each sequence's next step: as many as it asks (`auto`: `choice`, the policy's), within its
        token limit and what it may still generate once `ahead[b]` more tokens are taken."""
        ks = []
        for b, s in enumerate(seqs):
            k = choice if s.auto_drafts else s.max_drafts
            more = ahead[b] if ahead is not None else 0
            room = min(s.limit - s.state.length - more - 1, s.params.max_tokens - len(s.tokens) - more - 1)
            ks.append(max(0, min(k, room)))
        return ks

    def _propose(self, seqs: list[Sequence], choice: int) -> None:
        """Drafts for each sequence's next step (_drafts_to_make)."""
        ks = self._drafts_to_make(seqs, choice)
        if self.runner.mtp is not None:
            for s, d in zip(seqs, self.runner.draft(seqs, ks)):
                s.drafts = d  # none: the head's pairs wait for its next draft
        else:
            for s, k in zip(seqs, ks):
                s.drafts = propose_ngram(s.prompt.ids + s.tokens, k) if k else []
        for s in seqs:  # a constrained row verifies what its grammar allows (its forced tokens where it has them)
            if s.mask is not None:
                s.drafts = s.mask.drafts(s.drafts)

    def _set_speculation(self, seq: Sequence, requested) -> None:
        k = self.speculative_tokens if requested is None else _speculative_tokens(requested)
        if k == "auto":
            if self.runner.mtp is None:  # prompt lookup only where asked for
                return
            seq.max_drafts, seq.auto_drafts = AUTO_MAX_DRAFTS, True
        else:
            seq.max_drafts = k
        if seq.max_drafts:
            seq.draft_counts = DraftCounts()

    @staticmethod
    def _logprob(seq: Sequence, logits: torch.Tensor, token: int) -> TokenLogprob:
        """The token's log-probability under the model's distribution (logits [V], before any penalty or
        filter) and the request's number of most likely ones."""
        logp = logits.float().log_softmax(-1)
        top = logp.topk(seq.request.logprobs) if seq.request.logprobs else None
        return TokenLogprob(token, float(logp[token]),
                            list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])

    def _prefill(self, seq: Sequence, n: int, outputs: list) -> None:
        start = time.perf_counter()
        if seq.prefill_start_time is None:
            seq.prefill_start_time = start
        logits, hidden = self.runner.prefill(seq, n)
        if seq.request.hidden_only:
            if hidden is not None:
                seq.finish_reason = "length"
                self._emit(seq, "", [], outputs, hidden=hidden[0])
            return
        if hidden is not None:
            seq.prompt_logprobs += self._prompt_logprobs(seq, seq.computed - n, hidden)
        if n >= MIN_CHUNK // 2:  # short chunks say more about fixed costs than about speed
            rate = n / max(time.perf_counter() - start, 1e-6)
            self._prefill_rate = rate if self._prefill_rate is None else 0.7 * self._prefill_rate + 0.3 * rate
        if seq.request.on_prefill is not None:
            seq.request.on_prefill(seq.computed, seq.prompt_len)
        if self.prefix_cache is not None and seq.computed in seq.snapshots:
            self.prefix_cache.insert(seq.key[:seq.computed], seq.state, logits)
        if logits is None:
            return
        if seq.params.max_tokens:
            self._sample(seq, logits, outputs)
        else:  # the prompt was only to be scored
            seq.finish_reason = "length"
            self._emit(seq, "", [], outputs)

    def _prompt_logprobs(self, seq: Sequence, start: int, hidden: torch.Tensor) -> list[TokenLogprob]:
        """The entries of the prompt tokens a chunk predicts: the chunk starts at prompt index `start`, hidden [n, D];
        row i predicts the token at start + i + 1 (the prompt's last row predicts the first output token)."""
        ids = seq.prompt.ids[start + 1:start + 1 + len(hidden)]  # [m <= n]: the tokens the rows predict
        top_n, entries = seq.request.prompt_logprobs, []
        for logits in self.runner.logits_rows(hidden[:len(ids)]):  # [r, V] each, in order
            check_finite(logits)
            logp = logits.log_softmax(-1)
            targets = ids[len(entries):len(entries) + len(logp)]
            chosen = logp.gather(1, torch.tensor(targets, device=logp.device)[:, None])[:, 0].tolist()  # [r]
            if top_n:  # the rows' top entries, converted once per chunk
                top = logp.topk(top_n)
                best = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
            else:
                best = [[] for _ in targets]
            entries += map(TokenLogprob, targets, chosen, best)
        return entries

    def _sample(self, seq: Sequence, logits: torch.Tensor, outputs: list) -> None:
        """Sample seq's next token from logits [1, V], take it, and emit the output."""
        params = seq.params
        _start_history(seq, logits)
        allowed = seq.mask.allowed() if seq.mask is not None else None
        token = sample(logits, params, seq.history, seq.generator, allowed)  # [1]
        if seq.history is not None:
            seq.history.update(token)
        token = int(token)
        if seq.mask is not None:
            seq.mask.advance(token)
        logprobs = [self._logprob(seq, logits[0], token)] if seq.request.logprobs is not None else None
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        self._emit(seq, seq.accept(token), [token], outputs, logprobs=logprobs)

    def _emit(self, seq: Sequence, text: str, tokens: list[int], outputs: list, logprobs=None,
              error: str | None = None, hidden: torch.Tensor | None = None) -> None:
        """Hand an output to its request (freeing the sequence first when it is the last)."""
        if seq.finish_reason is not None:
            if (seq.finish_reason in ("stop", "length") and self.prefix_cache is not None and seq.state is not None
                    and not seq.request.hidden_only):
                # the next turn of a conversation (or an agent's next call) continues from here
                self.prefix_cache.insert((seq.key + seq.tokens)[:seq.state.length], seq.state)
            self.scheduler.finish(seq)
            seq.state = seq.history = seq.vision_embeds = seq.draft_state = seq.mask = None
            seq.mtp_pending, seq.mtp_count = [], 0
            with self._lock:
                self._sequences.pop(seq.request_id, None)
        out = seq.output(text, tokens, logprobs, error)
        out.hidden = hidden
        outputs.append(out)
        try:
            seq.sink(out)
        except Exception:  # a consumer's failure must not stop the engine: cancel what it was consuming
            traceback.print_exc(file=sys.stderr)
            if seq.finish_reason is None:
                self._aborts.append(seq.request_id)

