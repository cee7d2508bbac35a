"""Streaming versions of `qwenrt.parsing`: a completion arrives in text deltas and leaves as reasoning, content and
tool-call deltas whose concatenation equals what `parse_completion` gives for the whole text.

Tool calls stream the way vLLM's qwen3_coder parser does: a header delta (index, id, name, empty arguments) once
`<function=NAME>` is complete, then argument fragments as each `<parameter=...>` completes (the new part of the JSON
of the arguments so far, closing brace held back), and the rest when `</tool_call>` closes the call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qwenrt.parsing import CALL_START, THINK_END, THINK_START, _WS, _call_id, parameter_schemas, scan_call


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (text may end inside the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCallDelta:
    index: int
    arguments: str = ""
    id: str | None = None  # header delta only
    name: str | None = None  # header delta only


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ReasoningSplitter:
    """Incremental `split_reasoning`: text deltas in, (reasoning, content) deltas out."""

    def __init__(self, thinking_started: bool):
        self._started = thinking_started
        self._text = ""
        self._body: int | None = None  # where the text after an optional leading <think> starts, once known
        self._thinking = False
        self._end: int | None = None  # index of </think>, once seen
        self._sent = [0, 0]  # characters of reasoning and content given out

    @property
    def thinking(self) -> bool:
        """The output opened a reasoning block (only meaningful once something was fed)."""
        return self._thinking

    @property
    def reasoning_done(self) -> bool:
        return self._end is not None or (self._body is not None and not self._thinking)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self._text += delta
        text = self._text
        if self._body is None:
            stripped = text.lstrip(_WS)
            if not final and len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
                return "", ""
            if stripped.startswith(THINK_START):
                self._body, self._thinking = len(text) - len(stripped) + len(THINK_START), True
            else:
                self._body, self._thinking = 0, self._started
        reasoning, content = "", ""
        if not self._thinking:
            content = text
        else:
            if self._end is None and (end := text.find(THINK_END, self._body)) != -1:
                self._end = end
            if self._end is not None:
                reasoning = text[self._body:self._end].strip("\n")
                content = text[self._end + len(THINK_END):].lstrip("\n")
            else:
                body = text[self._body:]
                reasoning = (body if final else body[:len(body) - _partial_tag(body, THINK_END)]).strip("\n")
        out = reasoning[self._sent[0]:], content[self._sent[1]:]
        self._sent = [len(reasoning), len(content)]
        return out


class _Pieces:
    """The text around tool calls, given out as `parse_tool_calls` joins it: whitespace touching a call dropped,
    the pieces joined with "\\n" (text with no calls unchanged)."""

    def __init__(self):
        self.calls = 0
        self._emitted = False  # some non-blank piece was given out
        self._started = False  # the current piece has non-blank text
        self._held = ""  # whitespace not yet known to stay

    def text(self, s: str) -> str:
        body = s.strip(_WS)
        if not body:
            self._held += s
            return ""
        lead = self._held + s[:s.index(body[0])]
        if not self._started:
            lead = lead if self.calls == 0 else "\n" if self._emitted else ""
            self._started = True
        self._held = s[len(s.rstrip(_WS)):]
        self._emitted = True
        return lead + body

    def call_done(self) -> None:
        self.calls += 1
        self._held, self._started = "", False

    def finish(self) -> str:
        held, self._held = self._held, ""
        return held if self.calls == 0 or self._started else ""


@dataclass
class _OpenCall:
    index: int | None = None  # given when its header goes out
    sent: str = ""  # argument text given out


class ToolCallStream:
    """Incremental `parse_tool_calls`: text deltas in, (text, tool-call deltas) out."""

    def __init__(self, schemas: dict[str, dict], new_index: Callable[[], int]):
        self._schemas, self._new_index = schemas, new_index
        self._pieces = _Pieces()
        self._buf = ""  # text not yet given out: a possible tag start, or an open call from its <tool_call>
        self._call: _OpenCall | None = None
        self.finished = False

    @property
    def calls(self) -> int:
        return self._pieces.calls

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta
        text, calls = [], []
        while True:
            if self._call is None:
                start = self._buf.find(CALL_START)
                if start == -1:
                    keep = 0 if final else _partial_tag(self._buf, CALL_START)
                    text.append(self._pieces.text(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                text.append(self._pieces.text(self._buf[:start]))
                self._buf, self._call = self._buf[start:], _OpenCall()
            if not self._advance(text, calls, final):
                break
        if final:
            text.append(self._pieces.finish())
            self.finished = True
        return "".join(text), calls

    def _advance(self, text: list[str], calls: list[ToolCallDelta], final: bool) -> bool:
        """Read the open call as far as it goes; True when it closed (complete or not a call after all)."""
        call = self._call
        scan = scan_call(self._buf, len(CALL_START), self._schemas, final)
        if scan.name is not None and call.index is None:
            call.index = self._new_index()
            calls.append(ToolCallDelta(call.index, "", _call_id(), scan.name))
        if call.index is not None and (scan.arguments or scan.end is not None):
            arguments = json.dumps(scan.arguments, ensure_ascii=False)
            arguments = arguments if scan.end is not None else arguments[:-1]
            if arguments.startswith(call.sent) and len(arguments) > len(call.sent):
                calls.append(ToolCallDelta(call.index, arguments[len(call.sent):]))
                call.sent = arguments
        if scan.end is not None:
            self._pieces.call_done()
            self._buf, self._call = self._buf[scan.end:], None
            return True
        if scan.malformed:  # plain text, as parse_tool_calls leaves it; a later <tool_call> may still be one
            text.append(self._pieces.text(CALL_START))
            self._buf, self._call = self._buf[len(CALL_START):], None
            return True
        return False


class MessageStream:
    """One choice's completion as it streams: reasoning, content and (with tools) tool-call deltas, equal once
    concatenated to `parse_completion(text, thinking_started, tools)` (tools None: no tool-call parsing)."""

    def __init__(self, thinking_started: bool, tools: Sequence[Mapping[str, Any]] | None = None):
        self._split = ReasoningSplitter(thinking_started)
        self._parse_tools = tools is not None
        schemas = parameter_schemas(tools)
        self._count = 0
        self._channels = [ToolCallStream(schemas, self._next_index), ToolCallStream(schemas, self._next_index)]

    def _next_index(self) -> int:
        self._count += 1
        return self._count - 1

    @property
    def tool_calls(self) -> int:
        """Complete tool calls so far."""
        return sum(c.calls for c in self._channels)

    def feed(self, text: str, final: bool = False) -> MessageDelta:
        reasoning, content = self._split.feed(text, final)
        if not self._parse_tools:
            return MessageDelta(reasoning, content)
        out = MessageDelta()
        reasoning_calls, content_calls = self._channels
        if self._split.thinking and not reasoning_calls.finished:
            out.reasoning, calls = reasoning_calls.feed(reasoning, final or self._split.reasoning_done)
            out.tool_calls += calls
        out.content, calls = content_calls.feed(content, final)
        out.tool_calls += calls
        return out

    def finish(self) -> MessageDelta:
        return self.feed("", final=True)
