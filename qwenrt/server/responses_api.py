"""POST /v1/responses, OpenAI's Responses API, stateless: instructions and input items become the chat messages the
template takes and run on the chat route's path (the same checks, sampling and engine requests); the answer leaves
as output items (reasoning, message, function calls) in a `response`, or as the typed server-sent events the SDKs
read. Nothing is kept, so `previous_response_id`, `background` and `conversation` are refused."""

from __future__ import annotations

import itertools
import re
import uuid
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from qwenrt.parsing import THINK_END
from qwenrt.server.bridge import Submission, collect, event_stream, failure
from qwenrt.server.chat import submit_chat
from qwenrt.server.errors import APIError
from qwenrt.server.protocol import (ChatCompletionRequest, FunctionCallInput, FunctionCallOutputInput, InputMessage,
                                    ReasoningInput, ResponsesRequest)
from qwenrt.server.responses import now, sse
from qwenrt.stream_parser import MessageDelta, MessageStream

_ITEM_TYPES = {"message": InputMessage, "function_call": FunctionCallInput,
               "function_call_output": FunctionCallOutputInput, "reasoning": ReasoningInput}
_TEXT_PARTS = ("input_text", "output_text")
_INCLUDES = ("reasoning.encrypted_content",)  # nothing is encrypted: the reasoning comes back as text
_THINKING_OFF = ("none", "minimal")
# chat field -> the Responses field it came from (longest first), for errors the chat route raises
_CHAT_FIELDS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("tool_choice.function", "tool_choice"),
                ("messages", "input"))


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request -> chat messages and fields --------------------------------------------------------------------

def _check_stateless(body: ResponsesRequest) -> None:
    """Refuse what needs state or features qwenrt does not have, naming the field."""
    refused = {"previous_response_id": "qwenrt keeps no responses; send the whole conversation as input items",
               "conversation": "qwenrt keeps no conversations; send the whole conversation as input items",
               "background": "responses run in the foreground only", "prompt": "qwenrt has no stored prompts",
               "top_logprobs": "log-probabilities are not offered on /v1/responses"}
    for name, why in refused.items():
        if getattr(body, name) not in (None, False):
            raise APIError(400, f"{name} is not supported ({why})", name)
    if body.truncation == "auto":
        raise APIError(400, "truncation: only 'disabled' is supported (qwenrt does not drop input items; a request "
                            "that does not fit fails)", "truncation")
    for k, include in enumerate(body.include or ()):
        if include not in _INCLUDES:
            raise APIError(400, f"include[{k}]: {include!r} is not supported (supported: {', '.join(_INCLUDES)})",
                           f"include[{k}]")


def _validated(model: type[BaseModel], item: dict, path: tuple):
    """The item as `model`; a bad field is a 400 naming it under `path` (as the body's own fields are named)."""
    try:
        return model.model_validate(item)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *path, *err["loc"])} for err in e.errors()]) from None


_SYSTEM = ("system", "developer")


def _text(content: str | list[dict]) -> str:
    """A system message's content as one text (a system turn holds text only)."""
    return content if isinstance(content, str) else "".join(p.get("text") or "" for p in content)


def _parts(content: str | list[dict], path: str) -> str | list[dict]:
    """Responses content parts as chat parts, one for one (so a chat error's part index names the same part)."""
    if isinstance(content, str):
        return content
    parts = []
    for p, part in enumerate(content):
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image" and part.get("image_url") is None and part.get("file_id") is not None:
            param = f"{path}[{p}].file_id"
            raise APIError(400, f"{param}: files are not supported (qwenrt has no file store); send image_url as a "
                                "data: URI or a URL", param)
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": part.get("image_url")})
        else:
            param = f"{path}[{p}].type"
            raise APIError(400, f"{param}: unsupported content part type {kind!r} (input_text, input_image, "
                                "output_text)", param)
    return parts


