"""Hostile requests and careless use: token ids, text that is not Unicode, tools, empty batches, options refused before
the model loads, quantize leftovers. One line each, and `qwenrt chat` survives its bad lines."""

import io
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from PIL import Image

from qwenrt.cli import main
from qwenrt.convert import quantize_checkpoint
from qwenrt.errors import ContextLengthError
from qwenrt import tokenizer as tokenizer_module
from qwenrt.parsing import parse_completion
from qwenrt.prompt import prepare_prompt
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
    one_line_error(lambda: tok.decode([10 ** 6]), "outside the vocabulary")  # decoded to "" silently before
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


def test_a_missing_tokenizer_media_on_a_text_model_and_gguf_are_refused_before_loading(capsys, dense_ckpt, chat_ckpt,
                                                                                      tmp_path):
    image, gguf = tmp_path / "a.png", tmp_path / "model.gguf"
    Image.new("RGB", (8, 8)).save(image)
    gguf.write_bytes(b"GGUF" + bytes(28))
    assert f"{dense_ckpt[0]}: the checkpoint has no tokenizer.json" in early(capsys, "run", dense_ckpt[0], "hi")
    assert "has no tokenizer.json" in early(capsys, "chat", dense_ckpt[0])
    for media in ("--image", "--video"):
        err = early(capsys, "run", chat_ckpt[0], "hi", media, image)
        assert "a text-only model (no vision_config in config.json); --image/--video need" in err
    assert f"{gguf}: not a readable GGUF file" in early(capsys, "run", gguf, "hi")


@pytest.mark.parametrize("args, start, guess", [
    (["rn", "hi"], "qwenrt: error: argument verb: invalid choice: 'rn' (choose from ", "run"),
    (["run", "hi", "--temprature", "0"], "qwenrt run: error: unrecognized arguments: --temprature 0", "--temperature"),
    (["chat", "--hide-thinkng"], "qwenrt chat: error: unrecognized arguments: --hide-thinkng", "--hide-thinking"),
    (["bench", "--prompt-lenn=8"], "qwenrt bench: error: unrecognized arguments: --prompt-lenn=8", "--prompt-len"),
    (["serve", "--log-level", "debgu"], "qwenrt serve: error: argument --log-level: invalid choice: 'debgu' ", "debug"),
])
def test_a_mistyped_verb_or_option_gets_a_suggestion_on_one_line(capsys, args, start, guess):
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(start) and err.endswith(f"; did you mean {guess}?\n"), err


def test_an_unknown_option_with_nothing_close_gets_the_verbs_usage(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "hi", "--bogus"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("usage: qwenrt run ") and "did you mean" not in err
    assert err.endswith("qwenrt run: error: unrecognized arguments: --bogus\n")


class LibrarySpy:
    """Stands in for a tokenizer's library object, recording how many characters each encode call is handed."""

    def __init__(self, library):
        self.library, self.handed = library, []

    def encode(self, text, **kw):
        self.handed.append(len(text))
        return self.library.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.handed += [len(t) for t in texts]
        return self.library.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.library, name)


def spied(monkeypatch, tok) -> LibrarySpy:
    spy = LibrarySpy(tok._tok)
    monkeypatch.setattr(tok, "_tok", spy)
    return spy


PIECES = ["Hello, world! ", "It's 2024:\n\n\t", "foo_bar(x) -- ", "<|im_start|>user\n", "<think>\n", "e\u0301",
          "\u0301", "\u4f60\u597d\uff0c", "\U0001f600\u200d", "\ufb03 ", "A\u030a", "\u1100\u1161", "    ", "\r\n",
          "====", "1234567", "x" * 50, " " * 40]


@pytest.mark.parametrize("seed", range(4))
def test_encoding_in_pieces_gives_the_whole_encoding(chat_model, monkeypatch, seed):
    """Pieces cut at word starts give exactly the ids of one whole encode: special tokens, CJK, combining marks,
    whitespace runs, and words longer than a piece."""
    tok = chat_model[1]
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 300)
    rng = random.Random(seed)
    for _ in range(25):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(20, 400)))
        assert tok.encode_within(text, 10 ** 6) == tok.encode(text)
    for word in ("a" * 5000, "\u4f60" * 3000, " " * 5000):
        text = f"start {word} end " * 3
        assert tok.encode_within(text, 10 ** 6) == tok.encode(text)
        assert tok.encode_within(text, len(tok.encode(text)) - 1) is None


@pytest.mark.parametrize("text", ["word " * 200_000, "a" * 1_000_000, "\u4f60" * 300_000],
                         ids=["words", "one-letter word", "cjk word"])
def test_a_prompt_over_the_context_is_refused_after_a_limit_of_tokenizing(chat_model, monkeypatch, text):
    """1 MB was tokenized whole (with the GIL held) before the context check: 10 MB froze a server for 12 s and grew it
    by 0.5 GB. Now the library sees pieces and stops once the prompt cannot fit, without the GIL."""
    model, tok, _ = chat_model
    spy = spied(monkeypatch, tok)
    one_line_error(lambda: prepare_prompt(model, tok, text),
                   "prompt has more than 4095 tokens; the context limit is 4096")
    one_line_error(lambda: prepare_prompt(model, tok, [{"role": "user", "content": text}]), "context limit is 4096")
    assert max(spy.handed) <= 2 * tokenizer_module.PIECE_CHARS and sum(spy.handed) < 20 * tokenizer_module.PIECE_CHARS


def test_a_prompt_that_cannot_fit_whatever_it_holds_is_refused_untokenized(chat_model, monkeypatch):
    model, tok, _ = chat_model
    spy = spied(monkeypatch, tok)
    one_line_error(lambda: prepare_prompt(model, tok, "x" * (64 * 256 + 1), max_context=65), "context limit is 65")
    assert spy.handed == []
    assert prepare_prompt(model, tok, " " * 4000, max_context=65).ids == tok.encode(" " * 4000)  # 32 tokens: fits


def test_a_prompt_over_the_context_says_by_how_much(chat_model):
    """ContextLengthError carries the numbers the server's 400 (context_length_exceeded) words: the length when it
    was counted, else the count at which tokenizing stopped."""
    model, tok, _ = chat_model
    ids = tok.encode("word " * 50)
    with pytest.raises(ContextLengthError) as e:
        prepare_prompt(model, tok, ids, max_context=len(ids))
    assert (e.value.prompt_tokens, e.value.limit, e.value.counted) == (len(ids), len(ids), True)
    with pytest.raises(ContextLengthError) as e:
        prepare_prompt(model, tok, "word " * 50, max_context=10)
    assert (e.value.prompt_tokens, e.value.limit, e.value.counted) == (10, 10, False)


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
    assert err == ("qwenrt: error: the checkpoint's generation_config.json: repetition_penalty must be in [0.01, 100] "
                   "(1 = off), got 1e-300 (set it explicitly to override)")
    assert main(["run", str(ckpt), "Hi", "-n", "3", "--repetition-penalty", "1.1"]) == 0


def test_cli_basics(capsys, dense_ckpt, chat_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("qwenrt 0.")
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
