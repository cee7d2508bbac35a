"""`qwenrt serve`: a real server (a subprocess on a free loopback port, tiny checkpoints) driven with the official
`openai` client, plus the app in-process over a scripted engine where a test needs a model output it can choose
(tool calls, a reasoning block that closes, an engine error)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import torch
from PIL import Image

import qwenrt
from qwenrt.engine import RequestHandle, RequestOutput
from qwenrt.parsing import parse_completion
from tests import checkpoints
from tests.server_process import ROOT, ServerProcess

KEY = "sk-test"
ORIGIN = "http://localhost:3000"
JSON_HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


# ---- a real server ------------------------------------------------------------------------------------------

class Server(ServerProcess):
    def __init__(self, tmp: Path, checkpoint: Path, *options: str):
        super().__init__(checkpoint, tmp / "server.log", "--served-model-name", "tiny", "--api-key", KEY, *options,
                         env={"OMP_NUM_THREADS": "2"})

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **options)


@pytest.fixture(scope="session")
def server(chat_ckpt, tmp_path_factory):
    """The chat checkpoint (real vocabulary and template), default limits, no local media, CORS for one origin."""
    s = Server(tmp_path_factory.mktemp("server"), chat_ckpt[0], "--max-model-len", "1024", "--allowed-origins",
               ORIGIN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded_server(chat_ckpt, tmp_path_factory):
    """The chat checkpoint behind tight connection limits: 64 KiB bodies, headers due in 1 s, 16 connections."""
    s = Server(tmp_path_factory.mktemp("guarded"), chat_ckpt[0], "--max-request-bytes", "64KiB", "--header-timeout",
               "1", "--max-connections", "16")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def vlm_server(tmp_path_factory, media_dir):
    """A VLM with one running slot and one queue place, reading local images under media_dir."""
    path = tmp_path_factory.mktemp("vlm-chat-serve")
    checkpoints.build_chat_vlm(path)
    s = Server(tmp_path_factory.mktemp("vlm-server"), path, "--max-running", "1", "--max-queue", "1",
               "--allowed-local-media-path", str(media_dir))
    yield s
    s.stop()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def collect_stream(stream) -> dict:
    """Concatenate a chat stream's deltas into one message (tool calls by index), as a client would."""
    out = {"role": None, "content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            out["role"] = out["role"] or d.role
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for t in d.tool_calls or ():
                call = out["calls"].setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or t.id
                call["name"] = call["name"] or (t.function.name if t.function else None)
                call["arguments"] += (t.function.arguments or "") if t.function else ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


# ---- chat, completions, reasoning, sampling -----------------------------------------------------------------

def test_health_and_models(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].max_model_len == 1024


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_is_the_python_api_answer_split(server, chat_model, thinking):
    """Greedy: the server's message is what qwenrt.complete gives for the same messages (the same template,
    thinking switch and split at </think>); streamed deltas concatenate to it; usage counts the same tokens."""
    model, tok, _ = chat_model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = qwenrt.complete(model, tok, messages, max_tokens=14, enable_thinking=thinking)
    kw = dict(max_tokens=14, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    whole = chat(server.client(), messages, **kw)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (want.reasoning, want.content)
    assert (want.reasoning is not None) == thinking
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (want.prompt_tokens, want.generation_tokens)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.choices[0].finish_reason == want.finish_reason

    streamed = collect_stream(chat(server.client(), messages, stream=True, stream_options={"include_usage": True},
                                   **kw))
    assert streamed["role"] == "assistant"
    assert (streamed["reasoning"], streamed["content"]) == (want.reasoning or "", want.content)
    assert streamed["finish"] == whole.choices[0].finish_reason
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(streamed["usage"], k) for k in counts] == [getattr(whole.usage, k) for k in counts]


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server):
    client = server.client()
    messages = [{"role": "system", "content": "You are a careful assistant. " * 20}, *user("Summarise the above.")]
    hits = server.metric("prefix_cache_hits_total")
    first, again = (chat(client, messages, max_tokens=4, temperature=0) for _ in range(2))
    assert again.choices[0].message == first.choices[0].message
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens and first.usage.prompt_tokens_details.cached_tokens < cached
    assert server.metric("prefix_cache_hits_total") - hits >= cached