@dataclass
class _Origins:
    """Where each chat message came from in the request, so that a field the chat route refuses is named as the
    client sent it."""

    messages: list[str] = field(default_factory=list)  # message m's item: "instructions", "input", "input[3]"
    contents: list[str] = field(default_factory=list)  # its content: "input[3].content", "input[4].output"
    calls: dict[tuple[int, int], str] = field(default_factory=dict)  # (message, call) -> the function_call item

    def rename(self, e: APIError) -> APIError:
        """`e` with its param, and the chat fields its message names, in the Responses request's terms."""
        if e.param is not None:
            ours = self._param(e.param)
            e.message, e.param = e.message.replace(e.param, ours), ours
        for chat, ours in _CHAT_FIELDS:
            e.message = re.sub(rf"\b{re.escape(chat)}\b", ours, e.message)
        return e

    def _param(self, param: str) -> str:
        if m := re.match(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\]\.function|(\.content))?", param):
            n = int(m[1])
            head = self.calls[n, int(m[2])] if m[2] else self.contents[n] if m[3] else self.messages[n]
            return head + param[m.end():]
        if m := re.match(r"tools\[\d+\]\.function", param):
            return m[0].removesuffix(".function") + param[m.end():]
        for chat, ours in _CHAT_FIELDS:
            if param == chat or param.startswith((chat + ".", chat + "[")):
                return ours + param[len(chat):]
        return param


class _Conversation:
    """Chat messages built item by item: one assistant turn gathers the reasoning, message and function_call items
    that follow each other (as the template renders one turn); a function_call_output is a `tool` message."""

    def __init__(self):
        self.messages: list[dict] = []
        self.origins = _Origins()

    def add(self, message: dict, path: str, content_path: str) -> None:
        self.messages.append(message)
        self.origins.messages.append(path)
        self.origins.contents.append(content_path)

    def _turn(self) -> dict | None:
        """The assistant turn the next assistant item may join."""
        last = self.messages[-1] if self.messages else None
        return last if last is not None and last["role"] == "assistant" else None

    def item(self, raw: dict, i: int) -> None:
        path = f"input[{i}]"
        kind = raw.get("type", "message" if "role" in raw else None)
        if not isinstance(kind, str) or kind not in _ITEM_TYPES:
            raise APIError(400, f"{path}.type: unsupported input item type {kind!r} ({', '.join(_ITEM_TYPES)})",
                           f"{path}.type")
        item = _validated(_ITEM_TYPES[kind], raw, ("input", i))
        if kind == "message":
            self._message(item, path)
        elif kind == "function_call":
            self._call(item, path)
        elif kind == "function_call_output":
            self.add({"role": "tool", "tool_call_id": item.call_id, "content": _parts(item.output, f"{path}.output")},
                     path, f"{path}.output")
        else:
            texts = [t.text for t in item.content or item.summary]
            self.add({"role": "assistant", "content": "", "reasoning_content": "\n".join(texts)}, path,
                     f"{path}.content")

    def _message(self, item: InputMessage, path: str) -> None:
        content = _parts(item.content, f"{path}.content")
        if item.role in _SYSTEM and self.messages and all(m["role"] in _SYSTEM for m in self.messages):
            # instructions and the system/developer items after them (Codex CLI sends both): one system turn, the
            # only place the chat template takes one
            first = self.messages[0]
            first["content"] = _text(first["content"]) + "\n\n" + _text(content)
            return
        turn = self._turn()
        if item.role == "assistant" and turn is not None and not turn["content"] and "tool_calls" not in turn:
            turn["content"] = content  # the answer after a reasoning item
            self.origins.messages[-1], self.origins.contents[-1] = path, f"{path}.content"
        else:
            self.add({"role": item.role, "content": content}, path, f"{path}.content")

    def _call(self, item: FunctionCallInput, path: str) -> None:
        if self._turn() is None:
            self.add({"role": "assistant", "content": ""}, path, f"{path}.content")
        calls = self.messages[-1].setdefault("tool_calls", [])
        self.origins.calls[len(self.messages) - 1, len(calls)] = path
        calls.append({"id": item.call_id, "type": "function",
                      "function": {"name": item.name, "arguments": item.arguments}})


def _conversation(body: ResponsesRequest) -> _Conversation:
    conversation = _Conversation()
    if body.instructions is not None:
        conversation.add({"role": "system", "content": body.instructions}, "instructions", "instructions")
    if isinstance(body.input, str):
        conversation.add({"role": "user", "content": body.input}, "input", "input")
    else:
        for i, item in enumerate(body.input):
            conversation.item(item, i)
    if not conversation.messages:
        raise APIError(400, "input: must not be empty", "input")
    return conversation


