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
from torch.utils.checkpoint import checkpoint

from qwenrt.cache import HybridCache, SequenceState
from qwenrt.config import ModelConfig, TextConfig
from qwenrt.deltanet import GatedDeltaNet
from qwenrt.errors import QwenrtError
from qwenrt.kernels import inference_kernels
from qwenrt.mlp import MLP
from qwenrt.moe import SparseMoeBlock
from qwenrt.ops.attention import decode_attention
from qwenrt.ops.linear import Linear, project
from qwenrt.ops.rope import apply_rope, inv_frequencies, rope_cos_sin


def _check_shape(x, name: str, dims: str) -> torch.Tensor:
    """A non-empty tensor with one dimension per name in `dims` (e.g. "B, T")."""
    if not isinstance(x, torch.Tensor):
        raise QwenrtError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims.count(",") + 1 or x.numel() == 0:
        raise QwenrtError(f"{name} must be a non-empty [{dims}] tensor, got shape {list(x.shape)}")
    return x


def _check_ids(ids, vocab_size: int) -> torch.Tensor:
    """Token ids [B, T] in an int64/int32 tensor (what the embedding lookup takes), all inside the vocabulary:
    one min/max pass."""
    _check_shape(ids, "input_ids", "B, T")
    if ids.dtype not in (torch.int64, torch.int32):
        raise QwenrtError(f"input_ids must be token ids in an int64 or int32 tensor, got {ids.dtype}")
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0 or high >= vocab_size:
        raise QwenrtError(f"input_ids hold {low if low < 0 else high}, outside the vocabulary [0, {vocab_size})")
    return ids


def _check_embeds(embeds, hidden_size: int) -> torch.Tensor:
    _check_shape(embeds, "inputs_embeds", "B, T, D")
    if not embeds.is_floating_point() or embeds.shape[-1] != hidden_size:
        raise QwenrtError(f"inputs_embeds must be floats [B, T, {hidden_size}], got {embeds.dtype} "
                          f"{list(embeds.shape)}")
    return embeds


def _check_room(cache, tokens: int) -> None:
    """A HybridCache whose every sequence has room for `tokens` more under its limit."""
    if not isinstance(cache, HybridCache):
        raise QwenrtError(f"cache must be a HybridCache (model.new_cache()), got {type(cache).__name__}")
    full = [s.limit for s in cache.sequences if s.limit is not None and s.length + tokens > s.limit]
    if full:
        raise QwenrtError(f"the cache holds at most {full[0]} tokens per sequence; {tokens} more do not fit")


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QwenrtError(f"{name} must be an integer >= 1, got {value!r:.40}")


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
        kernels = _norm_kernels(x, self.weight, residual)  # autograd may need either (adapters train only some)
        if kernels is not None:
            return tuple(kernels.rms_norm(x.contiguous(), residual.contiguous(), self.weight.float(), self.eps))
        x = x + residual
        return x, self(x)


def _norm_kernels(x: torch.Tensor, *weights: torch.Tensor):
    return inference_kernels(x, *weights) if x.is_cpu and x.dtype in (torch.bfloat16, torch.float32) else None


def _prefill_kernels(q: torch.Tensor, *kv: torch.Tensor):
    """The native kernels for the tiled attention of a chunk against its cache (CPU, bf16/fp32, no autograd)."""
    return inference_kernels(q, *kv) if q.is_cpu and q.dtype in (torch.bfloat16, torch.float32) else None


