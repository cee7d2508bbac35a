"""Turn a Qwen3.5 completion into reasoning, content and structured tool calls.

Reasoning: `reasoning\\n</think>\\n\\ncontent` (the generation prompt already opened `<think>\\n`).
Tool calls use the Qwen3-Coder XML format:
    <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
Parsing never raises: anything malformed or unterminated stays in the text.
"""
from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNC_START, FUNC_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"
_BAD_NAME_CHARS = set("<>{}\"' \t\r\n")
_WS = " \t\r\n"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed function call; arguments are already converted to Python/JSON values."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=_call_id)

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedCompletion:
    """A completion split into reasoning (None when there was no think block), content and calls."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


def split_reasoning(text: str, thinking_started: bool) -> tuple[str | None, str]:
    """Split a completion at `</think>`; returns (reasoning or None, content).

    `thinking_started`: the prompt ended with `<think>\\n` (thinking on). A leading `<think>` in the
    output also opens a block. Without `</think>` an open block is all reasoning (cut off by length);
    with thinking off the text is all content. The newlines the chat template puts around the tags
    are removed exactly as the template does when it re-splits an assistant turn
    (reasoning: lstrip/rstrip "\\n"; content: lstrip "\\n").
    """
    stripped = text.lstrip(_WS)
    if stripped.startswith(THINK_START):
        text, thinking_started = stripped[len(THINK_START):], True
    if not thinking_started:
        return None, text
    reasoning, found, content = text.partition(THINK_END)
    return reasoning.strip("\n"), content.lstrip("\n") if found else ""


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None
                     ) -> tuple[str, list[ToolCall]]:
    """Extract complete `<tool_call>` blocks; returns (text without them, calls in order).

    `tools` (OpenAI-style tool dicts) types the arguments the way vLLM's `qwen3_coder` parser does;
    a parameter without a declared type is JSON-decoded when it parses, else kept as a string.
    Whitespace touching a removed block is dropped and the remaining pieces are joined with "\\n".
    """
    schemas = parameter_schemas(tools)
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = search = 0
    while (start := text.find(CALL_START, search)) != -1:
        parsed = _parse_call(text, start + len(CALL_START), schemas)
        if parsed is None:
            search = start + len(CALL_START)
            continue
        call, end = parsed
        pieces.append(text[pos:start])
        calls.append(call)
        pos = search = end
    if not calls:
        return text, []
    pieces.append(text[pos:])
    pieces = [pieces[0].rstrip(_WS)] + [p.strip(_WS) for p in pieces[1:-1]] + [pieces[-1].lstrip(_WS)]
    return "\n".join(p for p in pieces if p), calls


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class _More(Exception):
    """The text ends before the call's structure is decided (streaming only: more text may complete it)."""


def _tag(text: str, i: int, tags: tuple[str, ...], final: bool) -> str | None:
    """The tag among `tags` that text has at i; None when none does. Raises _More when the text ends inside one."""
    for tag in tags:
        if text.startswith(tag, i):
            return tag
    if not final and any(tag.startswith(text[i:]) for tag in tags):
        raise _More
    return None


def _read_name(text: str, i: int, final: bool = True) -> tuple[str, int] | None:
    """Name of a `<function=NAME>` / `<parameter=NAME>` tag whose NAME starts at i, and the index after `>`."""
    end = text.find(">", i)
    name = text[i:end] if end != -1 else text[i:]
    if any(c in _BAD_NAME_CHARS for c in name):
        return None
    if end == -1 and not final:
        raise _More
    return (name, end + 1) if end != -1 and name else None


def _param_end(text: str, i: int, final: bool = True) -> int:
    """Index of the `</parameter>` closing a value that starts at i, or -1.

    A close only counts when the next tag is another parameter or `</function>`, so values may
    contain a literal `</parameter>` (code, XML).
    """
    while (j := text.find(PARAM_END, i)) != -1:
        if _tag(text, _skip_ws(text, j + len(PARAM_END)), (PARAM_START, FUNC_END), final) is not None:
            return j
        i = j + len(PARAM_END)
    if not final:
        raise _More
    return -1


@dataclass
class CallScan:
    """How far a `<tool_call>` body has been read: the function name once its tag is complete, the parameters
    whose values are complete (typed), and `end` (the index after `</tool_call>`) once the call is."""

    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    end: int | None = None
    malformed: bool = False  # the text cannot be a call, whatever follows


