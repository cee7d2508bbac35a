"""Model sources: a local checkpoint directory or GGUF file, a Hugging Face hub repo id, or one GGUF file of a hub
repo (`OWNER/REPO:TAG`, `OWNER/REPO/PATH.gguf`); what the hub gives is downloaded once, then cached."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from qwenrt.default_model import DEFAULT_MODEL, default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.files import not_a_directory
from qwenrt.gguf.names import HubGGUF, hub_gguf, pick, quant_tags
from qwenrt.validation import check_path

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# what inference needs; the hub repos also hold READMEs, images and sometimes other formats
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# what a MODEL argument of the command line can be
MODEL_HELP = ("checkpoint directory, GGUF file, hub repo id (e.g. Qwen/Qwen3.5-0.8B), or a GGUF file of a hub repo: "
              "OWNER/REPO:QUANT (the file tagged QUANT, e.g. Q4_K_M) or OWNER/REPO/PATH.gguf")


def resolve_model_path(source: str | Path, revision: str | None = None) -> Path:
    """A local directory or GGUF file as is; the built-in model by its name; otherwise a hub repo id, or a GGUF file of
    a hub repo, fetched with huggingface_hub (HF_HUB_OFFLINE respected)."""
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
    spec = hub_gguf(str(source)) if not exists else None
    if spec is not None:
        return download_gguf(spec, str(source), revision)[0]
    if path.suffix.lower() == ".gguf":  # a .gguf name is a file, never a hub repo id
        raise QwenrtError(f"GGUF file not found: {path}")
    if exists:
        raise not_a_directory(path)
    name = str(source)
    if not is_repo_id(name):
        raise QwenrtError(f"{name}: no such directory (and not a hub repo id like 'Qwen/Qwen3.5-0.8B')")
    path = download(name, revision)
    if not any(path.glob("*.safetensors")):
        refuse_gguf_repo(name, revision)
    return path


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def download(name: str, revision: str | None = None, patterns: list[str] = ALLOW_PATTERNS) -> Path:
    """The snapshot directory of hub repo `name` in the Hugging Face cache, its files matching `patterns` fetched
    where missing (with progress bars); with HF_HUB_OFFLINE set, the cache only."""
    from huggingface_hub import snapshot_download

    with hub_errors(name):
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns, local_files_only=offline()))


def refuse_gguf_repo(name: str, revision: str | None = None) -> None:
    """Refuse hub repo `name` in one line naming its quantization tags when it holds GGUF model files (and no
    checkpoint: checked by the caller)."""
    with hub_errors(name):
        tags = quant_tags(repo_files(name, revision)[0])
    if tags:
        raise QwenrtError(f"{name} holds GGUF files, not a checkpoint: name one as {name}:QUANT (it has "
                          f"{', '.join(tags)})")


def download_gguf(spec: HubGGUF, name: str, revision: str | None = None) -> list[Path]:
    """The local paths of the GGUF file `spec` names (all parts of a split set, the first first), each fetched into
    the Hugging Face cache where missing (with progress bars); with HF_HUB_OFFLINE set or the hub unreachable,
    chosen from the cache. `name`: the model name as the user gave it."""
    from huggingface_hub import hf_hub_download

    with hub_errors(name, spec):
        files, cached = repo_files(spec.repo, revision)
        chosen = pick(spec, files, " in the local cache" if cached else "")
        return [Path(hf_hub_download(spec.repo, f, revision=revision, local_files_only=cached)) for f in chosen]


def repo_files(repo: str, revision: str | None = None) -> tuple[list[str], bool]:
    """The paths of the files in hub repo `repo`, and whether they are the cache's: the hub's list, or where
    HF_HUB_OFFLINE is set or the hub cannot be reached, those of the repo's snapshot in the cache."""
    from huggingface_hub import list_repo_files
    from huggingface_hub.errors import HfHubHTTPError

    if not offline():
        try:
            return list_repo_files(repo, revision=revision), False
        except Exception as e:  # unreachable (requests', httpx's or httpx2's errors by huggingface_hub version)
            if isinstance(e, HfHubHTTPError) and getattr(e.response, "status_code", 0) < 500:
                raise  # the hub answered: no such repo or revision, no access
    return cached_files(repo, revision), True


def cached_files(repo: str, revision: str | None = None) -> list[str]:
    """The paths of the files of hub repo `repo` at `revision` (a branch, tag or commit; default main) in the
    Hugging Face cache."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import CacheNotFound

    wanted = revision or "main"
    try:
        repos = scan_cache_dir(constants.HF_HUB_CACHE).repos  # the folder hf_hub_download reads now
    except CacheNotFound:
        repos = frozenset()
    for cached in (r for r in repos if r.repo_id == repo and r.repo_type == "model"):
        for snapshot in cached.revisions:
            if wanted in snapshot.refs or snapshot.commit_hash == wanted:
                return sorted(f.file_path.relative_to(snapshot.snapshot_path).as_posix() for f in snapshot.files)
    raise LocalEntryNotFoundError(f"{repo} at {wanted} is not in the cache")


@contextmanager
def hub_errors(name: str, spec: HubGGUF | None = None):
    """huggingface_hub's errors as one QwenrtError naming `name`, the model as the user gave it (`spec`: the GGUF
    file of a hub repo it names)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        yield
    except RepositoryNotFoundError:
        if spec is not None and spec.file is not None:  # a local path mistyped reads the same
            raise QwenrtError(f"GGUF file not found: {name} (nor a file of a hub repo {spec.repo})") from None
        raise QwenrtError(f"{name}: no such repository on the hub (or it is private: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline() else "the hub cannot be reached (no network?)"
        fetch = f"`qwenrt pull {name}`" + ("" if spec else f", or `hf download {name}` and pass its directory")
        raise QwenrtError(f"{name}: not in the local cache and {why}; fetch it where there is network ({fetch}), or "
                          "try a tiny random checkpoint (README: `python -m tests.make_checkpoint`)") from None
    except (HfHubHTTPError, OSError) as e:
        raise QwenrtError(f"{name}: download failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
