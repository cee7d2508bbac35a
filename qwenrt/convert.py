"""`qwenrt quantize`: a full-precision checkpoint -> a weight-only quantized one, written tensor by tensor.

The result loads with `qwenrt.load(DST)` directly: config.json gains a `quantization_config` entry
({"quant_method": "qwenrt", "bits", "group_size", "modules_not_converted"(, "overrides": the weights held in another
format, see qwenrt.quant.INT4_OVERRIDES)}) and every quantized weight W is stored as W's module path + .qweight /
.scales (/ .zeros), see qwenrt.quant. Text tensors are written under the text-only names (`model.*`, fused MoE
experts); MTP and vision tensors are copied as they are.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from qwenrt.checkpoint import INDEX_FILE, materialize
from qwenrt.errors import QwenrtError
from qwenrt.files import CheckpointDir
from qwenrt.hub import ALLOW_PATTERNS, resolve_model_path
from qwenrt.gguf.reader import is_gguf
from qwenrt.loader import STORED_DTYPES, verify_checkpoint
from qwenrt.quant import QuantSpec, default_overrides, plan_units, quantize_weight, storage_entries, stored_spec
from qwenrt.writer import Entry, aligned_order, write_safetensors


def _stored_dtype(ckpt, name: str) -> torch.dtype:
    if ckpt.dtypes[name] not in STORED_DTYPES:
        raise QwenrtError(f"{ckpt.path}: tensor '{name}' has dtype {ckpt.dtypes[name]}, which cannot be copied")
    return STORED_DTYPES[ckpt.dtypes[name]]


def _partial_dir(dst: Path) -> Path:
    """A hidden working directory beside `dst`; those of earlier runs that were killed are removed first."""
    for stale in dst.parent.glob(f".{dst.name}.partial-*"):
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise QwenrtError(f"cannot create {dst}: {e.strerror or e}") from None
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _side_files(src: Path) -> list[Path]:
    """The non-weight files a quantized copy keeps (tokenizer, templates, generation and preprocessor configs):
    what the hub download fetches, never a pickle; each confined to the checkpoint and a regular file."""
    where = CheckpointDir(src)
    names = [n for pattern in ALLOW_PATTERNS if pattern != "*.safetensors" for n in where.glob(pattern)]
    files = [where.file(n) for n in sorted(set(names)) if n not in (INDEX_FILE, "config.json")]
    return [f for f in files if f.is_file()]


def quantize_checkpoint(src: str | Path, dst: str | Path, bits: int, group_size: int | None = None,
                        progress: bool = False, overrides: dict[str, QuantSpec] | None = None) -> Path:
    """Write `src` (a directory or a hub repo id) quantized to int8 / int4 into the new directory `dst` (complete
    or absent). overrides: weights held in another format (None: the format's own, `default_overrides`; {}: none).
    Returns dst."""
    spec = QuantSpec.parse(bits, group_size)
    dst = Path(dst).expanduser()
    if dst.exists() or dst.is_symlink():
        raise QwenrtError(f"{dst}: already exists")
    src = resolve_model_path(src)
    if is_gguf(src):
        raise QwenrtError(f"{src}: a GGUF file runs as it is (its blocks natively: qwenrt run {Path(src).name}); "
                          "quantize takes a checkpoint directory")
    config, ckpt, plan, aside, model = verify_checkpoint(src)
    if stored_spec(config.raw):
        raise QwenrtError(f"{src}: already quantized")
    overrides = default_overrides(spec) if overrides is None else overrides
    units, kept = plan_units(model, spec, overrides=overrides)
    planned = {path: w for weights in units.values() for path, w in weights.items()}
    sources = {path: w.source for path, w in planned.items()}
    replaced = set(sources.values())  # a tied embedding included: its lookup reads the quantized head

    def first_name(name):
        source = plan[name]
        return source.names[0][0] if source.stacked else source.names[0]

    copies = [Entry(n, s.shape, _stored_dtype(ckpt, first_name(n))) for n, s in plan.items() if n not in replaced]
    copies += [Entry(n, ckpt.shapes[n], _stored_dtype(ckpt, n)) for n in aside]
    quantized = [Entry(f"{path}.{key}", shape, dtype) for path, w in planned.items()
                 for key, (shape, dtype) in storage_entries(w.shape, w.spec).items()]
    # aligned in the file, the int8 weights are used in place (mapped), not copied at load
    entries = aligned_order(copies + quantized)

    pending: dict[str, dict[str, torch.Tensor]] = {}  # pieces of weights being written (odd-sized ones come last)

    def produce(entry: Entry) -> torch.Tensor:
        ckpt.release()  # the tensors written so far leave RSS: the peak is a few tensors, not the checkpoint
        if entry.name in plan:
            return materialize(ckpt, plan[entry.name], entry.dtype, offset=False)  # the config is copied as it is
        if entry.name in ckpt.location:
            return ckpt.get(entry.name)
        path, _, key = entry.name.rpartition(".")
        if path not in pending:
            source = sources[path]
            pending[path] = quantize_weight(materialize(ckpt, plan[source], _stored_dtype(ckpt, first_name(source))),
                                            planned[path].spec, path)
        piece = pending[path].pop(key)
        if not pending[path]:
            del pending[path]
        return piece

    tmp = _partial_dir(dst)
    try:
        write_safetensors(tmp, entries, produce, progress=progress, desc=f"quantizing to {spec}")
        for file in _side_files(src):
            shutil.copyfile(file, tmp / file.name)
        raw = dict(config.raw, quantization_config=spec.config(kept, overrides))
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        tmp.rename(dst)
    except OSError as e:  # a full disk, a read-only place, a destination that appeared meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        raise QwenrtError(f"cannot write {dst}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
