"""The sparse MoE block: a softmax router (fp32), top-A experts (their weights renormalised unless the config's
norm_topk_prob is false), plus a shared expert scaled by sigmoid(shared_expert_gate(x)) (Qwen3-VL-MoE has none).

Without autograd, in bf16 on the CPU it runs as one native call (`kernels.MoE`: the router, each used expert's SwiGLU
and down projections in its weight format, the gated shared expert), at decode inside the decode plan's layer loop
and at prefill from here: the used experts (up to 256 of them per chunk on the 35B-A3B) without a Python call each.
At decode sizes it gives what `dispatched` gives bit for bit (tests/test_moe_native.py).
"""

from __future__ import annotations

import torch
from torch import nn

from qwenrt.config import TextConfig
from qwenrt.kernels import inference_kernels
from qwenrt.mlp import MLP, Experts
from qwenrt.native import bind, cached, expert_bank
from qwenrt.ops.linear import Linear
from qwenrt.quant import QuantExperts


class SparseMoeBlock(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        self.gate = Linear(c.hidden_size, c.num_experts)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(c.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        native = None
        if x.dtype == torch.bfloat16 and inference_kernels(x, *self.parameters()) is not None:
            native = native_block(self)
        out = native(x.contiguous()) if native is not None else self.dispatched(x)
        return out.reshape(shape)

    def dispatched(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] through the modules: a call per used expert."""
        logits = self.gate(x)  # [N, E]
        probs = logits.softmax(-1, dtype=torch.float32)
        weight, index = probs.topk(self.top_k, dim=-1)  # [N, A]
        if self.norm_topk_prob:
            weight = weight / weight.sum(-1, keepdim=True)
        weight = weight.to(logits.dtype)
        out = self.experts(x, index, weight)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def native_block(block: SparseMoeBlock):
    """The block as one `kernels.MoE`, bound once per weight generation; None where some part has no native format
    (fp32 weights, int4 in torch's packed layout) or without the native kernels."""
    return cached(block, "moe", block.gate.weight.dtype, lambda kernels: _bind_moe(kernels, block))


def _bind_moe(kernels, block: SparseMoeBlock):
    experts, shared = block.experts, block.shared_expert
    if type(experts) not in (Experts, QuantExperts):
        return None
    banks = [expert_bank(kernels, w) for w in (experts.gate_up_proj, experts.down_proj)]
    if shared is None:  # Qwen3-VL-MoE
        router = bind(kernels, [block.gate])
        return None if None in (*banks, router) else kernels.MoE(router, *banks, None, None, block.top_k,
                                                                  renormalize=block.norm_topk_prob)
    router = bind(kernels, [block.gate, block.shared_expert_gate])
    gate_up = bind(kernels, [shared.gate_proj, shared.up_proj], one_format=True)
    down = bind(kernels, [shared.down_proj])
    if None in (*banks, router, gate_up, down):
        return None
    return kernels.MoE(router, *banks, gate_up, down, block.top_k, renormalize=block.norm_topk_prob)
