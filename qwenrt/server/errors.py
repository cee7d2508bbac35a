"""Every failure in OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}` (code: the HTTP status,
as vLLM sends it), with the status that says whose fault it is. Bad input is never a 500."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from qwenrt.errors import QueueFullError, QwenrtError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The body of an error; text echoed from a request (a lone surrogate UTF-8 cannot hold) is escaped."""
    return {"error": {"message": _encodable(message), "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": _encodable(param), "code": status}}


def _encodable(text: str | None) -> str | None:
    return text if text is None else text.encode("utf-8", "backslashreplace").decode()


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def from_engine(e: Exception, fields: Mapping[str, str] = MappingProxyType({})) -> APIError:
    """An engine refusal as an API error: a full queue is 429, any other QwenrtError is the request's fault (its
    param: the field the engine names, as `fields` maps it to the request's)."""
    if isinstance(e, QueueFullError):
        return APIError(429, str(e))
    if isinstance(e, QwenrtError):
        return APIError(400, str(e), fields.get(e.field, e.field))
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list"}


def _location(loc) -> str:
    """pydantic's error location ('body', 'messages', 0, 'content') as a field path: messages[0].content."""
    path = ""
    for part in loc:
        if (part == "body" and not path) or (isinstance(part, str) and _names_a_type(part)):
            continue  # the body itself, or pydantic's name for a member of a union
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _names_a_type(part: str) -> bool:
    """A union member's tag: "list[int]", "str", a model's class name; API fields are lower-case identifiers."""
    return not part.isidentifier() or part in _TYPE_NAMES or part[:1].isupper()


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    errors = e.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = _location(first.get("loc", ())) or None
    if param is None:
        return "the request body must be a JSON object with the endpoint's fields", None
    # a union field (prompt, content, stop) fails once per alternative: say what each wanted
    field = param.split(".")[0].split("[")[0]
    reasons = dict.fromkeys(err.get("msg", "invalid value") for err in errors
                            if (_location(err.get("loc", ())) or "").startswith(field))
    return f"{param}: {' or '.join(list(reasons)[:4])}", param


def install(app) -> None:
    """Exception handlers that answer in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        return error_response(400, *_validation_message(e))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(QwenrtError)
    async def engine_error(_: Request, e: QwenrtError):
        error = from_engine(e)
        return error_response(error.status, error.message)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception):  # a bug of ours, still in the shape clients parse
        return error_response(500, f"internal error: {type(e).__name__}: {e}")