def _tools(body: ResponsesRequest) -> list[dict] | None:
    """Function tools in the chat shape; any other tool type is refused (qwenrt runs no tools itself)."""
    if body.tools is None:
        return None
    for i, tool in enumerate(body.tools):
        if tool.type != "function":
            raise APIError(400, f"tools[{i}].type: {tool.type!r} tools are not supported (only 'function' tools, "
                                "which the client runs)", f"tools[{i}].type")
        if tool.name is None:
            raise APIError(400, f"tools[{i}].name: a function tool needs a name", f"tools[{i}].name")
    return [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
            for tool in body.tools]


def _tool_choice(body: ResponsesRequest) -> str | dict | None:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise APIError(400, f"tool_choice.type: {choice.type!r} is not supported (a function tool: "
                            "{'type': 'function', 'name': ...})", "tool_choice.type")
    if not choice.name:
        raise APIError(400, "tool_choice.name: the function to call is needed", "tool_choice.name")
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(body: ResponsesRequest) -> dict | None:
    """text.format in chat's response_format shape."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    effort = body.reasoning.effort if body.reasoning is not None else None
    return ChatCompletionRequest.model_validate({
        "model": body.model, "messages": messages, "tools": _tools(body), "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "response_format": _response_format(body),
        "chat_template_kwargs": {"enable_thinking": None if effort is None else effort not in _THINKING_OFF},
        "user": body.user, "stream": body.stream})


async def responses(body: ResponsesRequest, http: HTTPRequest, state):
    name = state.check_model(body.model)
    _check_stateless(body)
    conversation = _conversation(body)
    try:
        _, submission, tools, parse_tools = await submit_chat(_chat_request(body, conversation.messages), state)
    except APIError as e:
        raise conversation.origins.rename(e) from None
    reply = _Reply(name, body, submission, tools if parse_tools else None, state.tokenizer.token_to_id(THINK_END))
    if body.stream:
        return StreamingResponse(event_stream(reply.events(), submission, http.receive, done=False),
                                 media_type="text/event-stream")
    return await reply.collect(http.receive)


# ---- the answer -> output items and events ----------------------------------------------------------------------

@dataclass
class _Item:
    """One output item as it grows. kind: reasoning, message or function_call; text: its text or arguments."""

    kind: str
    index: int  # output_index
    id: str
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    status: str = "in_progress"

    def part(self, text: str) -> dict:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def render(self, started: bool = False) -> dict:
        """The item as Response.output holds it; `started`: as output_item.added announces it (no content yet)."""
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                    "arguments": "" if started else self.text, "status": self.status}
        content = [] if started else [self.part(self.text)]
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": self.status}
        return {"id": self.id, "type": "message", "role": "assistant", "content": content, "status": self.status}

    def where(self) -> dict:
        """The fields an event about this item's content carries."""
        at = {"item_id": self.id, "output_index": self.index}
        return at if self.kind == "function_call" else at | {"content_index": 0}


_DELTA_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text",
                 "function_call": "response.function_call_arguments"}
_ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


