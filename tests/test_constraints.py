"""Constrained decoding on the built-in model: JSON Schemas from a fixed generator give valid output, batched rows
with and without constraints each get what they get alone, speculative decoding changes nothing, thinking comes
first, forced tool calls validate, and bad constraints are one-line errors."""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest

import qwenrt
from qwenrt.engine import Engine, Request
from qwenrt.errors import QwenrtError
from qwenrt.parsing import parse_completion, split_reasoning
from qwenrt.sampling import SamplingParams
from qwenrt.tiny.tasks import TOOLS

N_SCHEMAS = 50
WORDS = ["red", "green", "blue", "alpha", "beta", "x", "long value", "Paris"]


@pytest.fixture(scope="module")
def tiny():
    return qwenrt.load()


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(*tiny, speculative_tokens=0)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON Schema of the kinds clients send (objects, arrays, enums, bounded numbers, nesting, optional fields),
    bounded so that an output that follows it ends within a few hundred tokens."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        # multipleOf bounds the digits: a free fraction lets this small model write 0.2727... until max_tokens
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 100, 1000]),
                "multipleOf": rng.choice([0.5, 0.25, 0.01])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["name", "age", "city", "score", "tags", "ok", "kind", "value"], rng.randint(1, 4))
    properties = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def schemas() -> list[dict]:
    rng = random.Random(37)
    return [{"type": "object", "properties": {"answer": random_schema(rng)}, "required": ["answer"],
             "additionalProperties": False} if i % 5 == 0 else random_schema(rng) for i in range(N_SCHEMAS)]


def request(schema: dict | None, i: int, **options) -> Request:
    params = SamplingParams(max_tokens=160, json_schema=schema)
    return Request([{"role": "user", "content": f"Describe item {i} as JSON"}], params,
                   enable_thinking=False, **options)


def run_all(engine: Engine, requests: list[Request]) -> list[str]:
    """Submit every request at once (one batch), then read each one's whole text; a constrained one must end by
    itself."""
    streams = [engine.submit(r) for r in requests]
    texts = []
    for request, stream in zip(requests, streams):
        outs = list(stream)
        assert outs[-1].finish_reason in (("stop",) if request.params.constraint else ("stop", "length")), outs[-1]
        texts.append("".join(o.text for o in outs))
    return texts


def test_fifty_random_schemas_give_valid_json_batched_as_alone(engine):
    given = schemas()
    # constrained rows beside free ones, in one batch
    mixed = [request(s, i) for i, s in enumerate(given)] + [request(None, i) for i in range(4)]
    batched = run_all(engine, mixed)
    for schema, text in zip(given, batched):
        jsonschema.validate(json.loads(text), schema)
    for i in (0, 3, 7, 21, N_SCHEMAS, N_SCHEMAS + 2):  # constrained and free rows, each alone
        assert run_all(engine, [mixed[i]]) == [batched[i]]


def test_speculative_decoding_changes_no_constrained_output(tiny, engine):
    speculative = Engine(*tiny, speculative_tokens=3)
    picked = [request(s, i) for i, s in enumerate(schemas()[:12])]
    plain = run_all(engine, picked)
    drafted = run_all(speculative, [request(s, i) for i, s in enumerate(schemas()[:12])])
    assert drafted == plain
    assert speculative.draft_counts.draft_tokens > 0  # drafts were made, and some rejected by the grammar or model


def test_thinking_comes_first_then_the_constraint(engine):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["city", "n"], "additionalProperties": False}
    stream = engine.submit(Request([{"role": "user", "content": "What is the capital of France?"}],
                                   SamplingParams(max_tokens=300, json_schema=schema), enable_thinking=True))
    assert stream.thinking_started
    text = "".join(o.text for o in stream)
    reasoning, content = split_reasoning(text, True)
    assert reasoning  # free text: the model's own
    jsonschema.validate(json.loads(content), schema)


def test_regex_grammar_and_json_object(engine):
    def one(max_tokens=40, **constraint):
        return run_all(engine, [Request("The answer is", SamplingParams(max_tokens=max_tokens, **constraint))])[0]

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", one(regex=r"[0-9]{3}-[a-z]{2}"))
    assert one(grammar='start: "yes" | "no"') in ("yes", "no")
    # any JSON object: this small model fills a free key until max_tokens, so only its start is checked here
    with pytest.raises(AssertionError, match="length"):
        one(max_tokens=8, json_object=True)
    assert engine.submit(Request("x", SamplingParams(max_tokens=3, json_object=True))).__iter__().__next__() \
        .text.startswith("{")


