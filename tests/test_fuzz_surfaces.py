"""Fuzzing the surfaces strangers reach besides checkpoints (fixed seeds, bounded counts): request bodies of the
OpenAI server, the prefix-cache folder, and training data. Every case is answered correctly or refused cleanly (a
4xx in OpenAI's shape; one one-line QwenrtError), never a 500, a traceback, a hang or a wrong answer."""

from __future__ import annotations

import copy
import json
import os
import random
import time

import pytest

from qwenrt.engine import Engine, Request
from qwenrt.errors import QwenrtError
from qwenrt.sampling import SamplingParams
from tests.hostile import no_hang
from tests.test_fuzz import mutate_object

SERVER_CASES = 150
CACHE_CASES = 12
DATA_CASES = 300

# values a hostile or careless client sends where a well-formed one is expected
HOSTILE_VALUES = [None, True, False, 0, -1, 2 ** 63, -2 ** 63, 10 ** 400, 1e-300, 5e-324, 1e308, -0.0, "", "x",
                  "\ud800", "\x00", "a" * 5000, [], [True], [[]], [1] * 300, {}, {"type": "x"},
                  {"url": "http://127.0.0.1:1/x.png"}]


def mutate_request(rng: random.Random, body: dict) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.5:
            mutate_object(rng, body)
        else:
            path, target = [], body
            while isinstance(target, (dict, list)) and target and rng.random() < 0.7:
                key = rng.choice(list(target)) if isinstance(target, dict) else rng.randrange(len(target))
                path.append(key)
                if not isinstance(target[key], (dict, list)):
                    break
                target = target[key]
            if isinstance(target, dict):
                target[rng.choice(list(target) + ["stop", "n", "logprobs", "top_logprobs", "temperature",
                                                   "repetition_penalty", "model", "tool_choice"])] = \
                    rng.choice(HOSTILE_VALUES)
            elif isinstance(target, list) and target:
                target[rng.randrange(len(target))] = rng.choice(HOSTILE_VALUES)
    return body


CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "seed": 1,
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}]}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4, "logprobs": 2, "n": 2, "stop": "x",
              "stop_token_ids": [5]}
TOKENIZE = {"messages": CHAT["messages"], "tools": CHAT["tools"], "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False}, "return_token_strs": True}
DETOKENIZE = {"tokens": [5, 6, 7]}
CODES = {"context_length_exceeded": 400, "model_not_found": 404}  # OpenAI's string codes, which clients act on


@pytest.fixture(scope="module")
def live_app(chat_model):
    """The app over a real engine on the chat checkpoint, in this process."""
    from fastapi.testclient import TestClient

    from qwenrt.server.app import ServerConfig, create_app

    model, tok, _ = chat_model

    def load():
        engine = Engine(model, tok, max_model_len=512, max_running=4)
        engine.start()
        return engine

    app = create_app(ServerConfig("tiny", ["tiny"]), load)
    with TestClient(app) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.05)
        yield http


def _post(http, route: str, body) -> tuple[int, dict | str]:
    text = json.dumps(body)  # a lone surrogate stays escaped as the client sent it
    r = http.post(route, content=text.encode(), headers={"Content-Type": "application/json"})
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


@pytest.mark.parametrize("route,valid", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                         ("/tokenize", TOKENIZE), ("/detokenize", DETOKENIZE)])
def test_fuzz_server_requests(live_app, route, valid):
    assert _post(live_app, route, valid)[0] == 200
    rng = random.Random(2026 if "chat" in route else 2027)
    statuses: dict[int, int] = {}
    for case in range(SERVER_CASES):
        body = mutate_request(rng, valid)
        with no_hang(60):
            status, answer = _post(live_app, route, body)
        statuses[status] = statuses.get(status, 0) + 1
        detail = f"case {case}: {json.dumps(body)[:300]} -> {status} {str(answer)[:300]}"
        assert status == 200 or 400 <= status < 500, detail
        if status != 200:
            error = answer["error"]
            assert error["message"] and "\n" not in error["message"] and CODES.get(error["code"], error["code"]) == \
                status, detail
    print(f"fuzz {route}: {statuses}")
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k != 200) > SERVER_CASES // 4, statuses
    assert _post(live_app, route, valid)[0] == 200  # still serving


# ---- the prefix-cache folder --------------------------------------------------------------------------------

