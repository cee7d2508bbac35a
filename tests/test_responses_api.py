"""POST /v1/responses through the official `openai` client: the built-in model served for real (its answers, its
calculator tool round trip, thinking on and off, a cut-off answer), and the app over a scripted engine where a test
needs an output it can choose (several tool calls, an engine failure) or only checks what reaches the engine."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from qwenrt.default_model import DEFAULT_MODEL
from qwenrt.tiny.tasks import TOOLS, quality_tasks, run_tool
from tests.server_process import ServerProcess
from tests.test_server import CALLS_TEXT, ScriptedEngine, pieces_of, scripted_client, tokenizer  # noqa: F401

QUESTION = "What is 127 + 385?"
CALCULATOR = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat shape
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
REASONING_EVENTS = [e.replace("output_text", "reasoning_text") for e in MESSAGE_EVENTS]


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """The built-in model, which adds and subtracts (thinking or not) and calls its calculator."""
    server = ServerProcess(None, tmp_path_factory.mktemp("responses") / "serve.log", env={"OMP_NUM_THREADS": "2"})
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    server.stop()


def respond(client, **kw):
    return client.responses.create(model=DEFAULT_MODEL, temperature=0, **kw)


def run_together(types: list[str]) -> list[str]:
    """Event types with each run of one delta type collapsed to one entry."""
    return [t for k, t in enumerate(types) if not (t.endswith(".delta") and k and types[k - 1] == t)]


def text_of(item) -> str:
    return "".join(part.text for part in item.content)


# ---- the built-in model -----------------------------------------------------------------------------------------

def test_answer_is_the_chat_answer_whole_and_streamed(builtin):
    """Greedy: the reasoning item and the message hold what /v1/chat/completions splits for the same question (one
    engine path); the streamed events come in OpenAI's order, their deltas concatenate to the final text, and
    response.completed carries the whole response with usage."""
    chat = builtin.chat.completions.create(model=DEFAULT_MODEL, temperature=0,
                                           messages=[{"role": "user", "content": QUESTION}])
    whole = respond(builtin, input=QUESTION)
    assert whole.status == "completed" and whole.id.startswith("resp_") and whole.object == "response"
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning, message = whole.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert text_of(reasoning) == chat.choices[0].message.reasoning_content and "7+5=12, carry 1" in text_of(reasoning)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.status == "completed"
    assert whole.output_text == chat.choices[0].message.content == "127 + 385 = 512"
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens

    events = list(respond(builtin, input=QUESTION, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert run_together([e.type for e in events]) == ["response.created", "response.in_progress", *REASONING_EVENTS,
                                                      *MESSAGE_EVENTS, "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text and thought == text_of(final.output[0])
    lifecycle = [e.response.id for e in events if hasattr(e, "response")]
    assert len(lifecycle) == 3 and set(lifecycle) == {final.id}
    assert final.usage.output_tokens == usage.output_tokens and final.usage.input_tokens == usage.input_tokens


def test_instructions_are_a_leading_system_message(builtin):
    chat = builtin.chat.completions.create(model=DEFAULT_MODEL, temperature=0, messages=[
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": QUESTION}])
    whole = respond(builtin, input=QUESTION, instructions="Be exact.")
    assert whole.instructions == "Be exact."
    assert whole.usage.input_tokens == chat.usage.prompt_tokens > respond(builtin, input=QUESTION).usage.input_tokens
    assert whole.output_text == chat.choices[0].message.content


def test_reasoning_effort_none_turns_thinking_off(builtin):
    """Without thinking the built-in model shows its working in the reply, then the sum; no reasoning item."""
    whole = respond(builtin, input=QUESTION, reasoning={"effort": "none"})
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output_text.endswith("\n\n127 + 385 = 512") and "7+5=12, carry 1" in whole.output_text
    assert whole.usage.output_tokens_details.reasoning_tokens == 0 and whole.reasoning.effort == "none"
    thinking = respond(builtin, input=QUESTION, reasoning={"effort": "low"})
    assert [item.type for item in thinking.output] == ["reasoning", "message"]


def test_calculator_round_trip(builtin):
    """The first answer is a function_call (streamed: its argument deltas make the arguments); the client runs the
    tool and sends the items back with a function_call_output; the model answers from it."""
    task = quality_tasks("calculator", 1, 20260101)[0]
    question = task.messages[0]["content"]
    first = respond(builtin, input=question, tools=CALCULATOR)
    call = first.output[-1]
    assert [item.type for item in first.output] == ["reasoning", "function_call"] and first.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == (task.call["name"], task.call["arguments"])
    assert first.tools[0].name == "calculator" and first.tool_choice == "auto"

    events = list(respond(builtin, input=question, tools=CALCULATOR, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and arguments == done[0].arguments == call.arguments
    assert run_together([e.type for e in events])[-4:] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]

    result = run_tool(call.name, json.loads(call.arguments))
    history = [{"role": "user", "content": question}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    second = respond(builtin, input=history, tools=CALCULATOR)
    assert second.output[-1].type == "message" and result in second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_max_output_tokens_leaves_it_incomplete(builtin):
    whole = respond(builtin, input=QUESTION, max_output_tokens=5)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 5 and whole.max_output_tokens == 5
    assert whole.output[0].type == "reasoning" and whole.output[0].status == "incomplete"
    events = list(respond(builtin, input=QUESTION, max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 5


def test_text_format_and_a_named_tool_choice_take_the_chat_path(builtin):
    """text.format json_schema constrains the message as chat's response_format does; a named tool_choice forces
    that call where the model would answer itself; a schema the engine cannot compile is named text.format. (Thinking
    off: fewer tokens; the first use of each grammar compiles it.)"""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["512", "513"]}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}
    off = {"effort": "none"}
    whole = respond(builtin, input=QUESTION, text={"format": fmt}, reasoning=off, max_output_tokens=100)
    assert whole.status == "completed" and json.loads(whole.output_text)["answer"] in ("512", "513")
    assert whole.text.format.type == "json_schema" and whole.text.format.schema_ == schema
    forced = respond(builtin, input=QUESTION, tools=CALCULATOR, reasoning=off, tool_choice={"type": "function",
                                                                                           "name": "get_capital"})
    assert [item.type for item in forced.output] == ["function_call"] and forced.output[0].name == "get_capital"
    assert list(json.loads(forced.output[0].arguments)) == ["country"]
    with pytest.raises(openai.BadRequestError) as e:
        respond(builtin, input=QUESTION, text={"format": dict(fmt, schema={"type": "frob"})})
    assert e.value.body["param"] == "text.format"


# ---- over a scripted engine -------------------------------------------------------------------------------------

WEATHER_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}]


def without_ids(output) -> list[dict]:
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in output]


def as_the_sdk_types_it(data: dict) -> dict:
    """`data` validated strictly by the SDK's own type of it (a response or a stream event); usage's
    cache_write_tokens, which qwenrt does not count, set to 0 first."""
    usage = data.get("usage") or (data.get("response") or {}).get("usage")
    if usage:
        usage["input_tokens_details"].setdefault("cache_write_tokens", 0)
    TypeAdapter(ResponseStreamEvent if "sequence_number" in data else Response).validate_python(data)
    return data


def test_tool_calls_whole_and_streamed(tokenizer):  # noqa: F811
    """Reasoning, text and two calls: one item each, in that order, the arguments typed by the tools' schemas; the
    stream's items equal the whole response's; the wire carries `event:` lines and no [DONE]; every body has the
    shape of the SDK's type for it."""
    engine = ScriptedEngine(tokenizer, pieces_of(CALLS_TEXT))
    http, client = scripted_client(engine)
    kw = dict(model="tiny", input="Weather and time in Paris?", tools=WEATHER_TOOLS)
    with http:
        whole = client.responses.create(**kw)
        events = list(client.responses.create(stream=True, **kw))
        wire = http.post("/v1/responses", json=dict(kw, stream=True)).text
        as_the_sdk_types_it(http.post("/v1/responses", json=kw).json())
    assert engine.requests[0].tools == [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                                        for t in WEATHER_TOOLS]
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call", "function_call"]
    assert text_of(whole.output[0]) == "The user wants the weather." and whole.output_text == "Let me look that up."
    calls = [(item.name, json.loads(item.arguments)) for item in whole.output[2:]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3, "hourly": True}), ("get_time", {"zone": "CET"})]
    assert without_ids(events[-1].response.output) == without_ids(whole.output)
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [item.id for item in events[-1].response.output]
    blocks = [block.split("\n") for block in wire.strip().split("\n\n")]
    assert all(b[0] == f"event: {as_the_sdk_types_it(json.loads(b[1].removeprefix('data: ')))['type']}"
               for b in blocks)
    assert blocks[-1][0] == "event: response.completed" and "[DONE]" not in wire