class GatedAttention(nn.Module):
    """Softmax attention with a sigmoid output gate: q_proj emits [query | gate] per head; q/k RMSNorm; partial RoPE.
    Qwen3-VL's layers have no gate (`gated` False: q_proj emits the query alone)."""

    def __init__(self, c: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gated = c.attention_gate
        self.q_proj = Linear(c.hidden_size, (1 + self.gated) * c.num_attention_heads * c.head_dim)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: HybridCache | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D]; cos, sin [B, T, R]. Without a cache the T tokens attend causally among themselves, or as
        `mask` [T, T] (bool, True: row attends to column) says; with one, each row also attends to its sequence's
        cached tokens (rows may hold different lengths)."""
        B, T, _ = x.shape
        qg, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj])
        decoding = T == 1 and cache is not None and x.is_cpu and x.dtype in (torch.bfloat16, torch.float32)
        kernels = inference_kernels(x, *self.q_proj.parameters()) if decoding else None
        if kernels is not None and x.dtype in (torch.bfloat16, torch.float32):
            o = self.native_step(kernels, qg.view(B, -1), k.view(B, -1), v.view(B, -1), cos.reshape(B, -1),
                                 sin.reshape(B, -1), cache.sequences)
            return self.o_proj(o.view(B, 1, -1))
        qg = qg.view(B, T, self.num_heads, (1 + self.gated) * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim:]
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [B, Hkv, T, Dh]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        else:  # each sequence over its own keys: [1, Hkv, S_b, Dh]
            o = torch.cat([self._cached_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], seq)
                           for b, seq in enumerate(cache.sequences)])
        o = o.transpose(1, 2).reshape(B, T, -1)  # [B, T, H·Dh]
        return self.o_proj(o * torch.sigmoid(gate.reshape(B, T, -1)) if self.gated else o)

    def _cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SequenceState):
        """q [1, H, T, Dh] at positions length..length+T-1 of `seq`; k, v [1, Hkv, T, Dh] are stored first."""
        start, T, i = seq.length, q.shape[2], self.layer_idx
        kernels = _prefill_kernels(q, k, v) if seq.keys[i].dtype in (q.dtype, torch.int8) else None
        seq.write_kv(i, k, v)
        if kernels is not None:  # key tiles over the store: O(T × tile) memory, not O(T × S)
            o = kernels.attention_prefill(q[0].transpose(0, 1).contiguous(), seq.keys[i], seq.values[i], start)
            return o.transpose(0, 1)[None]  # [1, H, T, Dh]
        k, v = seq.kv(i, start + T)  # [1, Hkv, start + T, Dh]
        if T == 1:
            return decode_attention(q, k, v, None)
        if start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        keys = torch.arange(start + T, device=q.device)
        mask = keys[None, :] <= start + torch.arange(T, device=q.device)[:, None]  # [T, S]: cached + causal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def native_step(self, kernels, qg, k, v, cos: torch.Tensor, sin: torch.Tensor, sequences: list[SequenceState],
                    lengths: list[torch.Tensor] | None = None, counts: list[int] | None = None):
        """Projections of N rows (qg [N, H·2·Dh], or [N, H·Dh] ungated; k, v [N, Hkv·Dh]; cos, sin [N, R]):
        counts[b] successive tokens of sequences[b] (default one each), in sequence order -> the attention output
        [N, H·Dh] before o_proj, one native call per sequence: norms, RoPE, the cache writes at positions lengths[b]
        (an int64 tensor [counts[b]]; default the sequence's length), then each row's attention over its sequence's
        stores up to its own position, the gate."""
        qg = qg.view(qg.shape[0], self.num_heads, (1 + self.gated) * self.head_dim)
        qn, kn, i = self.q_norm.weight.float(), self.k_norm.weight.float(), self.layer_idx
        if lengths is None:
            lengths = [seq.length_tensor() for seq in sequences]
        if counts is None:
            counts = [1] * len(sequences)
        out, start = [], 0
        for seq, n, positions in zip(sequences, counts, lengths):
            end = start + n
            out.append(kernels.attention_decode_step(qg[start:end], k[start:end], v[start:end], qn, kn,
                                                     cos[start:end], sin[start:end], seq.keys[i], seq.values[i],
                                                     positions, self.q_norm.eps, self.gated))
            start = end
        return out[0] if len(out) == 1 else torch.cat(out)


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
        self.mlp = SparseMoeBlock(c) if c.is_moe_layer(layer_idx) else MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, delta, cos, sin, cache: HybridCache | None, mask: torch.Tensor | None = None):
        """x [B, T, D] the residual stream and delta the previous layer's MLP output, still to be added (None for the
        first layer): the add is fused into this layer's input norm. Returns (x, this layer's MLP output). `mask`:
        an attention layer's [T, T] mask without a cache (GatedAttention)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, delta)
        if self.is_linear:
            conv, rec = cache.deltanet_state(self.layer_idx) if cache is not None else (None, None)
            h, conv, rec = self.linear_attn(h, conv, rec)
            if cache is not None:
                cache.set_deltanet_state(self.layer_idx, conv, rec)
        else:
            h = self.self_attn(h, cos, sin, cache, mask)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return x, self.mlp(h)


class TextModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        # no random init (the weights are loaded, or set by train.init_weights): on `meta` it imports torch._dynamo,
        # 1.4 s of qwenrt.load()
        shape = (c.vocab_size, c.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    """The text decoder with its LM head. Call it on token ids, optionally continuing the sequences in a cache."""

    gradient_checkpointing = False  # training: keep each layer's inputs only, recompute the layer in the backward
    served_adapters = None  # LoRA adapters served side by side (qwenrt.served_adapters.AdapterSet), if any

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
        embed = self.model.embed_tokens  # an nn.Embedding, or a quantized lookup (qwenrt.quant.QuantEmbedding)
        return embed.weight.dtype if isinstance(embed, nn.Embedding) else embed.dtype

    @property
    def device(self) -> torch.device:
        embed = self.model.embed_tokens
        return embed.weight.device if isinstance(embed, nn.Embedding) else embed.device

    def new_sequence(self, capacity: int = 256, limit: int | None = None,
                     kv_dtype: torch.dtype | None = None) -> SequenceState:
        """An empty cache for one sequence (KV for full-attention layers, conv + recurrent state for DeltaNet);
        kv_dtype: the KV stores' dtype, the model's by default, or torch.int8 (8-bit rows, qwenrt.cache)."""
        _check_count("capacity", capacity)
        if limit is not None:
            _check_count("limit", limit)
        if kv_dtype not in (None, self.dtype, torch.int8):
            raise QwenrtError(f"kv_dtype must be the model's dtype or torch.int8, got {kv_dtype}")
        state = SequenceState(self.config.text, self.dtype, self.device, capacity, limit, kv_dtype)
        if self.served_adapters is not None:
            state.adapter = self.served_adapters.default
        return state

    def new_cache(self, batch_size: int = 1, capacity: int = 256, kv_dtype: torch.dtype | None = None) -> HybridCache:
        """An empty cache for `batch_size` sequences, continued together by `forward`; `capacity` tokens are allocated
        up front (it grows past them), at most the model's context; kv_dtype as `new_sequence` takes it."""
        _check_count("batch_size", batch_size)
        _check_count("capacity", capacity)
        if capacity > self.config.text.context_limit:
            raise QwenrtError(f"capacity must be at most the model's context of {self.config.text.context_limit}"
                              f" tokens, got {capacity}")
        return HybridCache([self.new_sequence(capacity, kv_dtype=kv_dtype) for _ in range(batch_size)])

    def forward(self, input_ids: torch.Tensor | None = None, cache: HybridCache | None = None, *,
                inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 0, deepstack_embeds: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [B, T] (or inputs_embeds [B, T, D]) -> logits [B, T', V] fp32.

        position_ids: [B, T] or [3, B, T] (M-RoPE axes); by default the text positions after the cache.
        logits_to_keep: 0 = every position, n = the last n only (prefill needs just the last).
        deepstack_embeds: Qwen3-VL's DeepStack features, k tensors like inputs_embeds (multimodal.VisionInputs), the
        i-th added to the hidden states after decoder layer i.
        Bad inputs are one QwenrtError before any work; `hidden_states`, the path the engine and training take with
        ids they have checked, does not look again.
        """
        self._check_inputs(input_ids, cache, inputs_embeds, logits_to_keep, deepstack_embeds)
        h = self.hidden_states(input_ids, cache, inputs_embeds=inputs_embeds, position_ids=position_ids,
                               keep=logits_to_keep, deepstack=deepstack_embeds)
        return self.lm_head(h).float()

    def _check_inputs(self, input_ids, cache, inputs_embeds, logits_to_keep, deepstack=None) -> None:
        if (input_ids is None) == (inputs_embeds is None):
            raise QwenrtError("pass input_ids or inputs_embeds, not both or neither")
        c = self.config.text
        x = _check_ids(input_ids, c.vocab_size) if inputs_embeds is None else _check_embeds(inputs_embeds,
                                                                                            c.hidden_size)
        if deepstack is not None:
            if not isinstance(deepstack, (list, tuple)) or len(deepstack) > c.num_hidden_layers:
                raise QwenrtError(f"deepstack_embeds must be a list of at most {c.num_hidden_layers} tensors")
            for d in deepstack:
                if _check_embeds(d, c.hidden_size).shape != x.shape[:2] + (c.hidden_size,):
                    raise QwenrtError(f"each deepstack_embeds tensor must be [B, T, D] = "
                                      f"{list(x.shape[:2]) + [c.hidden_size]}, got {list(d.shape)}")
        if cache is not None:
            _check_room(cache, x.shape[1])
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise QwenrtError(f"logits_to_keep must be an integer >= 0, got {logits_to_keep!r:.40}")

    def hidden_states(self, input_ids: torch.Tensor | None = None, cache: HybridCache | None = None, *,
                      inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                      keep: int | None = 0, deepstack: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The final-normed hidden states [B, T', D] the LM head reads: keep 0 = every position, n = the last n,
        None = none (the cache still takes the tokens; a prefill chunk that is not the prompt's last). deepstack:
        [B, T, D] each, the i-th added after layer i (to x + its MLP output, the add the next layer would fuse)."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        if cache is not None:
            if cache.batch_size != B:
                raise QwenrtError(f"cache holds {cache.batch_size} sequences but input has batch size {B}")
            cache.reserve(T)
        if position_ids is None:
            position_ids = cache.positions(T, x.device) if cache is not None else torch.arange(T, device=x.device)[
                None].expand(B, T)
        cos, sin = self.rotary(position_ids, x.dtype)
        if self.served_adapters is not None:  # each row's adapter, as its sequence's cache holds it
            self.served_adapters.active = [s.adapter for s in cache.sequences] if cache is not None else None
        delta = None
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            if recompute:
                x, delta = checkpoint(layer, x, delta, cos, sin, cache, use_reentrant=False)
            else:
                x, delta = layer(x, delta, cos, sin, cache)
            if deepstack is not None and i < len(deepstack):
                x, delta = x + delta + deepstack[i].to(x.dtype), None
        if cache is not None:
            cache.advance(T)
        if keep is None:
            return None
        if keep:
            x, delta = x[:, -keep:], None if delta is None else delta[:, -keep:]
        return self.model.norm(x) if delta is None else self.model.norm.add_forward(x, delta)[1]

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables cos, sin [B, T, rotary_dim] in `dtype` for positions [B, T] or [3, B, T] (M-RoPE axes)."""
        c = self.config.text
        cos, sin = rope_cos_sin(position_ids, self.inv_frequencies(position_ids.device), c.mrope_section,
                                c.mrope_interleaved, c.yarn.attention_factor if c.yarn is not None else 1.0)
        return cos.to(dtype), sin.to(dtype)

    def inv_frequencies(self, device: torch.device) -> torch.Tensor:
        """RoPE inverse frequencies [rotary_dim / 2] fp32, computed once per device."""
        cached = getattr(self, "_inv_freq", None)
        if cached is None or cached.device != torch.device(device):
            c = self.config.text
            self._inv_freq = inv_frequencies(c.rotary_dim, c.rope_theta, device=device, yarn=c.yarn)
        return self._inv_freq
