"""Third-party OpenAI clients against `qwenrt serve` (issue 37): which of them work unchanged. Not a test: a survey.

    python bench/clients.py                                  # starts the server with the built-in model
    python bench/clients.py --base-url http://127.0.0.1:8000 --clients openai,litellm

It installs nothing. Each client library that is installed (the official `openai` SDK, langchain-openai, LiteLLM,
openai-agents, pydantic-ai, instructor, smolagents, lm-eval) runs in a process of its own against the server, check
by check, and the table shows pass / fail (with the first line of the error) / not installed / - (no such check for
that client). A check passes when the client completes the round trip without an exception and the result has the
right shape; the prompts are those the built-in model answers ("What is 127 + 385?" must come back with 512, a
multiplication calls its calculator tool). Checks:
- chat, stream: one question, whole and streamed;
- tools: a tool call and the answer after the tool's response (`tool_choice` auto), and a call forced by
  `tool_choice` (required or named) where the client has a way to ask for one;
- structured: the client's structured-output path (response_format json_schema, or a forced tool), validated;
- overflow: a prompt over the context limit raises the client's own context-window error (or, where it has none, an
  HTTP 400 with `code: context_length_exceeded`);
- responses: the client over the Responses API (`POST /v1/responses`);
- agent: the client's agent loop with a tool (and `output_type` where it has one) to a final answer;
- loglik: prompt log-probabilities (`echo` with `logprobs` on /v1/completions), as lm-eval's log-likelihood tasks
  use them, with the prompt sent as token ids from transformers' AutoTokenizer of `--tokenizer`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILTIN_MODEL = ROOT / "qwenrt" / "tiny" / "model"
MARK = "qwenrt-clients: "  # the lines a client's process reports on
CHECKS = ("chat", "stream", "tools", "structured", "overflow", "responses", "agent", "loglik")

QUESTION, ANSWER = "What is 127 + 385?", "512"
TOOL_QUESTION = "What is 4821 * 37?"  # the built-in model calls its calculator for a product
OFF_TOPIC = "Hello"  # no tool call of its own: only a forced one
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Multiply or divide two whole numbers exactly.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "two numbers joined by * or /, e.g. 1234 * 56"}},
        "required": ["expression"]}}}
_BOUNDED = {"type": "integer", "minimum": 0, "maximum": 10**6}  # the built-in model writes a free number's digits on
SUM_SCHEMA = {"type": "object", "properties": {"a": _BOUNDED, "b": _BOUNDED, "total": _BOUNDED},
              "required": ["a", "b", "total"], "additionalProperties": False}


def calculator(expression: str) -> str:
    """Multiply or divide two whole numbers exactly.

    Args:
        expression: two numbers joined by * or /, e.g. 1234 * 56
    """
    left, op, right = re.split(r"\s*([*/×])\s*", expression.strip())
    return str(int(left) * int(right) if op in "*×" else int(left) // int(right))


@functools.cache  # one class: checks compare the output's type with it
def pydantic_sum():  # pydantic comes with every client here, not with this script
    from pydantic import BaseModel, ConfigDict, Field

    class Sum(BaseModel):
        """Two whole numbers and their sum (bounded, as SUM_SCHEMA)."""
        model_config = ConfigDict(extra="forbid")
        a: int = Field(ge=0, le=10**6)
        b: int = Field(ge=0, le=10**6)
        total: int = Field(ge=0, le=10**6)

    return Sum


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def overflow_text(words: int) -> str:
    return "hello " * words


def http_400(error, code: str = "context_length_exceeded") -> None:
    """Pass when an HTTP error body carries `code`; else fail naming what it had."""
    body = error.body if isinstance(error.body, dict) else {}
    expect(body.get("code") == code, f"400 with code {body.get('code')!r}: {body.get('message', error)}")


# ---- the clients' checks: each takes the run's settings, raises on failure ----------------------------------

class Run:
    """What every check needs: the server's /v1 URL, the model name, the overflow prompt's length, the tokenizer."""

    def __init__(self, args):
        self.base = args.base_url.rstrip("/") + "/v1"
        self.model, self.overflow_words, self.tokenizer = args.model, args.overflow_words, args.tokenizer


def openai_checks(run: Run) -> dict:
    import openai

    client = openai.OpenAI(base_url=run.base, api_key="none", max_retries=0)
    user = [{"role": "user", "content": QUESTION}]

    def chat():
        message = client.chat.completions.create(model=run.model, messages=user).choices[0].message
        expect(ANSWER in (message.content or ""), f"answer {message.content!r}")

    def stream():
        chunks = client.chat.completions.create(model=run.model, messages=user, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expect(ANSWER in text and chunks[-1].usage is not None, f"streamed {text!r}")

    def tools():
        messages = [{"role": "user", "content": TOOL_QUESTION}]
        reply = client.chat.completions.create(model=run.model, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        expect(bool(message.tool_calls), f"no tool call: {message.content!r}")
        call = message.tool_calls[0]
        result = calculator(**json.loads(call.function.arguments))
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
        final = client.chat.completions.create(model=run.model, messages=messages, tools=[CALCULATOR])
        expect(result in (final.choices[0].message.content or ""), "the answer lacks the tool's result")
        forced = client.chat.completions.create(model=run.model, messages=[{"role": "user", "content": OFF_TOPIC}],
                                                tools=[CALCULATOR], tool_choice="required").choices[0].message
        expect(bool(forced.tool_calls), "tool_choice required: no tool call")
        json.loads(forced.tool_calls[0].function.arguments)

    def structured():
        parsed = client.chat.completions.parse(model=run.model, messages=user, response_format=pydantic_sum())
        expect(parsed.choices[0].message.parsed is not None, "nothing parsed")

    def overflow():
        try:
            client.chat.completions.create(model=run.model, messages=[
                {"role": "user", "content": overflow_text(run.overflow_words)}], max_tokens=1)
        except openai.BadRequestError as e:
            return http_400(e)
        raise AssertionError("no error")

    def responses():
        response = client.responses.create(model=run.model, input=QUESTION)
        expect(ANSWER in response.output_text, f"output {response.output_text!r}")
        events = list(client.responses.create(model=run.model, input=QUESTION, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        expect(events[-1].type == "response.completed" and ANSWER in deltas, f"streamed {deltas!r}")

    def loglik():
        out = client.completions.create(model=run.model, prompt=QUESTION, max_tokens=0, echo=True, logprobs=1)
        logprobs = out.choices[0].logprobs
        expect(logprobs is not None and logprobs.token_logprobs[0] is None and
               all(isinstance(x, float) for x in logprobs.token_logprobs[1:]), "no prompt logprobs")

    return dict(chat=chat, stream=stream, tools=tools, structured=structured, overflow=overflow, responses=responses,
                loglik=loglik)


def langchain_checks(run: Run) -> dict:
    from langchain_core.exceptions import ContextOverflowError
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI

    def llm(**kwargs):
        return ChatOpenAI(model=run.model, base_url=run.base, api_key="none", max_retries=0, **kwargs)

    def chat():
        expect(ANSWER in llm().invoke(QUESTION).text, "no answer")

    def stream():
        expect(ANSWER in "".join(chunk.text for chunk in llm().stream(QUESTION)), "no answer")

    def tools():
        bound = llm().bind_tools([CALCULATOR])
        message = bound.invoke(TOOL_QUESTION)
        expect(bool(message.tool_calls), f"no tool call: {message.text!r}")
        call = message.tool_calls[0]
        result = calculator(**call["args"])
        final = bound.invoke([("user", TOOL_QUESTION), message, ToolMessage(result, tool_call_id=call["id"])])
        expect(result in final.text, "the answer lacks the tool's result")
        forced = llm().bind_tools([CALCULATOR], tool_choice="calculator").invoke(OFF_TOPIC)
        expect(bool(forced.tool_calls), "tool_choice calculator: no tool call")

    def structured():
        expect(llm().with_structured_output(pydantic_sum()).invoke(QUESTION) is not None, "nothing parsed")

    def overflow():
        try:
            llm(max_tokens=1).invoke(overflow_text(run.overflow_words))
        except ContextOverflowError:
            return
        raise AssertionError("no error")

    def responses():
        expect(ANSWER in llm(use_responses_api=True).invoke(QUESTION).text, "no answer")

    return dict(chat=chat, stream=stream, tools=tools, structured=structured, overflow=overflow, responses=responses)


def litellm_checks(run: Run) -> dict:
    import litellm

    common = dict(model=f"openai/{run.model}", api_base=run.base, api_key="none", num_retries=0)
    user = [{"role": "user", "content": QUESTION}]

    def chat():
        expect(ANSWER in (litellm.completion(messages=user, **common).choices[0].message.content or ""), "no answer")

    def stream():
        chunks = litellm.completion(messages=user, stream=True, **common)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        expect(ANSWER in text, f"streamed {text!r}")

    def tools():
        messages = [{"role": "user", "content": TOOL_QUESTION}]
        message = litellm.completion(messages=messages, tools=[CALCULATOR], **common).choices[0].message
        expect(bool(message.tool_calls), f"no tool call: {message.content!r}")
        call = message.tool_calls[0]
        result = calculator(**json.loads(call.function.arguments))
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
        final = litellm.completion(messages=messages, tools=[CALCULATOR], **common).choices[0].message
        expect(result in (final.content or ""), "the answer lacks the tool's result")
        forced = litellm.completion(messages=[{"role": "user", "content": OFF_TOPIC}], tools=[CALCULATOR],
                                    tool_choice="required", **common).choices[0].message
        expect(bool(forced.tool_calls), "tool_choice required: no tool call")

    def structured():
        content = litellm.completion(messages=user, response_format=pydantic_sum(), **common).choices[0].message.content
        pydantic_sum().model_validate_json(content)

    def overflow():
        try:
            litellm.completion(messages=[{"role": "user", "content": overflow_text(run.overflow_words)}], max_tokens=1,
                               **common)
        except litellm.ContextWindowExceededError:
            return
        raise AssertionError("no error")

    def responses():
        response = litellm.responses(input=QUESTION, **{k: v for k, v in common.items() if k != "num_retries"})
        text = "".join(part.text for item in response.output if item.type == "message" for part in item.content)
        expect(ANSWER in text, f"output {text!r}")

    return dict(chat=chat, stream=stream, tools=tools, structured=structured, overflow=overflow, responses=responses)


def agents_checks(run: Run) -> dict:
    import asyncio

    import openai
    from agents import (Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    tool = function_tool(calculator)

    def client():  # one per check: an async client's connections belong to the event loop that opened them
        return openai.AsyncOpenAI(base_url=run.base, api_key="none", max_retries=0)

    def chat_model():
        return OpenAIChatCompletionsModel(model=run.model, openai_client=client())

    def responses_model():
        return OpenAIResponsesModel(model=run.model, openai_client=client())

    def agent_run(model, prompt, **kwargs):
        return Runner.run_sync(Agent(name="qwenrt", model=model, **kwargs), prompt, max_turns=4)

    def chat():
        expect(ANSWER in agent_run(chat_model(), QUESTION).final_output, "no answer")

    def stream():
        async def streamed():
            result = Runner.run_streamed(Agent(name="qwenrt", model=chat_model()), QUESTION, max_turns=2)
            async for _ in result.stream_events():
                pass
            return result.final_output

        expect(ANSWER in asyncio.run(streamed()), "no answer")

    def tools():
        result = agent_run(chat_model(), TOOL_QUESTION, tools=[tool])
        expect(calculator("4821 * 37") in result.final_output, f"final output {result.final_output!r}")

    def structured():
        expect(isinstance(agent_run(chat_model(), QUESTION, output_type=pydantic_sum()).final_output, pydantic_sum()),
               "not the output type")

    def overflow():
        try:
            agent_run(chat_model(), overflow_text(run.overflow_words))
        except openai.BadRequestError as e:
            return http_400(e)
        raise AssertionError("no error")

    def responses():
        expect(ANSWER in agent_run(responses_model(), QUESTION).final_output, "no answer")

    def agent():
        result = agent_run(responses_model(), TOOL_QUESTION, tools=[tool], output_type=pydantic_sum())
        expect(isinstance(result.final_output, pydantic_sum()), "not the output type")

    return dict(chat=chat, stream=stream, tools=tools, structured=structured, overflow=overflow, responses=responses,
                agent=agent)


def pydantic_ai_checks(run: Run) -> dict:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=run.base, api_key="none")
    chat_model, responses_model = OpenAIChatModel(run.model, provider=provider), OpenAIResponsesModel(
        run.model, provider=provider)

    def chat():
        expect(ANSWER in Agent(chat_model).run_sync(QUESTION).output, "no answer")

    def stream():
        async def streamed():
            async with Agent(chat_model).run_stream(QUESTION) as result:
                return "".join([text async for text in result.stream_text(delta=True)])

        import asyncio
        expect(ANSWER in asyncio.run(streamed()), "no answer")

    def tools():
        result = Agent(chat_model, tools=[calculator]).run_sync(TOOL_QUESTION)
        calls = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
        expect(bool(calls) and calculator("4821 * 37") in result.output, f"output {result.output!r}")

    def structured():
        expect(isinstance(Agent(chat_model, output_type=pydantic_sum()).run_sync(QUESTION).output, pydantic_sum()),
               "not the output type")

    def overflow():
        try:
            Agent(chat_model).run_sync(overflow_text(run.overflow_words))
        except ModelHTTPError as e:
            return http_400(e)
        raise AssertionError("no error")

    def responses():
        expect(ANSWER in Agent(responses_model).run_sync(QUESTION).output, "no answer")

    def agent():
        result = Agent(responses_model, tools=[calculator], output_type=pydantic_sum()).run_sync(TOOL_QUESTION)
        expect(isinstance(result.output, pydantic_sum()), "not the output type")

    return dict(chat=chat, stream=stream, tools=tools, structured=structured, overflow=overflow, responses=responses,
                agent=agent)


def instructor_checks(run: Run) -> dict:
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=run.base, api_key="none", max_retries=0))

    def structured():
        result = client.chat.completions.create(model=run.model, response_model=pydantic_sum(), max_retries=0,
                                                messages=[{"role": "user", "content": QUESTION}])
        expect(isinstance(result, pydantic_sum()), "not the response model")

    return dict(structured=structured)


def smolagents_checks(run: Run) -> dict:
    import openai
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id=run.model, api_base=run.base, api_key="none")
    user = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    calculator_tool = tool(calculator)

    def chat():
        expect(ANSWER in (model.generate(user).content or ""), "no answer")

    def stream():
        expect(ANSWER in "".join(d.content or "" for d in model.generate_stream(user)), "no answer")

    def tools():
        message = model.generate([{"role": "user", "content": [{"type": "text", "text": TOOL_QUESTION}]}],
                                 tools_to_call_from=[calculator_tool])
        expect(bool(message.tool_calls), f"no tool call: {message.content!r}")

    def structured():
        format_ = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SUM_SCHEMA, "strict": True}}
        pydantic_sum().model_validate_json(model.generate(user, response_format=format_).content)

    def overflow():
        try:
            model.generate([{"role": "user", "content": [{"type": "text", "text": overflow_text(run.overflow_words)}]}],
                           max_tokens=1)
        except openai.BadRequestError as e:
            return http_400(e)
        raise AssertionError("no error")

    def agent():
        answer = ToolCallingAgent(tools=[calculator_tool], model=model, max_steps=3, verbosity_level=0).run(
            TOOL_QUESTION)
        expect(calculator("4821 * 37") in str(answer), f"final answer {answer!r}")

    return dict(chat=chat, stream=stream, tools=tools, structured=structured, overflow=overflow, agent=agent)


def lm_eval_checks(run: Run) -> dict:
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    until = {"until": ["<|im_end|>"], "max_gen_toks": 200}

    def completions():  # the prompt goes as token ids from transformers' tokenizer
        return LocalCompletionsAPI(base_url=run.base + "/completions", model=run.model, tokenizer_backend="huggingface",
                                   tokenizer=str(run.tokenizer), max_retries=1)

    def chat():
        chat_lm = LocalChatCompletion(base_url=run.base + "/chat/completions", model=run.model, max_retries=1)
        messages = JsonChatStr(json.dumps([{"role": "user", "content": QUESTION}]))
        [answer] = chat_lm.generate_until([Instance("generate_until", {}, (messages, until), 0)])
        expect(ANSWER in answer, f"chat answer {answer!r}")
        [answer] = completions().generate_until([Instance("generate_until", {}, (prompt, until), 0)])
        expect(ANSWER in answer, f"completions answer {answer!r}")

    def loglik():
        right, wrong = completions().loglikelihood([Instance("loglikelihood", {}, (prompt, f"127 + 385 = {a}"), i)
                                                    for i, a in enumerate((ANSWER, "513"))])
        expect(right[0] > wrong[0], f"log-likelihoods {right[0]:.2f} (512) and {wrong[0]:.2f} (513)")

    return dict(chat=chat, loglik=loglik)


# name: (distribution, top-level module, the checks)
CLIENTS = {
    "openai": ("openai", "openai", openai_checks),
    "langchain-openai": ("langchain-openai", "langchain_openai", langchain_checks),
    "litellm": ("litellm", "litellm", litellm_checks),
    "openai-agents": ("openai-agents", "agents", agents_checks),
    "pydantic-ai": ("pydantic-ai-slim", "pydantic_ai", pydantic_ai_checks),
    "instructor": ("instructor", "instructor", instructor_checks),
    "smolagents": ("smolagents", "smolagents", smolagents_checks),
    "lm-eval": ("lm_eval", "lm_eval", lm_eval_checks),
}


# ---- one client, in a process of its own ---------------------------------------------------------------------

def reason(error: BaseException) -> str:
    """The first line of what went wrong, short: a check's verdict, or the server's status and message where the
    client kept them (on the error or one it wraps), else the error's own."""
    if not isinstance(error, AssertionError):  # a check's own verdict says more than the error it looked at
        error = next((e for e in _chain(error) if _body(e)), error)
    body = _body(error)
    if body is not None:
        status = getattr(error, "status_code", None) or getattr(getattr(error, "response", None), "status_code", "")
        text = f"{status} {body['message']}"
    else:
        text = str(error) if isinstance(error, AssertionError) else f"{type(error).__name__}: {error}"
    line = next((s for s in text.splitlines() if s.strip()), type(error).__name__).strip()
    return line if len(line) <= 120 else line[:117] + "..."



