"""The built-in model's generated data: the working in <think> is right column by column and ends in the answer,
and nothing the quality test asks about (held-out operand pairs, held-out countries) occurs in training."""

import json
import random
import re

from qwenrt.tiny.tasks import (CAPITALS, FAMILY_WEIGHTS, add_reasoning, compare_line, conversations,
                               copy_conversations, copy_share, held_out, invented_place, quality_tasks, sub_reasoning)


def _check_columns(working: str) -> str:
    """Every column line's arithmetic holds; returns the digits after the last colon."""
    done = ""
    for line in working.splitlines():
        if "<" in line:
            continue
        sums = re.findall(r"(\d+(?:[+-]\d+)+)=(\d+)", line)  # "2+8+1=11", "10-1-7=2"
        for expression, value in sums:
            assert eval(expression) == int(value), line  # digits and + / - only
        if sums:
            done = line.rsplit(": ", 1)[1]
            assert done.isdigit(), line
    return done


def test_addition_working_is_right_and_ends_in_the_sum():
    rng = random.Random(0)
    for a, b in [(999, 1), (0, 0), (5, 995)] + [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(500)]:
        working = add_reasoning(a, b)
        last = working.splitlines()[-1]
        assert (last.split(": ")[1] if last.startswith("carry") else _check_columns(working)) == str(a + b), working


def test_subtraction_working_is_right_and_ends_in_the_difference():
    rng = random.Random(1)
    for a, b in [(512, 508), (19, 964), (100, 99), (7, 7)] + [(rng.randint(0, 999), rng.randint(0, 999))
                                                                 for _ in range(500)]:
        working = sub_reasoning(a, b)
        digits = _check_columns(working)
        last = working.splitlines()[-1]
        value = int(last.split(": ")[1]) if last.startswith("without leading zeros") else int(digits)
        assert working.splitlines()[0] == compare_line(a, b)
        assert (-value if a < b else value) == a - b, working


def test_comparison_works_from_the_left_and_is_right():
    assert compare_line(272, 255) == "272 vs 255: 2=2, 7>5, so 272>255"
    assert compare_line(716, 62) == "716 vs 62: 3 digits vs 2, so 716>62"
    rng = random.Random(3)
    for a, b in [(7, 7), (100, 99), (0, 5)] + [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(500)]:
        line = compare_line(a, b)
        rel = line.rsplit("so ", 1)[1]
        assert rel == f"{a}{'<' if a < b else '>' if a > b else '='}{b}", line
        for x, r, y in re.findall(r"\b(\d)([<>=])(\d)\b", line.split(": ", 1)[1].rsplit(", so", 1)[0]):
            assert r == ("<" if x < y else ">" if x > y else "="), line


def test_held_out_prompts_never_occur_in_training():
    data = conversations(4000, 1)
    text = json.dumps(data)
    assert not [c for c in CAPITALS if held_out(c) and c in text]
    asked = 0
    for conversation in data:
        for turn in conversation["messages"]:
            m = re.fullmatch(r"(\d+) ([+-]) (\d+) = -?\d+", turn["content"].rsplit("\n\n", 1)[-1]) \
                if turn["role"] == "assistant" else None
            if m:
                asked += 1
                assert not held_out(int(m.group(1)), m.group(2), int(m.group(3))), turn
    assert asked > 2000


def test_answers_without_thinking_show_the_working_then_the_sum():
    """Without thinking an arithmetic reply is the working (as inside <think>) and then `a op b = c`."""
    shown = 0
    for conversation in conversations(600, 4):
        for q, turn in zip(conversation["messages"], conversation["messages"][1:]):
            m = re.fullmatch(r"(?s)(.*)\n\n((\d+) ([+-]) (\d+) = (-?\d+))", turn.get("content", ""))
            if turn["role"] != "assistant" or "reasoning_content" in turn or not m:
                continue
            a, op, b = int(m.group(3)), m.group(4), int(m.group(5))
            assert m.group(1) == (add_reasoning(a, b) if op == "+" else sub_reasoning(a, b))
            assert int(m.group(6)) == (a + b if op == "+" else a - b)
            shown += 1
    assert shown > 50


def test_copying_comes_first_in_a_training_run_and_never_repeats_held_out_words():
    assert copy_share(0.0) == copy_share(0.25) > 0.5 > copy_share(0.4) > copy_share(0.5) == FAMILY_WEIGHTS["copy"]
    data = conversations(2000, 5, curriculum=True)

    def copies(part):
        return sum(c["messages"][-1]["content"].removeprefix("Sure: ") in c["messages"][-2]["content"] and
                   c["messages"][-2]["content"].startswith(("Repeat", "Please repeat", "Say this")) for c in part)

    assert copies(data[:500]) > 250 and copies(data[1500:]) < 60
    for task in quality_tasks("copy", 200, 7):
        words = task.answer.removeprefix("Sure: ")
        assert words.split() and all(held_out(w) for w in words.split())
        assert task.messages[0]["content"].endswith((f": {words}", f":\n{words}"))
    trained = {w for c in data for w in c["messages"][-1]["content"].removeprefix("Sure: ").split()
               if c["messages"][-2]["content"].startswith(("Repeat", "Please repeat", "Say this"))}
    assert trained and not [w for w in trained if held_out(w)]


def test_the_copy_phase_is_copying_alone_and_never_held_out_words():
    data = copy_conversations(300, 5)
    assert data == copy_conversations(300, 5)
    for c in data:
        prompt, reply = c["messages"][-2]["content"], c["messages"][-1]["content"]
        words = reply.removeprefix("Sure: ")
        assert prompt.endswith((f": {words}", f":\n{words}")) and not any(held_out(w) for w in words.split())
    assert 0.3 < sum("reasoning_content" in c["messages"][-1] for c in data) / len(data) < 0.7


def test_invented_places_are_not_real_ones():
    rng = random.Random(2)
    names = {invented_place(rng) for _ in range(2000)}
    assert len(names) > 1000 and not names & (set(CAPITALS) | set(CAPITALS.values()))


def test_sum_statements_label_every_statement_by_its_arithmetic():
    """The classifier check's data: bare and after the column working, half right and half near misses, held out by
    operand pair."""
    import re

    from qwenrt.tiny.tasks import add_reasoning, held_out, sum_statements

    for working in (False, True):
        train = sum_statements(200, 1, working=working)
        test = sum_statements(100, 2, heldout=True, working=working)
        for row, heldout in [(r, False) for r in train] + [(r, True) for r in test]:
            a, b, value = map(int, re.fullmatch(r"(\d+) \+ (\d+) = (\d+)", row["text"].splitlines()[-1]).groups())
            assert (value == a + b) == (row["label"] == "correct") and held_out(a, "+", b) == heldout
            if working:
                assert row["text"] == f"{a} + {b}\n{add_reasoning(a, b)}\n{a} + {b} = {value}"
        assert sum(r["label"] == "wrong" for r in train) == 100
