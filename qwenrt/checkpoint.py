"""Safetensors checkpoints: shard discovery, the HF-name rules, and strict accounting of every tensor.

One rule table maps checkpoint names to our parameter names:
    model.language_model.X  (published VLM layout)  -> model.X
    model.X                 (text-only layout)       -> model.X
    lm_head.weight                                    -> lm_head.weight
    mtp.X                   (the MTP head)           -> mtp.X
    model.visual.*                                    kept aside for the vision tower
and per-expert MoE tensors (mlp.experts.{e}.{gate,up,down}_proj.weight) are stacked into the fused, published
layout (mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I]).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qwenrt.errors import QwenrtError
from qwenrt.fields import Fields
from qwenrt.files import CheckpointDir, open_regular

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PER_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_RANK = 8


@dataclass
class Checkpoint:
    """Where every tensor of a checkpoint lives, by its checkpoint name, with its stored dtype and shape."""

    path: Path
    location: dict[str, Path]  # name -> shard file
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    _handles: dict[Path, object] = field(default_factory=dict, repr=False)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (memory-mapped, not copied, where the file allows)."""
        file = self.location[name]
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(file, framework="pt")
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, TypeError) as e:
            raise QwenrtError(f"{file}: cannot read tensor '{name}' ({' '.join(str(e).split())})") from None

    def release(self) -> None:
        """Close the files: the pages read so far leave this process's memory once their tensors are freed (they
        stay in the page cache). Reading tensor by tensor, a reader that calls it between tensors holds one."""
        self._handles.clear()

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.location if n.startswith(prefix)]

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.location.values()))