def scan_call(text: str, i: int, schemas: dict[str, dict], final: bool = True) -> CallScan:
    """Read the body of a `<tool_call>` starting at i. `final`: the text is complete (otherwise a prefix of a
    longer output: anything it ends inside of is left undecided rather than malformed)."""
    scan = CallScan()
    try:
        i = _skip_ws(text, i)
        if not _tag(text, i, (FUNC_START,), final) or (head := _read_name(text, i + len(FUNC_START), final)) is None:
            scan.malformed = True
            return scan
        scan.name, i = head
        properties = schemas.get(scan.name, {})
        while _tag(text, i := _skip_ws(text, i), (FUNC_END, PARAM_START), final) == PARAM_START:
            if (head := _read_name(text, i + len(PARAM_START), final)) is None:
                break
            param, start = head
            if (end := _param_end(text, start, final)) == -1:
                break
            value = text[start:end]
            value = value[1:] if value.startswith("\n") else value  # the template's own newlines
            value = value[:-1] if value.endswith("\n") else value
            scan.arguments[param] = _convert(value, properties.get(param))
            i = end + len(PARAM_END)
        else:
            if text.startswith(FUNC_END, i):
                i = _skip_ws(text, i + len(FUNC_END))
                if _tag(text, i, (CALL_END,), final):
                    scan.end = i + len(CALL_END)
                    return scan
        scan.malformed = True
    except _More:
        pass
    return scan


def _parse_call(text: str, i: int, schemas: dict[str, dict]) -> tuple[ToolCall, int] | None:
    """Parse the body of a `<tool_call>` starting at i; returns the call and the index after
    `</tool_call>`, or None when the block is malformed or unterminated."""
    scan = scan_call(text, i, schemas)
    return (ToolCall(scan.name, scan.arguments), scan.end) if scan.end is not None else None


def parameter_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict]:
    """Function name -> JSON-schema `properties`, from OpenAI-style (or bare function) tool dicts."""
    schemas: dict[str, dict] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = (params.get("properties") if isinstance(params, Mapping) else None) or {}
            schemas[fn["name"]] = props if isinstance(props, Mapping) else {}
    return schemas


def _kind(type_name: str) -> str:
    """Normalise a schema type name the way vLLM's qwen3_coder parser reads it."""
    t = type_name.strip().lower()
    if t in ("string", "str", "text", "varchar", "char", "enum"):
        return "string"
    if t.startswith(("int", "uint", "long", "short", "unsigned")):
        return "integer"
    if t.startswith(("num", "float", "double")):
        return "number"
    if t in ("boolean", "bool", "binary"):
        return "boolean"
    if t in ("object", "array", "arr") or t.startswith(("dict", "list")):
        return "container"
    return "null" if t == "null" else "unknown"


def schema_kinds(schema: Any) -> set[str]:
    """Kinds a parameter schema allows: `type` (str or list) and `anyOf`/`oneOf` members."""
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else list(declared or ())
    for option in list(schema.get("anyOf") or ()) + list(schema.get("oneOf") or ()):
        names += [option["type"]] if isinstance(option, Mapping) and isinstance(option.get("type"), str) else []
    return {_kind(n) for n in names if isinstance(n, str)}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _json(value: str) -> Any:
    """json.loads without NaN/Infinity (they would not survive json.dumps); raises ValueError, nesting past Python's
    recursion limit included."""
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _convert(value: str, schema: Any) -> Any:
    """Argument text -> value for its declared type; the raw string when it does not fit."""
    kinds = schema_kinds(schema)
    lowered = value.strip().lower()
    if kinds <= {"unknown"}:
        try:
            return _json(value)
        except ValueError:
            return value
    if "null" in kinds and lowered in ("null", "none"):
        return None
    if "string" in kinds:
        return value
    if lowered in ("null", "none"):  # Qwen3.5's template renders None via `| string`
        return None
    if "boolean" in kinds and lowered in ("true", "false"):
        return lowered == "true"
    if kinds & {"integer", "number", "container"}:
        try:
            parsed = _json(value)
        except ValueError:
            parsed = _literal(value) if "container" in kinds else value
        if _fits(parsed, kinds):
            return parsed
    return value


def _literal(value: str) -> Any:
    """Python-literal fallback for containers a model wrote as a repr (`{'k': 'v'}`)."""
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _fits(parsed: Any, kinds: set[str]) -> bool:
    if isinstance(parsed, bool):
        return False
    if isinstance(parsed, int):
        return bool(kinds & {"integer", "number"})
    if isinstance(parsed, float):
        return "number" in kinds
    return isinstance(parsed, (dict, list)) and "container" in kinds


def parse_completion(text: str, thinking_started: bool,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
    """split_reasoning, then tool calls from both parts (calls inside the think block come first)."""
    reasoning, content = split_reasoning(text, thinking_started)
    calls: list[ToolCall] = []
    if reasoning is not None:
        reasoning, calls = parse_tool_calls(reasoning, tools)
    content, content_calls = parse_tool_calls(content, tools)
    return ParsedCompletion(reasoning, content, calls + content_calls)
