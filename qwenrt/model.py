"""The Qwen3.5 text decoder, top to bottom. Module attributes keep the checkpoint's names.

Shape alphabet (used in every docstring and comment of the package):
    B batch, T tokens this call, S cached length (keys visible to a query), D hidden,
    H / Hkv attention heads, Dh attention head dim, Hk / Hv DeltaNet key / value heads, Dk / Dv their head dims,
    C conv channels (= 2·Hk·Dk + Hv·Dv), K conv kernel, E experts, A active experts, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.cache import HybridCache
from qwenrt.config import ModelConfig, TextConfig
from qwenrt.deltanet import GatedDeltaNet
from qwenrt.errors import QwenrtError
from qwenrt.kernels import cpu_kernels, inference_kernels
from qwenrt.ops.attention import decode_attention
from qwenrt.ops.linear import Linear, linear, project, swiglu
from qwenrt.ops.rope import apply_rope, inv_frequencies, rope_cos_sin


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: the checkpoint stores w and the norm scales by (1 + w), in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _norm_kernels(x, self.weight)
        if kernels is not None:
            return kernels.rms_norm(x.contiguous(), None, self.weight.float(), self.eps)[1]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm) in one pass where the native kernel is available."""
        kernels = _norm_kernels(x, self.weight)
        if kernels is not None:
            return tuple(kernels.rms_norm(x.contiguous(), residual.contiguous(), self.weight.float(), self.eps))
        x = x + residual
        return x, self(x)


def _norm_kernels(x: torch.Tensor, weight: torch.Tensor):
    return inference_kernels(x, weight) if x.is_cpu and x.dtype in (torch.bfloat16, torch.float32) else None


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

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens x [n, D] -> [n, D]."""
        gate, up = linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dispatch_experts(self.expert, x, index, weight)


def dispatch_experts(expert, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, D]; index, weight [N, A] -> Σ_a weight·expert(index, x) [N, D], each expert run once on its tokens."""
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
        y = expert(e, x[rows]) * weight[rows, cols, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """Softmax router (fp32), top-A, renormalised; plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, c: TextConfig):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.gate = Linear(c.hidden_size, c.num_experts)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(c.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        logits = self.gate(x)  # [N, E]
        probs = logits.softmax(-1, dtype=torch.float32)
        weight, index = probs.topk(self.top_k, dim=-1)  # [N, A]
        weight = (weight / weight.sum(-1, keepdim=True)).to(logits.dtype)
        out = self.experts(x, index, weight)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


class GatedAttention(nn.Module):
    """Softmax attention with a sigmoid output gate: q_proj emits [query | gate] per head; q/k RMSNorm; partial RoPE."""

    def __init__(self, c: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: HybridCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, D]; cos, sin [B, T, R]; mask [B, 1, T, S] boolean or None (plain causal / all visible)."""
        B, T, _ = x.shape
        qg, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj])
        kernels = inference_kernels(x, self.q_proj.weight) if T == 1 and cache is not None and x.is_cpu else None
        if kernels is not None and x.dtype in (torch.bfloat16, torch.float32):
            o = self.native_step(kernels, qg.view(B, -1), k.view(B, -1), v.view(B, -1), cos.reshape(B, -1),
                                 sin.reshape(B, -1), cache)
            return self.o_proj(o.view(B, 1, -1))
        qg = qg.view(B, T, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim:]
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [B, Hkv, T, Dh]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write_kv(self.layer_idx, k, v)  # [B, Hkv, S, Dh]
        if T == 1:
            o = decode_attention(q, k, v, mask)  # [B, H, 1, Dh]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None, enable_gqa=True)
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))  # [B, T, H·Dh]
        return self.o_proj(o)


    def native_step(self, kernels, qg, k, v, cos: torch.Tensor, sin: torch.Tensor, cache: HybridCache):
        """One token's projections (qg [B, H·2·Dh], k, v [B, Hkv·Dh]; cos, sin [B, R]) -> the gated attention output
        [B, H·Dh] before o_proj, in one native call: norms, RoPE, the cache write, attention over the stores in
        place, the gate."""
        return kernels.attention_decode_step(
            qg.view(qg.shape[0], self.num_heads, 2 * self.head_dim), k, v, self.q_norm.weight.float(),
            self.k_norm.weight.float(), cos, sin, cache.keys[self.layer_idx], cache.values[self.layer_idx],
            cache.lengths_tensor(qg.device), self.q_norm.eps)


