"""What a connection may cost before the app sees a request: the API key and the body's size are checked on headers
and bytes, before anything parses the body; a request's headers and body must arrive in time; the connections held at
once are capped. One client that trickles, floods or guesses keys cannot starve the others."""

from __future__ import annotations

import asyncio
import resource
import secrets
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qwenrt.server.errors import APIError, error_response

DEFAULT_MAX_REQUEST_BYTES = 32 << 20
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_MAX_CONNECTIONS = 1024
MIN_BODY_RATE = 64 << 10  # bytes a second a body must keep up, past its first `header_timeout` seconds
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what --api-key guards (/health and /metrics stay open)


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds to send a request's headers; the body's grace period
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def default_max_connections() -> int:
    """DEFAULT_MAX_CONNECTIONS, or half the open-file limit when that is lower: the checkpoint, the cache folder and
    media files need the rest."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, soft // 2))


class RequestGate:
    """ASGI middleware in front of the app: a request to KEYED_PATHS without the API key is refused on its headers
    (its body never read); a body is read whole, up to `max_request_bytes` (413 past it, announced or not) and at
    `MIN_BODY_RATE` after a grace period (408), then handed to the app."""

    def __init__(self, app, limits: Limits, api_key: str | None):
        self.app, self.limits = app, limits
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check_headers(scope)
            body = await self._read_body(receive)
        except APIError as e:
            response = error_response(e.status, e.message)
            response.headers["connection"] = "close"  # the rest of a refused body is not read
            return await response(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_headers(self, scope) -> None:
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith(KEYED_PATHS) and \
                not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limits.max_request_bytes:
            raise self._too_large()

    async def _read_body(self, receive) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.header_timeout
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body arrived slower than {MIN_BODY_RATE >> 10} KiB/s") from None
            if message["type"] == "http.disconnect":
                raise APIError(400, "the client went away while sending the request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_request_bytes:
                raise self._too_large()
            chunks.append(chunk)
            deadline += len(chunk) / MIN_BODY_RATE
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over the server's limit of {self.limits.max_request_bytes} "
                             "bytes (--max-request-bytes)")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with what it lacks: a connection over `max_connections` is closed as it opens, and one
    whose request headers are not all in `header_timeout` seconds after it opened (or after the first byte of a later
    request) is closed. uvicorn itself waits forever for headers: 160 half-sent requests starved /health."""

    limits = Limits()  # set by `guarded_protocol`

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._headers_due = None
        if len(self.connections) > self.limits.max_connections:
            transport.close()
            return
        self._expect_headers()

    def data_received(self, data: bytes) -> None:
        if self._headers_due is None and self.conn.their_state is h11.IDLE:
            self._expect_headers()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def connection_lost(self, exc) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
        super().connection_lost(exc)

    def _expect_headers(self) -> None:
        self._headers_due = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(limits: Limits) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn as `http=`, with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
