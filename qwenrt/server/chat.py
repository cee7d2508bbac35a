"""POST /v1/chat/completions: messages -> engine requests (one per choice) -> a chat.completion, or its chunks as
server-sent events (reasoning, content and tool calls split as they stream)."""

from __future__ import annotations

import json

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from qwenrt.engine import Request, RequestOutput
from qwenrt.parsing import parse_completion, split_reasoning
from qwenrt.server.bridge import Submission, collect, event_stream, failure_body, submit
from qwenrt.server.errors import APIError
from qwenrt.server.media import check_media
from qwenrt.server.params import check_context, choice_params
from qwenrt.server.protocol import ChatCompletionRequest, ChatMessage, NamedFunction, NamedToolChoice, Tool
from qwenrt.server.responses import LogprobCollector, chat_logprobs, new_id, now, sse, usage
from qwenrt.stream_parser import MessageDelta, MessageStream
from qwenrt.server.structured import constraint_options


def chat_messages(messages: list[ChatMessage], state) -> list[dict]:
    """Plain message dicts for the chat template: `developer` is a system turn, history tool-call arguments
    (a JSON string in the OpenAI API) become the mapping the template renders, legacy `function` turns and
    `function_call`s become tool turns and tool calls."""
    plain = []
    for m, message in enumerate(messages):
        message = _legacy_turn(message.model_dump(exclude_none=True), m)
        _check_text_parts(message.get("content"), m)
        if message["role"] == "developer":
            message["role"] = "system"
        for c, call in enumerate(message.get("tool_calls") or ()):
            function = call["function"]
            if isinstance(function.get("arguments"), str):
                param = f"messages[{m}].tool_calls[{c}].function.arguments"
                call["function"] = {**function, "arguments": _arguments(function["arguments"], param)}
        plain.append(message)
    return check_media(plain, state.media_policy)


def _legacy_turn(message: dict, m: int) -> dict:
    """A legacy `function` turn as a tool turn, an assistant's `function_call` as its last tool call."""
    if message["role"] == "function":
        message["role"] = "tool"
    call = message.pop("function_call", None)
    if call is not None:
        if isinstance(call.get("arguments"), str):
            call["arguments"] = _arguments(call["arguments"], f"messages[{m}].function_call.arguments")
        message["tool_calls"] = [*message.get("tool_calls", ()), {"type": "function", "function": call}]
    return message


def _arguments(arguments: str, param: str) -> dict:
    """A history tool call's arguments (a JSON string in the OpenAI API) as the mapping the template renders."""
    try:
        arguments = json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
        raise APIError(400, f"{param}: not valid JSON", param) from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{param}: must be a JSON object", param)
    return arguments


def _check_text_parts(content, m: int) -> None:
    """A text part's text is a string (the template would render a number or an object as text)."""
    for p, part in enumerate(content if isinstance(content, list) else ()):
        if part.get("type") == "text" and not isinstance(part.get("text"), str):
            param = f"messages[{m}].content[{p}].text"
            raise APIError(400, f"{param}: expected a string", param)


def _tools(body: ChatCompletionRequest) -> tuple[list[dict] | None, bool]:
    """(tool definitions for the template, whether to parse tool calls out of the output)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is not None and tools is None and choice != "none":
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    return tools, tools is not None and choice != "none"


def _legacy_functions(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """`functions` / `function_call` (the API's legacy form) as the `tools` / `tool_choice` they stand for."""
    if body.functions is None:
        if body.function_call is not None:
            raise APIError(400, "function_call needs functions", "function_call")
        return body
    if body.tools is not None:
        raise APIError(400, "functions is the legacy form of tools: give one of them", "functions")
    if body.function_call is not None and body.tool_choice is not None:
        raise APIError(400, "function_call is the legacy form of tool_choice: give one of them", "function_call")
    choice = body.function_call
    if isinstance(choice, NamedFunction):
        choice = NamedToolChoice(function=choice)
    return body.model_copy(update={"tools": [Tool(function=f) for f in body.functions],
                                   "tool_choice": choice if choice is not None else body.tool_choice})


def _thinking(body: ChatCompletionRequest) -> bool | None:
    """Whether the template opens a thinking block: chat_template_kwargs.enable_thinking, or reasoning_effort ("none"
    and "minimal" switch it off, the others on); given both, they must agree. None: the template's default."""
    explicit = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else None
    if body.reasoning_effort is None:
        return explicit
    wanted = body.reasoning_effort not in ("none", "minimal")
    if explicit is not None and explicit != wanted:
        raise APIError(400, f"reasoning_effort {body.reasoning_effort!r} turns thinking {'on' if wanted else 'off'}, "
                            f"but chat_template_kwargs.enable_thinking is {str(explicit).lower()}", "reasoning_effort")
    return wanted


def _assistant_message(text: str, thinking_started: bool, tools: list[dict] | None) -> tuple[dict, int]:
    """The whole answer as a message; tools None: no tool-call parsing. Returns it and its number of calls."""
    if tools is None:
        (reasoning, content), calls = split_reasoning(text, thinking_started), []
    else:
        parsed = parse_completion(text, thinking_started, tools)
        reasoning, content = parsed.reasoning, parsed.content
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                 for c in parsed.tool_calls]
    # vLLM sends the reasoning under both names: older clients read reasoning_content, newer ones reasoning
    message = {"role": "assistant", "content": content if content or not calls else None,
               "reasoning_content": reasoning, "reasoning": reasoning, "tool_calls": calls}
    return message, len(calls)


