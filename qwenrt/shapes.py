"""Random-weight checkpoints at the published Qwen3.5 text shapes (reference.md §1.2), Qwen3-Next-80B-A3B's and
Qwen3-VL's text decoders: benchmarks without downloads.

The weights are random, so outputs are meaningless; sizes, layouts and therefore speed and memory are those of the
real models. Written in the text-only layout (`model.*`, fused MoE experts as published), bf16, one tensor at a time,
or directly quantized (what `qwenrt quantize` makes of the bf16 one): a 35B-A3B in int4 without its 70 GB in bf16.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch

from qwenrt.config import QWEN3_VL, parse_config
from qwenrt.errors import QwenrtError
from qwenrt.families import qwen3_vl
from qwenrt.model import Qwen35ForCausalLM
from qwenrt.quant import QuantSpec, default_overrides, plan_units, quantize_weight, storage_entries
from qwenrt.writer import Entry, aligned_order, write_safetensors

_COMMON = dict(vocab_size=248320, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_num_key_heads=16, rms_norm_eps=1e-6, max_position_embeddings=262144,
               hidden_act="silu", attention_bias=False, attn_output_gate=True, full_attention_interval=4,
               mamba_ssm_dtype="float32", eos_token_id=248044, pad_token_id=248044, bos_token_id=248044,
               rope_parameters=dict(rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25,
                                    mrope_section=[11, 11, 10], mrope_interleaved=True))
# name: (layers, hidden, FFN, heads, KV heads, DeltaNet value heads, tied, MoE (experts, top-k, moe FFN, shared FFN))
_TABLE = {
    "0.8b": (24, 1024, 3584, 8, 2, 16, True, None),
    "2b": (24, 2048, 6144, 8, 2, 16, True, None),
    "4b": (32, 2560, 9216, 16, 4, 32, True, None),
    "9b": (32, 4096, 12288, 16, 4, 32, False, None),
    "27b": (64, 5120, 17408, 24, 4, 48, False, None),
    "35b-a3b": (40, 2048, 0, 16, 2, 32, False, (256, 8, 512, 512)),
}
# Qwen3-Next-80B-A3B as its config.json has it (the hub's keys: full_attention_interval, flat rope_theta); name ->
# layers: the whole model, and a slice of its first 4 layers (one LLLF period) with its embeddings and head, whose
# decode step is the whole model's per layer (int4: 3.6 GB to write, where the whole model is 40 GB)
_NEXT_COMMON = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    head_dim=256, num_attention_heads=16, num_key_value_heads=2, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=5120,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=262144,
    hidden_act="silu", attention_bias=False, full_attention_interval=4, tie_word_embeddings=False,
    rope_theta=10_000_000, partial_rotary_factor=0.25, bos_token_id=151643, eos_token_id=151645,
    router_aux_loss_coef=0.001)
_NEXT = {"next-80b-a3b": 48, "next-80b-a3b-4l": 4}
# Qwen3-VL's text decoders (Qwen3 layers): name: (layers, hidden, FFN, heads, KV heads, tied)
_QWEN3_VL_TABLE = {
    "qwen3-vl-2b": (28, 2048, 6144, 16, 8, True),
    "qwen3-vl-4b": (36, 2560, 9728, 32, 8, True),
    "qwen3-vl-8b": (36, 4096, 12288, 32, 8, False),
}
_QWEN3_VL = dict(vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=262144,
                 hidden_act="silu", attention_bias=False, eos_token_id=151645, pad_token_id=151643,
                 rope_parameters=dict(rope_type="default", rope_theta=5_000_000, mrope_section=[24, 20, 20],
                                      mrope_interleaved=True))
SHAPES = (*_TABLE, *_NEXT, *_QWEN3_VL_TABLE)
INIT_STD = 0.02
ROWS_PER_CHUNK = 1 << 14  # big tensors are generated in row chunks: bounded memory whatever the model size
GIB = 1 << 30
DISK_MARGIN = 256 << 20  # headers, config.json, and room left for the rest of the machine


def text_config(name: str) -> dict:
    """The config.json of the text decoder of Qwen3.5-`name` (one of SHAPES), of Qwen3-Next-80B-A3B (next-*) or of a
    Qwen3-VL (qwen3-vl-*)."""
    if name in _QWEN3_VL_TABLE:
        layers, hidden, ffn, heads, kv_heads, tied = _QWEN3_VL_TABLE[name]
        return dict(_QWEN3_VL, model_type="qwen3_vl_text", architectures=["Qwen3VLTextModel"],
                    num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                    num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    if name in _NEXT:
        return dict(_NEXT_COMMON, num_hidden_layers=_NEXT[name])
    if name not in _TABLE:
        raise QwenrtError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    layers, hidden, ffn, heads, kv_heads, v_heads, tied, moe = _TABLE[name]
    cfg = dict(_COMMON, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
               num_key_value_heads=kv_heads, linear_num_value_heads=v_heads, tie_word_embeddings=tied,
               layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    if moe is None:
        return dict(cfg, model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], intermediate_size=ffn)
    experts, top_k, moe_ffn, shared_ffn = moe
    return dict(cfg, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], num_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=moe_ffn, shared_expert_intermediate_size=shared_ffn,
                router_aux_loss_coef=0.001)


def title(name: str) -> str:
    """What the random checkpoint `name` (one of SHAPES) has the shape of, in words."""
    if name in _NEXT:
        return "Qwen3-Next-80B-A3B" + (f" (its first {_NEXT[name]} of 48 layers)" if _NEXT[name] < 48 else "")
    if name in _QWEN3_VL_TABLE:
        return f"Qwen3-VL-{name.rpartition('-')[2].upper()}'s text decoder"
    return f"Qwen3.5-{name}"


def meta_model(name: str) -> Qwen35ForCausalLM:
    """The decoder of Qwen3.5-`name` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return Qwen35ForCausalLM(parse_config(text_config(name), where=name))


