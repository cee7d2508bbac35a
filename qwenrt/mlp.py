"""Feed-forward blocks: the dense SwiGLU MLP and the MoE experts (the block that routes to them: qwenrt/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.ops.linear import Linear, linear, swiglu


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(x, self.gate_proj, self.up_proj))


class Experts(nn.Module):
    """E SwiGLU experts stored fused, as published: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def expert(self, e: int, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Expert e on its tokens x [n, D] (rows of the block's input: `rows`) -> [n, D]."""
        gate, up = linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dispatch_experts(self.expert, x, index, weight)


def dispatch_experts(expert, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, D]; index, weight [N, A] -> Σ_a weight·expert(index, x) [N, D], each expert run once on its tokens:
    expert(e, x[rows], rows)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _dispatch_grouped(expert, x, index, weight)
    out = torch.zeros_like(x)
    flat = index.reshape(-1)  # [N·A]
    order = flat.argsort()
    experts, counts = flat[order].unique_consecutive(return_counts=True)
    token = order // index.shape[1]
    slot = order % index.shape[1]
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        rows, cols = token[start:start + n], slot[start:start + n]
        start += n
        y = expert(e, x[rows], rows) * weight[rows, cols, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def _dispatch_grouped(expert, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dispatch_experts under autograd: the rows gathered once in expert order and the outputs added back once, so
    the backward writes [N·A, D] gradients, not a zero [N, D] one per used expert."""
    flat = index.reshape(-1)  # [N·A]
    order = flat.argsort(stable=True)
    experts, counts = flat[order].unique_consecutive(return_counts=True)
    token, slot = order // index.shape[1], order % index.shape[1]
    counts = counts.tolist()
    parts = zip(experts.tolist(), x[token].split(counts), token.split(counts))
    y = torch.cat([expert(e, rows_x, rows) for e, rows_x, rows in parts])  # [N·A, D], expert by expert
    y = y * weight[token, slot, None]
    return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))
