"""Fuzzing: random mutations of a valid tiny checkpoint's safetensors header and config.json (fixed seed, bounded
count). Every case must load correctly (and run) or raise one one-line QwenrtError: never another exception, a hang
or unbounded memory."""

import copy
import json
import random
import resource
import shutil

import pytest
import torch

import qwenrt
from qwenrt.errors import QwenrtError
from qwenrt.sampling import SamplingParams, sample
from tests.hostile import no_hang, read_safetensors, write_safetensors

CASES = 100  # per target
ODD_VALUES = [None, 0, -1, 1, 3, 2 ** 31, 2 ** 63, -2 ** 63, 1.5, -0.0, 1e308, "x", "", [], [1], [64], {}, {"a": 1},
              True, False, "F32", "BF16", "I8", 10 ** 30]


def mutate_value(rng: random.Random, value):
    """A plausible or hostile replacement for one JSON value."""
    choice = rng.random()
    if isinstance(value, bool) or choice < 0.35:
        return rng.choice(ODD_VALUES)
    if isinstance(value, int):
        return rng.choice([value + 1, value - 1, value * 2, value // 2, -value, value * 10 ** 6])
    if isinstance(value, float):
        return rng.choice([value * 10, -value, 0.0, value / 1e9, round(value, 3)])
    if isinstance(value, list) and value:
        items = list(value)
        i = rng.randrange(len(items))
        action = rng.random()
        if action < 0.4:
            items[i] = mutate_value(rng, items[i])
        elif action < 0.7:
            items.pop(i)
        else:
            items.insert(i, mutate_value(rng, items[i]))
        return items
    if isinstance(value, str):
        return rng.choice([value + "x", value[:-1], value.upper(), "../" + value, "/" + value])
    return rng.choice(ODD_VALUES)


def mutate_object(rng: random.Random, obj: dict, depth: int = 0) -> None:
    """Change, delete, add or recurse into one key of a JSON object."""
    keys = list(obj)
    if not keys or rng.random() < 0.1:
        obj[rng.choice(["extra", "__metadata__", "x" * 50])] = rng.choice(ODD_VALUES)
        return
    key = rng.choice(keys)
    if isinstance(obj[key], dict) and depth < 3 and rng.random() < 0.6:
        mutate_object(rng, obj[key], depth + 1)
    elif rng.random() < 0.15:
        del obj[key]
    else:
        obj[key] = mutate_value(rng, obj[key])


def mutate_header(rng: random.Random, file, pristine: tuple[dict, bytes]) -> None:
    header, data = copy.deepcopy(pristine[0]), pristine[1]
    kind = rng.random()
    if kind < 0.7:
        for _ in range(rng.randint(1, 3)):
            mutate_object(rng, header)
        write_safetensors(file, header, data)
    elif kind < 0.8:  # a lying length field
        text = json.dumps(header).encode()
        write_safetensors(file, header, data, length=len(text) + rng.choice([-1, 1, -len(text), 2 ** 40, 7]))
    elif kind < 0.9:  # flipped bytes in the JSON text
        text = bytearray(json.dumps(header).encode())
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.randrange(256)
        write_safetensors(file, header, data, header_text=bytes(text))
    else:  # truncated or extended data
        cut = rng.choice([-1, -4, -1000, 1, 64])
        write_safetensors(file, header, data[:cut] if cut < 0 else data + b"\0" * cut)


def mutate_config(rng: random.Random, file, pristine: dict) -> None:
    config = copy.deepcopy(pristine)
    for _ in range(rng.randint(1, 3)):
        mutate_object(rng, config)
    file.write_text(json.dumps(config))  # NaN/Infinity literals included when a float overflows


def outcome(path) -> str:
    """'loaded' (and ran), or 'refused' with one line; anything else fails the test."""
    try:
        with no_hang(30):
            model, _ = qwenrt.load(path)
            with torch.inference_mode():
                logits = model(torch.tensor([[1]]))[:, -1]
            sample(logits, SamplingParams())  # a QwenrtError where the weights made the logits non-finite
        return "loaded"
    except QwenrtError as e:
        assert "\n" not in str(e), str(e)
        return "refused"


@pytest.mark.parametrize("target", ["header", "config"])
def test_fuzz_checkpoint(dense_ckpt, tmp_path, target):
    path = tmp_path / "ckpt"
    shutil.copytree(dense_ckpt[0], path)
    weights, config = path / "model.safetensors", path / "config.json"
    pristine_header = read_safetensors(weights)
    pristine_config = json.loads(config.read_text())
    rng = random.Random(1234 if target == "header" else 5678)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts = {"loaded": 0, "refused": 0}
    for case in range(CASES):
        if target == "header":
            mutate_header(rng, weights, pristine_header)
        else:
            mutate_config(rng, config, pristine_config)
        try:
            counts[outcome(path)] += 1
        except BaseException as e:
            raise AssertionError(f"case {case}: {type(e).__name__}: {e}") from e
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 1024, f"peak RSS grew by {grown_mib:.0f} MiB"
    print(f"fuzz {target}: {counts}")
    assert counts["refused"] > CASES // 2 and counts["loaded"] > 0, counts  # the mutations bite, and not all of them
