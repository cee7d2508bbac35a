"""Where each of qwenrt's tensors lives in a `qwen35` / `qwen35moe` GGUF file, and the value transforms llama.cpp's
converter applies on the way (convert_hf_to_gguf.py, conversion/qwen.py), both ways; the related families' files
(`qwen3vl`, `qwen3vlmoe`, `qwen3next`) differ in the few names and transforms their family modules list.

Names: qwenrt's are the Hugging Face names of the text decoder (`model.layers.{i}.…`, `mtp.…`); a GGUF's are
`blk.{i}.…`, the MTP block being block L = num_hidden_layers. Shapes are PyTorch's order on both sides (the gguf
package's reader returns arrays so).

Transforms (to GGUF; the inverse on import):
- the (1+w) RMSNorm weights are stored with the 1 added (every norm but `linear_attn.norm`, a plain-w norm);
- A_log is stored as ssm_a = -exp(A_log); conv1d [C, 1, 4] as [C, 4];
- where a DeltaNet layer has more value heads than key heads (Hv = r·Hk), its value heads move from grouped order
  (head g·r + i) to tiled order (i·Hk + g): the V rows of in_proj_qkv, the rows of in_proj_z, in_proj_a,
  in_proj_b, A_log and dt_bias, the V channels of conv1d, the columns of out_proj;
- the fused experts gate_up_proj [E, 2I, D] are two tensors, gate [E, I, D] then up;
- the shared-expert gate [1, D] is read as [1, D] from files that store it as [D].
Qwen3-VL's files name the post-attention norm `ffn_norm` and hold its w·x norms' w as the checkpoint does (the
loader reads both as qwenrt's 1 + w);
Qwen3-Next's keep the value heads in grouped order (no reorder) and in_proj_b / in_proj_a fused as `ssm_ba`
[per key head: b (r rows) | a (r rows)], read back by rows.
"""

from __future__ import annotations

import math

import torch

from qwenrt.config import QWEN3_5, QWEN3_NEXT, QWEN3_VL, TextConfig
from qwenrt.families import qwen3_next, qwen3_vl

# qwenrt name after "model.layers.{i}." (or "mtp.layers.0.") -> GGUF name after "blk.{i}."
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GATE_UP = "mlp.experts.gate_up_proj"
GATE_UP_PARTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
GATE_UP_FUSED = "ffn_gate_up_exps.weight"  # newer converters' one-tensor form ([E, 2I, D], gate rows first)
FAMILY_LAYER_NAMES = {QWEN3_5: LAYER_NAMES, QWEN3_VL: {**LAYER_NAMES, **qwen3_vl.GGUF_LAYER_NAMES},
                      QWEN3_NEXT: {**LAYER_NAMES, **qwen3_next.GGUF_LAYER_NAMES}}
