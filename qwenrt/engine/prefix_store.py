"""Prefix snapshots on disk (`prefix_cache_dir`), so that a restart keeps them.

One safetensors file per snapshot, in a folder named after the model's identity (a different model, dtype or
quantization never reads them): the key, the KV of the whole prefix, the DeltaNet state and, for a prompt's end,
its last logits. Files are written by a background thread into a temporary name and renamed (no half file is ever
read); a file that does not read back as expected is removed with one warning. The folder holds at most `budget`
bytes: the oldest files go first.

The folder is an attack surface (another user of a shared machine, files copied in from elsewhere), so:
- `<dir>/<identity>` is this user's alone: created with mode 0700 (`<dir>` too, when it is created here), it must be
  a real directory (not a link), owned by the user and writable by no one else, or the engine does not start. `<dir>`
  itself may be shared (/tmp). After the check everything goes through the folder's descriptor, never its path, so a
  folder renamed or swapped meanwhile is not followed.
- Only regular files named as this store names them (`<40 hex>.safetensors`, `<40 hex>.tmp`) are read, renamed or
  removed, never through a link; any other entry with those suffixes (a FIFO, a directory, a link, a foreign file) is
  left alone with one warning, and nothing is opened in a way that can block.
- Every snapshot carries an HMAC-SHA256 of its metadata and tensors (names, dtypes, shapes, bytes), checked before
  any tensor is used; a snapshot holding NaN or Inf is refused too. The key is 32 random bytes in
  `<dir>/<identity>/.key` (mode 0600, the user's, checked at start). It lives beside the snapshots it signs so that
  the folder keeps them when it moves (a container volume, a new home directory, where a key under $HOME would be
  lost and every snapshot with it); what it adds to the folder check is that a file that came into the folder by any
  road but this writer (copied from another folder or machine, planted while the folder's mode was looser) is
  never used.

Shapes: kv [Lf, 2, Hkv, L, Dh] (model dtype), conv [Ll, C, K-1] and recurrent [Ll, Hv, Dk, Dv] fp32, key [L] int64.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import re
import secrets
import stat
import sys
import threading
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors, save as save_tensors

from qwenrt.checkpoint import shard_files
from qwenrt.errors import QwenrtError
from qwenrt.gguf.reader import gguf_files, is_gguf
from qwenrt.files import JSON_LIMIT, CheckpointDir, open_regular, read_bytes
from qwenrt.validation import check_path

FORMAT = "qwenrt-prefix-2"
SAMPLE = 1 << 16  # bytes read at each of SAMPLES places of every weight file for the identity
SAMPLES = 16
KEY_FILE, KEY_BYTES = ".key", 32
SNAPSHOT_NAME = re.compile(r"[0-9a-f]{40}\.safetensors")
TEMPORARY_NAME = re.compile(r"[0-9a-f]{40}\.tmp")
HEADER_LIMIT = 1 << 20  # a snapshot's header describes 5 tensors
TENSORS, REQUIRED = {"key", "conv", "recurrent", "kv", "logits"}, {"key", "conv", "recurrent"}
NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a link fails, a FIFO opens without waiting


def model_identity(model, kv_dtype: torch.dtype | None = None) -> str:
    """A digest of what makes logits what they are: config, weight files (headers and sampled contents), compute
    dtype, any quantization done at load, the RoPE scaling in effect and an 8-bit KV cache (`kv_dtype`)."""
    path = getattr(model, "checkpoint_path", None)
    if path is None:
        raise QwenrtError("prefix_cache_dir needs a model loaded from a checkpoint directory")
    h = hashlib.sha256()
    if is_gguf(path):  # its metadata is its config: the sampled bytes include it
        files = gguf_files(Path(path))
        if getattr(model, "mmproj_path", None) is not None:  # the vision tower's file makes image prompts' states
            files.append(model.mmproj_path)
    else:
        where = CheckpointDir(path)  # the files the loader read, confined as it confined them
        h.update(read_bytes(where.file("config.json"), JSON_LIMIT, "config.json"))
        files = shard_files(where)
    for f in files:
        fd = open_regular(f, "weight file")
        try:
            size = os.fstat(fd).st_size
            h.update(f"{f.name}:{size}".encode())
            for k in range(SAMPLES):
                h.update(os.pread(fd, SAMPLE, size * k // SAMPLES))
        finally:
            os.close(fd)
    specs = sorted({str(m.spec) for m in model.modules() if hasattr(m, "spec")})
    yarn = model.config.text.yarn  # a rope_scaling given at load rotates keys otherwise than config.json says
    h.update(f"{model.dtype}|{specs}".encode() + (f"|{yarn}".encode() if yarn is not None else b""))
    if kv_dtype not in (None, model.dtype):
        h.update(f"|kv {kv_dtype}".encode())
    return h.hexdigest()[:32]


def _mac(secret: bytes, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """HMAC-SHA256 of a snapshot's metadata and every tensor's name, dtype, shape and bytes."""
    h = hmac.new(secret, json.dumps([meta["format"], meta["model"], meta["length"]]).encode(), "sha256")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"|{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def key_digest(key: list[int]) -> str:
    return hashlib.sha256(torch.tensor(key, dtype=torch.int64).numpy().tobytes()).hexdigest()[:40]


def _refuse(folder: Path, problem: str, fix: str = "remove it"):
    raise QwenrtError(f"prefix cache folder {folder} {problem}: it must be a directory of yours that only you can "
                      f"write (qwenrt creates it with mode 0700); {fix} or choose another prefix_cache_dir")


def _open_private_folder(directory: Path, identity: str) -> int:
    """A descriptor of `directory/identity`, created 0700 when absent, once it is known to be this user's alone."""
    folder = directory / identity
    try:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            pass  # not a directory: opening it as one says so
        top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise QwenrtError(f"prefix cache directory {directory}: {e.strerror or e}") from None
    try:
        try:
            os.mkdir(identity, 0o700, dir_fd=top)
        except FileExistsError:
            if stat.S_ISLNK(os.stat(identity, dir_fd=top, follow_symlinks=False).st_mode):
                _refuse(folder, "is a symbolic link")
        fd = os.open(identity, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    except OSError as e:
        raise QwenrtError(f"prefix cache folder {folder}: {e.strerror or e}") from None
    finally:
        os.close(top)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        _refuse(folder, f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        os.close(fd)
        _refuse(folder, f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})", "`chmod go-w` it")
    return fd


def _make_key(folder: int) -> None:
    """Write a fresh key under a temporary name and link it in place: a racing engine sees a whole key or none."""
    tmp = f"{KEY_FILE}-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o600, dir_fd=folder)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
        os.link(tmp, KEY_FILE, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
    except FileExistsError:
        pass  # another engine made it first
    finally:
        os.close(fd)
        os.unlink(tmp, dir_fd=folder)


def _read_key(folder: int, where: Path) -> bytes:
    """The folder's MAC key, made on first use; refused unless it is a regular file of this user's, mode 0600."""
    try:
        try:
            fd = os.open(KEY_FILE, os.O_RDONLY | NO_FOLLOW, dir_fd=folder)
        except FileNotFoundError:
            _make_key(folder)
            fd = os.open(KEY_FILE, os.O_RDONLY | NO_FOLLOW, dir_fd=folder)
        try:
            st = os.fstat(fd)
            secret = os.read(fd, KEY_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
        finally:
            os.close(fd)
    except OSError as e:
        raise QwenrtError(f"prefix cache key {where / KEY_FILE}: {e.strerror or e}") from None
    if len(secret) != KEY_BYTES or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise QwenrtError(f"prefix cache key {where / KEY_FILE} must be a {KEY_BYTES}-byte file of yours that only "
                          f"you can read (mode 0600; it is {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}); "
                          "remove it and a new one is made (the snapshots it signed are then dropped)")
    return secret


def _read_header(fd: int, size: int) -> dict:
    """The JSON header of the safetensors file open at `fd` (ValueError when it is not one)."""
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    if size < 8 or n > min(size - 8, HEADER_LIMIT):
        raise ValueError("not a safetensors file")
    header = json.loads(os.pread(fd, n, 8))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors header")
    if 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0) != size:
        raise ValueError(f"its size ({size} bytes) is not what its header says: cut short?")
    return header


class PrefixStore:
    def __init__(self, directory: str | Path, identity: str, budget: int):
        directory = Path(check_path(directory, "prefix_cache_dir"))
        self.path = directory / identity  # for messages: every access goes through self._fd
        self._fd = _open_private_folder(directory, identity)
        try:
            self._secret = _read_key(self._fd, self.path)
        except QwenrtError:
            os.close(self._fd)
            raise
        self.identity, self.budget = identity, budget
        self._lock = threading.Lock()  # guards lengths: the writer thread changes it too
        self.lengths: dict[str, int] = {}  # digest -> prefix length, for every file on disk
        files, strays = self._entries()
        if strays:
            print(f"qwenrt: warning: prefix cache: leaving alone {len(strays)} entries of {self.path} that are not "
                  f"its files (not regular files, or not its names): {', '.join(sorted(strays)[:5])}"
                  f"{', ...' if len(strays) > 5 else ''}", file=sys.stderr)
        for name in sorted(files):
            if TEMPORARY_NAME.fullmatch(name):  # a write cut short by a crash
                self._unlink(name)
                continue
            digest = name.removesuffix(".safetensors")
            try:
                meta = self._metadata(name)
                if meta.get("format") != FORMAT or meta.get("model") != identity:
                    raise ValueError("not a snapshot of this model")
                self.lengths[digest] = int(meta["length"])
            except Exception as e:
                self.discard(digest, e)
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="qwenrt-prefix-store", daemon=True)
        self._writer.start()

    # ---- the folder ----

    def _entries(self) -> tuple[dict[str, os.stat_result], list[str]]:
        """({name: lstat} of this store's files: regular files named as it names them, [other entries with those
        suffixes, which it never touches])."""
        files, strays = {}, []
        for name in os.listdir(self._fd):
            if not name.endswith((".safetensors", ".tmp")):
                continue
            try:
                st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            ours = SNAPSHOT_NAME.fullmatch(name) or TEMPORARY_NAME.fullmatch(name)
            if ours and stat.S_ISREG(st.st_mode):
                files[name] = st
            else:
                strays.append(name)
        return files, strays

    def _open(self, name: str, limit: int) -> tuple[int, int]:
        """(fd, size) of the regular file `name` of at most `limit` bytes (ValueError when it is not one)."""
        fd = os.open(name, os.O_RDONLY | NO_FOLLOW, dir_fd=self._fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            os.close(fd)
            raise ValueError("not a regular file" if not stat.S_ISREG(st.st_mode) else
                             f"{st.st_size} bytes, over the cache's budget of {limit}")
        return fd, st.st_size

    def _metadata(self, name: str) -> dict:
        fd, size = self._open(name, self.budget)
        try:
            meta = _read_header(fd, size).get("__metadata__") or {}
        finally:
            os.close(fd)
        if not isinstance(meta, dict):
            raise ValueError("its metadata is not an object")
        return meta

    def _unlink(self, name: str) -> None:
        """Remove one of this store's files: a regular file only, and never through a link."""
        try:
            if stat.S_ISREG(os.stat(name, dir_fd=self._fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=self._fd)
        except FileNotFoundError:
            pass

    # ---- snapshots ----

    def candidates(self, key: list[int], longer_than: int):
        """(length, digest) of the snapshots on disk whose key is a prefix of `key` and longer than `longer_than`
        tokens, longest first."""
        with self._lock:
            lengths = sorted({n for n in self.lengths.values() if longer_than < n <= len(key)}, reverse=True)
        for n in lengths:
            digest = key_digest(key[:n])
            with self._lock:
                known = self.lengths.get(digest) == n
            if known:
                yield n, digest

    def read(self, digest: str, key: list[int]) -> dict[str, torch.Tensor] | None:
        """The tensors of a snapshot, checked against their MAC and key; None (and the file removed) when it is
        unusable."""
        name = f"{digest}.safetensors"
        try:
            fd, size = self._open(name, self.budget)
            try:
                meta = _read_header(fd, size).get("__metadata__") or {}
                data = os.fdopen(fd, "rb", buffering=0, closefd=False).readall()  # reads past 2 GiB too
            finally:
                os.close(fd)
            tensors = load_tensors(data)
            del data
            self._verify(meta, tensors, digest, key)
            os.utime(name, dir_fd=self._fd, follow_symlinks=False)  # recently used: evicted last
            return tensors
        except FileNotFoundError:  # still queued for writing, or removed meanwhile
            return None
        except Exception as e:
            self.discard(digest, e)
            return None

    def _verify(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str, key: list[int]) -> None:
        """Raise ValueError unless the tensors are the snapshot this store wrote under `digest` for a prefix of
        `key`, all finite."""
        signed = isinstance(meta.get("mac"), str) and all(isinstance(meta.get(k), str)
                                                          for k in ("format", "model", "length"))
        if not signed or not hmac.compare_digest(meta["mac"], _mac(self._secret, meta, tensors)):
            raise ValueError("its contents do not match their MAC")
        if meta["format"] != FORMAT or meta["model"] != self.identity:
            raise ValueError("not a snapshot of this model")
        if not REQUIRED <= tensors.keys() <= TENSORS:
            raise ValueError(f"unexpected tensors {sorted(tensors)}")
        stored = tensors["key"]
        if stored.dtype != torch.int64 or stored.shape != (int(meta["length"]),):
            raise ValueError("its key is not a list of its length")
        if key_digest(stored.tolist()) != digest or stored.tolist() != key[:len(stored)]:
            raise ValueError("its key does not match its name")
        if not all(torch.isfinite(t).all() for name, t in tensors.items() if name != "key"):
            raise ValueError("it holds NaN or Inf values")

    def write(self, key: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Queue a snapshot for writing (no-op when the file exists)."""
        digest = key_digest(key)
        with self._lock:
            if digest in self.lengths:
                return
            self.lengths[digest] = len(key)
        self._writes.put((digest, {"key": torch.tensor(key, dtype=torch.int64), **tensors}))

    def flush(self) -> None:
        """Wait until every queued snapshot is on disk."""
        done = threading.Event()
        self._writes.put((None, done))
        done.wait()

    def _write_loop(self) -> None:
        while True:
            digest, tensors = self._writes.get()
            if digest is None:
                tensors.set()
                continue
            target, tmp = f"{digest}.safetensors", f"{digest}.tmp"
            created = False
            try:
                tensors = {k: v.contiguous() for k, v in tensors.items()}
                meta = {"format": FORMAT, "model": self.identity, "length": str(len(tensors["key"]))}
                data = save_tensors(tensors, metadata={**meta, "mac": _mac(self._secret, meta, tensors)})
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o600, dir_fd=self._fd)
                created = True
                try:
                    with os.fdopen(fd, "wb", closefd=False) as out:
                        out.write(data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, target, src_dir_fd=self._fd, dst_dir_fd=self._fd)
                self._shrink()
            except Exception as e:  # a full disk, a read-only folder: the cache in memory goes on
                if created:
                    self._unlink(tmp)
                with self._lock:
                    self.lengths.pop(digest, None)
                print(f"qwenrt: warning: prefix cache: could not write {target}: {getattr(e, 'strerror', e) or e}",
                      file=sys.stderr)

    def _shrink(self) -> None:
        """Remove the least recently used files until the folder is within the budget."""
        files = [(st.st_mtime, st.st_size, name) for name, st in self._entries()[0].items()
                 if SNAPSHOT_NAME.fullmatch(name)]
        total = sum(size for _, size, _ in files)
        for _, size, name in sorted(files):
            if total <= self.budget:
                break
            self._unlink(name)
            with self._lock:
                self.lengths.pop(name.removesuffix(".safetensors"), None)
            total -= size

    def discard(self, digest: str, reason) -> None:
        """Remove an unusable snapshot file, with one warning."""
        print(f"qwenrt: warning: prefix cache: ignoring and removing {digest}.safetensors ({reason})",
              file=sys.stderr)
        self._unlink(f"{digest}.safetensors")
        with self._lock:
            self.lengths.pop(digest, None)
