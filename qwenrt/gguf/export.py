"""`qwenrt convert MODEL out.gguf --type TYPE`: a model qwenrt loads (a checkpoint directory, a hub repo id or a GGUF
file) written as a `qwen35` / `qwen35moe` GGUF file llama.cpp runs: the tensors and metadata as llama.cpp's converter
writes them (qwenrt.gguf.layout), streamed tensor by tensor into a hidden file renamed into place at the end.

Types: f32, f16, bf16 (norms, A/dt, conv and routers in F32 as the converter keeps them); q8_0 (every matrix whose
rows split into 32-value blocks, by gguf.quants); q4_0 (the same at Q4_0, but the output and tied embedding at Q6_K
as llama-quantize keeps them); q4_k_m (llama-quantize's mix: Q4_K, Q6_K for the value projections and ffn_down of
the first and last eighths and every third layer between, Q6_K output and tied embedding). In both 4-bit types the
DeltaNet output and a/b projections, which the measured sensitivities in shared/gguf.md single out, stay at Q8_0;
rows that are not 256-value blocks fall back to Q5_0/Q8_0 as llama-quantize does.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFValueType, GGUFWriter, quants
from tqdm import tqdm

from qwenrt.checkpoint import materialize
from qwenrt.config import QWEN3_5
from qwenrt.errors import QwenrtError
from qwenrt.gguf import kquants, mmproj as clip
from qwenrt.gguf.layout import F32_SUFFIXES, gguf_names, to_gguf
from qwenrt.gguf.metadata import SAMPLING, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED
from qwenrt.hub import resolve_model_path
from qwenrt.gguf.reader import GGUFCheckpoint
from qwenrt.loader import SAFETENSORS_DTYPES, STORED_DTYPES, check_checkpoint
from qwenrt.quant import EMBEDDING, QuantLinear, dequantize_weight
from qwenrt.vision.config import VisionConfig, load_preprocess_configs

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m")
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_k_m": 15}  # general.file_type (llama_ftype)
FLOATS = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}
KQUANTIZE = {Q.Q4_K: kquants.quantize_q4_k, Q.Q6_K: kquants.quantize_q6_k}
ARRAY_DTYPES = {Q.F32: np.float32, Q.F16: np.float16}  # arrays of values; every other type is written as bytes
SAMPLING_KEYS = {name: key for key, name in SAMPLING.items()}  # generation_config's -> general.sampling.*
SENSITIVE = ("ssm_out.weight", "ssm_alpha.weight", "ssm_beta.weight")  # >= 8 bits in the 4-bit mix
ENCODE_SLICE = 1 << 22  # values encoded at a time


def _uses_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers and every third one between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], kind: str, n_layers: int, tied: bool) -> Q:
    """The GGUF type of tensor `name` (GGUF's name, PyTorch shape) in a file of `kind`."""
    if len(shape) < 2 or name.endswith(F32_SUFFIXES):
        return Q.F32
    if kind in FLOATS:
        return FLOATS[kind]
    if kind == "q8_0":
        return Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        wanted = Q.Q6_K
    elif name.endswith(SENSITIVE):
        wanted = Q.Q8_0
    elif kind == "q4_0":
        wanted = Q.Q4_0
    elif name.startswith("blk.") and name.endswith(("attn_v.weight", "attn_qkv.weight", "ffn_down.weight",
                                                     "ffn_down_exps.weight")):
        wanted = Q.Q6_K if _uses_more_bits(int(name.split(".")[1]), n_layers) else Q.Q4_K
    else:
        wanted = Q.Q4_K
    if shape[-1] % 256:  # llama-quantize's fallback for rows that are not whole super-blocks
        wanted = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}.get(wanted, wanted)
    return wanted if shape[-1] % 32 == 0 else Q.F16


