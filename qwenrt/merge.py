"""`qwenrt merge-lora`: a full-precision checkpoint and a LoRA adapter -> a checkpoint with W + scaling·B·A in place of
each adapted weight, written tensor by tensor as `qwenrt quantize` writes (the text tensors under the text-only names,
the rest copied as stored, each in its stored dtype; config.json and the tokenizer files as they are)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from qwenrt.adapters import read_adapter
from qwenrt.checkpoint import materialize
from qwenrt.convert import _partial_dir, _side_files, _stored_dtype
from qwenrt.errors import QwenrtError
from qwenrt.gguf.reader import is_gguf
from qwenrt.hub import resolve_model_path
from qwenrt.loader import verify_checkpoint
from qwenrt.quant import stored_spec
from qwenrt.writer import Entry, aligned_order, write_safetensors


def merge_lora(base: str | Path, adapter: str | Path, out: str | Path, progress: bool = False) -> str:
    """Write `base` (a directory or hub repo id) with `adapter` merged into the new directory `out` (complete or
    absent). Returns a one-line summary."""
    out = Path(out).expanduser()
    if out.exists() or out.is_symlink():
        raise QwenrtError(f"{out}: already exists")
    base = resolve_model_path(base)
    if is_gguf(base):
        raise QwenrtError(f"{base}: a GGUF file; merge-lora takes a full-precision checkpoint directory")
    config, ckpt, plan, aside, model = verify_checkpoint(base)
    if stored_spec(config.raw):
        raise QwenrtError(f"{base}: a quantized checkpoint; merge the adapter into its full-precision original")
    spec, adapters = read_adapter(adapter, model)
    tmp = _partial_dir(out)
    try:
        write_merged(tmp, ckpt, plan, aside, adapters, spec.scaling, progress=progress)
        for file in _side_files(base):
            shutil.copyfile(file, tmp / file.name)
        shutil.copyfile(Path(base) / "config.json", tmp / "config.json")
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise QwenrtError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return f"merged {len(adapters)} adapted weights (rank {spec.rank}, scaling {spec.scaling:g}) into {out}"


def write_merged(folder: Path, ckpt, plan: dict, aside: list[str], adapters: dict, scaling: float,
                 dtype_of=None, extra: dict[str, torch.Tensor] | None = None, progress: bool = False) -> None:
    """The weights of `plan` (decoder names) with each adapted one's W + scaling·B·A, the `aside` tensors copied, and
    the `extra` tensors, into `folder` tensor by tensor. dtype_of(name): a weight's dtype (default: as stored)."""
    # a projection's weight [N, K] gets B·A; an expert bank [E, N, K] (named as its path) B_e·A_e per expert
    merged = {path if A.dim() == 3 else f"{path}.weight": (A, B) for path, (A, B) in adapters.items()}
    extra = extra or {}

    def first_name(name):
        source = plan[name]
        return source.names[0][0] if source.stacked else source.names[0]

    entries = [Entry(n, s.shape, dtype_of(n) if dtype_of else _stored_dtype(ckpt, first_name(n)))
               for n, s in plan.items()]
    entries += [Entry(n, ckpt.shapes[n], _stored_dtype(ckpt, n)) for n in aside]
    entries = aligned_order(entries + [Entry(n, tuple(t.shape), t.dtype) for n, t in extra.items()])

    def produce(entry: Entry) -> torch.Tensor:
        ckpt.release()  # one tensor at a time in memory
        if entry.name in extra:
            return extra[entry.name]
        if entry.name not in plan:
            return ckpt.get(entry.name)
        if entry.name not in merged:
            return materialize(ckpt, plan[entry.name], entry.dtype, offset=False)  # under the base's own config
        A, B = merged[entry.name]
        w = materialize(ckpt, plan[entry.name], torch.float32)
        w = w.baddbmm(B, A, alpha=scaling) if A.dim() == 3 else w.addmm(B, A, alpha=scaling)
        return w.to(entry.dtype)  # W + scaling·B·A in fp32, rounded once

    write_safetensors(folder, entries, produce, progress=progress, desc="merging")
