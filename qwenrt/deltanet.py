"""The Gated DeltaNet token mixer (3 of every 4 Qwen3.5 layers). Shapes use the alphabet in model.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.config import TextConfig
from qwenrt.kernels import inference_kernels
from qwenrt.ops.linear import Linear, project
from qwenrt.ops.conv import causal_conv1d_silu
from qwenrt.ops.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule


class GatedRMSNorm(nn.Module):
    """RMSNorm per value head, then × silu(z). Unlike the decoder norms the weight is plain w, not (1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)  # the reference rounds to the input dtype before the weight
        return (h * F.silu(z.float())).to(dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)  # pow(2) is x·x, and faster here


class GatedDeltaNet(nn.Module):
    def __init__(self, c: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.split = (key_dim, key_dim, value_dim)
        self.in_proj_qkv = Linear(c.hidden_size, c.conv_dim)
        self.in_proj_z = Linear(c.hidden_size, value_dim)
        self.in_proj_b = Linear(c.hidden_size, self.num_v_heads)
        self.in_proj_a = Linear(c.hidden_size, self.num_v_heads)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim, groups=c.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps)
        self.out_proj = Linear(value_dim, c.hidden_size)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor | None, recurrent_state: torch.Tensor | None):
        """x [B, T, D]; conv_state [B, C, K-1]; recurrent_state [B, Hv, Dk, Dv] fp32 (None = fresh sequence).

        Returns (out [B, T, D], new conv_state, new recurrent_state).
        """
        B, T, _ = x.shape
        if T == 1 and recurrent_state is not None and x.is_cpu and x.dtype in (torch.bfloat16, torch.float32):
            kernels = inference_kernels(x, *self.in_proj_qkv.parameters())
            if kernels is not None:
                return self.fused_decode_step(kernels, x, conv_state, recurrent_state)
        mixed, conv_state = self.conv_silu(self.in_proj_qkv(x), conv_state)  # [B, T, C]
        q, k, v = torch.split(mixed, self.split, dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim).float()

        beta = self.in_proj_b(x).sigmoid().float()  # [B, T, Hv]
        # log-decay in fp32: exp(A_log) overflows half precision
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())

        # normalise per key head, then share each key head with its Hv/Hk value heads (repeat_interleave, not tile)
        q = l2_normalize(q.float()) * self.head_k_dim ** -0.5
        k = l2_normalize(k.float())
        r = self.num_v_heads // self.num_k_heads
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # [B, T, Hv, Dk]

        rule = recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
        o, recurrent_state = rule(q, k, v, g=g, beta=beta, state=recurrent_state)  # o [B, T, Hv, Dv]

        z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.to(x.dtype), z).reshape(B, T, -1)  # [B, T, Hv·Dv]
        return self.out_proj(o), conv_state, recurrent_state

    def conv_silu(self, mixed: torch.Tensor, conv_state: torch.Tensor | None):
        """silu(causal depthwise conv) over mixed [B, T, C], continuing conv_state [B, C, K-1] fp32 (None: zeros).

        Returns (out [B, T, C], the state after these tokens). The native kernel works token-major and updates the
        state in place; torch's conv1d needs channel-major copies.
        """
        native = mixed.is_cpu and mixed.dtype in (torch.bfloat16, torch.float32)
        kernels = inference_kernels(mixed, self.conv1d.weight) if native else None
        if kernels is None:
            out, conv_state = causal_conv1d_silu(mixed.transpose(1, 2), self.conv1d.weight[:, 0], conv_state)
            return out.transpose(1, 2), conv_state
        if conv_state is None:
            B, _, C = mixed.shape
            conv_state = mixed.new_zeros(B, C, self.conv1d.weight.shape[-1] - 1, dtype=torch.float32)
        return kernels.causal_conv1d_silu(mixed.contiguous(), conv_state, self.fp32_parameters()[0]), conv_state

    def fused_decode_step(self, kernels, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor):
        """The same step as `forward` for T = 1 in one native call; conv and recurrent state updated in place."""
        B = x.shape[0]
        h = x[:, 0]  # [B, D]
        mixed, z, b, a = project(h, [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        out = self.native_step(kernels, mixed, z, b, a, conv_state, recurrent_state)
        return self.out_proj(out.view(B, 1, -1)), conv_state, recurrent_state

    def native_step(self, kernels, mixed, z, b, a, conv_state: torch.Tensor, recurrent_state: torch.Tensor):
        """The native kernel on one token's projections (mixed [B, C], z [B, Hv·Dv], b, a [B, Hv]) -> the gated
        output [B, Hv·Dv] before out_proj; conv and recurrent state updated in place."""
        conv_w, A_log, dt_bias, norm_w = self.fp32_parameters()
        return kernels.gdn_decode_step(mixed, conv_state, conv_w, a, b, A_log, dt_bias, recurrent_state,
                                       z.view(z.shape[0], self.num_v_heads, self.head_v_dim), norm_w,
                                       self.num_k_heads, self.norm.eps, mixed.dtype == torch.bfloat16)

    def native_steps(self, kernels, mixed, z, b, a, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                     saved_conv: torch.Tensor, saved_recurrent: torch.Tensor):
        """`native_step` over T successive tokens of one sequence (rows of mixed, z, b, a) in one native call; the
        states after each token but the last are copied into saved_conv [T-1, C, K-1] and saved_recurrent
        [T-1, Hv, Dk, Dv] (fp32), what a speculative verification commits when it rejects the tokens after."""
        conv_w, A_log, dt_bias, norm_w = self.fp32_parameters()
        return kernels.gdn_decode_steps(mixed, conv_state, conv_w, a, b, A_log, dt_bias, recurrent_state,
                                        z.view(z.shape[0], self.num_v_heads, self.head_v_dim), norm_w,
                                        self.num_k_heads, self.norm.eps, mixed.dtype == torch.bfloat16,
                                        saved_conv, saved_recurrent)

    def fp32_parameters(self) -> tuple[torch.Tensor, ...]:
        """conv weight [C, K], A_log, dt_bias, norm weight in fp32 for the native step, converted once per weight."""
        weights = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
        key = tuple((w.data_ptr(), 0 if w.is_inference() else w._version) for w in weights)  # no counter there
        if getattr(self, "_fp32_key", None) != key:
            self._fp32 = tuple(w.detach().float().reshape(w.shape[0], -1).squeeze(-1).contiguous() for w in weights)
            self._fp32_key = key
        return self._fp32
