"""Helpers for the hostile-input tests: safetensors header surgery, one-line error checks, a hang guard."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import pytest

from qwenrt.errors import QwenrtError


def read_safetensors(file: Path) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a safetensors file."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(file: Path, header, data: bytes, header_text: bytes | None = None,
                      length: int | None = None) -> None:
    """Write a (possibly broken) header and data; `header_text` replaces the JSON, `length` the length field."""
    text = json.dumps(header).encode() if header_text is None else header_text
    file.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)


@contextlib.contextmanager
def no_hang(seconds: int = 20):
    """Fail, rather than hang the suite, when the body runs past `seconds`."""
    def expired(*_):
        raise TimeoutError(f"hung for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_line_error(fn, *fragments) -> str:
    """Call fn(); it must raise a QwenrtError whose message is one line holding every fragment."""
    with no_hang(), pytest.raises(QwenrtError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message