def _chain(error: BaseException) -> list[BaseException]:
    """The error and those it was raised from or while handling, outermost first."""
    chain = [error]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(inner)
    return chain


def _body(error: BaseException) -> dict | None:
    """The OpenAI-shaped error body an HTTP error carries: openai's `body`, or a requests/httpx `response`'s JSON."""
    body = getattr(error, "body", None)
    if body is None and hasattr(getattr(error, "response", None), "json"):
        try:
            body = error.response.json().get("error")
        except Exception:  # noqa: BLE001 - not JSON: no body
            body = None
    return body if isinstance(body, dict) and isinstance(body.get("message"), str) else None


def report(record: dict) -> None:
    """One line to the parent; the mark keeps it apart from what clients print themselves (LiteLLM does)."""
    print(MARK + json.dumps(record), flush=True)


def _time_out(*_):
    raise TimeoutError("no result in time")


def run_client(name: str, args) -> None:
    """Print {"version", "checks"}, then one JSON line per check of client `name`: {"check", "status", "reason"}
    (or one {"status": "not installed"})."""
    distribution, module, checks = CLIENTS[name]
    try:
        checks = checks(Run(args))
    except ImportError as e:
        report({"status": "not installed", "reason": reason(e)})
        return
    report({"version": importlib.metadata.version(distribution), "checks": list(checks)})
    signal.signal(signal.SIGALRM, _time_out)
    for check in CHECKS:
        if check not in checks:
            continue
        signal.alarm(args.check_timeout)
        try:
            checks[check]()
            status, why = "pass", ""
        except Exception as e:  # noqa: BLE001 - any failure of the client is the finding
            status, why = "fail", reason(e)
        finally:
            signal.alarm(0)
        report({"check": check, "status": status, "reason": why})


