"""The engine runs in its own thread; handlers live on the event loop. `submit` adds requests from a worker thread
(tokenizing, rendering the template and reading images happen there) and hands their outputs back through one
asyncio queue; a submission that is left before it finished cancels what it started."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool

from qwenrt.engine import Request, RequestHandle, RequestOutput
from qwenrt.server.errors import from_engine
from qwenrt.server.metrics import RequestTimer


class Submission:
    """Requests added together (the choices of one HTTP request) and their outputs as (choice index, output)."""

    def __init__(self, engine, metrics):
        self.engine, self.metrics = engine, metrics
        self.handles: list[RequestHandle] = []
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._open: set[str] = set()

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
            timer.observe(out)
            loop.call_soon_threadsafe(queue.put_nowait, (index, out))
        return sink

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every request until all have finished."""
        while self._open:
            index, out = await self._queue.get()
            if out.finished:
                self._open.discard(out.request_id)
            yield index, out

    def abort(self) -> None:
        """Cancel what has not finished (the engine ends each with an "abort" output)."""
        for request_id in list(self._open):
            self.engine.abort(request_id)


async def submit(engine, metrics, requests: list[Request]) -> Submission:
    """Add requests to the engine; raises APIError (400 bad request, 429 queue full)."""
    submission = Submission(engine, metrics)
    try:
        await run_in_threadpool(submission._add, requests)
    except Exception as e:
        raise from_engine(e) from None
    return submission


async def abort_on_disconnect(receive, submission: Submission) -> None:
    """Wait for the client to go away, then cancel its requests (run as a task beside the response)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    submission.abort()
