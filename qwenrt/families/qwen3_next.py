"""Qwen3-Next (model_type "qwen3_next", Qwen3NextForCausalLM): the hybrid Gated DeltaNet MoE model Qwen3.5 was built
on, run as Qwen3.5 MoE. What differs is mapped at load into Qwen3.5's own parameters:
- config.json: transformers' Qwen3NextConfig defaults where they differ from Qwen3.5's (a key the file omits), and
  the keys Qwen3.5 MoE does not have: `norm_topk_prob` (False: the top-A router weights are not renormalised),
  `decoder_sparse_step` / `mlp_only_layers` (which layers have a dense MLP of `intermediate_size`).
- tensors: each DeltaNet layer's fused `in_proj_qkvz` and `in_proj_ba`, grouped per key head g as
  [q_g | k_g | v_g (r·Dv) | z_g (r·Dv)] and [b_g (r) | a_g (r)] with r = Hv/Hk, are split into Qwen3.5's
  in_proj_qkv [q | k | v] (the conv1d's channel order, unchanged), in_proj_z, in_proj_b and in_proj_a: row runs of
  the stored tensors, read once at load. A copy `qwenrt quantize` wrote holds them split already.
- RoPE: 1-D partial rotary, which is Qwen3.5's interleaved M-RoPE with every axis at the text position.
The per-expert tensors (mlp.experts.{e}.*), shared expert and gate, attention, (1 + w) norms and the MTP head's names
are Qwen3.5 MoE's.
"""

from __future__ import annotations

import dataclasses

import torch

from qwenrt.errors import QwenrtError
from qwenrt.fields import Fields

MODEL_TYPE = "qwen3_next"
# Qwen3NextConfig's defaults for keys whose Qwen3.5 default differs, or that Qwen3.5 MoE does not read
DEFAULTS = {"rope_theta": 10_000.0, "max_position_embeddings": 32768, "intermediate_size": 5632}
FUSED = ("in_proj_qkvz", "in_proj_ba")
# llama.cpp's GGUF files (conversion/qwen.py Qwen3NextModel): in_proj_qkvz written split as Qwen3.5's in_proj_qkv and
# in_proj_z (value heads in grouped order, unlike Qwen3.5's files), in_proj_ba kept fused as ssm_ba
GGUF_ARCHITECTURE = "qwen3next"
GGUF_LAYER_NAMES = {"linear_attn.in_proj_b.weight": "ssm_ba.weight", "linear_attn.in_proj_a.weight": "ssm_ba.weight"}


def with_defaults(d: dict) -> dict:
    """config.json's dict with transformers' Qwen3-Next defaults where a key is absent or null."""
    return {**DEFAULTS, **{k: v for k, v in d.items() if v is not None}}


def config_fields(f: Fields) -> dict:
    """The TextConfig fields only Qwen3-Next sets (its dense-layer keys are read with Qwen3-VL-MoE's)."""
    return {"norm_topk_prob": f.bool("norm_topk_prob", True)}


def _fused_runs(c) -> dict[str, dict[str, tuple[tuple[int, int], ...]]]:
    """fused tensor -> {Qwen3.5 projection: its (first row, rows) runs of the fused tensor, in Qwen3.5's order}."""
    hk, dk, dv, r = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, \
        c.linear_num_value_heads // c.linear_num_key_heads
    qkvz = [g * (2 * dk + 2 * r * dv) for g in range(hk)]  # each key-head group's first row
    ba = [g * 2 * r for g in range(hk)]
    return {
        "in_proj_qkvz": {
            "in_proj_qkv": tuple((s, dk) for s in qkvz) + tuple((s + dk, dk) for s in qkvz)
            + tuple((s + 2 * dk, r * dv) for s in qkvz),
            "in_proj_z": tuple((s + 2 * dk + r * dv, r * dv) for s in qkvz),
        },
        "in_proj_ba": {"in_proj_b": tuple((s, r) for s in ba), "in_proj_a": tuple((s + r, r) for s in ba)},
    }


def fused_rows(c) -> dict[str, dict[str, list[int]]]:
    """fused tensor -> {Qwen3.5 projection: the fused tensor's rows holding it, in the projection's order}."""
    return {fused: {part: [start + i for start, n in runs for i in range(n)] for part, runs in parts.items()}
            for fused, parts in _fused_runs(c).items()}


def ba_rows(projection: str, c) -> list[int]:
    """The rows of a fused in_proj_ba [2·Hv, D] holding `projection` ("in_proj_b" or "in_proj_a"), in its order."""
    return fused_rows(c)["in_proj_ba"][projection]


def split_adapter(fused: str, A: torch.Tensor, B: torch.Tensor, c) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA pair on a fused projection (A [r, D], B [rows, r], as PEFT trains it on Qwen3-Next) -> the same update
    on each Qwen3.5 projection it holds: {projection: (A, B's rows for it)}."""
    return {part: (A, B[rows]) for part, rows in fused_rows(c)[fused].items()}


def fuse_adapters(fused: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], c) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA pairs on some of a fused projection's parts ({projection: (A [r_p, D], B [N_p, r_p])}, one scaling) ->
    one pair on the fused tensor with the same update: A the parts' A stacked [Σr_p, D], B block-diagonal
    [rows, Σr_p], each part's block at its rows."""
    rows = fused_rows(c)[fused]
    A = torch.cat([pairs[part][0] for part in rows if part in pairs])
    B = A.new_zeros(sum(len(r) for r in rows.values()), A.shape[0])
    column = 0
    for part in (p for p in rows if p in pairs):
        rank = pairs[part][0].shape[0]
        B[rows[part], column:column + rank] = pairs[part][1]
        column += rank
    return A, B


def split_fused(plan: dict, c, where) -> dict:
    """`plan` ({name: qwenrt.checkpoint.Source}, as plan_text_tensors makes it) with every fused in_proj_qkvz / in_proj_ba replaced by the Qwen3.5
    projections it holds. c: the TextConfig. One QwenrtError for a fused tensor of the wrong shape."""
    runs = _fused_runs(c)
    out = {}
    for name, source in plan.items():
        prefix, _, leaf = name.rpartition(".")
        owner, _, fused = prefix.rpartition(".")
        if leaf != "weight" or fused not in FUSED or not owner.endswith(".linear_attn"):
            out[name] = source
            continue
        parts = runs[fused]
        rows = sum(n for part in parts.values() for _, n in part)
        if source.stacked or source.rows is not None or source.shape != (rows, c.hidden_size):
            raise QwenrtError(f"{where}: tensor '{source.names[0]}' has shape {list(source.shape)}; Qwen3-Next's "
                              f"fused {fused} needs [{rows}, {c.hidden_size}] ({c.linear_num_key_heads} key-head groups)")
        for part, part_runs in parts.items():
            ours = f"{owner}.{part}.weight"
            if ours in plan:
                raise QwenrtError(f"{where}: tensor '{ours}' is stored both split and fused in '{source.names[0]}'")
            out[ours] = dataclasses.replace(source, shape=(sum(n for _, n in part_runs), c.hidden_size), rows=part_runs)
    return out
