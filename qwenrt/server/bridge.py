"""The engine runs in its own thread; handlers live on the event loop. `submit` adds requests from a worker thread
(tokenizing, rendering the template and reading images happen there) and hands their outputs back through one
asyncio queue; a submission that is left before it finished cancels what it started. A server that stops cuts
every submission under way: each request ends as cancelled, with the reason as its error."""

from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from starlette.concurrency import run_in_threadpool

from qwenrt.engine import Request, RequestHandle, RequestOutput, TokenLogprob
from qwenrt.server.errors import APIError, error_body, from_engine
from qwenrt.server.metrics import RequestTimer
from qwenrt.server.responses import SSE_DONE, LogprobCollector, sse
from qwenrt.server.structured import ENGINE_FIELDS


class Submission:
    """Requests added together (the choices of one HTTP request) and their outputs as (choice index, output)."""

    def __init__(self, engine, metrics):
        self.engine, self.metrics = engine, metrics
        self.handles: list[RequestHandle] = []
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._open: set[str] = set()
        self.cut_reason: str | None = None  # why the server ended these requests (see `cut`)

    def _add(self, requests: list[Request]) -> None:
        """In a worker thread: add every request, or none (the ones already added are cancelled)."""
        try:
            for index, request in enumerate(requests):
                self.handles.append(self.engine.add_request(request, self._sink(index)))
                self._open.add(request.request_id)
        except BaseException:
            self.abort()
            raise

    def _sink(self, index: int):
        timer = RequestTimer(self.metrics)
        loop, queue = self._loop, self._queue

        def sink(out: RequestOutput) -> None:  # the engine thread
            try:
                timer.observe(out)
            except Exception:  # noqa: BLE001 (a metrics bug must not cancel the request: the engine would)
                traceback.print_exc(file=sys.stderr)
            loop.call_soon_threadsafe(queue.put_nowait, (index, out))
        return sink

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every request until all have finished."""
        while self._open:
            index, out = await self._queue.get()
            if out.finished:
                self._open.discard(out.request_id)
            if out.finish_reason == "abort" and self.cut_reason is not None:
                out = replace(out, error=self.cut_reason)
            yield index, out

    def abort(self) -> None:
        """Cancel what has not finished (the engine ends each with an "abort" output)."""
        for request_id in list(self._open):
            self.engine.abort(request_id)

    def cut(self, reason: str) -> None:
        """End what has not finished now, `reason` becoming its error (the server is stopping: its clients are told
        rather than waited for)."""
        self.cut_reason = reason
        self.abort()


async def submit(state, requests: list[Request], prompt_field: str | None = None,
                 max_tokens_field: str = "max_tokens") -> Submission:
    """Add requests to the server's engine; raises APIError (400 bad request naming the field, the engine's names
    mapped to the request's by ENGINE_FIELDS; 429 queue full). The submission is one the server cuts when it stops."""
    submission = Submission(state.engine, state.metrics)
    try:
        await run_in_threadpool(submission._add, requests)
    except Exception as e:
        raise from_engine(e, prompt_field, max_tokens_field, ENGINE_FIELDS) from None
    state.track(submission)
    return submission


async def _abort_on_disconnect(receive, submission: Submission) -> None:
    """Wait for the client to go away, then cancel its requests (run as a task beside the response)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    submission.abort()


def failure(out: RequestOutput) -> tuple[int, str]:
    """(status, message) of a request that ended without an answer: failed (500) or cancelled (503)."""
    if out.finish_reason == "error":
        return 500, out.error or "generation failed"
    return 503, out.error or "the request was cancelled"


def failure_body(out: RequestOutput) -> dict:
    """The error event of a request that ended without an answer."""
    return error_body(*failure(out))


@dataclass
class Finished:
    """One choice, run to its end."""

    text: str
    last: RequestOutput
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # every sampled token, a stop token included
    scored: RequestOutput | None = None  # the output that carried the prompt's logprobs (where asked for)


async def collect(submission: Submission, receive) -> list[Finished]:
    """Every choice's whole output; cancelled if the client goes away first. An engine failure is a 500."""
    n = len(submission.handles)
    texts, last, logprobs = [[] for _ in range(n)], [None] * n, [LogprobCollector() for _ in range(n)]
    scored = [None] * n
    token_ids = [[] for _ in range(n)]
    watcher = asyncio.create_task(_abort_on_disconnect(receive, submission))
    try:
        async for i, out in submission.outputs():
            texts[i].append(out.text)
            token_ids[i] += out.token_ids
            logprobs[i].add(out)
            last[i] = out
            if out.prompt_logprobs is not None:
                scored[i] = out
    finally:
        watcher.cancel()
        submission.abort()
    for out in last:
        if out.finish_reason in ("error", "abort"):
            raise APIError(*failure(out))
    return [Finished("".join(t), o, lp.entries, ids, s)
            for t, o, lp, ids, s in zip(texts, last, logprobs, token_ids, scored)]


async def event_stream(events: AsyncIterator[str], submission: Submission, receive, done: bool = True
                       ) -> AsyncIterator[str]:
    """A submission's server-sent events, then [DONE] (`done` False: none, as the Responses API ends). The requests
    are cancelled when the client goes away (or the stream stops early); a failure of ours mid-stream becomes an
    error event rather than a cut connection."""
    watcher = asyncio.create_task(_abort_on_disconnect(receive, submission))
    try:
        async for event in events:
            yield event
        if done:
            yield SSE_DONE
    except Exception as e:  # noqa: BLE001 (the status line is sent: an error event is all that is left)
        yield sse(error_body(500, f"internal error: {type(e).__name__}: {e}"))
    finally:
        watcher.cancel()
        submission.abort()
