"""Open a `qwen35` / `qwen35moe` GGUF file (or a split `-00001-of-0000N.gguf` set) as a checkpoint the loader
reads like a safetensors one: the config and tokenizer from its metadata, and each of the model's tensors by
qwenrt's name, dequantized from the memory-mapped file tensor by tensor (gguf.quants) and mapped back through
llama.cpp's converter transforms (qwenrt.gguf.layout).

A linear weight in a block type qwenrt holds exactly (qwenrt.gguf.blocks) is offered as the stored pieces of a
quantized checkpoint (`…qweight`, `…scales`, `…zeros`, as `qwenrt quantize` writes them), which the loader takes as
they are: no value rounded a second time. Other quantized tensors are dequantized to fp32 here and cast to the load
dtype (bf16 for a quantized file).
"""

from __future__ import annotations

import math
import mmap
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, GGUFValueType
from gguf import quants

from qwenrt.config import QWEN3_NEXT, ModelConfig, parse_config
from qwenrt.errors import QwenrtError
from qwenrt.gguf import mmproj as clip
from qwenrt.gguf.blocks import INT4_G32, SPECS, stored_blocks
from qwenrt.gguf.layout import from_gguf, gguf_names, gguf_shape, layer_part
from qwenrt.gguf.metadata import Metadata, architecture, config_dict, tokenizer_parts
from qwenrt.gguf.names import SPLIT
from qwenrt.quant import EMBEDDING, QuantSpec, quantizable_weights, storage_entries
from qwenrt.tokenizer import TokenizerParts
from qwenrt.writer import DTYPE_NAMES

# the float dtype a tensor of each type loads in at dtype "auto": as stored for float files, bf16 for quantized ones
AUTO_DTYPE = {Q.F32: "F32", Q.F16: "F16", Q.BF16: "BF16"}
READABLE = (*AUTO_DTYPE, *SPECS)  # the float types and the block types qwenrt holds as they are
MAX_SPLITS = 1024
MAX_ELEMENTS = 1 << 40  # per tensor: past every Qwen3.5 tensor (the 397B's experts are ~2^36)


def is_gguf(path) -> bool:
    return str(path).lower().endswith(".gguf")


def gguf_files(path: Path) -> list[Path]:
    """The files of a split set named by its first (or any) part; [path] for a single file."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m.group(3))
    if not 1 <= count <= MAX_SPLITS or not 1 <= int(m.group(2)) <= count:
        raise QwenrtError(f"{path}: a split GGUF name must be NAME-0000i-of-0000N.gguf with 1 <= i <= N")
    files = [path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise QwenrtError(f"{path}: split GGUF part(s) missing: {', '.join(missing[:4])}")
    return files


class FileReader(GGUFReader):
    """gguf's reader with metadata arrays read in one view (scalars) or one bounded pass (strings): its own
    reader takes ~19 s over the 750K strings of a Qwen3.5 vocabulary, and loops without end on an array whose
    count runs past the file."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if len(item_type) < 1 or len(count) < 1:
            raise ValueError("a metadata array runs past the end of the file")
        kind, n, offs = GGUFValueType(int(item_type[0])), int(count[0]), orig_offs + 12
        left = len(self.data) - offs
        if kind == GGUFValueType.STRING:
            if n * 8 > left:
                raise ValueError(f"a metadata array of {n} strings runs past the end of the file")
            parts, data = [item_type, count], []
            raw, plain = memoryview(self.data), self.data.view(np.ndarray)  # plain slices: ~20x a memmap's
            for _ in range(n):
                size = int.from_bytes(raw[offs:offs + 8], "little")
                if offs + 8 + size > len(plain):
                    raise ValueError("a metadata string runs past the end of the file")
                parts += [plain[offs:offs + 8], plain[offs + 8:offs + 8 + size]]
                data.append(len(parts) - 1)
                offs += 8 + size
            return offs - orig_offs, parts, data, [GGUFValueType.ARRAY, kind]
        scalar = self.gguf_scalar_to_np.get(kind)
        if scalar is None:
            raise ValueError(f"metadata arrays of {kind.name} are not read")
        if n * np.dtype(scalar).itemsize > left:
            raise ValueError(f"a metadata array of {n} {kind.name} runs past the end of the file")
        values = self._get(offs, scalar, n)
        return 12 + values.nbytes, [item_type, count, values], [2], [GGUFValueType.ARRAY, kind]


    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for info in fields:  # each tensor's size in exact integers (numpy's product of the dims can wrap)
            _, name, _, dims, kind, offset = info.parts
            name = bytes(name).decode("utf-8", "replace")
            known = [k for k in GGML_QUANT_SIZES if int(k) == int(kind[0])]
            if not known:
                raise ValueError(f"tensor '{name}' has an unknown type {int(kind[0])}")
            block, block_bytes = GGML_QUANT_SIZES[known[0]]
            count = math.prod(int(d) for d in dims)
            if count > MAX_ELEMENTS or count % block:
                raise ValueError(f"tensor '{name}' has an impossible shape {[int(d) for d in dims]}")
            if start_offs + int(offset[0]) + count // block * block_bytes > len(self.data):
                raise ValueError(f"tensor '{name}' lies past the end of the file (truncated?)")
        super()._build_tensors(start_offs, fields)