class _Output:
    """Response.output built from the parser's deltas, and the events (dicts without sequence_number) that tell a
    streaming client. One item is open at a time: text of another kind, or a new call, closes it and opens the
    next (so reasoning, text and calls that alternate become items that alternate)."""

    def __init__(self):
        self.items: list[_Item] = []
        self._current: _Item | None = None
        self._calls: dict[int, _Item] = {}  # the parser's call index -> its item

    def feed(self, delta: MessageDelta) -> list[dict]:
        """The delta's parts in the order they were written: the rest of a call under way, reasoning, text, new
        calls."""
        events = []
        started = {call.index for call in delta.tool_calls if call.id is not None}
        for call in delta.tool_calls:
            if call.index not in started and self._calls.get(call.index) is self._current:
                self._append(call.arguments, events)
        for kind, text in (("reasoning", delta.reasoning), ("message", delta.content)):
            if text:
                if self._current is None or self._current.kind != kind:
                    self._start(kind, events)
                self._append(text, events)
        for call in delta.tool_calls:
            if call.index in started:
                if call.id is not None:
                    self._calls[call.index] = self._start("function_call", events, call_id=call.id, name=call.name)
                self._append(call.arguments, events)
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open item: `status` completed, or incomplete when the output was cut off."""
        return self._close(status)

    def output(self) -> list[dict]:
        return [item.render() for item in self.items]

    def _start(self, kind: str, events: list[dict], **fields) -> _Item:
        events += self._close("completed")
        item = self._current = _Item(kind, len(self.items), _new_id(_ID_PREFIXES[kind]), **fields)
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": item.index,
                       "item": item.render(started=True)})
        if kind != "function_call":
            events.append({"type": "response.content_part.added", **item.where(), "part": item.part("")})
        return item

    def _append(self, text: str, events: list[dict]) -> None:
        if not text:
            return
        item = self._current
        item.text += text
        event = {"type": f"{_DELTA_EVENTS[item.kind]}.delta", **item.where(), "delta": text}
        events.append(event if item.kind != "message" else event | {"logprobs": []})

    def _close(self, status: str) -> list[dict]:
        item, self._current = self._current, None
        if item is None:
            return []
        item.status = status
        done = {"type": f"{_DELTA_EVENTS[item.kind]}.done", **item.where()}
        finished = {"type": "response.output_item.done", "output_index": item.index, "item": item.render()}
        if item.kind == "function_call":
            return [done | {"arguments": item.text}, finished]
        done |= {"text": item.text} if item.kind == "reasoning" else {"text": item.text, "logprobs": []}
        return [done, {"type": "response.content_part.done", **item.where(), "part": item.part(item.text)}, finished]


def _reasoning_tokens(token_ids: list[int], generation_tokens: int, thinking_started: bool, think_end) -> int:
    """Generated tokens before </think>; all of them when the prompt opened thinking and it never closed."""
    if think_end is not None and think_end in token_ids:
        return token_ids.index(think_end)
    return generation_tokens if thinking_started else 0


class _Reply:
    """The answer to one Responses request, whole or streamed."""

    def __init__(self, model: str, body: ResponsesRequest, submission: Submission, tools: list[dict] | None,
                 think_end: int | None):
        self.model, self.body, self.submission, self.tools, self.think_end = model, body, submission, tools, think_end
        self.id, self.created = _new_id("resp"), now()
        self.handle = submission.handles[0]

    def _usage(self, last, token_ids: list[int]) -> dict:
        prompt, generated = self.handle.prompt_tokens, last.generation_tokens
        reasoning = _reasoning_tokens(token_ids, generated, self.handle.thinking_started, self.think_end)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": last.cached_tokens},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + generated}

    def response(self, status: str, output: list[dict], usage: dict | None = None, error: str | None = None) -> dict:
        """The response object; the request's settings echoed as OpenAI echoes them."""
        body = self.body
        reasoning = body.reasoning.model_dump() if body.reasoning is not None else {"effort": None, "summary": None}
        choice = body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None else \
            body.tool_choice.model_dump(exclude_none=True)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": now() if status == "completed" else None,
            "error": {"code": "server_error", "message": error} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": reasoning, "store": False, "background": False,
            "temperature": body.temperature, "top_p": body.top_p, "truncation": "disabled",
            "text": {"format": {"type": "text"}} | (body.text.model_dump(by_alias=True, exclude_none=True)
                                                    if body.text is not None else {}),
            "tool_choice": choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "usage": usage, "user": body.user, "metadata": body.metadata or {}}

    async def collect(self, receive) -> dict:
        done = (await collect(self.submission, receive))[0]
        output = _Output()
        output.feed(MessageStream(self.handle.thinking_started, self.tools).feed(done.text, final=True))
        status = "incomplete" if done.last.finish_reason == "length" else "completed"
        output.finish(status)
        return self.response(status, output.output(), self._usage(done.last, done.token_ids))

    async def events(self):
        """response.created and .in_progress, each item's events as the text comes, then the whole response in
        response.completed (or .incomplete, or .failed when the engine fails)."""
        numbers = itertools.count()

        def event(data: dict) -> str:
            data = {"type": data["type"], "sequence_number": next(numbers), **data}
            return f"event: {data['type']}\n{sse(data)}"

        for kind in ("response.created", "response.in_progress"):
            yield event({"type": kind, "response": self.response("in_progress", [])})
        parser, output, token_ids = MessageStream(self.handle.thinking_started, self.tools), _Output(), []
        async for _, out in self.submission.outputs():
            if out.finish_reason in ("error", "abort"):
                failed = self.response("failed", output.output(), error=failure(out)[1])
                yield event({"type": "response.failed", "response": failed})
                return
            token_ids += out.token_ids
            for data in output.feed(parser.feed(out.text, final=out.finished)):
                yield event(data)
            if out.finished:
                status = "incomplete" if out.finish_reason == "length" else "completed"
                for data in output.finish(status):
                    yield event(data)
                final = self.response(status, output.output(), self._usage(out, token_ids))
                yield event({"type": f"response.{status}", "response": final})
