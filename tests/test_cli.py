"""`qwenrt run` and `qwenrt chat` end to end, in subprocesses."""

import json
import os
import subprocess
import sys

import jsonschema
import pytest
import torch

import qwenrt
from qwenrt.cli import main
from qwenrt.convert import quantize_checkpoint
from qwenrt.default_model import default_model_path
from qwenrt.kernels import kernel_path


def qwenrt_cli(*args, stdin=None, **env):
    return subprocess.run([sys.executable, "-m", "qwenrt", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, **env))


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
    int4 copy of the built-in model loads in bf16 and says its weight format. A count below 1 is refused while
    parsing, before anything loads."""
    int4 = quantize_checkpoint(default_model_path(), tmp_path / "int4", 4)
    run = qwenrt_cli("run", int4, "Hi", "-n", 2, "--threads", 1)
    assert run.returncode == 0, run.stderr
    assert "model (torch.bfloat16, weights int4 g64) in " in run.stderr and ", 1 thread\n" in run.stderr
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


def test_chat_session(chat_ckpt):
    script = "Hi there\n/thinking off\nAnd again\n/bogus\n/reset\nFresh start\n/exit\n"
    run = qwenrt_cli("chat", chat_ckpt[0], "-n", 6, "--temp", 0, stdin=script)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("generated 6 tokens") == 3
    assert "[thinking off]" in run.stderr and "[conversation reset]" in run.stderr
    assert "unknown command /bogus" in run.stderr


def test_run_with_an_image(vlm_chat, tmp_path):
    import numpy as np
    from PIL import Image

    model, tok, _, path = vlm_chat
    image = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(image)
    run = qwenrt_cli("run", path, "describe this", "--image", image, "-n", 6, "--temp", 0, "--dtype", "float32")
    assert run.returncode == 0, run.stderr
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                             {"type": "text", "text": "describe this"}]}]
    assert run.stdout == qwenrt.generate(model, tok, messages, max_tokens=6) + "\n"
    bad = qwenrt_cli("run", path, "describe this", "--image", tmp_path / "nope.png")
    assert bad.returncode == 1 and "nope.png" in bad.stderr and "Traceback" not in bad.stderr


def test_chat_ctrl_c_stops_the_answer_not_the_session(chat_ckpt):
    import signal
    import threading
    import time

    # as from a terminal: a suite started in the background of a shell passes SIGINT on ignored
    chat = subprocess.Popen([sys.executable, "-m", "qwenrt", "chat", str(chat_ckpt[0]), "-n", "100000", "--temp", "0"],
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
        chat.stdin.write("/exit\n")
        chat.stdin.flush()
        chat.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        chat.kill()
    text = "".join(err)
    assert chat.returncode == 0, text
    assert "[stopped]" in text and "Traceback" not in text
