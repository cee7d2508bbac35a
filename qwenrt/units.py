"""Sizes as people write them: "2GiB", "512MB", "1.5G", "0", or a plain number of bytes."""

from __future__ import annotations

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
