"""Model sources: a local checkpoint directory or a Hugging Face hub repo id (downloaded once, then cached)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from qwenrt.default_model import DEFAULT_MODEL, default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.files import not_a_directory
from qwenrt.validation import check_path

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# what inference needs; the hub repos also hold READMEs, images and sometimes other formats
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_path(source: str | Path, revision: str | None = None) -> Path:
    """A local directory as is; the built-in model by its name; otherwise a hub repo id, fetched with huggingface_hub
    (HF_HUB_OFFLINE respected)."""
    if revision is not None and not isinstance(revision, str):
        raise QwenrtError(f"revision must be a string (a branch, tag or commit), got {type(revision).__name__}")
    if isinstance(source, str) and source == DEFAULT_MODEL:
        if revision is not None:
            raise QwenrtError(f"{DEFAULT_MODEL} is the built-in model: it has no revisions")
        return default_model_path()
    path = Path(check_path(source, "model (a checkpoint directory or hub repo id)"))
    try:
        path = path.expanduser()
        exists = path.exists()
    except RuntimeError as e:  # `~user/...` of a user who does not exist
        raise QwenrtError(f"{source}: {e}") from None
    except OSError as e:  # e.g. a path through an unreadable directory, a name too long
        raise QwenrtError(f"{path}: {e.strerror or e}") from None
    if exists and (path.is_dir() or (path.suffix.lower() == ".gguf" and path.is_file())):
        return path
    if path.suffix.lower() == ".gguf":  # a .gguf name is a file, never a hub repo id
        raise QwenrtError(f"GGUF file not found: {path}")
    if exists:
        raise not_a_directory(path)
    name = str(source)
    if not is_repo_id(name):
        raise QwenrtError(f"{name}: no such directory (and not a hub repo id like 'Qwen/Qwen3.5-0.8B')")
    return download(name, revision)


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def download(name: str, revision: str | None = None, patterns: list[str] = ALLOW_PATTERNS) -> Path:
    """The snapshot directory of hub repo `name` in the Hugging Face cache, its files matching `patterns` fetched
    where missing (with progress bars); with HF_HUB_OFFLINE set, the cache only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns, local_files_only=offline))
    except RepositoryNotFoundError:
        raise QwenrtError(f"{name}: no such repository on the hub (or it is private: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached (no network?)"
        raise QwenrtError(f"{name}: not in the local cache and {why}; fetch it where there is network (`qwenrt "
                          f"pull {name}`, or `hf download {name}` and pass its directory), or try a tiny random "
                          "checkpoint (README: `python -m tests.make_checkpoint`)") from None
    except (HfHubHTTPError, OSError) as e:
        raise QwenrtError(f"{name}: download failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