def test_input_items_become_the_chat_turns(tokenizer):  # noqa: F811
    """A reasoning item, an assistant message and two function_call items make one assistant turn; each
    function_call_output a tool message; `developer` a system turn; instructions come first."""
    engine = ScriptedEngine(tokenizer, ["ok"])
    http, client = scripted_client(engine)
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather and time?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Both."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone": "CET"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"}]
    with http:
        client.responses.create(model="tiny", input=history, tools=WEATHER_TOOLS, instructions="Be brief.")
    assert engine.requests[0].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather and time?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "reasoning_content": "Both.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris", "days": 3}}},
                        {"id": "c2", "type": "function", "function": {"name": "get_time",
                                                                      "arguments": {"zone": "CET"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}]
    rendered = tokenizer.apply_chat_template(engine.requests[0].prompt, tools=engine.requests[0].tools)
    assert "<think>\nBoth.\n</think>\n\nLooking.\n\n<tool_call>\n<function=get_weather>" in rendered
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>" in rendered


def test_instructions_and_leading_developer_items_are_one_system_turn(tokenizer):  # noqa: F811
    """As Codex CLI sends them: the template takes a system message only at the start."""
    engine = ScriptedEngine(tokenizer, ["ok"])
    http, client = scripted_client(engine)
    with http:
        client.responses.create(model="tiny", instructions="Be brief.", input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
            {"role": "system", "content": "Cwd: /repo"}, {"role": "user", "content": "hi"}])
    assert engine.requests[0].prompt == [{"role": "system", "content": "Be brief.\n\nSandbox: read-only.\n\nCwd: /repo"},
                                         {"role": "user", "content": "hi"}]