def _as_legacy(message: dict) -> dict:
    """A message answering `functions`: its first call as `function_call` (the legacy API has one call a turn)."""
    calls = message.pop("tool_calls")
    if calls:
        message["function_call"] = calls[0]["function"]
    return message


def _finish_reason(engine_reason: str, tool_calls: int, legacy: bool) -> str:
    if engine_reason == "stop" and tool_calls:
        return "function_call" if legacy else "tool_calls"
    return engine_reason


def _delta_dict(delta: MessageDelta, legacy: bool) -> dict:
    out = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    first = next((t for t in delta.tool_calls if t.index == 0), None)
    if legacy and first is not None:  # the legacy API has one call a turn: the first
        out["function_call"] = {"arguments": first.arguments} if first.id is None else \
            {"name": first.name, "arguments": first.arguments}
    elif delta.tool_calls and not legacy:
        out["tool_calls"] = [
            {"index": t.index, "function": {"arguments": t.arguments}} if t.id is None else
            {"index": t.index, "id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in delta.tool_calls]
    return out


async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest, state):
    name = state.check_model(body.model)
    request_id, submission, tools, parse_tools = await submit_chat(body, state)
    reply = _Reply(request_id, name, body, submission, state.tokenizer, tools, parse_tools)
    if body.stream:
        return StreamingResponse(event_stream(reply.events(), submission, http.receive), media_type="text/event-stream")
    return await reply.collect(http.receive)


async def submit_chat(body: ChatCompletionRequest, state) -> tuple[str, Submission, list[dict] | None, bool]:
    """The request's engine requests, added: (request id, submission, tool definitions, whether to parse tool calls).
    Raises APIError naming the chat field at fault (the Responses route renames it)."""
    messages = chat_messages(body.messages, state)
    body = _legacy_functions(body)
    tools, parse_tools = _tools(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    constraint = constraint_options(body.response_format)
    max_tokens = body.max_completion_tokens or body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    thinking = _thinking(body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request_id = new_id("chatcmpl")
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    requests = [Request(messages, params, enable_thinking=thinking, tools=tools, logprobs=logprobs,
                        tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls is not False,
                        request_id=f"{request_id}-{j}", media_policy=state.media_policy,
                        adapter=state.adapter(body.model))
                for j, params in enumerate(choice_params(body, state.tokenizer, max_tokens, state.max_model_len,
                                                         constraint))]
    submission = await submit(state, requests, "messages", field)
    try:
        check_context(submission.handles, max_tokens, state.max_model_len, "messages", field)
    except APIError:
        submission.abort()
        raise
    return request_id, submission, tools, parse_tools


class _Reply:
    """The answer to one chat request, whole or streamed."""

    def __init__(self, request_id: str, model: str, body: ChatCompletionRequest, submission: Submission, tokenizer,
                 tools, parse_tools: bool):
        self.id, self.model, self.body, self.submission = request_id, model, body, submission
        self.tokenizer, self.tools, self.parse_tools = tokenizer, tools, parse_tools
        self.legacy = body.functions is not None  # calls go out as the legacy function_call
        self.created = now()
        self.prompt_tokens = submission.handles[0].prompt_tokens

    def _usage(self, last: list[RequestOutput]) -> dict:
        """Over the choices' latest outputs (they share one prompt)."""
        return usage(self.prompt_tokens, sum(o.generation_tokens for o in last), max(o.cached_tokens for o in last))

    async def collect(self, receive) -> dict:
        finished = await collect(self.submission, receive)
        choices = []
        for i, done in enumerate(finished):
            message, calls = _assistant_message(done.text, self.submission.handles[i].thinking_started,
                                                self.tools if self.parse_tools else None)
            choices.append({"index": i, "message": _as_legacy(message) if self.legacy else message,
                            "logprobs": chat_logprobs(self.tokenizer, done.logprobs) if self.body.logprobs else None,
                            "finish_reason": _finish_reason(done.last.finish_reason, calls, self.legacy)})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage([d.last for d in finished])}

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if usage_ is not None:
            chunk["usage"] = usage_
        return sse(chunk)

    async def events(self):
        """The chunks: a role chunk per choice, then the deltas as they come, then usage when asked for."""
        handles = self.submission.handles
        parsers = [MessageStream(h.thinking_started, self.tools if self.parse_tools else None) for h in handles]
        logprobs = [LogprobCollector() for _ in handles]
        latest: list[RequestOutput] = [None] * len(handles)
        for i in range(len(handles)):
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        async for i, out in self.submission.outputs():
            if out.finish_reason in ("error", "abort"):
                yield sse(failure_body(out))
                continue
            latest[i] = out
            delta = parsers[i].feed(out.text, final=out.finished)
            entries = logprobs[i].add(out) if self.body.logprobs else []
            if not (delta or entries or out.finished):
                continue
            finish = _finish_reason(out.finish_reason, parsers[i].tool_calls, self.legacy) if out.finished else None
            yield self._chunk([{"index": i, "delta": _delta_dict(delta, self.legacy),
                                "logprobs": chat_logprobs(self.tokenizer, entries) if entries else None,
                                "finish_reason": finish}])
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield self._chunk([], self._usage(latest))
