"""The models qwenrt can see (`qwenrt list`): the built-in one and the Qwen3.5-family checkpoints in the Hugging Face
cache, each by the name `run`, `chat`, `serve` and `load` take; and `qwenrt pull`, which fetches one ahead of time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qwenrt.default_model import DEFAULT_MODEL, default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.files import CheckpointDir
from qwenrt.gguf.names import hub_gguf
from qwenrt.hub import ALLOW_PATTERNS, download, download_gguf, is_repo_id, refuse_gguf_repo
from qwenrt.units import human


@dataclass(frozen=True)
class Model:
    name: str  # what `qwenrt run NAME` takes
    model_type: str  # config.json's
    size: int  # bytes on disk
    path: str
    source: str  # "built-in" or "hf-cache"


def _model_type(path: Path) -> str | None:
    """config.json's model_type, or None where there is no readable one."""
    try:
        config = CheckpointDir(path).optional_json("config.json")
    except QwenrtError:
        return None
    kind = config.get("model_type") if config else None
    return kind if isinstance(kind, str) else None


def _supported_types() -> set[str]:
    from qwenrt.config import TEXT_MODEL_TYPES, VLM_MODEL_TYPES

    return {*VLM_MODEL_TYPES, *TEXT_MODEL_TYPES}


def builtin_model() -> Model:
    path = default_model_path()
    size = sum(f.stat().st_size for f in path.iterdir())
    return Model(DEFAULT_MODEL, _model_type(path), size, str(path), "built-in")


def cached_models() -> list[Model]:
    """The Hugging Face cache's model repos whose config.json has a model_type qwenrt runs, by repo id: the snapshot
    `main` points at (what loading the repo id uses), else the newest."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    except (OSError, ValueError) as e:  # e.g. a file where the cache folder should be
        raise QwenrtError(f"cannot read the Hugging Face cache: {e}") from None
    models, supported = [], _supported_types()
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        kind = _model_type(revision.snapshot_path)
        if kind in supported:
            models.append(Model(repo.repo_id, kind, revision.size_on_disk, str(revision.snapshot_path), "hf-cache"))
    return models


def list_models() -> list[Model]:
    return [builtin_model(), *cached_models()]


def format_models(models: list[Model]) -> str:
    """A table: name, model_type, size, path."""
    rows = [("NAME", "TYPE", "SIZE", "PATH")] + [(m.name, m.model_type, human(m.size, "B"), m.path) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3] for row in rows)


def pull(name: str, revision: str | None = None) -> str:
    """Fetch hub repo `name` into the Hugging Face cache (its config first: a model qwenrt cannot run is not
    downloaded), or the GGUF file of a hub repo it names (`OWNER/REPO:TAG`, `OWNER/REPO/PATH.gguf`); returns the
    closing line."""
    if name == DEFAULT_MODEL:
        return f"{DEFAULT_MODEL} is built in ({default_model_path()}): nothing to download"
    spec = hub_gguf(name)
    if spec is not None:
        files = download_gguf(spec, name, revision)
        return f"{name}: {human(sum(f.stat().st_size for f in files), 'B')} in {files[0]}"
    if not is_repo_id(name):
        raise QwenrtError(f"{name}: not a hub repo id like 'Qwen/Qwen3.5-0.8B' (or OWNER/REPO:TAG for a GGUF file)")
    kind, supported = _model_type(download(name, revision, ["config.json"])), _supported_types()
    if kind is None:
        refuse_gguf_repo(name, revision)
    if kind not in supported:
        found = "no config.json" if kind is None else f"model_type {kind!r}"
        raise QwenrtError(f"{name}: {found}, not a model qwenrt runs (model_type {', '.join(sorted(supported))})")
    path = download(name, revision, ALLOW_PATTERNS)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{name}: {human(size, 'B')} in {path}"