def test_reasoning_effort_and_sampling_reach_the_engine(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, ["ok"])
    http, client = scripted_client(engine)
    with http:
        whole = client.responses.create(model="tiny", input="Hi", reasoning={"effort": "minimal"}, temperature=0.5,
                                        top_p=0.9, max_output_tokens=7, metadata={"k": "v"}, store=True)
        client.responses.create(model="tiny", input="Hi", reasoning={"effort": "high"})
        client.responses.create(model="tiny", input="Hi")
    assert [r.enable_thinking for r in engine.requests] == [False, True, None]
    params = engine.requests[0].params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.9, 7)
    assert whole.output_text == "ok" and whole.metadata == {"k": "v"} and whole.temperature == 0.5


REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]"),
    ({"tools": [*WEATHER_TOOLS, {"type": "web_search"}]}, "tools[2].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "x"}]}, "input[1].type"),
    ({"input": [{"type": ["message"], "role": "user", "content": "a"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[1].call_id"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "{oops"}]}, "input[1].arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[1].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "file:///etc/passwd"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "robot", "content": "a"}]}, "input[0].role"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "{}"}}}, "text.format.schema"),
]


@pytest.mark.parametrize("fields, param", REFUSED, ids=[p for _, p in REFUSED])
def test_refusals_name_the_field(tokenizer, fields, param):  # noqa: F811
    engine = ScriptedEngine(tokenizer, ["ok"])
    http, client = scripted_client(engine)
    with http:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "tiny", "input": "Hi", **fields})
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["message"].startswith(param) or param in e.value.body["message"]
    assert engine.requests == []


def test_context_overflow_is_named_in_responses_terms(tokenizer):  # noqa: F811
    """The chat route's context error, as clients recognise it, naming input and max_output_tokens."""
    http, client = scripted_client(ScriptedEngine(tokenizer, ["ok"]))
    with http:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input="Hi", max_output_tokens=5000)
    error = e.value.body
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    assert error["message"].startswith("This model's maximum context length is 4096 tokens. However, you requested "
                                       "5005 tokens (5 in the input, 5000 in the completion: max_output_tokens).")
    assert "messages" not in error["message"] and "max_completion_tokens" not in error["message"]


def test_engine_failure_is_a_500_or_response_failed(tokenizer):  # noqa: F811
    http, client = scripted_client(ScriptedEngine(tokenizer, ["a", "b"], finish="error", error="out of luck"))
    with http:
        with pytest.raises(openai.InternalServerError, match="out of luck"):
            client.responses.create(model="tiny", input="Hi")
        events = list(client.responses.create(model="tiny", input="Hi", stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.message == "out of luck"
