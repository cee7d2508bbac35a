"""POST /v1/completions: raw prompts (text or token ids, one or a list) -> engine requests (prompts × n choices)
-> a text_completion, or its chunks as server-sent events.

echo: each choice's text starts with its prompt (as given; token ids decoded), and with logprobs its logprobs start
with the prompt's tokens, the first with null logprobs (vLLM's shape); max_tokens 0 (echo only) scores the prompt
and generates nothing. A stream sends the prompt in each choice's first chunk."""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from qwenrt.engine import Request, RequestOutput
from qwenrt.server.bridge import Submission, collect, event_stream, failure_body, submit
from qwenrt.server.errors import APIError, context_length_error
from qwenrt.server.params import check_context, choice_params
from qwenrt.server.protocol import CompletionRequest
from qwenrt.server.responses import (LogprobCollector, completion_logprobs, joined_logprobs, new_id, next_offset, now,
                                    sse, usage)
from qwenrt.server.structured import constraint_options


def _prompts(body: CompletionRequest, max_model_len: int) -> list:
    """A list of prompts, each a string or a list of token ids; token ids counted before each is checked."""
    prompt = body.prompt
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    for ids in prompts:
        if not isinstance(ids, str) and len(ids) >= max_model_len:
            raise context_length_error(max_model_len, len(ids), "prompt")
    return prompts


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """What an engine request scores of its prompt: with echo, what logprobs asks for; max_tokens 0 needs scoring
    (the engine generates nothing only for a request that scores its prompt)."""
    if body.echo and body.logprobs is not None:
        return body.logprobs
    return 0 if body.echo and body.max_tokens == 0 else None


async def completions(body: CompletionRequest, http: HTTPRequest, state):
    name = state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt scored, nothing generated)",
                       "max_tokens")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (qwenrt does not rank extra samples)", "best_of")
    prompts = _prompts(body, state.max_model_len)
    params = choice_params(body, state.tokenizer, body.max_tokens, state.max_model_len,
                           constraint_options(body.response_format))
    request_id = new_id("cmpl")
    requests = [Request(prompt, p, logprobs=body.logprobs, prompt_logprobs=_prompt_logprobs(body),
                        request_id=f"{request_id}-{k}-{j}", adapter=state.adapter(name))
                for k, prompt in enumerate(prompts) for j, p in enumerate(params)]
    submission = await submit(state, requests, "prompt")
    try:
        check_context(submission.handles, body.max_tokens, state.max_model_len, "prompt", "max_tokens")
    except APIError:
        submission.abort()
        raise
    reply = _Reply(request_id, name, body, prompts, submission, state.tokenizer)
    if body.stream:
        return StreamingResponse(event_stream(reply.events(), submission, http.receive), media_type="text/event-stream")
    return await reply.collect(http.receive)


class _Reply:
    def __init__(self, request_id: str, model: str, body: CompletionRequest, prompts: list, submission: Submission,
                 tokenizer):
        self.id, self.model, self.body, self.submission, self.tokenizer = request_id, model, body, submission, tokenizer
        self.prompts = prompts  # choice i is of prompt i // n
        self.created = now()
        # each prompt counted once, whatever n
        self.prompt_tokens = sum(h.prompt_tokens for h in submission.handles[::body.n])

    def _body(self, choices: list[dict], last: list[RequestOutput] | None) -> dict:
        """A response body; with usage over the choices' latest outputs when `last` is given."""
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
               "choices": choices}
        if last is not None:  # each prompt's cached tokens counted once, whatever n
            out["usage"] = usage(self.prompt_tokens, sum(o.generation_tokens for o in last),
                                 sum(o.cached_tokens for o in last[::self.body.n]))
        return out

    def _logprobs(self, entries, offset: int) -> dict | None:
        return completion_logprobs(self.tokenizer, entries, offset) if self.body.logprobs is not None else None

    def _choice(self, i: int, text: str, entries, offset: int, scored: RequestOutput | None) -> tuple[str, dict | None]:
        """Choice i's text and logprobs for `entries` at `offset`; with echo its prompt comes first, from offset 0,
        with the logprobs `scored` carries (the choice's first output)."""
        if not self.body.echo:
            return text, self._logprobs(entries, offset)
        prompt = self.prompts[i // self.body.n]
        head = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        if self.body.logprobs is None or scored is None or scored.prompt_logprobs is None:
            return head + text, self._logprobs(entries, 0)
        head_lp = completion_logprobs(self.tokenizer, scored.prompt_logprobs, 0, scored.prompt_token_ids)
        return head + text, joined_logprobs(head_lp, self._logprobs(entries, next_offset(head_lp, 0)))

    async def collect(self, receive) -> dict:
        finished = await collect(self.submission, receive)
        choices = []
        for i, done in enumerate(finished):
            text, logprobs = self._choice(i, done.text, done.logprobs, 0, done.scored)
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": done.last.finish_reason})
        return self._body(choices, [d.last for d in finished])

    async def events(self):
        n = len(self.submission.handles)
        logprobs, latest, offsets = [LogprobCollector() for _ in range(n)], [None] * n, [0] * n
        started = [False] * n  # a choice's first chunk sent (with echo, it carries the prompt)
        async for i, out in self.submission.outputs():
            if out.finish_reason in ("error", "abort"):
                yield sse(failure_body(out))
                continue
            latest[i] = out
            entries = logprobs[i].add(out)
            if not (out.text or entries or out.finished or (self.body.echo and not started[i])):
                continue
            text, lp = (self._choice(i, out.text, entries, offsets[i], out) if not started[i]
                        else (out.text, self._logprobs(entries, offsets[i])))
            started[i] = True
            if lp is not None:
                offsets[i] = next_offset(lp, offsets[i])
            yield sse(self._body([{"index": i, "text": text, "logprobs": lp,
                                   "finish_reason": out.finish_reason}], None))
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield sse(self._body([], latest))