BA = ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")  # Qwen3-Next's: rows of one ssm_ba
# the MTP head's own tensors (qwenrt name after "mtp.") -> GGUF name after "blk.{L}."
MTP_NAMES = {
    "fc.weight": "nextn.eh_proj.weight",
    "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "norm.weight": "nextn.shared_head_norm.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# stored in F32 whatever the file's type (llama.cpp's converter does so; its quantizer never touches them)
F32_SUFFIXES = ("norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight",
                "ffn_gate_inp_shexp.weight")


def gguf_names(name: str, config: TextConfig) -> tuple[str, ...]:
    """The GGUF tensor(s) holding qwenrt tensor `name` (two for the fused experts); () for a name it has none for."""
    n_layers = config.num_hidden_layers
    if name in GLOBAL_NAMES:
        return (GLOBAL_NAMES[name],)
    if name.startswith("mtp."):
        rest = name[len("mtp."):]
        if rest in MTP_NAMES:
            return (f"blk.{n_layers}.{MTP_NAMES[rest]}",)
        if not rest.startswith("layers.0."):
            return ()
        block, rest = n_layers, rest[len("layers.0."):]
    elif name.startswith("model.layers."):
        index, _, rest = name[len("model.layers."):].partition(".")
        if not index.isdecimal():
            return ()
        block = int(index)
    else:
        return ()
    if rest == GATE_UP:
        return tuple(f"blk.{block}.{part}" for part in GATE_UP_PARTS)
    names = FAMILY_LAYER_NAMES[config.family]
    return (f"blk.{block}.{names[rest]}",) if rest in names else ()


def is_one_plus_norm(name: str, config: TextConfig) -> bool:
    """A (1+w) RMSNorm weight, stored in GGUF with the 1 added (Qwen3-VL's norms are w·x: stored as they are)."""
    return config.family != QWEN3_VL and name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")) \
        and not name.endswith("linear_attn.norm.weight")


def reorder_v_heads(t: torch.Tensor, dim: int, config: TextConfig, head_dim: int, inverse: bool = False
                    ) -> torch.Tensor:
    """t with its value-head axis `dim` ([Hv·head_dim]) moved from grouped to tiled order (inverse: back)."""
    hk, r = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    if r == 1:
        return t
    shape = list(t.shape)
    dim %= len(shape)
    split = [r, hk] if inverse else [hk, r]
    t = t.reshape(*shape[:dim], *split, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


def _reorder_qkv_rows(t: torch.Tensor, config: TextConfig, inverse: bool) -> torch.Tensor:
    """in_proj_qkv [2·Hk·dk + Hv·dv, D] (or conv1d [C, 4]): only the V part's heads move."""
    qk = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    v = reorder_v_heads(t[qk:], 0, config, config.linear_value_head_dim, inverse)
    return torch.cat([t[:qk], v])


def _reorder(rest: str, t: torch.Tensor, config: TextConfig, inverse: bool) -> torch.Tensor:
    """The V-head reorder of a DeltaNet tensor (rest: its name within the layer): Qwen3.5's files only."""
    if config.family != QWEN3_5:
        return t
    dv = config.linear_value_head_dim
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        return _reorder_qkv_rows(t, config, inverse)
    if rest == "linear_attn.in_proj_z.weight":
        return reorder_v_heads(t, 0, config, dv, inverse)
    if rest in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.A_log",
                "linear_attn.dt_bias"):
        return reorder_v_heads(t, 0, config, 1, inverse)
    if rest == "linear_attn.out_proj.weight":  # columns [Hv·dv], or a quantized piece's [Hv·dv/G] (its groups)
        return reorder_v_heads(t, 1, config, t.shape[1] // config.linear_num_value_heads, inverse)
    return t


def gguf_shape(name: str, shapes: list[tuple[int, ...]], config: TextConfig) -> tuple[int, ...]:
    """The qwenrt shape of tensor `name` from its GGUF parts' (PyTorch-order) shapes, the transforms' reshapes
    applied."""
    rest = layer_part(name)
    if rest == GATE_UP and len(shapes) == 2:
        return (*shapes[0][:-2], shapes[0][-2] + shapes[1][-2], shapes[0][-1])
    if rest == "linear_attn.conv1d.weight":
        return (shapes[0][0], 1, math.prod(shapes[0][1:]))
    if rest == "mlp.shared_expert_gate.weight":
        return (1, math.prod(shapes[0]))
    if rest in BA and config.family == QWEN3_NEXT:
        return (shapes[0][0] // 2, *shapes[0][1:])
    return shapes[0]


def layer_part(name: str) -> str:
    """`linear_attn.A_log` of `model.layers.3.linear_attn.A_log`; the name itself where it is not a layer's."""
    for prefix in ("model.layers.", "mtp.layers."):
        if name.startswith(prefix):
            return name[len(prefix):].partition(".")[2]
    return name


def to_gguf(name: str, t: torch.Tensor, config: TextConfig) -> tuple[torch.Tensor, ...]:
    """qwenrt tensor `name` -> the GGUF tensor(s) `gguf_names` gives, in its order (fp32 math, the input's dtype)."""
    rest = layer_part(name)
    if rest == GATE_UP:
        half = t.shape[-2] // 2
        return t[..., :half, :].contiguous(), t[..., half:, :].contiguous()
    if rest.startswith("linear_attn."):
        if rest == "linear_attn.conv1d.weight":
            t = t.reshape(t.shape[0], -1)  # [C, 1, K] -> [C, K]
        t = _reorder(rest, t, config, inverse=False)
        if rest == "linear_attn.A_log":
            t = -torch.exp(t.float())
    if is_one_plus_norm(name, config):
        t = t.float() + 1
    return (t,)


def from_gguf(name: str, parts: list[torch.Tensor], config: TextConfig) -> torch.Tensor:
    """The GGUF tensor(s) of qwenrt tensor `name` (as `gguf_names` lists them, fp32) -> that tensor."""
    rest = layer_part(name)
    if rest == GATE_UP:
        return torch.cat(parts, dim=-2)
    t = parts[0]
    if rest in BA and config.family == QWEN3_NEXT:
        t = t[qwen3_next.ba_rows(rest.split(".")[1], config)]
    if rest.startswith("linear_attn."):
        if rest == "linear_attn.A_log":
            t = torch.log(-t)
        t = _reorder(rest, t, config, inverse=True)
        if rest == "linear_attn.conv1d.weight":
            t = t.reshape(t.shape[0], 1, -1)  # [C, K] -> [C, 1, K]
    if rest == "mlp.shared_expert_gate.weight":
        t = t.reshape(1, -1)
    if is_one_plus_norm(name, config):
        t = t - 1
    return t