def survey(name: str, args, log: Path) -> dict:
    """{"version", check: (status, reason)} of one client, run in a subprocess."""
    if importlib.util.find_spec(CLIENTS[name][1]) is None:
        return {"version": "", "status": "not installed"}
    command = [sys.executable, __file__, "--one", name, "--base-url", args.base_url, "--model", args.model,
               "--overflow-words", str(args.overflow_words), "--tokenizer", str(args.tokenizer),
               "--check-timeout", str(args.check_timeout)]
    with open(log, "w") as err:
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=args.check_timeout * (len(CHECKS) + 1))
            out, ended = done.stdout, None if done.returncode == 0 else f"the client process exited {done.returncode}"
        except subprocess.TimeoutExpired as e:
            out, ended = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or "", "timed out"
    result, planned = {"version": ""}, []
    for line in out.splitlines():
        if not line.startswith(MARK):
            continue
        record = json.loads(line[len(MARK):])
        if "version" in record:
            result["version"], planned = record["version"], record["checks"]
        elif "check" in record:
            result[record["check"]] = (record["status"], record["reason"])
        else:
            result["status"] = record["status"]
    if ended:
        for check in planned or CHECKS:
            result.setdefault(check, ("fail", f"{ended} (log: {log})"))
    return result


# ---- the table ---------------------------------------------------------------------------------------------------

