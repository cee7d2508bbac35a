"""A Lark grammar (llguidance's dialect) for Qwen3.5's tool calls, so that `tool_choice` "required" or a named
function forces well-formed calls: the Qwen3-Coder XML format qwenrt/parsing.py reads,

    <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

naming an offered function, with its required parameters, and values its JSON Schema types accept: a string
parameter's value is raw text (as the chat template writes it; its enum and maxLength hold), any other's is JSON
matching the parameter's schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qwenrt.constraints import json_options
from qwenrt.errors import QwenrtError
from qwenrt.parsing import schema_kinds

# a string value ends at the first "</parameter>\n" (lazy: the shortest text that does); the parser drops the
# newline the template puts before the tag
_RAW_VALUE = r"/(?s:.{LENGTH})\n?<\/parameter>\n/"


NL = "\n"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value_rule(rule: str, schema: Any, defs: dict) -> str:
    """The rule for one parameter's value and its closing tag."""
    kinds = schema_kinds(schema)
    if not isinstance(schema, Mapping) or "string" in kinds or kinds <= {"unknown"}:
        enum = schema.get("enum") if isinstance(schema, Mapping) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) and kinds <= {"string"}:
            return f"{rule}: ({' | '.join(_literal(v) for v in enum)}) \"\\n</parameter>\\n\""
        longest = schema.get("maxLength") if isinstance(schema, Mapping) else None
        length = f"{{0,{longest}}}" if isinstance(longest, int) and not isinstance(longest, bool) and longest >= 0 \
            else "*"
        return f"{rule}[lazy]: {_RAW_VALUE.replace('{LENGTH}', length)}"
    embedded = {**defs, **schema, "x-guidance": json_options()}
    return f"{rule}: %json {json.dumps(embedded, ensure_ascii=False)} \"\\n</parameter>\\n\""


def _function_rules(index: int, function: Mapping[str, Any]) -> list[str]:
    """Rules for one function's call body: fn{index}: <function=NAME>\\n, its parameters, </function>\\n."""
    name = function["name"]
    parameters = function.get("parameters") if isinstance(function.get("parameters"), Mapping) else {}
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), Mapping) else {}
    required = [p for p in parameters.get("required") or () if isinstance(p, str) and p in properties]
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    rules, body = [], []
    ordered = required + [p for p in properties if p not in required]
    for j, param in enumerate(ordered):
        rule = f"v{index}_{j}"
        rules.append(_value_rule(rule, properties[param], defs))
        part = f"{_literal(f'<parameter={param}>' + NL)} {rule}"
        body.append(part if param in required else f"({part})?")
    rules.append(f"fn{index}: {_literal(f'<function={name}>' + NL)} {' '.join(body)} \"</function>\\n\"")
    return rules


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], token: Callable[[str], str], name: str | None = None,
                      parallel: bool = True) -> str:
    """The grammar of one tool call (several with `parallel`) to the offered `tools` (OpenAI's shape), or to the
    function `name` only. token(text): how the grammar names the tokenizer's `<tool_call>` / `</tool_call>`."""
    functions = [t.get("function", t) for t in tools]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise QwenrtError(f"tool_choice names the function {name!r}, which is not among the tools",
                              "tool_choice")
    rules = [rule for i, f in enumerate(functions) for rule in _function_rules(i, f)]
    open_, close = token("<tool_call>"), token("</tool_call>")
    calls = "call (SEP call)*" if parallel else "call"
    return "\n".join([
        f"start: LEAD? {calls}",
        "LEAD: /\\n{1,2}/",
        "SEP: /\\n{1,2}/",
        f"call: {open_} \"\\n\" ({' | '.join(f'fn{i}' for i in range(len(functions)))}) {close}",
        *rules])
