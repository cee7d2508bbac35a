"""Every failure in OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}` (code: the HTTP status,
as vLLM sends it, or OpenAI's string where clients act on one: "context_length_exceeded"), with the status that
says whose fault it is. Bad input is never a 500."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from qwenrt.errors import ContextLengthError, QueueFullError, QwenrtError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The body of an error; text echoed from a request (a lone surrogate UTF-8 cannot hold) is escaped."""
    return {"error": {"message": _encodable(message), "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": _encodable(param), "code": status if code is None else code}}


def _encodable(text: str | None) -> str | None:
    return text if text is None else text.encode("utf-8", "backslashreplace").decode()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def context_length_error(limit: int, prompt_tokens: int, field: str, counted: bool = True,
                         max_tokens: int | None = None, max_tokens_field: str = "max_tokens") -> APIError:
    """A request over the context, worded as OpenAI and vLLM word it: LangChain acts on the code, LiteLLM on the
    message's first sentence. `field` holds the prompt (messages, prompt); with `max_tokens`, the prompt fits alone."""
    head = f"This model's maximum context length is {limit} tokens. However, "
    if max_tokens is None:
        count = f"{prompt_tokens} tokens (at most {limit - 1}: the answer needs one)" if counted else \
            f"more than {prompt_tokens - 1} tokens"
        detail = f"your {field} resulted in {count}. Please reduce the length of the {field}."
    else:
        detail = (f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {field}, {max_tokens} "
                  f"in the completion: {max_tokens_field}). Please reduce the length of the {field} or "
                  f"{max_tokens_field}.")
    return APIError(400, head + detail, field, "context_length_exceeded")


def from_engine(e: Exception, prompt_field: str | None = None, max_tokens_field: str = "max_tokens",
                fields: Mapping[str, str] = MappingProxyType({})) -> APIError:
    """An engine refusal as an API error: a full queue is 429, any other QwenrtError is the request's fault, named
    by the field it names (as `fields` maps the engine's names to the request's), else by the field that holds what
    was refused (`prompt_field`: the prompt's, which most engine checks are about)."""
    if isinstance(e, QueueFullError):
        return APIError(429, str(e))
    if isinstance(e, ContextLengthError) and prompt_field is not None:
        return context_length_error(e.limit, e.prompt_tokens, prompt_field, e.counted)
    if isinstance(e, QwenrtError):
        named = {"max_tokens": max_tokens_field, **fields}
        param = named.get(e.field, e.field) if e.field else prompt_field
        return APIError(400, str(e), param)
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
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        return error_response(400, *_validation_message(e))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(QwenrtError)
    async def engine_error(_: Request, e: QwenrtError):
        error = from_engine(e)
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # a bug of ours, still in the shape clients parse
        response = error_response(500, f"internal error: {type(e).__name__}: {e}")
        request_id = getattr(request.state, "request_id", None)  # Starlette answers this one outside the middleware
        if request_id is not None:
            response.headers["x-request-id"] = request_id
        return response
