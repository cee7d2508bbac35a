"""The `x-request-id` header: the client's echoed on every response (errors and streams included), or a fresh one,
so a client's logs and the server's can be matched."""

from __future__ import annotations

import re
import uuid

from qwenrt.server.errors import error_response

HEADER = "x-request-id"
MAX_CHARS = 256
_VALID = re.compile(rb"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")  # printable ASCII, no spaces at the ends


class RequestId:
    """ASGI middleware, outermost but for Starlette's own 500 handler (which reads the id from the request's state).
    A client's id that is not 1 to MAX_CHARS printable ASCII characters is a 400: echoing it would put control
    characters or a megabyte into our headers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(HEADER.encode())
        valid = given is None or (len(given) <= MAX_CHARS and _VALID.fullmatch(given) is not None)
        request_id = given if given is not None and valid else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER.encode(), request_id)]
            await send(message)

        if not valid:
            response = error_response(400, f"the {HEADER} header must be 1 to {MAX_CHARS} printable ASCII characters",
                                      HEADER)
            return await response(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)