def _answer(engine: Engine, prompt: list[int]) -> list[int]:
    outputs = []
    engine.add_request(Request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)), outputs.append)
    while engine.has_work:
        engine.step()
    return [t for out in outputs for t in out.token_ids]


def _corrupt(rng: random.Random, file) -> str:
    """One hostile change to a snapshot file; says which."""
    data = bytearray(file.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    kind = rng.choice(["flip data", "flip header", "truncate", "extend", "metadata", "fifo", "directory", "link"])
    if kind == "flip data":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(8 + header_len, len(data))] ^= 1 << rng.randrange(8)
    elif kind == "flip header":
        data[rng.randrange(8, 8 + header_len)] = rng.randrange(32, 127)
    elif kind == "truncate":
        data = data[:rng.randrange(len(data))]
    elif kind == "extend":
        data += os.urandom(rng.randint(1, 100))
    elif kind == "metadata":  # a forger's edit: plausible metadata, a wrong length
        header = json.loads(data[8:8 + header_len])
        header["__metadata__"]["length"] = str(rng.choice([0, 1, -1, 10 ** 9, "x"]))
        text = json.dumps(header).encode()
        data = bytearray(len(text).to_bytes(8, "little") + text + data[8 + header_len:])
    file.unlink()
    if kind == "fifo":
        os.mkfifo(file)
    elif kind == "directory":
        file.mkdir()
    elif kind == "link":
        file.symlink_to("/etc/hostname")
    else:
        file.write_bytes(bytes(data))
    return kind


def test_fuzz_prefix_cache_folder(chat_model, tmp_path):
    model, tok, _ = chat_model
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    expected = _answer(Engine(model, tok), prompt)
    rng = random.Random(31)
    for case in range(CACHE_CASES):
        folder = tmp_path / f"case{case}"
        writer = Engine(model, tok, prefix_cache_dir=folder)
        assert _answer(writer, prompt) == expected
        writer.prefix_cache.store.flush()
        files = sorted(folder.rglob("*.safetensors"))
        assert files
        kinds = [_corrupt(rng, f) for f in rng.sample(files, rng.randint(1, len(files)))]
        with no_hang(60):
            try:
                reader = Engine(model, tok, prefix_cache_dir=folder)
            except QwenrtError as e:  # refusing the whole folder is a clean outcome too
                assert "\n" not in str(e)
                continue
            assert _answer(reader, prompt) == expected, f"case {case}: {kinds}"
        assert os.path.exists("/etc/hostname")


# ---- training data ------------------------------------------------------------------------------------------

CONVERSATION = {"messages": [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "reasoning_content": "2+3=5", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "5"}],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]}


def _raw_line(rng: random.Random, line: bytes) -> bytes:
    """A byte-level mutation of one JSONL line (cut, flipped, a deep nest, a huge number)."""
    kind = rng.random()
    if kind < 0.25:
        return line[:rng.randrange(len(line))]
    if kind < 0.5:
        data = bytearray(line)
        data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind < 0.75:
        return b"[" * 100_000 + b"]" * 100_000
    return line.replace(b"2", b"2" * 5000, 1)


def test_fuzz_training_data(chat_model, tmp_path):
    from qwenrt.train.data import encode_all, read_jsonl

    _, tok, _ = chat_model
    rng = random.Random(77)
    valid = json.dumps(CONVERSATION).encode()
    counts = {"encoded": 0, "refused": 0}
    for case in range(DATA_CASES):
        if rng.random() < 0.3:
            line = _raw_line(rng, valid)
        else:
            record = copy.deepcopy(CONVERSATION)
            for _ in range(rng.randint(1, 3)):
                mutate_object(rng, record)
            line = json.dumps(record).encode()
        data = tmp_path / f"case{case}.jsonl"
        data.write_bytes(line + b"\n")
        try:
            with no_hang(30):
                encode_all(tok, read_jsonl(data), max_len=256)
            counts["encoded"] += 1
        except QwenrtError as e:
            assert "\n" not in str(e), f"case {case}: {e}"
            counts["refused"] += 1
        except BaseException as e:
            raise AssertionError(f"case {case}: {line[:200]!r}: {type(e).__name__}: {e}") from e
    print(f"fuzz training data: {counts}")
    assert counts["encoded"] > 0 and counts["refused"] > DATA_CASES // 4, counts
