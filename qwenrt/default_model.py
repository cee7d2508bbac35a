"""The model used when none is named: qwenrt-tiny, trained from scratch by qwenrt's own recipe (qwenrt/tiny/) and
shipped inside the package, so qwenrt answers with no download and no network."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "qwenrt-tiny"


def default_model_path() -> Path:
    """The directory of the built-in checkpoint (a Hugging Face layout, like any other)."""
    return Path(__file__).parent / "tiny" / "model"


def resolve_model(source: str | Path | None) -> tuple[str | Path, str]:
    """(what to load, how to name it to the user): `source` as given, or the built-in model when it is None or its
    name (a directory of that name is ./qwenrt-tiny)."""
    if source is None or (isinstance(source, str) and source == DEFAULT_MODEL):
        path = default_model_path()
        return path, f"the built-in model {DEFAULT_MODEL} ({path})"
    return source, str(source)