def _open(file: Path) -> GGUFReader:
    """A memory-mapped reader of one file, every tensor's bytes inside the file; a malformed file is one line."""
    try:
        reader = FileReader(file, "r")
    except FileNotFoundError:
        raise QwenrtError(f"GGUF file not found: {file}") from None
    except (OSError, ValueError, TypeError, IndexError, KeyError, OverflowError, MemoryError, UnicodeError,
            AssertionError) as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise QwenrtError(f"{file}: not a readable GGUF file ({reason})") from None
    return reader


@dataclass
class GGUFCheckpoint:
    """A GGUF model as qwenrt.checkpoint.Checkpoint's interface has it (names, shapes, dtypes, get), by qwenrt's
    tensor names: float tensors by the parameter's name, weights held as blocks by their stored pieces' names.
    dtypes: what each loads as at "auto" (a piece: its own dtype); file_types: each parameter's type in the file."""

    path: Path
    config: ModelConfig
    sources: dict[str, tuple]  # qwenrt parameter name -> the reader tensors it is made of
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    file_types: dict[str, str]
    files: list[Path]
    tokenizer: TokenizerParts | None = field(default=None, repr=False)
    pieces: dict[str, tuple[str, QuantSpec, str]] = field(default_factory=dict)  # name -> (parameter, spec, piece)
    float_dtype: str = "BF16"  # the load dtype at "auto": the embedding's for a float file, bf16 for a quantized one
    _decoded: tuple = field(default=(None, {}), repr=False)  # the last parameter's pieces: read one after another
    mmproj: Path | None = None  # the vision projector file holding model.visual.*, if one was given
    preprocess: tuple | None = field(default=None, repr=False)  # its (image, video) PreprocessConfig

    @property
    def location(self) -> dict[str, Path]:
        return {name: self.path for name in self.shapes}

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.shapes if n.startswith(prefix)]

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` as qwenrt lays it out: a float file's in its own dtype, a quantized one's in fp32, a
        stored piece as the blocks hold it."""
        if name in self.pieces:
            return self._piece(*self.pieces[name])
        if name.startswith(clip.VISUAL):
            return clip.from_mmproj(name, [_tensor(self.mmproj, t) for t in self.sources[name]])
        parts = [_tensor(self.path, t) for t in self.sources[name]]
        for t in self.sources[name]:
            _release(t)
        if any(p.dtype != parts[0].dtype for p in parts):
            parts = [p.float() for p in parts]
        return from_gguf(name, parts, self.config.text)

    def _piece(self, parameter: str, spec: QuantSpec, piece: str) -> torch.Tensor:
        if self._decoded[0] != parameter:
            sources = self.sources[parameter]
            parts = [stored_blocks(Q(t.tensor_type), t.data, _torch_shape(t), spec)[1] for t in sources]
            for t in sources:
                _release(t)
            self._decoded = (parameter, {key: from_gguf(parameter, [p[key] for p in parts], self.config.text)
                                         for key in spec.pieces})
        return self._decoded[1][piece]

    def vision_part(self) -> GGUFCheckpoint:
        """This checkpoint's projector tensors alone: holding them does not hold the text file's map."""
        keep = self.names(clip.VISUAL)
        return replace(self, sources={n: self.sources[n] for n in keep}, shapes={n: self.shapes[n] for n in keep},
                       dtypes={n: self.dtypes[n] for n in keep}, file_types={n: self.file_types[n] for n in keep},
                       tokenizer=None, pieces={}, _decoded=(None, {}))

    def type_summary(self) -> list[str]:
        """The file's tensor types with their counts, most frequent first: ["Q4_K ×120", "F32 ×60", ...]."""
        return [f"{kind} ×{n}" for kind, n in Counter(self.file_types.values()).most_common()]


def _release(t) -> None:
    """Drop the file's pages under tensor t from this process (they were copied out): a load's resident memory is
    then what it keeps, plus one tensor, not the whole file besides."""
    mapping = getattr(t.data, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, start, min(len(mapping), t.data_offset + t.n_bytes) - start)


def _torch_shape(t) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape))


def _tensor(path: Path, t) -> torch.Tensor:
    """One reader tensor in PyTorch's shape (the reverse of GGUF's): floats copied out of the map, quantized blocks
    dequantized to fp32."""
    shape = list(_torch_shape(t))
    kind = Q(t.tensor_type)
    if kind == Q.F32:
        array = np.array(t.data, dtype=np.float32)
    elif kind == Q.F16:
        array = np.array(t.data, dtype=np.float16)
    elif kind == Q.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16).reshape(shape)).view(torch.bfloat16)
    else:
        try:
            array = quants.dequantize(t.data, kind)
        except (ValueError, NotImplementedError) as e:
            raise QwenrtError(f"{path}: cannot dequantize tensor '{t.name}' ({kind.name}): {e}") from None
    return torch.from_numpy(array.reshape(shape))


def open_gguf(path: str | Path, mmproj: str | Path | None = None, blocks: bool = True) -> GGUFCheckpoint:
    """Open and check a GGUF model: its architecture and metadata, every tensor qwenrt needs present (by name,
    shape and a readable type), none left over; with the vision tower of projector file `mmproj` if given.
    blocks: offer the linear weights whose block type qwenrt holds exactly as stored pieces (for the CPU); False:
    every tensor as a float one."""
    path = Path(path)
    if not path.is_file():
        raise QwenrtError(f"GGUF file not found: {path}")
    files = gguf_files(path)
    readers = [_open(f) for f in files]
    meta = Metadata(readers[0].fields, path)
    architecture(meta)  # a projector or another model's file is named for what it is before its tensors are read
    tensors = {}
    for file, reader in zip(files, readers):
        for t in reader.tensors:
            if t.name in tensors:
                raise QwenrtError(f"{file}: tensor '{t.name}' appears twice in the set")
            tensors[t.name] = t
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise QwenrtError(f"{path}: no token_embd.weight tensor (not a language model file?)")
    config = parse_config(config_dict(meta, int(embed.shape[1]) if len(embed.shape) > 1 else 0,
                                      "output.weight" not in tensors), where=f"{path} metadata")
    sources, used = _map_tensors(path, config, tensors)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise QwenrtError(f"{path}: {len(unknown)} tensor(s) qwenrt does not know: {', '.join(unknown[:6])}")
    shapes = {name: _shape(name, parts, config) for name, parts in sources.items()}
    dtypes = {name: AUTO_DTYPE.get(Q(parts[0].tensor_type), "BF16") for name, parts in sources.items()}
    file_types = {name: Q(parts[0].tensor_type).name for name, parts in sources.items()}
    quantized = any(Q(t.tensor_type) not in AUTO_DTYPE for parts in sources.values() for t in parts)
    ckpt = GGUFCheckpoint(path, config, sources, shapes, dtypes, file_types, files, tokenizer_parts(meta),
                          float_dtype="BF16" if quantized else dtypes["model.embed_tokens.weight"])
    if blocks:
        _offer_blocks(ckpt)
    if mmproj is not None:
        add_mmproj(ckpt, Path(mmproj))
    return ckpt


def _block_spec(name: str, parts: tuple, config: ModelConfig) -> QuantSpec | None:
    """The exact qwenrt format of parameter `name`'s blocks, or None where it has none: a float or unmapped type,
    parts of two types, or the DeltaNet output's head reorder cutting through its groups (through Q4_K's 256-column
    headers: then fp32 scales and zeros)."""
    kinds = {Q(t.tensor_type) for t in parts}
    spec = SPECS.get(kinds.pop()) if len(kinds) == 1 else None
    if spec is None or layer_part(name) != "linear_attn.out_proj.weight":
        return spec
    head = config.text.linear_value_head_dim
    if spec.q4k and head % 256:
        spec = INT4_G32
    return None if head % spec.group_size else spec


def _offer_blocks(ckpt: GGUFCheckpoint) -> None:
    """Replace each linear weight held exactly as blocks by its stored pieces (names, shapes, dtypes), and an
    untied embedding's (its lookup reads them as stored)."""
    weights = quantizable_weights(_meta_model(ckpt.config))
    if not ckpt.config.text.tie_word_embeddings:
        weights[EMBEDDING] = f"{EMBEDDING}.weight"
    for weight, parameter in weights.items():
        spec = _block_spec(parameter, ckpt.sources[parameter], ckpt.config) if parameter in ckpt.sources else None
        if spec is None:
            continue
        del ckpt.shapes[parameter], ckpt.dtypes[parameter]
        stored = storage_entries(_shape(parameter, ckpt.sources[parameter], ckpt.config), spec)
        for key, (shape, dtype) in stored.items():
            ckpt.pieces[f"{weight}.{key}"] = (parameter, spec, key)
            ckpt.shapes[f"{weight}.{key}"] = shape
            ckpt.dtypes[f"{weight}.{key}"] = DTYPE_NAMES[dtype]


def _meta_model(config: ModelConfig):
    """The model of this config with an MTP head, on `meta`."""
    from qwenrt.model import Qwen35ForCausalLM
    from qwenrt.mtp import MTPHead

    with torch.device("meta"):
        model = Qwen35ForCausalLM(config)
        model.mtp = MTPHead(config.text)
    return model


def add_mmproj(ckpt: GGUFCheckpoint, path: Path) -> None:
    """Add the vision tower of llama.cpp projector file `path` to GGUF model `ckpt`: its tensors as model.visual.*,
    its config a VLM's (the vision tokens from the model's tokenizer), its preprocessing. Shapes are checked against
    the config by the loader, as a checkpoint's are."""
    if not path.is_file():
        raise QwenrtError(f"vision projector file not found: {path}")
    family = ckpt.config.text.family
    if family == QWEN3_NEXT:
        raise QwenrtError(f"{path}: a vision projector for a Qwen3-Next model, which takes no images")
    reader = _open(path)
    meta = Metadata(reader.fields, path)
    vision = clip.vision_config(meta, ckpt.config.text.hidden_size, family)
    ids = clip.vision_token_ids(ckpt.tokenizer, ckpt.config.text.vocab_size, ckpt.path)
    config = clip.vlm_config(ckpt.config, vision, ids, path)
    tensors = {}
    for t in reader.tensors:
        if t.name in tensors:
            raise QwenrtError(f"{path}: tensor '{t.name}' appears twice")
        tensors[t.name] = t
    sources = _map_vision_tensors(path, config, tensors)
    unknown = sorted(set(tensors) - {t.name for parts in sources.values() for t in parts})
    if unknown:
        raise QwenrtError(f"{path}: {len(unknown)} tensor(s) qwenrt does not know: {', '.join(unknown[:6])}")
    for name, parts in sources.items():
        ckpt.sources[name] = parts
        ckpt.shapes[name] = clip.mmproj_shape(name, [tuple(int(n) for n in reversed(t.shape)) for t in parts])
        ckpt.dtypes[name] = AUTO_DTYPE.get(Q(parts[0].tensor_type), "BF16")
        ckpt.file_types[name] = Q(parts[0].tensor_type).name
    ckpt.config, ckpt.mmproj, ckpt.files = config, path, [*ckpt.files, path]
    ckpt.preprocess = clip.preprocess_configs(meta, vision)


def _map_vision_tensors(path: Path, config: ModelConfig, tensors: dict) -> dict[str, tuple]:
    """{qwenrt vision name: its reader tensors}: every tensor of the tower the config describes, of a readable type."""
    from qwenrt.vision import VisionConfig, VisionTower

    vision = VisionConfig.from_dict(config.vision)
    with torch.device("meta"):
        names = [clip.VISUAL + n for n, _ in VisionTower(vision).named_parameters()]
    sources, missing = {}, []
    for name in names:
        wanted = clip.mmproj_names(name, vision.deepstack_visual_indexes)
        if all(w in tensors for w in wanted):
            sources[name] = tuple(tensors[w] for w in wanted)
        else:
            missing += [w for w in wanted if w not in tensors]
    if missing:
        raise QwenrtError(f"{path}: missing {len(missing)} tensor(s): {', '.join(missing[:6])}")
    for parts in sources.values():  # the patch kernel's two frames
        if len({tuple(t.shape) for t in parts}) > 1:
            raise QwenrtError(f"{path}: tensors {' and '.join(t.name for t in parts)} differ in shape")
    for t in (t for parts in sources.values() for t in parts):
        if Q(t.tensor_type) not in READABLE:
            raise QwenrtError(f"{path}: tensor '{t.name}' is {Q(t.tensor_type).name}, a type qwenrt does not read")
    return sources


def _expected_names(config: ModelConfig) -> list[str]:
    """qwenrt's names of every tensor the file may hold for this config (the MTP head's too)."""
    from qwenrt.mtp import MTPHead, mtp_state_dict

    with torch.device("meta"):
        names = [n for n, _ in _meta_model(config).named_parameters() if not n.startswith("mtp.")]
        names += list(mtp_state_dict(MTPHead(config.text)))
    if not config.text.tie_word_embeddings and "lm_head.weight" not in names:
        names.append("lm_head.weight")
    return names


def _map_tensors(path: Path, config: ModelConfig, tensors: dict) -> tuple[dict[str, tuple], set[str]]:
    """{qwenrt name: its reader tensors}, and the GGUF names used. Every decoder tensor must be there; the MTP
    head's are taken all or none."""
    sources, missing = {}, {"trunk": [], "mtp": []}
    for name in _expected_names(config):
        wanted = gguf_names(name, config.text)
        fused = tuple(w.replace("ffn_gate_exps", "ffn_gate_up_exps") for w in wanted[:1])
        if name.endswith(".mlp.experts.gate_up_proj") and fused[0] in tensors:
            wanted = fused  # a newer converter's one [E, 2I, D] tensor
        if wanted and all(w in tensors for w in wanted):
            sources[name] = tuple(tensors[w] for w in wanted)
        else:
            missing["mtp" if name.startswith("mtp.") else "trunk"].append(wanted[0] if wanted else name)
    if missing["trunk"]:
        raise QwenrtError(f"{path}: missing {len(missing['trunk'])} tensor(s): {', '.join(missing['trunk'][:6])}")
    mtp = [n for n in sources if n.startswith("mtp.")]
    if mtp and missing["mtp"]:
        raise QwenrtError(f"{path}: the MTP block is incomplete: missing {', '.join(missing['mtp'][:6])}")
    for t in (t for parts in sources.values() for t in parts):
        if Q(t.tensor_type) not in READABLE:
            raise QwenrtError(f"{path}: tensor '{t.name}' is {Q(t.tensor_type).name}, a type qwenrt does not read "
                              f"(it reads {', '.join(k.name for k in READABLE)})")
    return sources, {t.name for parts in sources.values() for t in parts}


def _shape(name: str, parts: tuple, config: ModelConfig) -> tuple[int, ...]:
    """The qwenrt shape of tensor `name` from its GGUF parts."""
    return gguf_shape(name, [_torch_shape(t) for t in parts], config.text)
