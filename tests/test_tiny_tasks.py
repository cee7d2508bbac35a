"""The built-in model's generated data: the working in <think> is right column by column and ends in the answer,
and nothing the quality test asks about (held-out operand pairs, held-out countries) occurs in training."""

import json
import random
import re

from qwenrt.tiny.tasks import CAPITALS, add_reasoning, conversations, held_out, invented_place, sub_reasoning


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
        assert (a < b) == working.startswith(f"{a}<{b}")
        assert (-value if a < b else value) == a - b, working


def test_held_out_prompts_never_occur_in_training():
    data = conversations(4000, 1)
    text = json.dumps(data)
    assert not [c for c in CAPITALS if held_out(c) and c in text]
    asked = 0
    for conversation in data:
        for turn in conversation["messages"]:
            m = re.fullmatch(r"(\d+) ([+-]) (\d+) = -?\d+", turn["content"]) if turn["role"] == "assistant" else None
            if m:
                asked += 1
                assert not held_out(int(m.group(1)), m.group(2), int(m.group(3))), turn
    assert asked > 2000


def test_invented_places_are_not_real_ones():
    rng = random.Random(2)
    names = {invented_place(rng) for _ in range(2000)}
    assert len(names) > 1000 and not names & (set(CAPITALS) | set(CAPITALS.values()))
