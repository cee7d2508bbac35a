"""The streaming parsers: reasoning, content and tool-call deltas, fed in any chunking, concatenate to exactly what
`parse_completion` gives for the whole text (tool-call arguments included, as JSON strings)."""

import json
import random

import pytest

from qwenrt.parsing import parse_completion, split_reasoning
from qwenrt.stream_parser import MessageStream
from tests.test_parsing import TOOLS, call_block

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "detail": {"type": "object"}}}}}]

TEXTS = [  # (completion text, the prompt opened <think>)
    ("Let me think.\n</think>\n\nThe answer is 4.", True),
    ("<think>\nPlan.\n</think>\n\nDone.", False),
    ("  <think>\nPlan.\n</think>\n\n\nDone.\n", True),
    ("\n</think>\n\nHi", True),
    ("Still thinking about it\n\n", True),
    ("Answer with </think> inside", False),
    ("  <thi", False),
    (" \n", True),
    ("a</thin", True),
    ("I will call.\n\n" + call_block("configure", count="3", ratio="0.5", label="x y", tags='["a","b"]')
     + "\n\nafter  \n", False),
    ("think " + call_block("configure", count="1") + " more\n</think>\n\n" + call_block("get", q="v") + "\n"
     + call_block("configure", enabled="true", note="null"), True),
    ("<tool_call>\n<function=bad name>\n</function>\n</tool_call> then " + call_block("f", a="1"), False),
    ("x <tool_call><tool_call>\n<function=f>\n</function>\n</tool_call> y", False),
    (call_block("f", code="a </parameter> b\n</parameter> c") + "  ", False),
    ("  " + call_block("f") + "\n\n  " + call_block("g", a="[1,2]") + "   ", False),
    ("Checking.\n</think>\n\n" + call_block("get_weather", city="Paris", days="3", detail='{"wind": true}'), True),
    ("<tool_call", False),
]


def streamed(text: str, started: bool, tools, sizes: list[int]):
    """Feed text in chunks of the given sizes; (reasoning, content, [(name, arguments text)], call ids)."""
    stream = MessageStream(started, tools)
    deltas, pos = [], 0
    for n in sizes:
        deltas.append(stream.feed(text[pos:pos + n]))
        pos += n
    deltas += [stream.feed(text[pos:]), stream.finish()]
    calls = {}
    for d in deltas:
        for t in d.tool_calls:
            if t.id is not None:
                assert t.index not in calls and t.arguments == "" and t.id.startswith("call_")
                calls[t.index] = [t.name, ""]
            calls[t.index][1] += t.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), [tuple(calls[i]) for i in
                                                                                       sorted(calls)]


def chunkings(text: str, count: int, seed: int):
    rng = random.Random(seed)
    yield [1] * len(text)  # token by token, as small as it gets
    yield [len(text)]
    for _ in range(count):
        yield [rng.randint(0, 5) for _ in range(len(text))]


@pytest.mark.parametrize("text, started", TEXTS)
def test_streamed_equals_whole(text, started):
    tools = TOOLS + WEATHER
    whole = parse_completion(text, started, tools)
    want = (whole.reasoning or "", whole.content, [(c.name, c.arguments_json) for c in whole.tool_calls])
    reasoning, content = split_reasoning(text, started)
    for sizes in chunkings(text, 60, seed=len(text)):
        assert streamed(text, started, tools, sizes) == want, sizes
        assert streamed(text, started, None, sizes) == (reasoning or "", content, [])  # no tools: no parsing


def test_arguments_stream_per_parameter_as_vllm_does():
    text = call_block("get_weather", city="Paris", days="3") + " ok"
    stream = MessageStream(False, WEATHER)
    fragments = [t.arguments for i in range(len(text)) for t in stream.feed(text[i]).tool_calls]
    fragments += [t.arguments for t in stream.finish().tool_calls]
    # header (empty), one fragment per complete parameter (closing brace held back), then the rest
    assert fragments == ["", '{"city": "Paris"', ', "days": 3', "}"]
    assert json.loads("".join(fragments)) == {"city": "Paris", "days": 3}


def test_a_call_cut_off_after_its_header_stays_text():
    # Like vLLM, the header goes out once <function=NAME> is complete; if the call never closes, the whole parse
    # (and the streamed content) keeps it as text, and the header is left without arguments.
    for text, arguments in (("text <tool_call>\n<function=f>", ""),
                            ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n", '{"a": 1')):
        reasoning, content, calls = streamed(text, False, TOOLS, [1] * len(text))
        assert content == parse_completion(text, False, TOOLS).content == text
        assert calls == [("f", arguments)]
