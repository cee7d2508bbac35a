"""POST /v1/completions: raw prompts (text or token ids, one or a list) -> engine requests (prompts × n choices)
-> a text_completion, or its chunks as server-sent events."""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from qwenrt.engine import Request, RequestOutput
from qwenrt.server.bridge import Submission, collect, event_stream, submit
from qwenrt.server.errors import APIError, context_length_error, error_body
from qwenrt.server.params import check_context, choice_params
from qwenrt.server.protocol import CompletionRequest
from qwenrt.server.responses import LogprobCollector, completion_logprobs, new_id, now, sse, usage
from qwenrt.server.structured import constraint_options


def _prompts(body: CompletionRequest, max_model_len: int) -> list:
    """A list of prompts, each a string or a list of token ids; token ids counted before each is checked."""
    prompt = body.prompt
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    for ids in prompts:
        if not isinstance(ids, str) and len(ids) >= max_model_len:
            raise context_length_error(max_model_len, len(ids), "prompt")
    return prompts


async def completions(body: CompletionRequest, http: HTTPRequest, state):
    name = state.check_model(body.model)
    for field, refused in (("echo", body.echo), ("suffix", body.suffix)):
        if refused:
            raise APIError(400, f"{field} is not supported", field)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (qwenrt does not rank extra samples)", "best_of")
    prompts = _prompts(body, state.max_model_len)
    params = choice_params(body, state.tokenizer, body.max_tokens, state.max_model_len,
                           constraint_options(body.response_format))
    request_id = new_id("cmpl")
    requests = [Request(prompt, p, logprobs=body.logprobs, request_id=f"{request_id}-{k}-{j}")
                for k, prompt in enumerate(prompts) for j, p in enumerate(params)]
    submission = await submit(state.engine, state.metrics, requests, "prompt")
    try:
        check_context(submission.handles, body.max_tokens, state.max_model_len, "prompt", "max_tokens")
    except APIError:
        submission.abort()
        raise
    reply = _Reply(request_id, name, body, submission, state.tokenizer)
    if body.stream:
        return StreamingResponse(event_stream(reply.events(), submission, http.receive), media_type="text/event-stream")
    return await reply.collect(http.receive)


class _Reply:
    def __init__(self, request_id: str, model: str, body: CompletionRequest, submission: Submission, tokenizer):
        self.id, self.model, self.body, self.submission, self.tokenizer = request_id, model, body, submission, tokenizer
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

    async def collect(self, receive) -> dict:
        finished = await collect(self.submission, receive)
        choices = [{"index": i, "text": done.text, "logprobs": self._logprobs(done.logprobs, 0),
                    "finish_reason": done.last.finish_reason} for i, done in enumerate(finished)]
        return self._body(choices, [d.last for d in finished])

    async def events(self):
        n = len(self.submission.handles)
        logprobs, latest, offsets = [LogprobCollector() for _ in range(n)], [None] * n, [0] * n
        async for i, out in self.submission.outputs():
            if out.finish_reason == "error":
                yield sse(error_body(500, out.error or "generation failed"))
                continue
            latest[i] = out
            entries = logprobs[i].add(out)
            if not (out.text or entries or out.finished):
                continue
            lp = self._logprobs(entries, offsets[i])
            if entries and lp is not None:
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            yield sse(self._body([{"index": i, "text": out.text, "logprobs": lp,
                                   "finish_reason": out.finish_reason}], None))
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield sse(self._body([], latest))