def test_history_reasoning_under_either_name(server):
    """An assistant turn's reasoning arrives as `reasoning_content` (SGLang, old vLLM) or `reasoning` (vLLM): the
    template renders both the same (the turn after the last user query keeps its think block)."""
    def ask(field):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", field: "Greet back."}]
        return chat(server.client(), messages, max_tokens=1, temperature=0).usage.prompt_tokens

    plain = chat(server.client(), [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
                 max_tokens=1).usage.prompt_tokens
    assert ask("reasoning_content") == ask("reasoning") > plain


def test_completions_whole_streamed_and_token_ids(server, chat_model):
    _, tok, _ = chat_model
    client = server.client()
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    whole = client.completions.create(prompt="The quick brown fox", logprobs=2, **kw)
    choice = whole.choices[0]
    assert whole.usage.prompt_tokens == len(tok.encode("The quick brown fox"))
    assert len(choice.logprobs.tokens) == whole.usage.completion_tokens == len(choice.logprobs.token_logprobs)
    assert all(len(top) <= 2 and lp <= 0
               for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    assert "".join(choice.logprobs.tokens) == choice.text
    chunks = list(client.completions.create(prompt="The quick brown fox", stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # a token-id prompt is the same prompt; a list of prompts gives one choice each, in order
    ids = tok.encode("The quick brown fox")
    batch = client.completions.create(prompt=[ids, tok.encode("Hello")], **kw)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == choice.text
    assert batch.choices[1].text == client.completions.create(prompt="Hello", **kw).choices[0].text


def test_echo_scores_the_prompt_as_one_whole_forward(server, chat_model):
    """lm-eval's log-likelihood request (echo, logprobs, max_tokens 0): the text is the prompt, its tokens carry the
    logprobs of one whole forward (the first null); with max_tokens > 0 the completion's follow with text_offset
    continuing; a stream sends the prompt in its first chunk."""
    model, tok, _ = chat_model
    client = server.client()
    prompt = "Echo: the quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]  # [T, V]
    ref, tolerance = logits.log_softmax(-1), 1e-4 * logits.abs().max().item()
    scored = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.text_offset == [len("".join(lp.tokens[:i]))
                                                                             for i in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref[torch.arange(len(ids) - 1), ids[1:]].tolist(), abs=tolerance)
    assert [list(top) for top in lp.top_logprobs[1:]] == [[tok.decode([int(row.argmax())])] for row in ref[:-1]]
    by_ids = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0).choices[0]
    assert by_ids.text == tok.decode(ids) and by_ids.logprobs.token_logprobs == lp.token_logprobs
    bare = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0).choices[0]
    assert bare.text == prompt and bare.logprobs is None
    kw = dict(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, **kw).choices[0]
    assert echoed.text == prompt + plain.text and echoed.logprobs.tokens == lp.tokens + plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs == pytest.approx(lp.token_logprobs + plain.logprobs.token_logprobs,
                                                           abs=tolerance)
    assert echoed.logprobs.text_offset == lp.text_offset + [len(prompt) + o for o in plain.logprobs.text_offset]
    chunks = [c.choices[0] for c in client.completions.create(echo=True, stream=True, **kw)]
    assert chunks[0].text.startswith(prompt) and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == echoed.text
    for key in ("tokens", "text_offset"):
        assert sum((getattr(c.logprobs, key) for c in chunks), []) == getattr(echoed.logprobs, key)


def test_sampling_fields_reach_the_sampler(server):
    client = server.client()
    seeded = [chat(client, user("Tell me a story."), max_tokens=12, temperature=1.0, seed=7).choices[0].message
              for _ in range(2)]
    assert seeded[0] == seeded[1]  # a seed makes a sampled answer repeatable
    greedy = chat(client, user("Tell me a story."), max_tokens=12, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text = greedy.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = chat(client, user("Tell me a story."), max_tokens=12, temperature=0, stop=[stop],
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    whole = chat(client, user("Tell me a story."), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    # greedy: the chosen token is the most likely one
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)


def test_tools_reach_the_template_and_stream_like_whole(server):
    """A random model does not call tools; this shows the tools reach the prompt and the streamed message equals the
    whole one on the real path (the call parsing itself is tested with a scripted engine below)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    client = server.client()
    kw = dict(max_tokens=10, temperature=0)
    without = chat(client, user("Weather in Paris?"), **kw)
    whole = chat(client, user("Weather in Paris?"), tools=tools, **kw)
    assert whole.usage.prompt_tokens > without.usage.prompt_tokens + 50
    streamed = collect_stream(chat(client, user("Weather in Paris?"), tools=tools, stream=True, **kw))
    message = whole.choices[0].message
    assert (streamed["reasoning"], streamed["content"]) == (message.reasoning_content or "", message.content or "")
    assert len(streamed["calls"]) == len(message.tool_calls)


# ---- around the core: models by id, tokenize, reasoning under both names and its effort, CORS, request ids --

def post(server, path: str, body: dict, headers: dict = JSON_HEADERS) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_a_model_by_id(server):
    client = server.client()
    assert client.models.retrieve("tiny").model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert (e.value.body["param"], e.value.code) == ("model", "model_not_found")


def test_tokenize_is_the_prompt_the_endpoints_use(server, chat_model):
    """vLLM's /tokenize: chat messages give exactly the ids /v1/chat/completions prompts with (thinking on or off,
    tools); /detokenize gives the rendered text back; a raw prompt is what /v1/completions counts."""
    _, tok, _ = chat_model
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, *user("Weather in Paris?")]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for thinking, tools_ in ((None, None), (False, None), (True, tools)):
        kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}} if thinking is not None else {}
        got = post(server, "/tokenize", {"model": "tiny", "messages": messages, "tools": tools_, **kwargs}).json()
        used = chat(client, messages, max_tokens=1, tools=tools_ or openai.omit, extra_body=kwargs).usage
        text = tok.apply_chat_template(messages, enable_thinking=thinking, tools=tools_)
        assert got == {"count": used.prompt_tokens, "max_model_len": 1024, "tokens": tok.encode(text),
                       "token_strs": None}
        assert post(server, "/detokenize", {"model": "tiny", "tokens": got["tokens"]}).json() == {"prompt": text}
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))
    raw = post(server, "/tokenize", {"prompt": "The quick brown fox", "return_token_strs": True}).json()
    assert raw["tokens"] == tok.encode("The quick brown fox") and raw["count"] == client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=1).usage.prompt_tokens
    assert raw["token_strs"] == [tok.id_to_token(t) for t in raw["tokens"]] and raw["token_strs"][1] == "Ġquick"


@pytest.mark.parametrize("path, body, param, code", [
    ("/tokenize", {"prompt": "word " * 1100}, "prompt", "context_length_exceeded"),
    ("/tokenize", {"messages": user("word " * 1100)}, "messages", "context_length_exceeded"),
    ("/detokenize", {"tokens": [7] * 1025}, "tokens", "context_length_exceeded"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens", 400),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]", 400),
    ("/tokenize", {"prompt": "x", "messages": user("x")}, "prompt", 400),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": ""}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model", "model_not_found"),
])
def test_tokenize_refusals_name_their_field(server, path, body, param, code):
    r = post(server, path, body)
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and r.status_code == (404 if param == "model" else 400)


def test_tokenize_needs_the_api_key(server):
    assert post(server, "/tokenize", {"prompt": "x"}, {}).status_code == 401
    assert post(server, "/detokenize", {"tokens": [1]}, {}).status_code == 401


def test_reasoning_under_both_names(server):
    """vLLM sends the reasoning as reasoning_content and as reasoning (what newer clients read), whole and streamed;
    the checkpoint thinks by default."""
    kw = dict(max_tokens=8, temperature=0)
    message = chat(server.client(), user("Name a colour."), **kw).choices[0].message
    assert message.reasoning_content and message.model_extra["reasoning"] == message.reasoning_content
    deltas = [c.choices[0].delta for c in chat(server.client(), user("Name a colour."), stream=True, **kw)]
    reasoning = [d.model_extra.get("reasoning") for d in deltas if d.model_extra.get("reasoning_content")]
    assert reasoning == [d.reasoning_content for d in deltas if d.model_extra.get("reasoning_content")]
    assert "".join(reasoning) == message.reasoning_content


def test_reasoning_effort_switches_thinking(server):
    """none and minimal turn thinking off, the others on: the same answer as chat_template_kwargs.enable_thinking
    (given both, they must agree)."""
    client = server.client()
    kw = dict(max_tokens=6, temperature=0)
    for effort, thinking in (("none", False), ("minimal", False), ("high", True)):
        got = chat(client, user("Name a colour."), reasoning_effort=effort, **kw)
        want = chat(client, user("Name a colour."), extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
                    **kw)
        assert (got.choices[0].message, got.usage.prompt_tokens) == (want.choices[0].message, want.usage.prompt_tokens)
        assert (got.choices[0].message.reasoning_content is None) == (not thinking)
        both = chat(client, user("Name a colour."), reasoning_effort=effort,
                    extra_body={"chat_template_kwargs": {"enable_thinking": thinking}}, **kw)
        assert both.choices[0].message == want.choices[0].message


PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os, x-stainless-retry-count, "
                                               "openai-organization"}


def test_cors_for_the_allowed_origins(server):
    """--allowed-origins: a browser's preflight (no API key on it) is answered before the key check, for the headers
    the OpenAI JS SDK sends; the answers then carry the origin (errors too, so the page can read them)."""
    preflight = httpx.options(server.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == PREFLIGHT["Access-Control-Request-Headers"]
    answer = post(server, "/v1/chat/completions", {"messages": user("Hi"), "max_tokens": 1},
                  {**JSON_HEADERS, "Origin": ORIGIN})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    assert answer.headers["access-control-expose-headers"] == "x-request-id"
    refused = post(server, "/v1/chat/completions", {"messages": user("Hi")}, {"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in other.headers


def test_request_ids_are_echoed_or_made(server):
    """x-request-id: the client's comes back on every answer (errors and streams too), or a fresh one; one that is
    not a short line of printable ASCII is refused."""
    ok = {"messages": user("Hi"), "max_tokens": 1}
    for path, body, headers, status in (
            ("/v1/chat/completions", ok, JSON_HEADERS, 200),
            ("/v1/chat/completions", {**ok, "stream": True}, JSON_HEADERS, 200),
            ("/v1/chat/completions", {**ok, "model": "gpt-4"}, JSON_HEADERS, 404),
            ("/v1/chat/completions", {"messages": []}, JSON_HEADERS, 400),
            ("/v1/chat/completions", ok, {}, 401),
            ("/tokenize", {"prompt": "Hi"}, JSON_HEADERS, 200)):
        r = post(server, path, body, {**headers, "x-request-id": "trace 42/a"})
        assert (r.status_code, r.headers["x-request-id"]) == (status, "trace 42/a"), r.text
    made = [server.client().chat.completions.with_raw_response.create(model="tiny", **ok) for _ in range(2)]
    ids = [m.headers["x-request-id"] for m in made]
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1] and made[0].request_id == ids[0]
    for bad in ("x" * 257, "caf\u00e9"):
        r = post(server, "/v1/chat/completions", ok, [*JSON_HEADERS.items(), ("x-request-id", bad.encode())])
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
        assert re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"])


# ---- concurrency and cancellation ---------------------------------------------------------------------------

PROMPTS = ["Hi", "Name three primes.", "Write a haiku about rain.", "What is 2+2?", "Translate 'cat' to French.",
           "Describe the sea in one line, please, with as much detail as you can muster.", "Count to five.", "Why?"]


def test_eight_concurrent_streams_each_equal_alone(server, chat_model):
    """Eight greedy streams at once, cold (their prompts prefilled together), each equal to that request run alone
    (in this process's own engine, so no state is shared with the server's batch)."""
    model, tok, _ = chat_model
    client = server.client(timeout=300)

    def run(prompt):
        return collect_stream(chat(client, user(prompt), max_tokens=8, temperature=0, stream=True))

    most = [0.0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            most[0] = max(most[0], server.metric("num_requests_running"))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(run, PROMPTS))
    done.set()
    watcher.join()
    for prompt, t in zip(PROMPTS, together):
        alone = qwenrt.complete(model, tok, user(prompt), max_tokens=8)
        assert (t["reasoning"], t["content"], t["finish"]) == (alone.reasoning or "", alone.content,
                                                              alone.finish_reason)
    assert most[0] >= 2  # they really shared the engine's batch
    server.wait_idle()


def test_disconnect_cancels_the_request(server):
    client = server.client(timeout=300)
    aborted = server.metric("request_success_total", '{finished_reason="abort"}')
    generated = server.metric("generation_tokens_total")
    stream = chat(client, user("Go on forever."), max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert server.wait_idle() < 10
    # non-streamed: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0,
                   json={"messages": user("Go on forever."), "max_tokens": 900, "ignore_eos": True})
    assert server.wait_idle() < 10
    assert server.metric("request_success_total", '{finished_reason="abort"}') == aborted + 2
    assert server.metric("generation_tokens_total") - generated < 900  # neither ran to its max_tokens
    assert server.metric("num_requests_running") == 0


# ---- images -------------------------------------------------------------------------------------------------

def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


def test_image_from_data_uri_and_allowed_file(vlm_server, media_dir):
    client = vlm_server.client()
    data = png(0)
    (media_dir / "a.png").write_bytes(data)
    kw = dict(max_tokens=8, temperature=0)
    by_uri = chat(client, image_message("data:image/png;base64," + base64.b64encode(data).decode()), **kw)
    by_file = chat(client, image_message(f"file://{media_dir / 'a.png'}"), **kw)
    text_only = chat(client, user("What is this?"), **kw)
    assert by_uri.usage.prompt_tokens > text_only.usage.prompt_tokens + 5  # the image's tokens are in the prompt
    assert by_uri.choices[0].message == by_file.choices[0].message
    with pytest.raises(openai.BadRequestError, match="only files under"):
        chat(client, image_message(f"file://{ROOT / 'README.md'}"), **kw)


def test_media_is_read_under_one_strict_policy(vlm_server, media_dir):
    """The policy `qwenrt serve` builds: nothing on loopback is fetched (nothing even connects), local files only
    under --allowed-local-media-path, a path the OS cannot take a 400 naming the part."""
    client = vlm_server.client()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(openai.BadRequestError, match="non-public address"):
            chat(client, image_message(f"http://localhost:{listener.getsockname()[1]}/x.png"), max_tokens=2)
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, image_message(f"file://{media_dir}/a%00b.png"), max_tokens=2)
    assert e.value.body["param"] == "messages[0].content[0].image_url.url" and "NUL" in e.value.message


def test_local_files_need_the_flag(server, media_dir):
    (media_dir / "b.png").write_bytes(png(1))
    with pytest.raises(openai.BadRequestError) as e:
        chat(server.client(), image_message(str(media_dir / "b.png")), max_tokens=2)
    assert e.value.body["param"] == "messages[0].content[0].image_url.url"


# ---- errors -------------------------------------------------------------------------------------------------

def test_error_statuses(server):
    client = server.client()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=user("Hi"))
    assert e.value.body["param"] == "model" and e.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, user("Hi"), temperature=-1)
    assert e.value.body["param"] == "temperature"


def overflow(create, **request) -> dict:
    """The error body of a request over the context, as the official client raises it."""
    with pytest.raises(openai.BadRequestError) as e:
        create(model="tiny", **request)
    assert e.value.code == "context_length_exceeded", e.value.body
    assert e.value.body["message"].startswith("This model's maximum context length is 1024 tokens. However, ")
    return e.value.body


def test_every_context_overflow_is_context_length_exceeded(server):
    """LangChain acts on the code, LiteLLM on the first sentence (vLLM's and OpenAI's wording), so their trimming
    and fallbacks fire: a long chat, a long text or token-id prompt, and a prompt that only max_tokens pushes over."""
    chat_, complete = server.client().chat.completions.create, server.client().completions.create
    body = overflow(chat_, messages=user("word " * 1100))
    assert body["param"] == "messages" and "your messages resulted in more than 1023 tokens" in body["message"]
    body = overflow(chat_, messages=user("Hi"), max_tokens=1020)
    assert body["param"] == "messages" and "in the completion: max_tokens)" in body["message"]
    body = overflow(chat_, messages=user("Hi"), max_completion_tokens=1020)
    assert body["param"] == "messages" and "max_completion_tokens" in body["message"]
    for prompt in ("word " * 1100, [7] * 1024, [7] * 1010):  # the last fits without the default max_tokens 16
        body = overflow(complete, prompt=prompt)
        assert body["param"] == "prompt"
    assert "you requested 1026 tokens (1010 in the prompt, 16 in the completion: max_tokens)" in body["message"]
    assert "resulted in 1024 tokens (at most 1023: " in overflow(complete, prompt=[7] * 1024)["message"]


MALFORMED = [
    b"{not json", b"[]", b'"text"', b"{}", b'{"messages": []}', b'{"messages": "hi"}',
    b'{"messages": [{"role": "robot", "content": "hi"}]}', b'{"messages": [{"role": "user", "content": 5}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
    b'{"messages": [{"role": "assistant", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "n": 1000}',
    b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}',
    b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 99}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream": "maybe"}',
    b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": '
    b'{"name": "f", "arguments": "{oops"}}]}]}',
    b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": '
    b'{"name": "f", "arguments": "' + b"[" * 100_000 + b'"}}]}]}',  # was a RecursionError: a 500
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
    b'{"url": "data:image/png;base64,AAAA"}}]}]}',
    # bools are not numbers nor strings bools (they were taken as 1 or true); a text part's text is a string
    b'{"messages": [{"role": "user", "content": "hi"}], "n": true}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": true}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": true}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [true]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": "yes"}}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]}',
    # an earlier turn's tool calls in OpenAI's shape (they were 400s worded by the chat template, or rendered)
    b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": 5}]}, '
    b'{"role": "user", "content": "hi"}]}',
    b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": 5}}]}, '
    b'{"role": "user", "content": "hi"}]}',
    b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]'
    b'}, {"role": "user", "content": "hi"}]}',
    # caps before work
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": ' + json.dumps([f"s{i}" for i in range(65)]).encode()
    + b'}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": "' + b"x" * 257 + b'"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": ' + json.dumps(list(range(257))).encode()
    + b'}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + json.dumps(
        [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]).encode() + b'}',
    b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e-300, "temperature": 1}',
]


@pytest.mark.parametrize("body", MALFORMED)
def test_bad_input_is_a_400_in_openai_shape(server, body):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["code"] == 400 and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b'{"prompt": ""}', b'{"prompt": [999999999]}', b'{"prompt": [-5, 3]}',
                                  b'{"prompt": []}', b'{"prompt": [true]}', b'{"prompt": [1.0, 2]}',
                                  b'{"prompt": [[1], [true]]}',
                                  b'{"prompt": "x", "best_of": 3}',
                                  b'{"prompt": [[1], "x"]}', b'{"prompt": "x", "logprobs": 50}'])
def test_bad_completion_input_is_a_400(server, body):
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ' + json.dumps([f"s{i}" for i in range(65)]).encode()
     + b'}', "stop"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": ' + json.dumps(list(range(300))).encode()
     + b'}', "stop_token_ids"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e-300, "temperature": 1}',
     "repetition_penalty"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', "messages[0].content[0].text"),
    (b'{"prompt": [true]}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),  # only with echo
    (b'{"prompt": "x", "echo": true, "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "echo": true, "logprobs": 21}', "logprobs"),
    (b'{"prompt": ' + json.dumps([1] * 5000).encode() + b'}', "prompt"),  # counted before each id is checked
    (b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": 5}}'
     b']}, {"role": "user", "content": "hi"}]}', "messages[0].tool_calls[0].function.arguments"),
    # refused by the engine, named by the field that holds what it refused
    (b'{"prompt": [999999999]}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", '
     b'"parameters": {"description": "\\ud800"}}}]}', "tools"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}', "reasoning_effort"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none", "chat_template_kwargs": '
     b'{"enable_thinking": true}}', "reasoning_effort"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "function_call": "auto"}', "function_call"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}], "tools": [{"type": '
     b'"function", "function": {"name": "f"}}]}', "functions"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}], "function_call": "none", '
     b'"tool_choice": "none"}', "function_call"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "function_call": {"name": "f", '
     b'"arguments": "{oops"}}]}', "messages[1].function_call.arguments"),
])
def test_a_refusal_names_its_field(server, body, param):
    path = "/v1/completions" if body.startswith(b'{"prompt"') else "/v1/chat/completions"
    r = httpx.post(server.url + path, content=body, timeout=60, headers=JSON_HEADERS)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_extreme_temperatures_are_greedy(server):
    """1e-300 and 5e-324 overflowed float32 once divided by: multinomial saw inf, an HTTP 500."""
    client = server.client()
    kw = dict(max_tokens=6, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    greedy = chat(client, user("Tell me a story."), temperature=0, **kw).choices[0].message.content
    for temperature in (1e-300, 5e-324):
        assert chat(client, user("Tell me a story."), temperature=temperature, **kw).choices[0].message.content \
            == greedy
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=1e-300, logprobs=3)
    assert completion.choices[0].text == client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                                                   temperature=0).choices[0].text


def test_an_error_echoing_unencodable_text_is_still_json(server):
    """`"model": "\\ud800"` is echoed by the 404; UTF-8 cannot encode a lone surrogate, so encoding the error failed."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers=JSON_HEADERS,
                   content=b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}')
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "The model `\\ud800` does not exist" in error["message"]


def test_a_bad_generation_default_stops_the_server_at_start(chat_ckpt, tmp_path):
    """repetition_penalty 1e-300 in generation_config.json made every request that did not set it a 500."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(chat_ckpt[0], ckpt)
    config = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps(config | {"repetition_penalty": 1e-300}))
    with pytest.raises(RuntimeError, match="did not come up"):
        Server(tmp_path, ckpt)
    assert (tmp_path / "server.log").read_text().strip().splitlines()[-1] == (
        "qwenrt: error: the checkpoint's generation_config.json: repetition_penalty must be in [0.01, 100] (1 = off), "
        "got 1e-300 (set it explicitly to override)")


def serve_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwenrt", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_a_port_in_use_is_one_line_before_the_model_loads():
    """It printed uvicorn's bind error, then `terminate called without an active exception` (the model still loading
    in a thread), Aborted, exit 134."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = serve_cli("--port", str(port))
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines() == [f"qwenrt: error: port {port} on 127.0.0.1 is already in use (another server? "
                                       "pick a free one with --port)"]


def test_a_bad_model_path_is_reported_once(tmp_path):
    run = serve_cli(str(tmp_path / "missing"), "--port", "0")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("no such directory") == 1
    assert run.stderr.splitlines()[-1].startswith(f"qwenrt: error: {tmp_path / 'missing'}: no such directory")


def test_ctrl_c_cuts_the_answers_under_way_and_exits_0(tmp_path):
    """Ctrl-C waited 5 s for a stream, logged a CancelledError traceback, and the stream ended without [DONE]. Now a
    stream ends with an error event and [DONE], a whole answer is a 503, and the server exits 0 (SIGTERM: the same)."""
    server = ServerProcess(None, tmp_path / "server.log", "--max-model-len", "4096")
    forever = {"messages": user("Go on forever."), "max_tokens": 4000, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                                                         json=forever | {"stream": True}) as stream:
            whole = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=forever, timeout=60)
            lines = stream.iter_lines()
            assert next(line for line in lines if '"reasoning_content"' in line)  # it is answering
            while server.metric("num_requests_running") < 2:
                assert not whole.done(), whole.result().text
                time.sleep(0.01)
            server.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
            response = whole.result()
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["message"], rest[-1]) == (503, "the server is shutting down", "data: [DONE]")
    assert len(rest) < 4000  # cut, not run to its end
    assert response.status_code == 503 and response.json()["error"]["message"] == "the server is shutting down"
    log = server.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log and "timeout graceful shutdown" not in log, log