def encode(t: torch.Tensor, kind: Q) -> np.ndarray:
    """A tensor [..., K] as GGUF stores `kind`: float arrays, or uint8 blocks [..., K / block · block bytes]; its
    rows encoded a slice at a time from their fp32 values, so the temporaries stay small beside the result."""
    rows = t.reshape(-1, t.shape[-1])  # [R, K]
    step = max(1, ENCODE_SLICE // rows.shape[1])
    out = None
    for r0 in range(0, rows.shape[0], step):
        part = _encode_rows(rows[r0:r0 + step].float().numpy(), kind)
        if out is None:
            out = np.empty((rows.shape[0], part.shape[1]), dtype=part.dtype)
        out[r0:r0 + step] = part
    return out.reshape(*t.shape[:-1], out.shape[1])


def _encode_rows(x: np.ndarray, kind: Q) -> np.ndarray:
    if kind == Q.F32:
        return x
    if kind == Q.F16:
        return x.astype(np.float16)
    if kind in KQUANTIZE:
        return KQUANTIZE[kind](x)
    return quants.quantize(x, kind)


def _metadata(writer: GGUFWriter, config, tokenizer, n_mtp: int, kind: str, name: str) -> None:
    c = config.text
    arch = "qwen35moe" if c.is_moe else "qwen35"

    def key(name: str) -> str:
        return f"{arch}.{name}"

    writer.add_name(name)
    writer.add_uint32(key("block_count"), c.num_hidden_layers + n_mtp)
    writer.add_uint32(key("context_length"), c.max_position_embeddings)
    writer.add_uint32(key("embedding_length"), c.hidden_size)
    writer.add_uint32(key("attention.head_count"), c.num_attention_heads)
    writer.add_uint32(key("attention.head_count_kv"), c.num_key_value_heads)
    writer.add_array(key("rope.dimension_sections"), [*c.mrope_section, *[0] * (4 - len(c.mrope_section))])
    writer.add_float32(key("rope.freq_base"), c.rope_theta)
    writer.add_float32(key("attention.layer_norm_rms_epsilon"), c.rms_norm_eps)
    writer.add_uint32(key("attention.key_length"), c.head_dim)
    writer.add_uint32(key("attention.value_length"), c.head_dim)
    writer.add_uint32("general.file_type", FILE_TYPES[kind])
    if c.is_moe:
        writer.add_uint32(key("expert_count"), c.num_experts)
        writer.add_uint32(key("expert_used_count"), c.num_experts_per_tok)
        writer.add_uint32(key("expert_feed_forward_length"), c.moe_intermediate_size)
        writer.add_uint32(key("expert_shared_feed_forward_length"), c.shared_expert_intermediate_size)
    else:
        writer.add_uint32(key("feed_forward_length"), c.intermediate_size)
    if n_mtp:
        writer.add_uint32(key("nextn_predict_layers"), n_mtp)
    writer.add_uint32(key("ssm.conv_kernel"), c.linear_conv_kernel_dim)
    writer.add_uint32(key("ssm.state_size"), c.linear_key_head_dim)
    writer.add_uint32(key("ssm.group_count"), c.linear_num_key_heads)
    writer.add_uint32(key("ssm.time_step_rank"), c.linear_num_value_heads)
    writer.add_uint32(key("ssm.inner_size"), c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_array(key("attention.recurrent_layers"),
                     [t == "linear_attention" for t in c.layer_types] + [False] * n_mtp)
    interval = next((i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention"), 4)
    writer.add_uint32(key("full_attention_interval"), interval)
    writer.add_uint32(key("rope.dimension_count"), c.rotary_dim)
    writer.add_quantization_version(2)
    if tokenizer is not None:
        _tokenizer(writer, tokenizer, c.vocab_size)


def _tokenizer(writer: GGUFWriter, tokenizer, vocab_rows: int) -> None:
    """The tokenizer as llama.cpp's converter writes a Qwen3.5 one: gpt2 / qwen35, the list padded to the
    embedding's rows with [PAD{i}] (unused), added tokens as control (special) or user-defined."""
    backend = json.loads(tokenizer.backend_json())
    model = backend["model"]
    if model.get("type") != "BPE":
        raise QwenrtError("GGUF export needs a byte-level BPE tokenizer (Qwen3.5's)")
    tokens, types = [f"[PAD{i}]" for i in range(vocab_rows)], [TOKEN_UNUSED] * vocab_rows
    for token, i in model["vocab"].items():
        if i < vocab_rows:
            tokens[i], types[i] = token, TOKEN_NORMAL
    for added in backend.get("added_tokens", []):
        if added["id"] < vocab_rows:
            tokens[added["id"]] = added["content"]
            control = added.get("special") or (added["content"].startswith("<|") and added["content"].endswith("|>"))
            types[added["id"]] = TOKEN_CONTROL if control else TOKEN_USER_DEFINED  # the converter's rule
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tokenizer.eos_token_ids:
        writer.add_eos_token_id(tokenizer.eos_token_ids[0])
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    for key, value in tokenizer.generation_defaults.items():
        if key in SAMPLING_KEYS:
            writer.add_key_value(SAMPLING_KEYS[key], value, GGUFValueType.INT32 if key == "top_k" else
                                 GGUFValueType.FLOAT32)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def export_gguf(source: str | Path, out: str | Path, kind: str = "bf16", progress: bool = False,
                mmproj: str | Path | None = None) -> Path:
    """Write the model at `source` as GGUF file `out` of type `kind` (see TYPES), and its vision tower as llama.cpp
    projector file `mmproj` if given (qwenrt.gguf.mmproj; both files appear together or neither). Returns out."""
    if kind not in TYPES:
        raise QwenrtError(f"unknown GGUF type {kind!r} (use one of: {', '.join(TYPES)})")
    out = _new_file(out)
    vision_out = _new_file(mmproj) if mmproj is not None else None
    if vision_out is not None and vision_out.resolve() == out.resolve():
        raise QwenrtError(f"{out}: the model and its vision projector need two files")
    path = resolve_model_path(source)
    verified, tokenizer = check_checkpoint(path, blocks=False)  # a GGUF source's blocks as floats
    config, ckpt, plan, _, model = verified
    if config.text.family != QWEN3_5:  # qwen35 / qwen35moe files: llama.cpp reads them as Qwen3.5
        raise QwenrtError(f"{path}: a {config.text.family} model is not written as GGUF (qwenrt writes the "
                          "Qwen3.5 architectures qwen35 and qwen35moe)")
    if config.text.yarn is not None:  # llama.cpp's YaRN keys and rounding differ from transformers': not mapped
        raise QwenrtError(f"{path}: a config with YaRN rope scaling is not written as GGUF (write it without, and "
                          "set llama.cpp's --rope-scaling yarn options when running it)")
    tensors = _float_tensors(ckpt, plan, model)
    if vision_out is not None:
        _check_vision_export(path, config, ckpt, vision_out)
    c = config.text
    n_mtp = 1 if any(n.startswith("mtp.") for n in plan) else 0
    tied = c.tie_word_embeddings
    entries = []  # (gguf name, qwenrt name, part index, shape, type)
    for name, (shape, _) in tensors.items():
        names = gguf_names(name, c)
        shapes = _gguf_shapes(name, shape)
        for i, (gname, shape) in enumerate(zip(names, shapes)):
            entries.append((gname, name, i, shape, tensor_type(gname, shape, kind, c.num_hidden_layers, tied)))
    tmp = _partial(out)
    vision_tmp, placed = (_partial(vision_out) if vision_out is not None else None), None
    try:
        writer = GGUFWriter(tmp, "qwen35moe" if c.is_moe else "qwen35")
        _metadata(writer, config, tokenizer, n_mtp, kind, Path(str(path)).name)
        _write_tensors(writer, entries, lambda name: to_gguf(name, _read(ckpt, tensors[name][1]), c), out.name,
                       progress)
        if vision_tmp is not None:
            _write_mmproj(vision_tmp, vision_out.name, path, config, ckpt, kind, progress)
            os.replace(vision_tmp, vision_out)
            placed = vision_out
        os.replace(tmp, out)
    except BaseException:
        for file in (tmp, vision_tmp, placed):
            if file is not None:
                file.unlink(missing_ok=True)
        raise
    return out


def _new_file(out: str | Path) -> Path:
    out = Path(out).expanduser()
    if not out.name.lower().endswith(".gguf"):
        raise QwenrtError(f"{out}: the output's name must end in .gguf")
    if out.exists():
        raise QwenrtError(f"{out}: already exists")
    return out


def _partial(out: Path) -> Path:
    """The hidden file `out` is written as, renamed into place once whole."""
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def _read(ckpt, read: Callable[[], torch.Tensor]) -> torch.Tensor:
    """read() after the pages of the tensors read before have left RSS (a safetensors source's files are reopened; a
    GGUF one's pages are released as read): the peak is a tensor or two, not the checkpoint."""
    if not isinstance(ckpt, GGUFCheckpoint):
        ckpt.release()
    return read()


def _read_dtype(ckpt, source) -> torch.dtype:
    """A safetensors tensor is read as stored (encode widens a slice at a time), a GGUF one in fp32."""
    first = source.names[0][0] if source.stacked else source.names[0]
    return torch.float32 if isinstance(ckpt, GGUFCheckpoint) else SAFETENSORS_DTYPES[ckpt.dtypes[first]]


def _write_tensors(writer: GGUFWriter, entries: list[tuple], parts: Callable[[str], tuple], shown: str,
                   progress: bool) -> None:
    """The tensor infos, then (after the metadata already added) header, metadata and each tensor's data, streamed:
    entries (gguf name, qwenrt name, part index, shape, type) in file order; parts(name): that tensor's GGUF parts,
    read once for its consecutive entries."""
    for gname, _, _, shape, qtype in entries:
        writer.add_tensor_info(gname, _stored_shape(shape, qtype), np.dtype(ARRAY_DTYPES.get(qtype, np.uint8)),
                               _nbytes(shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done: dict[str, tuple] = {}
    for _, name, part, _, qtype in tqdm(entries, desc=f"writing {shown}", unit="tensor", disable=not progress,
                                        file=sys.stderr):
        if name not in done:
            done = {name: parts(name)}
        writer.write_tensor_data(encode(done[name][part], qtype))
    writer.close()


def _float_tensors(ckpt, plan: dict, model) -> dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]:
    """qwenrt name -> (shape, read it in fp32), in the checkpoint's order: its tensors, and a `qwenrt quantize`
    checkpoint's quantized weights as the values its kernels multiply by (dequantized from the stored pieces; `model`
    holds their placeholders, each at its weight's path)."""
    held = {path: m for path, m in model.named_modules() if isinstance(m, QuantLinear)}
    tensors = {}
    for name, source in plan.items():
        path, _, piece = name.rpartition(".")
        if path not in held:
            tensors[name] = (source.shape, lambda source=source: materialize(ckpt, source, _read_dtype(ckpt, source)))
            continue
        m = held.pop(path)
        weight = EMBEDDING + ".weight" if path == "lm_head" and model.config.text.tie_word_embeddings else \
            path if m.qweight.dim() == 3 else f"{path}.weight"  # a tied head is the embedding; experts: the bank
        if weight in tensors:  # an embedding stored beside its quantized tied head: that one is written
            continue
        shape = (*m.qweight.shape[:-2], m.out_features, m.in_features)
        pieces = {key: plan[f"{path}.{key}"] for key in m.spec.pieces}
        tensors[weight] = (shape, lambda m=m, pieces=pieces: dequantize_weight(
            {key: materialize(ckpt, src, STORED_DTYPES[ckpt.dtypes[src.names[0]]]) for key, src in pieces.items()},
            m.spec))
    return tensors


def _check_vision_export(path: Path, config, ckpt, out: Path) -> None:
    if not ckpt.names(clip.VISUAL):
        raise QwenrtError(f"{path}: the model has no vision tower to write as {out.name}")
    clip.check_exportable(VisionConfig.from_dict(config.vision), path)


def _write_mmproj(tmp: Path, shown: str, path: Path, config, ckpt, kind: str, progress: bool) -> None:
    """The vision tower of checkpoint `path` as llama.cpp's converter writes its projector file, tensor by tensor
    (in the checkpoint's name order, as the converter reads them) into `tmp` (`shown` on the progress bar)."""
    vision = VisionConfig.from_dict(config.vision)
    file_type = clip.FILE_TYPES[kind]
    entries = []  # (file name, qwenrt name, part index, shape, type)
    for name in sorted(ckpt.names(clip.VISUAL)):
        parts = zip(clip.mmproj_names(name), clip.mmproj_shapes(name, ckpt.shapes[name]))
        entries += [(gname, name, i, shape, clip.tensor_type(gname, shape, file_type))
                    for i, (gname, shape) in enumerate(parts)]
    writer = GGUFWriter(tmp, "clip")
    clip.write_metadata(writer, vision, load_preprocess_configs(path)[0], config.text.hidden_size, file_type,
                        Path(str(path)).name, sum(math.prod(e[3]) for e in entries))
    _write_tensors(writer, entries, lambda name: clip.to_mmproj(name, ckpt.get(name).float()), shown, progress)


def _gguf_shapes(name: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """PyTorch shapes of the GGUF tensor(s) of qwenrt tensor `name` of `shape`."""
    if name.endswith("mlp.experts.gate_up_proj"):
        half = (*shape[:-2], shape[-2] // 2, shape[-1])
        return [half, half]
    if name.endswith("linear_attn.conv1d.weight"):
        return [(shape[0], shape[-1])]
    return [tuple(shape)]


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * block_bytes


def _stored_shape(shape: tuple[int, ...], qtype: Q) -> tuple[int, ...]:
    """The shape add_tensor_info takes: elements for float types, bytes along the last axis for block types."""
    if qtype in ARRAY_DTYPES:
        return shape
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * block_bytes)
