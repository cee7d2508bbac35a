"""`qwenrt run` and `qwenrt chat` end to end, in subprocesses (in-process where only their output is checked), how
the answer and the reasoning are written, and what the command line answers without loading."""

import io
import json
import os
import socket
import subprocess
import sys
from unittest import mock

import jsonschema
import pytest
import torch

import qwenrt
from qwenrt import log
from qwenrt.cli import main
from qwenrt.convert import quantize_checkpoint
from qwenrt.console import DIM, RESET, THINKING_CLOSE, THINKING_OPEN, AnswerWriter, reasoning_destination
from qwenrt.default_model import default_model_path
from qwenrt.kernels import kernel_path


def qwenrt_cli(*args, stdin=None, **env):
    return subprocess.run([sys.executable, "-m", "qwenrt", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, **env))


# every --help, --version and usage error of the command line, and which heavy modules they imported
LIGHT_ANSWERS = """
import argparse, contextlib, io, sys
import qwenrt.cli
parser = qwenrt.cli.build_parser()
verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
argvs = [["--version"], ["--help"], ["frobnicate"], ["run"], ["bench", "--bogus"], ["serve", "--port", "x"]]
for argv in argvs + [[verb, "--help"] for verb in verbs]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), contextlib.suppress(SystemExit):
        qwenrt.cli.main(argv)
    assert out.getvalue().strip(), argv
heavy = ("torch", "numpy", "tokenizers", "safetensors", "huggingface_hub", "fastapi", "qwenrt.engine", "qwenrt.loader")
print(len(verbs), sorted(m for m in sys.modules if m.startswith(heavy)))
"""