def parameter_count(name: str) -> int:
    """Parameters of the text decoder (a tied head counted once)."""
    return sum(p.numel() for p in meta_model(name).parameters())


def _generator(seed: int, name: str) -> torch.Generator:
    """The generator of the tensor `name`: its values do not depend on which tensors are written, or in what order
    (a checkpoint written quantized holds the bf16 one's values quantized)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _random_rows(name: str, shape: tuple[int, ...], seed: int, plain_norms: tuple[str, ...] = ()):
    """Yield the tensor `name` as bf16 row chunks. Matrices N(0, 0.02); norms, A_log, dt_bias near their inits
    (`plain_norms`: the names ending so are w·x norms, w ≈ 1: Qwen3-VL's)."""
    g = _generator(seed, name)
    rows = shape[0]
    per_row = math.prod(shape[1:])
    step = max(1, ROWS_PER_CHUNK * 1024 // max(per_row, 1))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        x = torch.randn((n, *shape[1:]), generator=g)
        if name.endswith(("linear_attn.norm.weight", *plain_norms)):  # plain-w norms: w ≈ 1
            x = 1.0 + INIT_STD * x
        elif name.endswith(".A_log"):  # A = exp(A_log) in [1, 16], as transformers initialises it
            x = torch.empty(x.shape).uniform_(1.0, 16.0, generator=g).log()
        elif name.endswith(".dt_bias"):
            x = 1.0 + 0.1 * x
        elif name.endswith("conv1d.weight"):  # depthwise, 4 taps: keep the conv output O(input)
            x.mul_(0.5)
        else:  # matrices, embeddings, and the (1 + w) norms' w
            x.mul_(INIT_STD)
        chunk = x.to(torch.bfloat16)
        del x  # not held while the chunk is used
        yield chunk


def _with_mtp(model: Qwen35ForCausalLM) -> Qwen35ForCausalLM:
    """`model` with an MTP head, as published checkpoints have (and as the loader builds it: `mtp.*`)."""
    from qwenrt.mtp import MTPHead

    with torch.device("meta"):
        model.mtp = MTPHead(model.config.text)
    return model


def _producer(weights: dict, seed: int, plain_norms: tuple[str, ...] = ()):
    """produce(entry) for a random checkpoint: tensors in bf16, and the stored pieces of `weights` (see
    `_quantized_weights`; none for bf16) quantized row chunk by row chunk as they are generated. A pass over a weight
    streams one piece and holds its other small ones (scales, zeros) until written; a qweight written after them costs
    a second pass (only odd-sized pieces are placed so, see `aligned_order`)."""
    todo = {path: set(spec.pieces) for path, (_, _, spec) in weights.items()}  # pieces not yet written
    held: dict[str, dict[str, list[torch.Tensor]]] = {}  # path -> piece -> row chunks computed on an earlier pass

    def produce(entry: Entry):
        path, _, key = entry.name.rpartition(".")
        if path not in weights:  # a tensor kept in bf16
            return _random_rows(entry.name, entry.shape, seed, plain_norms)
        todo[path].discard(key)
        if key in held.get(path, {}):
            chunks = held[path].pop(key)
            if not held[path]:
                del held[path]
            return chunks
        return _stream(path, key, todo[path] - {"qweight"} - held.get(path, {}).keys())

    def _stream(path: str, key: str, hold: set[str]):
        source, shape, spec = weights[path]
        for chunk in _random_rows(source, shape, seed):
            pieces = quantize_weight(chunk, spec, path)
            for other in hold:
                held.setdefault(path, {}).setdefault(other, []).append(pieces[other])
            yield pieces[key]

    return produce


def _quantized_weights(model: Qwen35ForCausalLM, spec: QuantSpec) -> tuple[dict, dict]:
    """What `qwenrt quantize` quantizes in `model`, as it plans it: ({weight path: (source parameter, shape,
    format)}, config.json's quantization_config)."""
    overrides = default_overrides(spec)
    units, kept = plan_units(model, spec, overrides=overrides)
    weights = {path: planned for unit in units.values() for path, planned in unit.items()}
    return weights, spec.config(kept, overrides)


def planned_entries(name: str, quantize: QuantSpec | None = None) -> tuple[list[Entry], dict, dict | None]:
    """The tensors of the random checkpoint of Qwen3.5-`name` in file order as `write_random_checkpoint` writes
    them, quantized as `qwenrt quantize` writes the bf16 one: (entries, the quantized weights as
    `_quantized_weights` gives them, the quantization_config or None)."""
    model = meta_model(name)
    if model.config.text.family != QWEN3_VL:  # Qwen3-VL has no MTP head
        model = _with_mtp(model)
    entries = aligned_order([Entry(n, tuple(p.shape), torch.bfloat16) for n, p in model.named_parameters()])
    if quantize is None:
        return entries, {}, None
    weights, config = _quantized_weights(model, quantize)
    replaced = {source for source, _, _ in weights.values()}
    quantized = [Entry(f"{path}.{key}", shape, dtype) for path, (_, w_shape, spec) in weights.items()
                 for key, (shape, dtype) in storage_entries(w_shape, spec).items()]
    return aligned_order([e for e in entries if e.name not in replaced] + quantized), weights, config


def _check_disk(path: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(path.parent).free
    if needed + DISK_MARGIN > free:
        raise QwenrtError(f"not enough disk space for {what}: it needs {(needed + DISK_MARGIN) / GIB:.1f} GiB in "
                          f"{path.parent} ({needed / GIB:.1f} GiB and a {DISK_MARGIN >> 20} MiB margin), "
                          f"{free / GIB:.1f} GiB is free")


def write_random_checkpoint(name: str, path: str | Path, seed: int = 0, progress: bool = False,
                            shard_bytes: int | None = None, quantize: QuantSpec | None = None) -> Path:
    """Write a random checkpoint of `name` (Qwen3.5's with an MTP head) to `path` (created; must not exist): bf16, or
    written directly quantized to `quantize`, tensor for tensor what `qwenrt quantize` makes of the bf16 one of the
    same seed, without writing that. Holds about one row chunk (ROWS_PER_CHUNK × 1024 values) at a time, plus the
    scales and zeros of one weight. Returns the path."""
    path = Path(path)
    if path.exists():
        raise QwenrtError(f"{path}: already exists")
    entries, weights, quantization = planned_entries(name, quantize)
    what = f"random {title(name)}" + ("" if quantize is None else f" in {quantize}")
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_disk(path, sum(e.nbytes for e in entries), what)
    config = dict(text_config(name), dtype="bfloat16")
    if quantization is not None:
        config["quantization_config"] = quantization
    tmp = path.with_name(f".{path.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        kwargs = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
        plain = qwen3_vl.NORMS + (qwen3_vl.FINAL_NORM,) if name in _QWEN3_VL_TABLE else ()
        write_safetensors(tmp, entries, _producer(weights, seed, plain), progress=progress, desc=what, **kwargs)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.rename(path)  # complete or absent, never half-written
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
