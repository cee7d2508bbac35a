"""Qwen3-VL and Qwen3-VL-MoE (transformers' `qwen3_vl`, `qwen3_vl_moe`): the Qwen3 decoder under the vision tower.

Against Qwen3.5 its decoder has every layer softmax attention, no attention output gate (`GatedAttention.gated`),
rotary over the whole head (always interleaved M-RoPE), plain w·x RMSNorms, an MoE without a shared expert, and
DeepStack (the tower's `deepstack_visual_indexes` block outputs added after the first decoder layers,
`Qwen35ForCausalLM.hidden_states(deepstack=)`). The norms load as qwenrt's zero-centred (1 + w) norms with w - 1
stored, and the published MoE files' expert banks ([E, D, 2I] / [E, I, D]) are read in transformers 5.23's layout,
so every norm, kernel and decode plan is Qwen3.5's; the config's differences are read by qwenrt.config.
"""

from __future__ import annotations

import dataclasses

# the decoder's RMSNorm weights: w·x in the checkpoint, (1 + w)·x in qwenrt
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
         "self_attn.k_norm.weight")
FINAL_NORM = "model.norm.weight"
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# llama.cpp's GGUF files (conversion/qwen3vl.py): general.architecture -> model_type, and the one layer tensor named
# apart from Qwen3.5's (qwenrt.gguf.layout); their norms hold w as the checkpoints do
GGUF_ARCHITECTURES = {"qwen3vl": "qwen3_vl_text", "qwen3vlmoe": "qwen3_vl_moe_text"}
GGUF_LAYER_NAMES = {"post_attention_layernorm.weight": "ffn_norm.weight"}


def map_tensors(plan: dict, text) -> dict:
    """The loader's tensor plan (our name -> checkpoint.Source) for a Qwen3-VL checkpoint (TextConfig `text`):
    every decoder norm read as w - 1, expert banks in the published layout read transposed."""
    plan = {name: dataclasses.replace(source, offset=-1.0) if name == FINAL_NORM or name.endswith(NORMS) else source
            for name, source in plan.items()}
    for name in [n for n in plan if n.endswith(GATE_UP)]:
        prefix = name[:-len(GATE_UP)]
        if prefix + DOWN in plan and _published(plan[name].shape, plan[prefix + DOWN].shape, text):
            for bank in (name, prefix + DOWN):
                E, K, N = plan[bank].shape
                plan[bank] = dataclasses.replace(plan[bank], shape=(E, N, K), transposed=True)
    return plan


def _published(gate_up: tuple, down: tuple, text) -> bool:
    """Whether a layer's banks are stored as the hub's Qwen3-VL-MoE files hold them (gate_up [E, D, 2I], down
    [E, I, D]) rather than as transformers 5.23 writes them ([E, 2I, D], [E, D, I]). Both banks decide together:
    one of them differs between the layouts whatever D and I are (gate_up alone cannot tell when D = 2I)."""
    E, D, I = text.num_experts, text.hidden_size, text.moe_intermediate_size
    return tuple(gate_up) == (E, D, 2 * I) and tuple(down) == (E, I, D)
