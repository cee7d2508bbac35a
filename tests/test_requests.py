"""Hostile requests and careless use: token ids, text that is not Unicode, tools, empty batches, options refused before
the model loads, quantize leftovers. One line each, and `qwenrt chat` survives its bad lines."""

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from qwenrt.cli import main
from qwenrt.convert import quantize_checkpoint
from qwenrt.parsing import parse_completion
from qwenrt.validation import check_max_context, check_request
from tests.hostile import one_line_error

VOCAB = 512


@pytest.mark.parametrize("prompt, fragment", [
    ([1, -1, 2], "-1 is outside the vocabulary [0, 512)"),
    ([2 ** 63], "outside the vocabulary"),
    ([2 ** 64 + 5], "outside the vocabulary"),
    ([VOCAB], "512 is outside"),
    ([1, True], "must be integers"),
    ([1.5], "must be integers"),
    (torch.tensor([[3, 700]]), "700 is outside"),
    ([], "the prompt is empty"),
    ("", "the prompt is empty"),
    ("abc\ud800def", "lone surrogate '\\ud800' at character 3"),
    ([{"role": "user", "content": "\udcff"}], "message 0.content is not valid Unicode"),
    ([{"role": "user", "content": [{"type": "text", "text": "ok \udc80"}]}], "message 0.content[0].text"),
    ([{"content": "hi"}], "needs a string 'role'"),
    ([{"role": "user", "content": "hi"}, "stray"], "message 1 must be a dict"),
    (b"bytes", "a prompt must be"),
    (None, "a prompt must be"),
])
def test_bad_prompts(prompt, fragment):
    one_line_error(lambda: check_request([prompt], vocab_size=VOCAB, model_limit=4096), fragment)


@pytest.mark.parametrize("tools, fragment", [
    ([{"type": "function", "function": {"name": "f", "parameters": "a string"}}], "'parameters' must be a JSON-schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}], "'parameters' must be"),
    ([{"name": "f", "parameters": 5}], "'parameters' must be"),
    ([{"type": "function", "function": {"parameters": {}}}], "must be a dict with a function name"),
    (["f"], "must be a dict with a function name"),
    ({"name": "f"}, "tools must be a list"),
    ([{"name": "f\ud800"}], "tool 0.name is not valid Unicode"),
])
def test_bad_tools(tools, fragment):
    one_line_error(lambda: check_request(["hi"], vocab_size=VOCAB, model_limit=4096, tools=tools), fragment)


def test_request_level_checks():
    one_line_error(lambda: check_request([], vocab_size=VOCAB, model_limit=4096), "no prompts given")
    one_line_error(lambda: check_request("hi", vocab_size=VOCAB, model_limit=4096), "prompts must be a list")
    assert check_request(["hi", [1, 2], [{"role": "user", "content": "x"}]], vocab_size=VOCAB, model_limit=4096) == 4096
    assert check_max_context(100, 4096) == 100
    for bad in (4097, 1, 0, -5, 10.5, True, "100"):
        one_line_error(lambda: check_max_context(bad, 4096), "max_context must be an integer in [2, 4096]")


def test_tokenizer_refuses_what_the_library_cannot_take(chat_model):
    _, tok, _ = chat_model
    one_line_error(lambda: tok.encode("a\ud800"), "text to encode is not valid Unicode")
    one_line_error(lambda: tok.encode(None), "text to encode must be a string")
    one_line_error(lambda: tok.decode([5, -1]), "-1 is outside")
    one_line_error(lambda: tok.decode([2 ** 63]), "outside")
    one_line_error(lambda: tok.decode(["x"]), "must be integers")
    assert tok.decode([10 ** 6]) == ""  # inside the library's range, outside the vocabulary: nothing
    one_line_error(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                   tools=[{"name": "f", "parameters": "x"}]), "'parameters'")


def test_tool_parsing_never_raises_on_odd_tools():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    for tools in ([{"name": "f", "parameters": "x"}], [{"function": {"name": "f", "parameters": [1]}}], ["f"], [None]):
        parsed = parse_completion(text, False, tools)
        assert parsed.tool_calls[0].name == "f" and parsed.tool_calls[0].arguments == {"a": 1}