class DecoderLayer(nn.Module):
    def __init__(self, c: TextConfig, layer_idx: int, layer_type: str | None = None):
        """layer_type: c.layer_types[layer_idx] unless given (the MTP head's layer is full attention)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.is_linear = (layer_type or c.layer_types[layer_idx]) == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c, layer_idx)
        else:
            self.self_attn = GatedAttention(c, layer_idx)
        self.mlp = SparseMoeBlock(c) if c.is_moe else MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, delta, cos, sin, cache: HybridCache | None, mask):
        """x [B, T, D] the residual stream and delta the previous layer's MLP output, still to be added (None for the
        first layer): the add is fused into this layer's input norm. Returns (x, this layer's MLP output)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, delta)
        if self.is_linear:
            i = self.layer_idx
            conv, rec = (cache.conv[i], cache.recurrent[i]) if cache is not None else (None, None)
            h, conv, rec = self.linear_attn(h, conv, rec)
            if cache is not None:
                cache.conv[i], cache.recurrent[i] = conv, rec
        else:
            h = self.self_attn(h, cos, sin, cache, mask)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return x, self.mlp(h)


class TextModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    """The text decoder with its LM head. Call it on token ids, optionally continuing the sequences in a cache."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config.text
        self.model = TextModel(c)
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch_size: int = 1, capacity: int = 256) -> HybridCache:
        """An empty cache for `batch_size` sequences (KV for full-attention layers, conv + recurrent state for DeltaNet)."""
        return HybridCache(self.config.text, batch_size, self.dtype, self.device, capacity)

    def text_positions(self, B: int, T: int, cache: HybridCache | None) -> torch.Tensor:
        """[B, T] positions continuing each cached sequence (plus its M-RoPE offset after vision tokens)."""
        steps = torch.arange(T, device=self.device)
        if cache is None:
            return steps.expand(B, T)
        starts = [n + d for n, d in zip(cache.lengths, cache.rope_deltas)]
        return torch.tensor(starts, device=self.device)[:, None] + steps

    def forward(self, input_ids: torch.Tensor | None = None, cache: HybridCache | None = None, *,
                inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """input_ids [B, T] (or inputs_embeds [B, T, D]) -> logits [B, T', V] fp32.

        position_ids: [B, T] or [3, B, T] (M-RoPE axes); by default the text positions after the cache.
        logits_to_keep: 0 = every position, n = the last n only (prefill needs just the last).
        """
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        if position_ids is None:
            position_ids = self.text_positions(B, T, cache)
        cos, sin = self.rope_tables(position_ids, x.dtype)
        mask = None
        if cache is not None:
            if cache.batch_size != B:
                raise QwenrtError(f"cache holds {cache.batch_size} sequences but input has batch size {B}")
            cache.reserve(cache.max_length + T)
            native = T == 1 and inputs_embeds is None and x.is_cpu and inference_kernels(x) is not None
            plan = self.decode_plan() if native else None
            if plan is not None:  # the same step, without per-module Python work
                logits = plan(input_ids, cache, cos[:, 0], sin[:, 0])
                cache.advance(T)
                return logits
            mask = cache.attention_mask(T, x.device)
        return self.lm_head(self._final_hidden(x, cos, sin, cache, mask, logits_to_keep)).float()

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] of fresh sequences (no cache) -> the final-normed hidden states [B, T, D]: what lm_head
        and the MTP head read. Training applies the head only where it has a loss."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_tables(self.text_positions(*input_ids.shape, None), x.dtype)
        return self._final_hidden(x, cos, sin, None, None, 0)

    def _final_hidden(self, x, cos, sin, cache: HybridCache | None, mask, logits_to_keep: int) -> torch.Tensor:
        """The decoder layers and the final norm over x [B, T, D] -> [B, T', D] (T' = logits_to_keep or T)."""
        delta = None
        for layer in self.model.layers:
            x, delta = layer(x, delta, cos, sin, cache, mask)
        if cache is not None:
            cache.advance(x.shape[1])
        if logits_to_keep:
            x, delta = x[:, -logits_to_keep:], delta[:, -logits_to_keep:]
        return self.model.norm.add_forward(x, delta)[1]

    def rope_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] or [3, B, T] -> cos, sin [B, T, rotary_dim] in `dtype`."""
        c = self.config.text
        cos, sin = rope_cos_sin(position_ids, self.inv_frequencies(position_ids.device), c.mrope_section,
                                c.mrope_interleaved)
        return cos.to(dtype), sin.to(dtype)

    def decode_plan(self):
        """The native decode step (qwenrt/decode_plan.py), or None without the native kernels or where some part of
        the model has none."""
        kernels = cpu_kernels()
        if kernels is None:
            return None
        from qwenrt.decode_plan import DecodePlan  # it imports the quantized layers, which import this module

        return DecodePlan.for_model(self, kernels)

    def inv_frequencies(self, device: torch.device) -> torch.Tensor:
        """RoPE inverse frequencies [rotary_dim / 2] fp32, computed once per device."""
        cached = getattr(self, "_inv_freq", None)
        if cached is None or cached.device != torch.device(device):
            c = self.config.text
            self._inv_freq = inv_frequencies(c.rotary_dim, c.rope_theta, device=device)
        return self._inv_freq