@pytest.mark.parametrize("thinking", [False, True])
def test_forced_tool_calls_validate_against_the_tools(engine, thinking):
    extra = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "mode": {"enum": ["fast", "exact"]}},
        "required": ["a", "b"]}}}
    # this small model rambles in a free string: the built-in tools' strings get a maxLength, which the call keeps
    tools = [{"type": "function", "function": {**t["function"], "parameters": {
        **t["function"]["parameters"], "properties": {k: {**v, "maxLength": 24} for k, v in
                                                      t["function"]["parameters"]["properties"].items()}}}}
             for t in TOOLS] + [extra]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice, expected in (("required", None), ({"type": "function", "function": {"name": "add"}}, "add"),
                             ({"type": "function", "function": {"name": "calculator"}}, "calculator")):
        # the model adds without tools when left alone
        req = Request([{"role": "user", "content": "What is 345 + 278?"}], SamplingParams(max_tokens=200),
                      tools=tools, tool_choice=choice, parallel_tool_calls=False, enable_thinking=thinking)
        text = run_all(engine, [req])[0]
        parsed = parse_completion(text, thinking, tools)
        assert len(parsed.tool_calls) == 1, text
        call = parsed.tool_calls[0]
        assert expected is None or call.name == expected
        jsonschema.validate(call.arguments, by_name[call.name])
        free = run_all(engine, [Request(req.prompt, req.params, tools=tools, enable_thinking=thinking)])[0]
        assert not parse_completion(free, thinking, tools).tool_calls  # the model would not call on its own


@pytest.mark.parametrize("constraint, field, words", [
    ({"json_schema": {"type": "strin"}}, "json_schema", "Invalid type"),
    ({"json_schema": {"$ref": "#/nowhere"}}, "json_schema", "does not exist"),
    ({"json_schema": {"type": "object", "dependentSchemas": {"a": {}}}}, "json_schema", "dependentSchemas"),
    ({"json_schema": {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}}, "json_schema", "nothing can"),
    ({"json_schema": {"enum": [f"v{i}" for i in range(200_000)]}}, "json_schema", "characters"),
    ({"json_schema": {"type": "integer", "minimum": -10**30}}, "json_schema", "JSON"),
    ({"grammar": "start: undefined_rule"}, "grammar", "unknown name"),
    ({"regex": "(unclosed"}, "regex", ""),
    ({"regex": "a", "grammar": "start: \"a\""}, "grammar", "at most one"),
])
def test_bad_constraints_are_one_line_errors_within_a_bound(engine, constraint, field, words):
    start = time.monotonic()
    with pytest.raises(QwenrtError) as e:
        engine.add_request(Request("x", SamplingParams(max_tokens=4, **constraint)), lambda out: None)
    assert time.monotonic() - start < 5
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value)
    assert not engine.has_work


def test_schema_bombs_are_refused_or_compiled_within_a_bound(engine):
    """A Python schema that repeats one list 8 times at each of 40 levels (8^40 as JSON) is refused before it is
    written; 40 $defs each referring to the next 8 times (a JSON text of a few KB that expands exponentially if
    inlined) compiles or is refused quickly, never a stall."""
    shared: dict = {"type": "integer"}
    for _ in range(40):
        shared = {"anyOf": [shared] * 8}
    start = time.monotonic()
    with pytest.raises(QwenrtError, match="characters as JSON"):
        SamplingParams(json_schema=shared)
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 8} for i in range(40)}
    defs["d40"] = {"type": "integer"}
    try:
        engine.add_request(Request("x", SamplingParams(max_tokens=4, json_schema={"$defs": defs, "$ref": "#/$defs/d0"}),
                                   request_id="bomb"), lambda out: None)
        engine.abort("bomb")
    except QwenrtError as e:
        assert e.field == "json_schema"
    assert time.monotonic() - start < 10


def test_tool_choice_checks(engine):
    with pytest.raises(QwenrtError, match="not among the tools") as e:
        engine.add_request(Request([{"role": "user", "content": "hi"}], tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "nope"}}), print)
    assert e.value.field == "tool_choice"
    with pytest.raises(QwenrtError, match="needs tools"):
        engine.add_request(Request([{"role": "user", "content": "hi"}], tool_choice="required"), print)
    with pytest.raises(QwenrtError, match="cannot be combined"):
        engine.add_request(Request([{"role": "user", "content": "hi"}], SamplingParams(json_object=True),
                                   tools=TOOLS, tool_choice="required"), print)


class FailingMatcher:
    """An llguidance matcher that reports an error once it has taken `after` tokens."""

    def __init__(self, matcher, after: int):
        self.matcher, self.after, self.taken = matcher, after, 0

    def __getattr__(self, name):
        return getattr(self.matcher, name)

    def consume_token(self, token: int) -> bool:
        self.taken += 1
        return self.matcher.consume_token(token)

    def is_error(self) -> bool:
        return self.taken >= self.after or self.matcher.is_error()

    def get_error(self) -> str:
        return "lexer fuel exhausted" if self.taken >= self.after else self.matcher.get_error()


def test_a_constraint_failing_mid_batch_ends_only_its_row(engine, monkeypatch):
    """A step fills its rows' masks before sampling any: a failure there ends its own row with the constraint's
    error, and the rows beside it go on as alone."""
    schema = schemas()[1]
    free, constrained = request(None, 1), request(schema, 2)
    alone = run_all(engine, [free])
    make = engine._token_mask

    def failing(req, thinking_started):
        mask = make(req, thinking_started)
        if mask is not None:
            mask.matcher = FailingMatcher(mask.matcher, after=3)
        return mask

    monkeypatch.setattr(engine, "_token_mask", failing)
    streams = [engine.submit(r) for r in (free, constrained)]
    outs = [list(s) for s in streams]
    assert "".join(o.text for o in outs[0]) == alone[0]
    assert outs[1][-1].finish_reason == "error"
    assert outs[1][-1].error == "the output constraint failed: lexer fuel exhausted"
    assert sum(len(o.token_ids) for o in outs[1]) == 3
