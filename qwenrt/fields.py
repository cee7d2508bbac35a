"""Typed, range-checked fields of untrusted JSON objects (config.json and friends): one-line errors naming the field."""

from __future__ import annotations

import math

from qwenrt.errors import QwenrtError

REQUIRED = object()


class Fields:
    """Reads one JSON object; every getter checks the type and range before the value is used."""

    def __init__(self, d, where: str):
        if not isinstance(d, dict):
            raise QwenrtError(f"{where}: expected a JSON object, got {type(d).__name__}")
        self.d, self.where = d, where

    def _get(self, key: str, default):
        value = self.d.get(key)
        if value is None:
            if default is REQUIRED:
                raise QwenrtError(f"{self.where}: missing required field '{key}'")
            return default, True
        return value, False

    def _fail(self, key: str, need: str, value) -> QwenrtError:
        shown = repr(value)
        return QwenrtError(f"{self.where}: '{key}' must be {need}, got {shown if len(shown) <= 60 else shown[:57] + '...'}")

    def int(self, key: str, default=REQUIRED, lo: int = 1, hi: int = 1 << 31) -> int:
        value, absent = self._get(key, default)
        if absent:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self._fail(key, f"an integer in [{lo}, {hi}]", value)
        return value

    def float(self, key: str, default=REQUIRED, lo: float = -math.inf, hi: float = math.inf,
              open_low: bool = False) -> float:
        value, absent = self._get(key, default)
        if absent:
            return value
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (lo < value if open_low else lo <= value) and value <= hi)
        if not ok:
            low = f"({lo}" if open_low else f"[{lo}"
            raise self._fail(key, f"a finite number in {low}, {hi}]", value)
        return float(value)

    def bool(self, key: str, default=REQUIRED) -> bool:
        value, absent = self._get(key, default)
        if not absent and not isinstance(value, bool):
            raise self._fail(key, "true or false", value)
        return value

    def str(self, key: str, default=REQUIRED, choices=None) -> str:
        value, absent = self._get(key, default)
        if absent:
            return value
        if not isinstance(value, str) or (choices is not None and value not in choices):
            raise self._fail(key, f"one of {', '.join(map(repr, choices))}" if choices else "a string", value)
        return value

    def list(self, key: str, default=REQUIRED, max_len: int = 1 << 16) -> list:
        value, absent = self._get(key, default)
        if not absent and (not isinstance(value, list) or len(value) > max_len):
            raise self._fail(key, f"a list of at most {max_len} entries", value)
        return value

    def ints(self, key: str, default=REQUIRED, lo: int = 0, hi: int = 1 << 31, max_len: int = 1 << 16):
        """An integer or a list of integers, as a tuple."""
        value, absent = self._get(key, default)
        if absent:
            return value
        items = [value] if isinstance(value, int) else value
        if (not isinstance(items, list) or len(items) > max_len
                or not all(isinstance(i, int) and not isinstance(i, bool) and lo <= i <= hi for i in items)):
            raise self._fail(key, f"an integer or a list of integers in [{lo}, {hi}]", value)
        return tuple(items)

    def obj(self, key: str, default=REQUIRED) -> Fields | None:
        value, absent = self._get(key, default)
        if absent:
            return None if value is None else Fields(value, f"{self.where} {key}")
        return Fields(value, f"{self.where} {key}")
