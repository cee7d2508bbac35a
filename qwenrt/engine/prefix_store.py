"""Prefix snapshots on disk (`prefix_cache_dir`), so that a restart keeps them.

One safetensors file per snapshot, in a folder named after the model's identity (a different model, dtype or
quantization never reads them): the key, the KV of the whole prefix, the DeltaNet state and, for a prompt's end,
its last logits. Files are written by a background thread into a temporary name and renamed (no half file is ever
read); a file that does not read back as expected is removed with one warning. The folder holds at most `budget`
bytes: the oldest files go first.

Shapes: kv [Lf, 2, Hkv, L, Dh] (model dtype), conv [Ll, C, K-1] and recurrent [Ll, Hv, Dk, Dv] fp32, key [L] int64.
"""

from __future__ import annotations

import hashlib
import os
import queue
import sys
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwenrt.errors import QwenrtError

FORMAT = "qwenrt-prefix-1"
SAMPLE = 1 << 16  # bytes read at each of SAMPLES places of every weight file for the identity
SAMPLES = 16


def model_identity(model) -> str:
    """A digest of what makes logits what they are: config, weight files (headers and sampled contents), compute
    dtype and any quantization done at load."""
    path = getattr(model, "checkpoint_path", None)
    if path is None:
        raise QwenrtError("prefix_cache_dir needs a model loaded from a checkpoint directory")
    h = hashlib.sha256()
    h.update((Path(path) / "config.json").read_bytes())
    for f in sorted(Path(path).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as handle:
            for k in range(SAMPLES):
                handle.seek(size * k // SAMPLES)
                h.update(handle.read(SAMPLE))
    specs = sorted({str(m.spec) for m in model.modules() if hasattr(m, "spec")})
    h.update(f"{model.dtype}|{specs}".encode())
    return h.hexdigest()[:32]


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def key_digest(key: list[int]) -> str:
    return hashlib.sha256(torch.tensor(key, dtype=torch.int64).numpy().tobytes()).hexdigest()[:40]


class PrefixStore:
    def __init__(self, directory: str | Path, identity: str, budget: int):
        self.folder = Path(directory) / identity
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QwenrtError(f"prefix cache directory {directory}: {e.strerror or e}") from None
        self.identity, self.budget = identity, budget
        self._lock = threading.Lock()  # guards lengths: the writer thread changes it too
        self.lengths: dict[str, int] = {}  # digest -> prefix length, for every file on disk
        for f in sorted(self.folder.glob("*.safetensors")):
            try:
                with safe_open(f, "pt") as handle:
                    meta = handle.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("model") != identity:
                    raise ValueError("not a snapshot of this model")
                self.lengths[f.stem] = int(meta["length"])
            except Exception as e:
                self.discard(f.stem, e)
        for f in self.folder.glob("*.tmp"):  # a write cut short by a crash
            f.unlink(missing_ok=True)
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="qwenrt-prefix-store", daemon=True)
        self._writer.start()

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
        """The tensors of a snapshot, checked against its key; None (and the file removed) when it is unreadable."""
        f = self.folder / f"{digest}.safetensors"
        try:
            with safe_open(f, "pt") as handle:
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
                checksum = (handle.metadata() or {}).get("sha256")
            if checksum != _checksum(tensors):
                raise ValueError("its contents do not match their checksum")
            if tensors["key"].tolist() != key[:len(tensors["key"])]:
                raise ValueError("its key does not match its name")
            os.utime(f)  # recently used: evicted last
            return tensors
        except FileNotFoundError:  # still queued for writing, or removed meanwhile
            return None
        except Exception as e:
            self.discard(digest, e)
            return None

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
            target = self.folder / f"{digest}.safetensors"
            tmp = target.with_suffix(".tmp")
            try:
                tensors = {k: v.contiguous() for k, v in tensors.items()}
                save_file(tensors, str(tmp), metadata={"format": FORMAT, "model": self.identity,
                                                       "length": str(len(tensors["key"])),
                                                       "sha256": _checksum(tensors)})
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
                os.replace(tmp, target)
                self._shrink()
            except Exception as e:  # a full disk, a read-only folder: the cache in memory goes on
                tmp.unlink(missing_ok=True)
                with self._lock:
                    self.lengths.pop(digest, None)
                print(f"qwenrt: warning: prefix cache: could not write {target.name}: {getattr(e, 'strerror', e) or e}",
                      file=sys.stderr)

    def _shrink(self) -> None:
        """Remove the least recently used files until the folder is within the budget."""
        files = [(f.stat().st_mtime, f.stat().st_size, f) for f in self.folder.glob("*.safetensors")]
        total = sum(size for _, size, _ in files)
        for _, size, f in sorted(files, key=lambda x: x[0]):
            if total <= self.budget:
                break
            f.unlink(missing_ok=True)
            with self._lock:
                self.lengths.pop(f.stem, None)
            total -= size

    def discard(self, digest: str, reason) -> None:
        """Remove an unusable snapshot file, with one warning."""
        print(f"qwenrt: warning: prefix cache: ignoring and removing {digest}.safetensors ({reason})",
              file=sys.stderr)
        (self.folder / f"{digest}.safetensors").unlink(missing_ok=True)
        with self._lock:
            self.lengths.pop(digest, None)