def cell(result: dict, check: str) -> str:
    if result.get("status") == "not installed":
        return "not installed"
    status, why = result.get(check, ("-", ""))
    return f"fail: {why}" if status == "fail" else status


def table(results: dict[str, dict]) -> str:
    lines = ["| client | version | " + " | ".join(CHECKS) + " |", "|---|---|" + "---|" * len(CHECKS)]
    for name, result in results.items():
        lines.append(f"| {name} | {result.get('version') or '-'} | " + " | ".join(cell(result, c) for c in CHECKS)
                     + " |")
    return "\n".join(lines)


def server_facts(base_url: str) -> tuple[str, int | None]:
    """The first served model name and its context limit (qwenrt and vLLM list max_model_len)."""
    import httpx

    card = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]
    return card["id"], card.get("max_model_len")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server (default: start `qwenrt serve` with the built-in model "
                                           "on a free loopback port)")
    parser.add_argument("--model", help="the model name clients send (default: the server's first)")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated, of {', '.join(CLIENTS)}")
    parser.add_argument("--tokenizer", type=Path, default=BUILTIN_MODEL,
                        help="checkpoint directory whose tokenizer lm-eval loads (default: the built-in model)")
    parser.add_argument("--overflow-words", type=int,
                        help="length of the overflow prompt (default: the server's context limit + 16)")
    parser.add_argument("--check-timeout", type=int, default=120, help="seconds one check may take (default 120)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--one", choices=CLIENTS, help=argparse.SUPPRESS)  # a client's own process
    args = parser.parse_args()
    if args.one:
        return run_client(args.one, args)
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        parser.error(f"unknown client(s) {', '.join(unknown)} (known: {', '.join(CLIENTS)})")

    logs = Path(tempfile.mkdtemp(prefix="qwenrt-clients-"))
    print(f"logs in {logs}", file=sys.stderr)
    server = None
    if args.base_url is None and any(importlib.util.find_spec(CLIENTS[n][1]) for n in names):
        sys.path.insert(0, str(ROOT))  # `tests.*` when run as a script
        from tests.server_process import ServerProcess

        server = ServerProcess(None, logs / "serve.log", timeout=900)  # the first start may compile the kernels
        args.base_url = server.url
    try:
        if args.base_url and (args.model is None or args.overflow_words is None):
            model, limit = server_facts(args.base_url)
            args.model = args.model or model
            args.overflow_words = args.overflow_words or (limit or 131072) + 16
        results = {}
        for name in names:
            start = time.monotonic()
            results[name] = survey(name, args, logs / f"{name}.log")
            print(f"{name}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