def shard_files(where: CheckpointDir) -> list[Path]:
    """The safetensors files of a checkpoint: model.safetensors when present (as transformers), else its index's
    shards, else every *.safetensors file. Every name is confined to the directory."""
    if where.exists(SINGLE_FILE):
        return [where.file(SINGLE_FILE, "weight file")]
    if where.exists(INDEX_FILE):
        index = where.file(INDEX_FILE)
        weight_map = Fields(where.read_json(INDEX_FILE), str(index)).obj("weight_map").d
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise QwenrtError(f"{index}: weight_map values must be file names")
        files = sorted({where.file(f, "shard") for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise QwenrtError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return files
    files = [where.file(name, "weight file") for name in where.glob("*.safetensors")]
    if not files:
        raise QwenrtError(f"{where.path}: no *.safetensors weight files")
    return files


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _tensor_entry(file: Path, name, info) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked."""
    bad = f"{file}: corrupt safetensors header: tensor {name!r}"
    if not isinstance(name, str) or not name or not isinstance(info, dict):
        raise QwenrtError(f"{bad} is not a name with an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise QwenrtError(f"{bad} has unknown dtype {dtype!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(type(n) is int and 0 <= n < 1 << 48 for n in shape)):
        raise QwenrtError(f"{bad} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(n) is int and 0 <= n < 1 << 62 for n in offsets) or offsets[0] > offsets[1]):
        raise QwenrtError(f"{bad} has invalid data_offsets {offsets!r}")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise QwenrtError(f"{bad}: shape {shape} {dtype} needs {nbytes} bytes but its data_offsets span "
                          f"{offsets[1] - offsets[0]}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A shard's tensors, name -> (dtype, shape), after checking everything the safetensors format requires: the
    header's size and JSON, each entry's dtype, shape and byte range, and that the ranges tile the data exactly
    (no overlaps, gaps or truncation). `inspect` and `load` both rely on it."""
    fd = open_regular(file, "weight file")
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, 8)
        if len(head) < 8:
            raise QwenrtError(f"{file}: truncated safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise QwenrtError(f"{file}: corrupt or truncated safetensors header (header length {n}, file {size} bytes)")
        raw = b""
        while len(raw) < n and (chunk := os.read(fd, n - len(raw))):
            raw += chunk
    except OSError as e:
        raise QwenrtError(f"cannot read weight file {file}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys,
                            parse_constant=_invalid)
    except (ValueError, RecursionError) as e:
        raise QwenrtError(f"{file}: corrupt safetensors header (not JSON: {' '.join(str(e).split())[:80]})") from None
    if not isinstance(header, dict):
        raise QwenrtError(f"{file}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise QwenrtError(f"{file}: corrupt safetensors header (__metadata__ must map strings to strings)")
    entries = {name: _tensor_entry(file, name, info) for name, info in header.items()}
    end = 0
    for name, (_, _, begin, stop) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a gap at byte {end}"
            raise QwenrtError(f"{file}: corrupt safetensors header: tensor '{name}' {what}")
        end = stop
    if 8 + n + end != size:
        problem = "truncated" if 8 + n + end > size else "corrupt (trailing bytes)"
        raise QwenrtError(f"{file}: {problem}: tensors need {8 + n + end} bytes, file has {size}")
    return {name: (dtype, shape) for name, (dtype, shape, _, _) in entries.items()}


def _invalid(constant: str):
    raise ValueError(f"{constant} is not JSON")


def open_checkpoint(path: str | Path) -> Checkpoint:
    where = CheckpointDir(path)
    location, shapes, dtypes = {}, {}, {}
    for file in shard_files(where):
        for name, (dtype, shape) in read_header(file).items():
            if name in location:
                raise QwenrtError(f"{file}: tensor '{name}' also appears in {location[name].name}")
            location[name], shapes[name], dtypes[name] = file, shape, dtype
    return Checkpoint(where.path, location, shapes, dtypes)


def canonical_name(name: str) -> str | None:
    """Checkpoint name -> our text-decoder parameter name, or None for parts the decoder does not own."""
    if name.startswith("model.visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


@dataclass(frozen=True)
class Source:
    """How to build one decoder tensor: a stored tensor, or per-expert tensors stacked into the fused layout."""

    names: tuple[str, ...] | tuple[tuple[str, ...], ...]
    shape: tuple[int, ...]
    stacked: bool = False  # names[e] = (gate, up) or (down,) for expert e
    offset: float = 0.0  # added to the stored values in fp32 (a family's w·x norm read as qwenrt's (1 + w) one)
    transposed: bool = False  # an expert bank stored [E, K, N]: read as [E, N, K]
    rows: tuple[tuple[int, int], ...] | None = None  # (first, count) runs of the stored tensor's rows: a fused part


def plan_text_tensors(ckpt: Checkpoint) -> tuple[dict[str, Source], list[str]]:
    """Map our decoder names to their sources, from headers alone. Returns (plan, names set aside: the vision tower's)."""
    plan, aside, experts = {}, [], {}
    for name, shape in ckpt.shapes.items():
        ours = canonical_name(name)
        if ours is None:
            aside.append(name)
            continue
        m = _PER_EXPERT.match(ours)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = name
            continue
        if ours in plan:
            raise QwenrtError(f"{ckpt.path}: tensor '{ours}' is stored twice ('{plan[ours].names[0]}' and '{name}')")
        plan[ours] = Source((name,), shape)
    for prefix, by_index in experts.items():
        n = len(by_index)
        if sorted(by_index) != list(range(n)) or any(len(p) != 3 for p in by_index.values()):
            raise QwenrtError(f"{ckpt.path}: incomplete per-expert tensors under '{prefix}' "
                              f"(experts {sorted(by_index)}; each needs gate_proj, up_proj and down_proj)")
        gate, up, down = (ckpt.shapes[by_index[0][k]] for k in ("gate_proj", "up_proj", "down_proj"))
        for e, parts in by_index.items():
            if tuple(ckpt.shapes[parts[k]] for k in ("gate_proj", "up_proj", "down_proj")) != (gate, up, down):
                raise QwenrtError(f"{ckpt.path}: expert {e} under '{prefix}' has shapes unlike expert 0")
        plan[prefix + ".gate_up_proj"] = Source(
            tuple((p["gate_proj"], p["up_proj"]) for _, p in sorted(by_index.items())),
            (n, gate[0] + up[0], *gate[1:]), stacked=True)
        plan[prefix + ".down_proj"] = Source(
            tuple((p["down_proj"],) for _, p in sorted(by_index.items())), (n, *down), stacked=True)
    return plan, aside


def materialize(ckpt: Checkpoint, source: Source, dtype: torch.dtype, offset: bool = True) -> torch.Tensor:
    """Read one planned tensor in `dtype` (zero-copy when stored in that dtype, not stacked and not a fused part).
    offset False: without the source's offset, a norm as its checkpoint means it (what a writer keeps under the
    checkpoint's config)."""
    if source.stacked:
        return torch.stack([torch.cat([ckpt.get(n).to(dtype) for n in parts]) for parts in source.names])
    tensor = ckpt.get(source.names[0])
    if source.rows is not None:
        tensor = torch.cat([tensor[first:first + n] for first, n in source.rows])
    if source.offset and offset:
        return (tensor.float() + source.offset).to(dtype)
    if source.transposed:
        return tensor.to(dtype).transpose(1, 2).contiguous()
    return tensor.to(dtype)
