"""`qwenrt inspect`: what a checkpoint holds, its sizes, and whether it passes the loader's contracts (the very
checks `load` runs: the same functions, the NaN/Inf scan of the weights included unless skipped)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from qwenrt.hub import resolve_model_path
from qwenrt.checkpoint import DTYPE_BYTES
from qwenrt.config import QWEN3_5
from qwenrt.gguf.reader import GGUFCheckpoint
from qwenrt.loader import VISUAL_PREFIX, check_checkpoint, scan_weights, stored_float_dtype
from qwenrt.mtp import MTPHead
from qwenrt.model import Qwen35ForCausalLM
from qwenrt.quant import stored_spec
from qwenrt.units import human as _human


def _count(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def _decoder_tensors(ckpt, plan: dict) -> int:
    """The decoder's tensors as the checkpoint names them (a GGUF file's blocks count once, not by their pieces)."""
    if isinstance(ckpt, GGUFCheckpoint):
        return sum(not name.startswith(VISUAL_PREFIX) for name in ckpt.sources)
    return len(plan)


def inspect_checkpoint(path: str | Path, check_finite: bool = True, mmproj: str | Path | None = None,
                       rope_scaling: dict | None = None) -> dict:
    """A report of the checkpoint as a dict of plain values. Raises QwenrtError when a contract fails, with the error
    `load` gives. check_finite=False skips the NaN/Inf scan (a read of every weight), as in `load`. mmproj: a GGUF
    model's vision projector file, checked with it. rope_scaling: as `load` takes it."""
    path = resolve_model_path(path)
    verified, tokenizer = check_checkpoint(path, mmproj, rope_scaling=rope_scaling)
    if check_finite:
        scan_weights(path, verified)
    config, ckpt, plan, aside, _ = verified
    c = config.text
    with torch.device("meta"):  # logical parameters, whatever the storage (a quantized checkpoint packs them)
        params = dict(Qwen35ForCausalLM(config).named_parameters())  # a tied head appears once
        has_mtp = any(n.startswith("mtp.") for n in plan)
        mtp_params = _count(p.shape for p in MTPHead(c).parameters()) if has_mtp else 0
    decoder = _count(p.shape for p in params.values())
    embeddings = _count(params[n].shape for n in ("model.embed_tokens.weight", "lm_head.weight") if n in params)
    active = decoder
    moe_layers = sum(map(c.is_moe_layer, range(c.num_hidden_layers)))
    if c.is_moe:  # per token only A of E routed experts run
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size
        active -= moe_layers * (c.num_experts - c.num_experts_per_tok) * per_expert
    stored = ckpt.type_summary() if isinstance(ckpt, GGUFCheckpoint) else sorted({ckpt.dtypes[n] for n in ckpt.location})
    compute_bytes = DTYPE_BYTES[stored_float_dtype(ckpt, plan)]
    n_full, n_linear = len(c.full_attention_layers), len(c.linear_attention_layers)
    kv_per_token = n_full * 2 * c.num_key_value_heads * c.head_dim * compute_bytes
    state_per_seq = n_linear * (c.conv_dim * (c.linear_conv_kernel_dim - 1) * compute_bytes
                                + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4)
    pattern = "".join("L" if t == "linear_attention" else "F" for t in c.layer_types)
    return {
        "path": str(path),
        "mmproj": str(mmproj) if mmproj is not None else None,
        "model_type": config.model_type,
        # Qwen3.5's unnamed (as the README shows it); another family's by name
        "family": ("" if c.family == QWEN3_5 else f"{c.family} ") + ("MoE" if c.is_moe else "dense")
                  + (" VLM" if config.is_vlm else " text"),
        "deepstack_layers": len((config.vision or {}).get("deepstack_visual_indexes") or ()),
        "attention_gate": c.attention_gate,
        "mtp": has_mtp,
        "vision_tensors": sum(n.startswith("model.visual.") for n in aside),
        "layers": c.num_hidden_layers,
        "deltanet_layers": n_linear,
        "attention_layers": n_full,
        "layer_pattern": pattern,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "experts": f"{c.num_experts} (top-{c.num_experts_per_tok}{'' if c.norm_topk_prob else ', not renormalised'})"
                   + (" + shared" if c.shared_expert_intermediate_size else "")
                   + (f" in {moe_layers} of {c.num_hidden_layers} layers (the others dense)"
                      if moe_layers < c.num_hidden_layers else "") if c.is_moe else None,
        "tied_embeddings": c.tie_word_embeddings,
        "params_decoder": decoder,
        "params_embeddings": embeddings,
        "params_active_per_token": active,
        "params_vision": _count(ckpt.shapes[n] for n in aside if n.startswith("model.visual.")),
        "params_mtp": mtp_params,
        "stored_dtypes": stored,
        "quantization": _quantization(config.raw),
        "file_bytes": ckpt.total_bytes,
        "kv_bytes_per_token": kv_per_token,
        "context_limit": c.context_limit,
        "rope_scaling": c.yarn.describe() if c.yarn is not None else None,
        "deltanet_state_bytes_per_sequence": state_per_seq,
        "tokenizer_tokens": tokenizer.vocab_size if tokenizer is not None else None,
        "weights_scanned": check_finite,
        "verdict": f"OK: config consistent, all {_decoder_tensors(ckpt, plan)} decoder tensors present with the "
                   "expected shapes, "
                   + ("tokenizer files valid" if tokenizer is not None else "no tokenizer")
                   + ("; weights free of NaN/Inf" if check_finite else "; weights not scanned for NaN/Inf"),
    }