def test_help_version_and_usage_errors_load_nothing():
    """Issue 38: they imported torch and the engine first (3.8 s quiet, 13-22 s on a busy machine)."""
    done = subprocess.run([sys.executable, "-c", LIGHT_ANSWERS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    verbs, imported = done.stdout.split(" ", 1)
    assert int(verbs) >= 9 and imported.strip() == "[]"


def test_import_qwenrt_is_light_and_the_public_api_whole():
    script = ("import sys, qwenrt; assert 'torch' not in sys.modules; "
              "import qwenrt.generate; from qwenrt import generate; "  # the submodule first, then the function
              "assert generate is qwenrt.generate is sys.modules['qwenrt.generate'].generate; "
              "assert all(callable(getattr(qwenrt, name)) for name in qwenrt.__all__)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_run_streams_the_greedy_answer(chat_ckpt, chat_model):
    model, tok, _ = chat_model
    run = qwenrt_cli("run", chat_ckpt[0], "Hello", "--max-tokens", 12, "--temperature", 0, "--dtype", "float32",
                     "--no-thinking")
    assert run.returncode == 0, run.stderr
    expected = qwenrt.generate(model, tok, [{"role": "user", "content": "Hello"}], max_tokens=12,
                               enable_thinking=False)
    assert run.stdout == expected + "\n"
    assert "generated 12 tokens" in run.stderr and "finish: length" in run.stderr
    # the load line names the weight format, the kernel level and the threads
    assert "model (torch.float32, weights fp32) in " in run.stderr
    assert f"s, CPU kernels: {kernel_path()}, {torch.get_num_threads()} threads\n" in run.stderr


def test_threads_flag_reaches_torch(tmp_path, capsys):
    """--threads sets the threads torch and the native kernels run on (the load line reads them back from torch); an
    int4 copy of the built-in model loads in bf16 and says its weight formats (int4, its DeltaNet a/b at int8). A
    count below 1 is refused while parsing, before anything loads."""
    int4 = quantize_checkpoint(default_model_path(), tmp_path / "int4", 4)
    run = qwenrt_cli("run", int4, "Hi", "-n", 2, "--threads", 1)
    assert run.returncode == 0, run.stderr
    assert "model (torch.bfloat16, weights int4 g64 + int8) in " in run.stderr and ", 1 thread\n" in run.stderr
    for verb in (["run", "hi"], ["chat"], ["serve"]):
        with pytest.raises(SystemExit) as done:  # argparse: a usage line, exit 2
            main([*verb, "--threads", "0"])
        assert done.value.code == 2 and "--threads: must be " in capsys.readouterr().err


def test_load_line_says_when_no_native_kernels_run(chat_ckpt):
    run = qwenrt_cli("run", chat_ckpt[0], "Hi", "-n", 2, QWENRT_KERNELS="0")
    assert run.returncode == 0, run.stderr
    assert "CPU kernels: torch ops (QWENRT_KERNELS=0)" in run.stderr
    run = qwenrt_cli("run", chat_ckpt[0], "Hi", "-n", 2, QWENRT_ISA="avx1024")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("qwenrt: error: QWENRT_ISA='avx1024' is not a kernel level")


def test_run_raw_prompt_from_stdin(chat_ckpt, chat_model):
    model, tok, _ = chat_model
    run = qwenrt_cli("run", chat_ckpt[0], "-", "--raw", "-n", 8, "--temp", 0, "--dtype", "float32",
                     stdin="def main():")
    assert run.returncode == 0, run.stderr
    assert run.stdout == qwenrt.generate(model, tok, "def main():", max_tokens=8) + "\n"


def test_run_errors_are_one_line(chat_ckpt, tmp_path):
    (tmp_path / "not_a_ckpt").mkdir()
    cases = [
        (("run", tmp_path / "missing", "hi"), "no such directory"),
        (("run", tmp_path / "not_a_ckpt", "hi"), "no config.json"),
        (("run", chat_ckpt[0], "a long prompt " * 20, "--max-context", 16), "context limit is 16"),
        (("run", chat_ckpt[0], "hi", "--top-p", 3), "top_p must be in (0, 1]"),
    ]
    for args, message in cases:
        run = qwenrt_cli(*args)
        assert run.returncode == 1, (args, run.stderr)
        assert "Traceback" not in run.stderr and message in run.stderr, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("qwenrt: error:")


def test_run_answers_in_a_json_schema_file(tmp_path):
    schema = {"type": "object", "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 2000}},
              "required": ["sum"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    run = qwenrt_cli("run", "What is 345 + 278?", "--json-schema", tmp_path / "schema.json", "--no-thinking")
    assert run.returncode == 0, run.stderr
    jsonschema.validate(json.loads(run.stdout), schema)
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    for args, message in [(("--json-schema", tmp_path / "missing.json"), "JSON Schema file not found"),
                          (("--json-schema", tmp_path / "bad.json"), "json_schema: failed to compile JSON schema"),
                          (("--regex", "(unclosed"), "regex: invalid regex"),
                          (("--regex", "a", "--json-schema", tmp_path / "schema.json"), "at most one")]:
        run = qwenrt_cli("run", "hi", *args)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("qwenrt: error:") and message in run.stderr, run.stderr


def test_chat_session(chat_ckpt, tmp_path):
    """Commands, a refused /set that leaves the chat going, a multi-line question, and /load restoring exactly what
    /save wrote: the same question after it gets the same answer (two saves of the same state are equal)."""
    saved, after, again = tmp_path / "saved.json", tmp_path / "after.json", tmp_path / "again.json"
    question = '"""\nTwo\nlines\n"""\n'
    script = (f"Hi there\n/thinking off\nAnd again\n/bogus\n/reset\nFresh start\n/set top_p 3\n/set max_tokens 4\n"
              f"/save {saved}\n{question}/save {after}\n/load {saved}\n{question}/save {again}\n/exit\n")
    run = qwenrt_cli("chat", chat_ckpt[0], "-n", 6, "--temp", 0, stdin=script)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("generated 6 tokens") == 3 and run.stderr.count("generated 4 tokens") == 2
    assert "[thinking off]" in run.stderr and "[conversation reset]" in run.stderr
    assert "unknown command /bogus" in run.stderr
    assert "error: top_p must be in (0, 1], got 3.0\n" in run.stderr and "Traceback" not in run.stderr
    conversation = json.loads(saved.read_text())
    assert [m["content"] for m in conversation["messages"][::2]] == ["Fresh start"]
    assert conversation["settings"] | {"top_p": 1} == {"max_tokens": 4, "temperature": 0.0, "top_k": None,
                                                       "top_p": 1, "min_p": None, "repetition_penalty": None,
                                                       "presence_penalty": None, "frequency_penalty": None,
                                                       "seed": None, "thinking": False}
    assert json.loads(after.read_text())["messages"][2] == {"role": "user", "content": "Two\nlines"}
    assert after.read_text() == again.read_text()


def test_run_with_an_image(vlm_chat, tmp_path):
    import numpy as np
    from PIL import Image

    model, tok, _, path = vlm_chat
    image = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(image)
    run = qwenrt_cli("run", path, "describe this", "--image", image, "-n", 6, "--temp", 0, "--dtype", "float32",
                     "--no-thinking")  # all of the output is the answer, on stdout
    assert run.returncode == 0, run.stderr
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                             {"type": "text", "text": "describe this"}]}]
    assert run.stdout == qwenrt.generate(model, tok, messages, max_tokens=6, enable_thinking=False) + "\n"
    bad = qwenrt_cli("run", path, "describe this", "--image", tmp_path / "nope.png")
    assert bad.returncode == 1 and "nope.png" in bad.stderr and "Traceback" not in bad.stderr


def test_chat_ctrl_c_stops_the_answer_not_the_session(chat_ckpt, chat_model, tmp_path):
    """The stopped question and its partial answer stayed in the conversation and garbled the next answer; now the
    next question is answered as in a fresh conversation."""
    import signal
    import threading
    import time

    model, tok, _ = chat_model
    # as from a terminal: a suite started in the background of a shell passes SIGINT on ignored
    chat = subprocess.Popen([sys.executable, "-m", "qwenrt", "chat", str(chat_ckpt[0]), "-n", "100000", "--temp", "0",
                             "--no-thinking", "--dtype", "float32"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = []
    reader = threading.Thread(target=lambda: err.extend(iter(chat.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 600  # a loaded machine may take minutes to load and compile
        while not any(line.startswith("commands:") for line in err) and time.time() < deadline:
            time.sleep(0.1)  # the session is ready
        chat.stdin.write("Tell me everything\n")
        chat.stdin.flush()
        time.sleep(3)  # 100000 tokens take far longer: the answer is being generated (its text may be held back)
        chat.send_signal(signal.SIGINT)
        time.sleep(0.5)
        chat.stdin.write(f"/set max_tokens 8\nHello\n/save {tmp_path / 'chat.json'}\n/exit\n")
        chat.stdin.flush()
        chat.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        chat.kill()
    text = "".join(err)
    assert chat.returncode == 0, text
    assert "[stopped: the question and the partial answer are left out of the conversation]" in text
    assert "Traceback" not in text
    fresh = qwenrt.complete(model, tok, [{"role": "user", "content": "Hello"}], max_tokens=8, enable_thinking=False)
    assert json.loads((tmp_path / "chat.json").read_text())["messages"] == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": fresh.content}]
    assert f"[prompt {fresh.prompt_tokens} tokens" in text


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def written(thinking_started, text: str, reasoning_to, out=None) -> str:
    """What AnswerWriter puts on stdout (`out`) for `text` streamed one character at a time (tags split across
    deltas)."""
    out = out if out is not None else io.StringIO()
    with mock.patch.object(sys, "stdout", out):
        writer = AnswerWriter(thinking_started, reasoning_to)
        for i, char in enumerate(text):
            writer.write(char, final=i == len(text) - 1)
    return out.getvalue()


def test_the_answer_writer_sets_the_reasoning_apart(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    text = "7+5=12\n</think>\n\n512"
    aside = io.StringIO()
    assert written(True, text, aside) == "512"
    assert aside.getvalue() == f"{THINKING_OPEN}\n7+5=12\n{THINKING_CLOSE}\n\n"
    assert written(True, text, None) == "512"  # --hide-thinking
    terminal = Terminal()
    styled = written(True, text, terminal, terminal)  # a terminal: the same lines, dimmed, then the answer undimmed
    assert styled.replace(DIM, "").replace(RESET, "") == f"{THINKING_OPEN}\n7+5=12\n{THINKING_CLOSE}\n\n512"
    assert styled.startswith(DIM) and styled.count(DIM) == styled.count(RESET) and styled.endswith(RESET + "512")
    monkeypatch.setenv("NO_COLOR", "1")
    plain = Terminal()
    assert DIM not in written(True, text, plain, plain)
    assert written(False, "no thinking</think> here", aside) == "no thinking</think> here"  # thinking off
    assert written(None, "<think>raw</think>", aside) == "<think>raw</think>"  # --raw: as generated
    cut = io.StringIO()
    assert written(True, "cut off while thi", cut) == ""  # max_tokens inside the reasoning: its block still closes
    assert cut.getvalue() == f"{THINKING_OPEN}\ncut off while thi\n{THINKING_CLOSE}\n\n"


def test_where_the_reasoning_goes(monkeypatch):
    monkeypatch.setattr(log, "_level", log.NORMAL)
    for stdout, default in ((Terminal(), "stdout"), (io.StringIO(), "stderr")):
        monkeypatch.setattr(sys, "stdout", stdout)
        assert reasoning_destination(None) is getattr(sys, default)
        assert reasoning_destination(True) is sys.stdout and reasoning_destination(False) is None
    monkeypatch.setattr(log, "_level", log.QUIET)
    assert reasoning_destination(None) is None and reasoning_destination(True) is sys.stdout


def test_run_prints_the_answer_alone_into_a_pipe(capsys, monkeypatch):
    """In-process (stdout captured: not a terminal). The reasoning goes to stderr, marked; -q leaves stderr empty;
    -v adds the setup and the phases' times."""
    monkeypatch.setattr(log, "_level", log.NORMAL)  # main sets it; restored after the test
    question = "What is 127 + 385?"
    done = qwenrt.complete(*qwenrt.load(), [{"role": "user", "content": question}], temperature=0, max_tokens=512)
    assert done.reasoning and done.content == "127 + 385 = 512"
    block = f"{THINKING_OPEN}\n{done.reasoning}\n{THINKING_CLOSE}\n\n"
    assert main(["run", question, "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == done.content + "\n" and block in err and "</think>" not in err
    assert main(["run", question, "--temperature", "0", "-q", "--show-thinking"]) == 0
    assert capsys.readouterr() == (block + done.content + "\n", "")
    assert main(["run", question, "--temperature", "0", "-v", "--hide-thinking"]) == 0
    out, err = capsys.readouterr()
    assert out == done.content + "\n" and THINKING_OPEN not in err
    for line in (f"checkpoint: {default_model_path()}\n", "device: cpu\n", "sampling: max_tokens 512, temperature 0.0\n",
                 "time: checks "):
        assert line in err, err


def test_serve_quiet_says_nothing_but_errors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = qwenrt_cli("serve", tmp_path / "missing", "-q", "--port", port)
    assert serve.returncode == 1
    lines = serve.stderr.splitlines()
    assert lines and all(line.startswith("qwenrt: error: ") and "no such directory" in line for line in lines), lines


def test_chat_quiet_prints_the_answers_alone(chat_ckpt, chat_model, capsys, monkeypatch):
    model, tok, _ = chat_model
    monkeypatch.setattr(log, "_level", log.NORMAL)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n/exit\n"))
    assert main(["chat", str(chat_ckpt[0]), "-n", "3", "--temp", "0", "--dtype", "float32", "--no-thinking",
                 "-q"]) == 0
    answer = qwenrt.generate(model, tok, [{"role": "user", "content": "Hello"}], max_tokens=3, enable_thinking=False)
    assert capsys.readouterr() == (f">>> {answer}\n>>> ", "")
