"""The Python API's fronts on the engine: `stream_generate` yields a `GenerationResponse` per sampled token;
`generate` returns the text; `complete` and `batch_generate` return `Completion`s (reasoning, content and tool
calls split out). Each takes a model (its default engine is used, made on first use) or an `Engine`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields

from qwenrt.engine import Engine, Request, RequestOutput, RequestStream
from qwenrt.engine.request import DraftCounts, TokenLogprob
from qwenrt.errors import QwenrtError
from qwenrt.model import Qwen35ForCausalLM
from qwenrt.parsing import ToolCall, parse_completion
from qwenrt.sampling import SamplingParams
from qwenrt.tokenizer import Tokenizer
from qwenrt.validation import check_prompt_list


@dataclass
class GenerationResponse:
    """One sampled token: the text it completes (empty while a character or stop string is pending)."""

    text: str
    token: int  # the sampled token (an end-of-sequence token on a "stop" finish; it is not in the text)
    finish_reason: str | None  # None while generating; "stop" or "length" on the last response
    prompt_tokens: int
    generation_tokens: int
    time_to_first_token: float  # seconds
    prompt_tps: float  # prompt tokens computed (not restored from the prefix cache) per second
    generation_tps: float
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    drafts: DraftCounts | None = None  # speculative decoding so far (None: not speculating)


@dataclass
class Completion:
    """A finished generation."""

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    reasoning: str | None = None
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    time_to_first_token: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    cached_tokens: int = 0
    drafts: DraftCounts | None = None
    # with prompt_logprobs=n: one per prompt token (the first None), and the prompt's ids they refer to
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None

    @property
    def generation_tokens(self) -> int:
        return len(self.tokens)


def _params(params: SamplingParams | None, sampling: dict) -> SamplingParams:
    if params is not None and sampling:
        raise QwenrtError("pass either params=SamplingParams(...) or sampling keyword arguments, not both")
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise QwenrtError(f"params must be a SamplingParams, got {type(params).__name__}")
        return params
    unknown = sorted(sampling.keys() - {f.name for f in fields(SamplingParams)})
    if unknown:
        raise QwenrtError(f"unknown generation option(s): {', '.join(unknown)}")
    try:
        return SamplingParams(**sampling)
    except TypeError as e:  # a value of the wrong type that SamplingParams's checks did not name
        raise QwenrtError(f"invalid generation option: {e}") from None


def _engine(model, tokenizer) -> Engine:
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise QwenrtError(f"tokenizer must be the Tokenizer qwenrt.load returned (or None), got "
                          f"{type(tokenizer).__name__}")
    if not isinstance(model, (Engine, Qwen35ForCausalLM)):
        raise QwenrtError(f"model must be the model qwenrt.load returned or an Engine, got {type(model).__name__}")
    if isinstance(model, Engine):
        if tokenizer is not None and tokenizer is not model.tokenizer:
            raise QwenrtError("this engine was made with another tokenizer")
        return model
    return Engine.for_model(model, tokenizer)


def _submit(model, tokenizer, prompt, params, enable_thinking, tools, prefill_chunk, max_context,
            on_prefill=None, speculative_tokens=None, tool_choice=None, parallel_tool_calls=True,
            prompt_logprobs=None, adapter=None) -> RequestStream:
    return _engine(model, tokenizer).submit(Request(prompt, params, enable_thinking, tools, tool_choice=tool_choice,
                                                    parallel_tool_calls=parallel_tool_calls,
                                                    prefill_chunk=prefill_chunk, max_context=max_context,
                                                    on_prefill=on_prefill,
                                                    speculative_tokens=speculative_tokens,
                                                    prompt_logprobs=prompt_logprobs, adapter=adapter))


def _rates(out: RequestOutput) -> tuple[float, float, float]:
    """(time to first token, prompt tokens/s, generated tokens/s after the first) of an output."""
    if out.first_token_time is None:
        return 0.0, 0.0, 0.0
    ttft = out.first_token_time - out.arrival_time
    prefill = out.first_token_time - (out.prefill_start_time or out.arrival_time)
    after = out.time - out.first_token_time
    computed = out.prompt_tokens - out.cached_tokens
    return ttft, computed / max(prefill, 1e-9), max(out.generation_tokens - 1, 0) / max(after, 1e-9)


def _checked(out: RequestOutput) -> RequestOutput:
    if out.finish_reason == "error":
        raise QwenrtError(out.error)
    return out


def stream_generate(model, tokenizer, prompt, *, params: SamplingParams | None = None,
                    enable_thinking: bool | None = None, tools=None, tool_choice=None, parallel_tool_calls: bool = True,
                    prefill_chunk: int | None = None, max_context: int | None = None, on_prefill=None,
                    speculative_tokens: int | str | None = None, adapter: str | None = None,
                    **sampling) -> Iterator[GenerationResponse]:
    """Generate for one prompt, yielding text deltas as they complete. The last response has finish_reason set.

    sampling: SamplingParams fields (max_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
    presence_penalty, frequency_penalty, seed, stop, stop_token_ids, ignore_eos; an output constraint: json_schema,
    json_object, regex or grammar). tool_choice: "auto" (default), "none", "required" (the answer is a call to one
    of `tools`) or {"type": "function", "function": {"name": NAME}} (a call to NAME). on_prefill(done, total) is
    called after each prompt chunk. speculative_tokens: drafts verified per step (0 off, k, "auto"; default the
    engine's: "auto", which speculates with the model's MTP head where that pays). With speculation one response
    may complete several tokens (`token` is the last). adapter: the name of a LoRA adapter the model serves
    (`qwenrt.load(..., adapters={name: directory})`) to run with (default: the model's own, if any). Leaving the loop
    early cancels.
    """
    if on_prefill is not None and not callable(on_prefill):
        raise QwenrtError(f"on_prefill must be a function (done, total), got {type(on_prefill).__name__}")
    stream = _submit(model, tokenizer, prompt, _params(params, sampling), enable_thinking, tools, prefill_chunk,
                     max_context, on_prefill, speculative_tokens, tool_choice, parallel_tool_calls, adapter=adapter)
    for out in stream:
        if not _checked(out).token_ids:  # nothing sampled (cancelled)
            continue
        yield GenerationResponse(out.text, out.token_ids[-1], out.finish_reason, out.prompt_tokens,
                                 out.generation_tokens, *_rates(out), out.cached_tokens, out.drafts)


def batch_generate(model, tokenizer, prompts: Sequence, *, params: SamplingParams | None = None,
                   enable_thinking: bool | None = None, tools=None, tool_choice=None, parallel_tool_calls: bool = True,
                   prefill_chunk: int | None = None, max_context: int | None = None,
                   speculative_tokens: int | str | None = None, prompt_logprobs: int | None = None,
                   adapter: str | Sequence | None = None, **sampling) -> list[Completion]:
    """Generate for several prompts at once (decoded together by the engine); results in prompt order.

    prompt_logprobs=n: each Completion also carries every prompt token's log-probability given the tokens before it
    (the first token has none) with the n most likely tokens there; max_tokens=0 then only scores the prompts.
    adapter: a served adapter's name for every prompt, or a list of one name (or None) per prompt: prompts of
    different adapters run in the same batched steps."""
    check_prompt_list(prompts)
    params = _params(params, sampling)
    names = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * len(prompts)
    if len(names) != len(prompts):
        raise QwenrtError(f"adapter: {len(names)} names for {len(prompts)} prompts")
    streams: list[RequestStream] = []
    try:
        for prompt, name in zip(prompts, names):
            streams.append(_submit(model, tokenizer, prompt, params, enable_thinking, tools, prefill_chunk,
                                   max_context, speculative_tokens=speculative_tokens, tool_choice=tool_choice,
                                   parallel_tool_calls=parallel_tool_calls, prompt_logprobs=prompt_logprobs,
                                   adapter=name))
        results = []
        for stream in streams:
            sampled, text, first, last = [], [], None, None
            for last in stream:
                sampled += _checked(last).token_ids
                text.append(last.text)
                if first is None:
                    first = last
            # a stop token is sampled but not generated text: the generated tokens are the first ones
            results.append(_completion(stream, "".join(text), sampled[:last.generation_tokens], first, last, tools))
        return results
    finally:
        for stream in streams:  # after an error: nothing left running
            _engine(model, tokenizer).abort(stream.request_id)


def _completion(stream: RequestStream, text: str, tokens: list[int], first: RequestOutput, last: RequestOutput,
                tools) -> Completion:
    parsed = parse_completion(text, stream.thinking_started, tools)
    return Completion(text, tokens, last.finish_reason, stream.prompt_tokens, parsed.reasoning, parsed.content,
                      parsed.tool_calls, *_rates(last), last.cached_tokens, last.drafts, first.prompt_logprobs,
                      first.prompt_token_ids)


def complete(model, tokenizer, prompt, **options) -> Completion:
    """Generate for one prompt and return the whole `Completion` (text, reasoning/content, tool calls, usage)."""
    return batch_generate(model, tokenizer, [prompt], **options)[0]


def generate(model, tokenizer, prompt, **options) -> str:
    """Generate for one prompt and return the text. Options as for `stream_generate`."""
    return complete(model, tokenizer, prompt, **options).text