def test_chat_survives_lines_that_are_not_utf8(chat_ckpt, capsys, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfe broken\nHello\n/exit\n"), encoding="utf-8")  # strict, as a pipe
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", str(chat_ckpt[0]), "-n", "3", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "message 0.content is not valid Unicode" in err and "generated 3 tokens" in err, err


def test_run_refuses_a_stdin_prompt_that_is_not_utf8(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"), encoding="utf-8"))
    assert "the prompt on stdin is not valid UTF-8" in early(capsys, "run", tmp_path / "not-loaded", "-")


def early(capsys, *args) -> str:
    """Run the CLI in-process; it must fail with one line and without loading anything."""
    assert main([str(a) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qwenrt: error:"), err
    return err


@pytest.mark.parametrize("args, fragment", [
    (["--top-p", 3], "top_p must be in (0, 1]"),
    (["--temperature", -1], "temperature must be >= 0"),
    (["-n", 0], "max_tokens must be an integer >= 1"),
    (["--device", "banana"], "unknown device 'banana'"),
    (["--dtype", "int3"], "unsupported dtype 'int3'"),
    (["--image", "/nonexistent/cat.png"], "file not found: /nonexistent/cat.png"),
    (["--image", "/dev/null"], "not a regular file"),
])
def test_options_are_refused_before_loading(capsys, tmp_path, args, fragment):
    err = early(capsys, "run", tmp_path / "not-loaded", "hi", *args)
    assert fragment in err


def with_generation_config(source, tmp_path, **fields):
    """A copy of a checkpoint whose generation_config.json also sets `fields`."""
    shutil.copytree(source, tmp_path / "ckpt")
    config = json.loads((source / "generation_config.json").read_text())
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(config | fields))
    return tmp_path / "ckpt"


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_run_with_a_vanishing_temperature_default_is_greedy(capsys, chat_ckpt, tmp_path, temperature):
    """Dividing by it overflowed float32: multinomial saw inf and `qwenrt run` printed a traceback."""
    ckpt = with_generation_config(chat_ckpt[0], tmp_path, temperature=temperature)
    assert main(["run", str(ckpt), "Hi", "-n", "3", "--no-thinking"]) == 0
    greedy = capsys.readouterr().out
    assert main(["run", str(ckpt), "Hi", "-n", "3", "--no-thinking", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy


def test_run_names_a_bad_generation_default(capsys, chat_ckpt, tmp_path):
    ckpt = with_generation_config(chat_ckpt[0], tmp_path, repetition_penalty=1e-300)
    assert main(["run", str(ckpt), "Hi", "-n", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("qwenrt: error: ") and "the checkpoint's generation_config.json: repetition_penalty must be in [0.01, 100] (1 = off), got " \
           "1e-300 (set it explicitly to override)" in err
    assert main(["run", str(ckpt), "Hi", "-n", "3", "--repetition-penalty", "1.1"]) == 0


def test_cli_basics(capsys, dense_ckpt, chat_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("qwenrt 0.")
    assert "nothing to measure" in early(capsys, "bench")
    err = early(capsys, "bench", "--shape", "1b")
    assert "unknown --shape '1b'" in err and "building" not in err
    assert "no such directory" in early(capsys, "quantize", tmp_path / "nope", tmp_path / "q", "--bits", "8")
    err = early(capsys, "quantize", "not/a-real-thing", tmp_path / "q", "--bits", "8")  # a hub id, as for `run`
    assert "not in the local cache and HF_HUB_OFFLINE is set" in err and "hf download not/a-real-thing" in err
    err = early(capsys, "run", chat_ckpt[0], "hi", "--max-context", 10 ** 7)
    assert "max_context must be an integer in [2, 4096]" in err
    with pytest.raises(SystemExit):  # argparse: a usage line, exit 2
        main(["run", str(chat_ckpt[0]), "hi", "--prefill-chunk", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_quantize_leftovers_and_destinations(dense_ckpt, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for file in dense_ckpt[0].iterdir():
        (src / file.name).write_bytes(file.read_bytes())
    (src / "pytorch_model.bin").write_bytes(b"pickle payload")
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 10}))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".q.partial-{dead.pid}"  # what a quantize killed with SIGKILL leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    live = tmp_path / f".q.partial-{os.getpid()}-other"  # not a pid: left alone
    live.mkdir()
    dst = quantize_checkpoint(src, tmp_path / "q", 8)
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer_config.json"]  # no pickle copied
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    one_line_error(lambda: quantize_checkpoint(src, blocker / "q", 8), "cannot create", "Not a directory")
    one_line_error(lambda: quantize_checkpoint(src, dst, 8), "already exists")
