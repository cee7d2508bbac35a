"""Files a checkpoint names, confined to its directory: regular files only, read with a size cap, one-line errors.

Every name a checkpoint gives (index entries, config and tokenizer files, shards) goes through `CheckpointDir.file`:
no absolute paths, no `..`, and a symlink may only point inside the checkpoint, or to a file directly in the blob
store of the Hugging Face cache repo the checkpoint is a snapshot of (`models--org--name/snapshots/REV/f ->
../../blobs/HASH`). That store is found from the snapshot's real path, never through a link: `blobs` must be a real
directory beside the real `snapshots` folder holding the snapshot (`blobs -> /` would otherwise admit every file).
Whether a file is regular is checked when it is opened (`open_regular`).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path, PurePosixPath

from qwenrt.errors import QwenrtError

MIB = 1 << 20
JSON_LIMIT = 64 * MIB  # config / tokenizer_config / generation_config / index files
TOKENIZER_LIMIT = 512 * MIB  # tokenizer.json (Qwen3.5's is ~12 MB)
NAME_MAX = 255  # bytes in one part of a path (Linux, macOS)


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def open_regular(path: Path, what: str = "file") -> int:
    """An fd for reading the regular file `path`; a FIFO or a device is refused without blocking on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise QwenrtError(f"{what} not found: {path}") from None
    except OSError as e:
        raise QwenrtError(f"cannot open {what} {path}: {_why(e)}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise QwenrtError(f"{what} {path} is {kind}")
    return fd


def read_bytes(path: Path, limit: int, what: str = "file") -> bytes:
    """The whole of a regular file of at most `limit` bytes."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise QwenrtError(f"{what} {path} is {size} bytes; the limit is {limit}")
        chunks, total = [], 0
        while chunk := os.read(fd, min(limit + 1 - total, 16 * MIB)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # grew while being read
                raise QwenrtError(f"{what} {path} is over the limit of {limit} bytes")
        return b"".join(chunks)
    except OSError as e:
        raise QwenrtError(f"cannot read {what} {path}: {_why(e)}") from None
    finally:
        os.close(fd)


def read_text(path: Path, limit: int = JSON_LIMIT, what: str = "file") -> str:
    try:
        return read_bytes(path, limit, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise QwenrtError(f"cannot read {what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_json(path: Path, limit: int = JSON_LIMIT, what: str = "file", expect=dict):
    """A JSON file as `expect` (dict by default); NaN/Infinity, bad UTF-8 and deep nesting are refused."""
    try:
        value = json.loads(read_text(path, limit, what), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise QwenrtError(f"{path} is not valid JSON ({' '.join(str(e).split()) or type(e).__name__})") from None
    if not isinstance(value, expect):
        raise QwenrtError(f"{path}: expected a JSON {'object' if expect is dict else expect.__name__}, "
                          f"got {type(value).__name__}")
    return value


def not_a_directory(path: Path) -> QwenrtError:
    """The error for a model path that is not a checkpoint directory; a GGUF file is named as such."""
    if path.suffix.lower() == ".gguf":
        return QwenrtError(f"{path}: a GGUF file, not a checkpoint directory (give it as the model: qwenrt.load "
                           "and every command open it)")
    return QwenrtError(f"{path}: not a directory")


def _blob_store(root: Path) -> Path | None:
    """`<repo>/blobs` when the real path `root` is `<repo>/snapshots/<rev>` and that `blobs` is a real directory (not a
    link); None otherwise. Every part of `root` is real, so the repo is the one that truly holds the snapshot."""
    if root.parent.name != "snapshots":
        return None
    blobs = root.parent.parent / "blobs"
    try:
        return blobs if stat.S_ISDIR(os.lstat(blobs).st_mode) else None
    except OSError:
        return None


class CheckpointDir:
    """A checkpoint directory and the places its files may live."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            if not self.path.is_dir():
                raise not_a_directory(self.path)
            self.root = self.path.resolve(strict=True)
            os.listdir(self.root)
            self.blobs = _blob_store(self.root)
        except OSError as e:
            raise QwenrtError(f"cannot read checkpoint directory {self.path}: {_why(e)}") from None

    def file(self, name: str, what: str = "file") -> Path:
        """The checkpoint file `name` (relative), refused if it escapes the checkpoint; it need not exist."""
        if not isinstance(name, str) or not name or "\0" in name:
            raise QwenrtError(f"{self.path}: invalid {what} name {name!r}")
        try:
            too_long = any(len(os.fsencode(part)) > NAME_MAX for part in PurePosixPath(name).parts)
        except UnicodeEncodeError:  # a lone surrogate: no file can have that name
            raise QwenrtError(f"{self.path}: invalid {what} name {name!r:.80} (not valid Unicode)") from None
        if too_long:
            raise QwenrtError(f"{self.path}: invalid {what} name {name!r:.80}: a part of it is over {NAME_MAX} bytes")
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or name.startswith("~"):
            raise QwenrtError(f"{self.path}: {what} name {name!r} points outside the checkpoint directory")
        path = self.path / pure
        try:
            target = path.resolve()
        except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop on older Pythons
            raise QwenrtError(f"{self.path}: cannot resolve {what} {name!r} ({e})") from None
        if not self._confined(target):
            raise QwenrtError(f"{self.path}: {what} {name!r} is a link to {target}, outside the checkpoint "
                              "directory (copy the file in instead)")
        return path

    def _confined(self, target: Path) -> bool:
        """Whether the real path `target` lies inside the checkpoint, or directly in its repo's blob store."""
        return (target == self.root or self.root in target.parents
                or (self.blobs is not None and target.parent == self.blobs))

    def exists(self, name: str) -> bool:
        """Whether `name` is present (a confined file, or a dangling/escaping link, which `file` then refuses)."""
        path = self.path / name
        try:
            return path.is_symlink() or path.exists()
        except OSError:  # e.g. permission denied: present, and reading it will say why
            return True

    def read_json(self, name: str, what: str | None = None, limit: int = JSON_LIMIT) -> dict:
        return read_json(self.file(name, what or name), limit, what or name)

    def optional_json(self, name: str) -> dict | None:
        return self.read_json(name) if self.exists(name) else None

    def glob(self, pattern: str) -> list[str]:
        try:
            return sorted(p.name for p in self.path.glob(pattern))
        except OSError as e:
            raise QwenrtError(f"cannot list checkpoint directory {self.path}: {_why(e)}") from None


def output_dir(path: str | Path, what: str = "output directory") -> Path:
    """The directory `path` to write into, created (mode 0755 less the umask, missing parents too) when absent.
    Refused in one line when it is a symlink (dangling or not), not a directory, or no folder can be made in it
    (read-only, /proc). Links above `path` are the caller's own; whoever creates levels below checks each."""
    path = Path(path)
    try:
        if not os.path.lexists(path):
            path.mkdir(mode=0o755, parents=True, exist_ok=True)
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):  # a real write, not access(): root passes that on /proc
            os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=path))
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise QwenrtError(f"cannot write to {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISLNK(mode):
        raise QwenrtError(f"{what} {path} is a symlink; qwenrt writes only into real directories (give its target)")
    if not stat.S_ISDIR(mode):
        raise QwenrtError(f"{what} {path} is not a directory")
    return path