# ---- connections: keys and sizes before bodies, timeouts, a connection cap ---------------------------------

def raw_exchange(url: str, request: bytes, wait: float = 10.0) -> tuple[int, dict | None, float]:
    """Send raw bytes on a fresh connection; (status, JSON body or None, seconds until the server answered)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(request)
        response = b""
        while b"\r\n\r\n" not in response or len(response.split(b"\r\n\r\n", 1)[1]) < content_length(response):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    elapsed = time.monotonic() - start
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else None, elapsed


def content_length(response: bytes) -> int:
    match = re.search(rb"content-length: *(\d+)", response.split(b"\r\n\r\n", 1)[0], re.I)
    return int(match.group(1)) if match else 0


def post_head(path: str, length: int, key: str | None = KEY, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n{extra}"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_the_api_key_is_checked_before_the_body_is_read(server):
    """A 100 MB body was read and parsed (+300 MB) before the 401; now the headers are enough."""
    status, body, elapsed = raw_exchange(server.url, post_head("/v1/chat/completions", 100_000_000, key=None))
    assert status == 401 and body["error"]["type"] == "authentication_error" and elapsed < 5


def test_a_body_over_the_limit_is_refused_unread(server, guarded_server):
    status, body, elapsed = raw_exchange(server.url, post_head("/v1/completions", 100_000_000))
    assert status == 413 and "over the server's limit of 33554432 bytes" in body["error"]["message"] and elapsed < 5
    # chunked, so no length is announced: cut off once it passes the limit (64 KiB here)
    head = post_head("/v1/completions", 0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    chunk = b"%x\r\n%s\r\n" % (16384, b"x" * 16384)
    status, body, _ = raw_exchange(guarded_server.url, head + chunk * 5)
    assert status == 413 and "limit of 65536 bytes" in body["error"]["message"]


def test_a_body_that_trickles_is_dropped(guarded_server):
    status, body, elapsed = raw_exchange(guarded_server.url, post_head("/v1/completions", 1000) + b'{"prompt": ')
    assert status == 408 and 0.9 < elapsed < 5, body


def test_half_sent_requests_are_closed_and_cannot_starve_the_server(guarded_server):
    """Slowloris: uvicorn waits forever for headers, and 160 half-sent requests starved /health under `ulimit -n 128`.
    Now the connections over the cap are closed as they open and the rest once their headers are 1 s late."""
    host, port = guarded_server.url.removeprefix("http://").split(":")
    half_sent = []
    for _ in range(24):  # the cap is 16
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        half_sent.append(sock)
    start = time.monotonic()
    closed = []
    for sock in half_sent:
        try:
            closed.append(sock.recv(100) == b"")
        except ConnectionResetError:
            closed.append(True)
        sock.close()
    assert all(closed) and time.monotonic() - start < 5
    while True:  # the server answers again once the slots free up
        try:
            assert httpx.get(guarded_server.url + "/health", timeout=5).status_code == 200
            break
        except httpx.TransportError:
            assert time.monotonic() - start < 5
            time.sleep(0.05)


def test_full_queue_is_a_429(vlm_server):
    client = vlm_server.client(timeout=300)
    long = dict(max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    running = chat(client, user("one"), **long)
    while vlm_server.metric("num_requests_running") < 1:
        time.sleep(0.02)
    waiting = chat(client, user("two"), **long)  # the stream opens once the request is queued
    with pytest.raises(openai.RateLimitError, match="queue is full"):
        chat(client, user("three"), max_tokens=2)
    running.close()
    waiting.close()
    vlm_server.wait_idle()


# ---- the app over a scripted engine -------------------------------------------------------------------------

class ScriptedEngine:
    """Stands in for the engine where a test must choose the model's output: every request gets `pieces` (one
    per step, like tokens) and then `finish`. Only what the server uses of an engine is here."""

    max_model_len = 4096
    memory_budget = 1
    num_running = num_waiting = 0

    def __init__(self, tokenizer, pieces: list[str], finish: str = "stop", error: str | None = None):
        self.tokenizer, self.pieces, self.finish, self.error = tokenizer, pieces, finish, error
        self.scheduler = type("Scheduler", (), {"reserved": 0})()
        self.requests = []

    def add_request(self, request, sink):
        self.requests.append(request)
        start = time.perf_counter()

        def run():
            for n, piece in enumerate(self.pieces, 1):
                sink(RequestOutput(request.request_id, piece, [n], None, 5, n, start, start, start,
                                   time.perf_counter()))
            sink(RequestOutput(request.request_id, "", [], self.finish, 5, len(self.pieces), start, start, start,
                               time.perf_counter(), error=self.error))
        threading.Thread(target=run).start()
        return RequestHandle(request.request_id, 5, request.enable_thinking is not False)

    def abort(self, request_id):
        pass

    def stop(self):
        pass


def scripted_client(engine_or_load, names=("tiny",), **config):
    from fastapi.testclient import TestClient

    from qwenrt.server.app import ServerConfig, create_app

    load = engine_or_load if callable(engine_or_load) else lambda: engine_or_load
    app = create_app(ServerConfig("scripted", list(names), **config), load)
    http = TestClient(app)
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from qwenrt.tokenizer import load_tokenizer
    from tests.tokenizer_fixture import qwen35_tokenizer_dir

    return load_tokenizer(qwen35_tokenizer_dir())


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}]
CALLS_TEXT = ("The user wants the weather.\n</think>\n\nLet me look that up.\n\n<tool_call>\n<function=get_weather>\n"
              "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n"
              "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n"
              "</parameter>\n</function>\n</tool_call>")


def pieces_of(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_tool_calls_whole_and_streamed(tokenizer):
    engine = ScriptedEngine(tokenizer, pieces_of(CALLS_TEXT))
    http, client = scripted_client(engine)
    with http:
        kw = dict(model="tiny", messages=user("Weather and time in Paris?"), tools=WEATHER)
        whole = client.chat.completions.create(**kw).choices[0]
        streamed = collect_stream(client.chat.completions.create(stream=True, **kw))
    want = parse_completion(CALLS_TEXT, True, WEATHER)
    assert engine.requests[0].tools == WEATHER  # the definitions went to the chat template
    assert whole.finish_reason == streamed["finish"] == "tool_calls"
    assert whole.message.reasoning_content == streamed["reasoning"] == want.reasoning == "The user wants the weather."
    assert whole.message.content == streamed["content"] == want.content == "Let me look that up."
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert calls == [(c.name, c.arguments_json) for c in want.tool_calls]
    assert json.loads(calls[0][1]) == {"city": "Paris", "days": 3, "hourly": True}  # typed by the schema
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed["calls"].items())] == calls
    assert all(c["id"].startswith("call_") for c in streamed["calls"].values())


def test_tool_choice_none_leaves_the_text(tokenizer):
    http, client = scripted_client(ScriptedEngine(tokenizer, pieces_of(CALLS_TEXT)))
    with http:
        message = client.chat.completions.create(model="tiny", messages=user("Hi"), tools=WEATHER,
                                                 tool_choice="none").choices[0]
    assert message.finish_reason == "stop" and not message.message.tool_calls
    assert "<tool_call>" in message.message.content


def test_history_tool_calls_render_as_the_template_expects(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    http, client = scripted_client(engine)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "reasoning": "Use the tool.", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with http:
        client.chat.completions.create(model="tiny", messages=history, tools=WEATHER)
    rendered = tokenizer.apply_chat_template(engine.requests[0].prompt, tools=WEATHER)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" in rendered
    assert "<think>\nUse the tool.\n</think>" in rendered and "<tool_response>\nsunny\n</tool_response>" in rendered


def test_engine_error_reaches_the_client(tokenizer):
    http, client = scripted_client(ScriptedEngine(tokenizer, ["a", "b"], finish="error", error="out of luck"))
    with http:
        with pytest.raises(openai.InternalServerError, match="out of luck"):
            client.chat.completions.create(model="tiny", messages=user("Hi"))
        with pytest.raises(openai.APIError, match="out of luck"):
            collect_stream(client.chat.completions.create(model="tiny", messages=user("Hi"), stream=True))


def test_503_while_loading_and_after_a_failed_load(tokenizer):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return ScriptedEngine(tokenizer, ["hi"])

    http, client = scripted_client(slow_load)
    with http:
        assert http.get("/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as e:
            client.models.list()
        assert e.value.status_code == 503 and "loading" in e.value.message
        release.set()
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        answer = client.chat.completions.create(model="tiny", messages=user("Hi")).choices[0].message
        assert answer.reasoning_content == "hi"

    def failing_load():
        raise qwenrt.QwenrtError("no such checkpoint")

    http, client = scripted_client(failing_load)
    with http:
        deadline = time.monotonic() + 30
        while "no such checkpoint" not in http.get("/health").text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError, match="failed to load: no such checkpoint"):
            client.models.list()


def test_several_choices_whole_and_streamed(tokenizer):
    engine = ScriptedEngine(tokenizer, pieces_of("Plan.\n</think>\n\nAnswer."))
    http, client = scripted_client(engine)
    with http:
        whole = client.chat.completions.create(model="tiny", messages=user("Hi"), n=3, seed=5)
        chunks = list(client.chat.completions.create(model="tiny", messages=user("Hi"), n=3, stream=True))
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all((c.message.reasoning_content, c.message.content) == ("Plan.", "Answer.") for c in whole.choices)
    assert [r.params.seed for r in engine.requests[:3]] == [5, 6, 7]  # seeded choices differ, repeatably
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == "Answer."
    assert whole.usage.completion_tokens == 3 * len(engine.pieces) and whole.usage.prompt_tokens == 5


def test_a_model_by_a_name_with_slashes(tokenizer):
    http, client = scripted_client(ScriptedEngine(tokenizer, ["hi"]), names=("Qwen/Qwen3.5-0.8B", "tiny"))
    with http:
        assert client.models.retrieve("Qwen/Qwen3.5-0.8B").id == "Qwen/Qwen3.5-0.8B"  # sent as Qwen%2FQwen3.5-0.8B
        assert http.get("/v1/models/Qwen/Qwen3.5-0.8B").json()["id"] == "Qwen/Qwen3.5-0.8B"
        missing = http.get("/v1/models/Qwen/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_without_allowed_origins_there_is_no_cors(tokenizer):
    """As before the flag: the API-key gate answers a preflight to /v1 (401), with no CORS headers; with the flag
    the same preflight is answered first."""
    for origins, status in ((None, 401), ([ORIGIN], 200)):
        http, _ = scripted_client(ScriptedEngine(tokenizer, ["hi"]), api_key=KEY, allowed_origins=origins)
        with http:
            preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == status
        assert ("access-control-allow-origin" in preflight.headers) == (origins is not None)


LEGACY_FUNCTIONS = [tool["function"] for tool in WEATHER]


def test_legacy_functions_are_tools(tokenizer):
    """functions / function_call are tools / tool_choice by their old names; the call comes back as the legacy
    function_call (the first one: the legacy API has one a turn), whole and streamed."""
    engine = ScriptedEngine(tokenizer, pieces_of(CALLS_TEXT))
    http, client = scripted_client(engine)
    with http:
        kw = dict(model="tiny", messages=user("Weather in Paris?"), functions=LEGACY_FUNCTIONS)
        whole = client.chat.completions.create(function_call="auto", **kw).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        left = client.chat.completions.create(function_call="none", **kw).choices[0]
    assert engine.requests[0].tools == WEATHER
    assert whole.finish_reason == "function_call" and whole.message.tool_calls is None
    assert whole.message.function_call.name == "get_weather"
    assert json.loads(whole.message.function_call.arguments) == {"city": "Paris", "days": 3, "hourly": True}
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert calls[0].name == "get_weather" and all(c.name is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == whole.message.function_call.arguments
    assert chunks[-1].choices[0].finish_reason == "function_call"
    assert left.finish_reason == "stop" and left.message.function_call is None and "<tool_call>" in left.message.content


def test_legacy_function_turns_render_as_tool_turns(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    http, client = scripted_client(engine)
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    legacy = [*user("Weather?"), {"role": "assistant", "content": None, "function_call": call},
              {"role": "function", "name": "get_weather", "content": "sunny"}]
    current = [*user("Weather?"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": call}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                   "content": "sunny"}]
    with http:
        for messages in (legacy, current):
            client.chat.completions.create(model="tiny", messages=messages, functions=LEGACY_FUNCTIONS)
    rendered = [tokenizer.apply_chat_template(r.prompt, tools=r.tools) for r in engine.requests]
    assert rendered[0] == rendered[1] and "<tool_response>\nsunny\n</tool_response>" in rendered[0]


# ---- structured output and forced tool calls ----------------------------------------------------------------

class Reading(pydantic.BaseModel):
    """Bounded everywhere, so that this checkpoint's random choices end within max_tokens."""

    station: str = pydantic.Field(max_length=10)
    level: int = pydantic.Field(ge=0, le=500)
    unit: Literal["cm", "m"]
    ok: bool


FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # this random checkpoint never closes a think


def test_parse_returns_content_that_validates(server):
    completion = server.client().chat.completions.parse(
        model="tiny", messages=user("Give me a reading"), response_format=Reading, max_tokens=300, temperature=0,
        extra_body=NO_THINKING)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Reading)
    assert Reading.model_validate_json(message.content) == message.parsed


@pytest.mark.parametrize("choice, names", [("required", {"get_forecast", "get_time"}),
                                           ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_forced_tool_calls_validate_whole_and_streamed(server, choice, names):
    tools = [FORECAST, CLOCK]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    kw = dict(tools=tools, tool_choice=choice, max_tokens=200, temperature=0, extra_body=NO_THINKING)
    whole = chat(server.client(), user("Hello!"), **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    for call in whole.message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed = collect_stream(chat(server.client(), user("Hello!"), stream=True, **kw))
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_completions_take_a_response_format(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    out = server.client().completions.create(model="tiny", prompt="JSON:", max_tokens=30, temperature=0,
                                             extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                                 "name": "n", "schema": schema}}})
    jsonschema.validate(json.loads(out.choices[0].text), schema)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON Schema"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [CLOCK], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_constraints_are_400s_naming_the_field(server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server.client(), user("hi"), max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == param and words in e.value.body["message"]


# ---- the gauges fleet routers read ----------------------------------------------------------------------------

def vllm_gauges(http) -> dict[str, float]:
    """/metrics' vllm: samples, by name with their labels."""
    return {name: float(value) for name, value in re.findall(r"^(vllm:\S+) (\S+)$", http.get("/metrics").text, re.M)}


def test_router_gauges_move_with_the_load(chat_model):
    """llm-d's endpoint picker and the vLLM/SGLang routers read vllm:num_requests_running / _waiting and
    vllm:kv_cache_usage_perc: one request runs at a time here, so two more wait while it does, and all fall back to 0
    when they end."""
    from qwenrt.engine import Engine

    model, tokenizer, _ = chat_model
    engine = Engine(model, tokenizer, max_running=1)
    engine.start()
    http, client = scripted_client(engine)
    with http:
        idle = vllm_gauges(http)
        with ThreadPoolExecutor(3) as pool:
            runs = [pool.submit(client.completions.create, model="tiny", prompt="One two", max_tokens=300,
                                temperature=0, extra_body={"ignore_eos": True}) for _ in range(3)]
            busiest = {}
            while not all(r.done() for r in runs):
                g = vllm_gauges(http)
                if g["vllm:num_requests_waiting"] > busiest.get("vllm:num_requests_waiting", -1):
                    busiest = g
                time.sleep(0.005)
        after = vllm_gauges(http)
    engine.stop()
    assert all(r.result().usage.completion_tokens == 300 for r in runs)
    cache = "vllm:cache_config_info{block_size=\"1024\",cache_dtype=\"float32\",enable_prefix_caching=\"true\"}"
    assert idle == after == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                             "vllm:kv_cache_usage_perc": 0, cache: 1}
    assert busiest["vllm:num_requests_running"] == 1 and busiest["vllm:num_requests_waiting"] == 2
    assert 0 < busiest["vllm:kv_cache_usage_perc"] < 1
