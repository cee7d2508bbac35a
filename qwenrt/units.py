"""Values as people write them on a command line: sizes ("2GiB", "512MB", "1.5G", "0", or a plain number of bytes)
and speculative draft counts ("auto", "3"); and counts and sizes as qwenrt prints them."""

from __future__ import annotations

import argparse
import json
import re

from qwenrt.errors import QwenrtError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size string; a one-line QwenrtError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise QwenrtError(f"not a size: {text!r} (examples: 0, 512MiB, 2GiB, 1500000000)")
    return int(float(match.group(1)) * _UNITS[unit])


def human(n: int, unit: str = "") -> str:
    """A count or a size in decimal units: 708.43K, 1.97MB."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n}{unit}"


def speculative_tokens(text: str) -> int | str:
    """--speculative-tokens: "auto" or a draft count (0 = off)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a number of tokens, got {text!r}") from None
    if not 0 <= value <= 8:
        raise argparse.ArgumentTypeError(f"must be auto or 0..8, got {value}")
    return value


def rope_scaling(text: str) -> dict:
    """--rope-scaling: a JSON object of rope_parameters keys (its values are checked when the config is read)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{YARN_EXAMPLE}', got {text[:80]!r}")
    return value


YARN_EXAMPLE = '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":262144}'


def add_rope_scaling_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rope-scaling", type=rope_scaling, metavar="JSON",
                   help=f"replace the checkpoint's RoPE scaling, e.g. YaRN: '{YARN_EXAMPLE}' (the context limit "
                        "becomes factor x original; static YaRN may cost some short-context quality: use it when "
                        "prompts need it); '{\"rope_type\":\"default\"}' turns a config's off")


def add_kv_cache_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                   help="keys and values in the model's dtype (auto), or in 8 bits with a scale per token and head "
                        "(int8: about half the memory of a bf16 cache, for long contexts)")


def add_mmproj_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mmproj", metavar="FILE", help="a llama.cpp vision projector file (mmproj-*.gguf) giving a "
                   "GGUF model its vision tower")


def add_speculative_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-tokens", type=speculative_tokens, metavar="auto|K",
                   help="draft tokens verified per decode step: 0 = off, 1..8, or auto (default: auto, which uses "
                        "the model's MTP head where it pays; without one, a count drafts from earlier text)")
