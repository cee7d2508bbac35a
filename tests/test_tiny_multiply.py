"""The multiplication task the built-in model is fine-tuned on (bench/lora_multiply.py): its working is right
arithmetic line by line for every two-digit pair, held-out pairs never occur in training data, the built-in
tokenizer encodes every conversation, and the JSONL it writes trains."""

import json
import re

import pytest

from qwenrt.default_model import default_model_path
from qwenrt.tiny import finetune_data
from qwenrt.tiny.tasks import (REPLAY_WEIGHTS, TIMES_PROMPT, conversations, held_out, mul_reasoning,
                               multiplication_conversations, quality_tasks)

PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]


def _product_lines_value(lines: list[str], a: int, d: int) -> int:
    """The value a x d the digit lines arrive at, each line's arithmetic checked."""
    if lines == [f"{a} * 0=0"]:
        return 0
    carry = 0
    for line, x in zip(lines, reversed(str(a))):
        m = re.fullmatch(r"(\d) \* (\d)(?:\+(\d))?=(\d+)(?:\+(\d)=(\d+))?(?:, carry (\d))?: (\d+)", line)
        assert m, line
        assert (int(m.group(1)), int(m.group(2))) == (int(x), d) and int(m.group(4)) == int(x) * d, line
        total = int(m.group(6) or m.group(4))
        assert int(m.group(3) or 0) == int(m.group(5) or 0) == carry and total == int(x) * d + carry, line
        assert m.group(7) is None or int(m.group(7)) == total // 10, line
        carry = total // 10
    assert len(lines) == len(str(a))
    return int(lines[-1].rsplit(": ", 1)[1])


def test_multiplication_working_is_right_for_every_two_digit_pair():
    for a, b in PAIRS:
        lines = mul_reasoning(a, b).splitlines()
        ones, tens = b % 10, b // 10
        cut = lines.index(f"{a} * {tens}:", 1)
        assert lines[0] == f"{a} * {ones}:"
        low = _product_lines_value(lines[1:cut], a, ones)
        add = next(i for i, line in enumerate(lines) if re.fullmatch(r"\d+\+\d+:", line))
        high = _product_lines_value(lines[cut + 1:add], a, tens)
        assert (low, high) == (a * ones, a * tens) and lines[add] == f"{low}+{high * 10}:"
        columns = lines[add + 1:]
        for line in columns:
            for expression, value in re.findall(r"(\d+(?:\+\d+)+)=(\d+)", line):
                assert eval(expression) == int(value), line  # digits and + only
        assert columns[-1].rsplit(": ", 1)[1] == str(a * b), (a, b)


def test_held_out_pairs_never_occur_in_training_and_are_a_tenth():
    asked = [m for c in multiplication_conversations(3000, 1)
             for m in [re.fullmatch(r"(?s).*?(\d+) \* (\d+) = (\d+)", c["messages"][-1]["content"])] if m]
    assert len(asked) > 2500
    assert not [m for m in asked if held_out(int(m.group(1)), "*", int(m.group(2)))]
    assert all(int(m.group(1)) * int(m.group(2)) == int(m.group(3)) for m in asked)
    held = quality_tasks("mul", 300, 2)
    assert all(held_out(int(t.answer.split()[0]), "*", int(t.answer.split()[2])) for t in held)
    assert 0.08 < sum(held_out(a, "*", b) for a, b in PAIRS) / len(PAIRS) < 0.12


def test_replay_mixes_in_the_built_in_tasks_at_its_share():
    data = multiplication_conversations(1000, 3, replay=0.25)
    assert data == multiplication_conversations(1000, 3, replay=0.25)
    products = sum(bool(re.search(r"\d+ \* \d+ = \d+$", c["messages"][-1]["content"])) for c in data)
    assert 700 < products < 800
    thinking = sum("reasoning_content" in c["messages"][-1] for c in data[:200])
    assert 60 < thinking < 140


def test_replay_draws_more_calculator_calls_and_copying_than_the_built_in_mix():
    def shares(data):
        calls = sum(any(call["function"]["name"] == "calculator"
                        for m in c["messages"] for call in m.get("tool_calls", ())) for c in data)
        copies = sum(c["messages"][-2]["content"].startswith(("Repeat", "Please repeat", "Say this")) for c in data)
        return calls / len(data), copies / len(data)

    replayed = multiplication_conversations(2000, 3, replay=1.0)
    assert replayed == conversations(2000, 4, weights=REPLAY_WEIGHTS)
    calls, copies = shares(replayed)
    built_in_calls, built_in_copies = shares(conversations(2000, 4))
    assert 0.12 < calls < 0.18 and 0.12 < copies < 0.18  # REPLAY_WEIGHTS: 15% each
    assert built_in_calls < 0.06 and built_in_copies < 0.06  # FAMILY_WEIGHTS: 4% each


def test_times_table_drills_are_right_and_ask_what_they_answer():
    drills = [c for c in multiplication_conversations(600, 6, replay=0.2, facts=0.3)
              if c["messages"][0]["content"].startswith(TIMES_PROMPT.format(""))]
    assert 120 < len(drills) < 240
    for c in drills:
        asked = c["messages"][0]["content"].removeprefix(TIMES_PROMPT.format("")).split(", ")
        lines = c["messages"][1]["content"].splitlines()
        assert [line.split("=")[0] for line in lines] == asked
        for line in lines:
            m = re.fullmatch(r"(\d) \* (\d)(?:\+(\d)=(\d+)\+\3)?=(\d+)", line)
            assert m and int(m.group(5)) == int(m.group(1)) * int(m.group(2)) + int(m.group(3) or 0), line
            assert m.group(4) is None or int(m.group(4)) == int(m.group(1)) * int(m.group(2)), line


def test_the_built_in_tokenizer_encodes_every_multiplication_conversation():
    from qwenrt.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_path())
    for c in multiplication_conversations(200, 4, facts=0.3) + multiplication_conversations(100, 5, heldout=True):
        for thinking in (False, True):
            text = tokenizer.apply_chat_template(c["messages"], enable_thinking=thinking)
            assert tokenizer.decode(tokenizer.encode(text)) == text


def test_written_jsonl_trains_lora_adapters(tmp_path, capsys):
    from qwenrt.train.trainer import TrainConfig, train

    data, held = tmp_path / "mul.jsonl", tmp_path / "held.jsonl"
    finetune_data.main([str(data), "--n", "12", "--replay", "0.2"])
    finetune_data.main([str(held), "--n", "4", "--held-out", "--seed", "1"])
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(lines) == 12 and all(c["messages"][-1]["role"] == "assistant" for c in lines)
    summary = train(TrainConfig(out=str(tmp_path / "out"), init=str(default_model_path()), data=str(data),
                                eval_data=str(held), lora_rank=2, steps=2, batch_size=4, threads=1, progress=False))
    assert summary["parameters"]["lora"] > 0 and (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert summary["history"][-1]["eval_loss"] < summary["history"][0]["eval_loss"]


def test_finetune_data_refuses_bad_settings(tmp_path, capsys):
    with pytest.raises(SystemExit):
        finetune_data.main([str(tmp_path / "x.jsonl"), "--replay", "1.5"])
    assert "--replay" in capsys.readouterr().err