def _quantization(raw_config: dict) -> str | None:
    """"int4 g64 (int8: linear_attn.in_proj_a, ...), 13 modules kept in full precision" for a `qwenrt quantize`
    checkpoint."""
    stored = stored_spec(raw_config)
    if stored is None:
        return None
    spec, kept, overrides = stored
    held: dict[str, list[str]] = {}  # format -> the weights (path suffixes) held in it
    for suffix, other in overrides.items():
        held.setdefault(other.short, []).append(suffix)
    return spec.short + "".join(f" ({fmt}: {', '.join(suffixes)})" for fmt, suffixes in held.items()) + (
        f", {len(kept)} modules kept in full precision" if kept else "")


def _pattern(p: str) -> str:
    """'LLLFLLLF' -> 'LLLF ×2' when the pattern repeats."""
    for size in range(1, len(p) + 1):
        if len(p) % size == 0 and p[:size] * (len(p) // size) == p:
            return f"{p[:size]} ×{len(p) // size}" if size < len(p) else p
    return p


def format_report(r: dict) -> str:
    lines = [
        f"checkpoint      {r['path']}" + (f" + vision projector {r['mmproj']}" if r["mmproj"] else ""),
        f"model_type      {r['model_type']}  ({r['family']}"
        + (f", DeepStack into {r['deepstack_layers']} layers" if r["deepstack_layers"] else "")
        + f", MTP head: {'yes' if r['mtp'] else 'no'}, "
        f"vision tensors: {r['vision_tensors']})",
        f"layers          {r['layers']} = {r['deltanet_layers']} Gated DeltaNet + {r['attention_layers']} "
        f"{'gated ' if r['attention_gate'] else ''}attention"
        f"  [{_pattern(r['layer_pattern'])}; L = DeltaNet, F = full attention]",
        f"hidden / vocab  {r['hidden_size']} / {r['vocab_size']}" + (f"; experts {r['experts']}" if r["experts"] else ""),
        f"parameters      decoder {_human(r['params_decoder'])} (embeddings {_human(r['params_embeddings'])}"
        f"{', tied' if r['tied_embeddings'] else ''})"
        + (f", active per token {_human(r['params_active_per_token'])}" if r["experts"] else "")
        + f"; vision {_human(r['params_vision'])}; MTP {_human(r['params_mtp'])}",
        f"stored dtype    {', '.join(r['stored_dtypes'])}  ({_human(r['file_bytes'], 'B')} on disk"
        + (f"; weight-only {r['quantization']}" if r["quantization"] else "") + ")",
        f"KV cache        {_human(r['kv_bytes_per_token'], 'B')} per token (full-attention layers only)",
        f"DeltaNet state  {_human(r['deltanet_state_bytes_per_sequence'], 'B')} per sequence, whatever its length",
        f"context         {r['context_limit']} tokens ({r['rope_scaling'] or 'no RoPE scaling'}; a full context's KV "
        f"{_human(r['kv_bytes_per_token'] * r['context_limit'], 'B')})",
        "tokenizer       " + (f"{r['tokenizer_tokens']} tokens" if r["tokenizer_tokens"] is not None
                                else "none (prompts as token ids only)"),
        f"contract        {r['verdict']}",
    ]
    return "\n".join(lines)
