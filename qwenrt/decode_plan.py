"""The decode step (one new token per sequence) as native kernel calls with their weights bound once.

It computes what the modules compute on their native paths (tests/test_kernels.py holds the two together) without
the per-module Python work. The layers run as one native call per step (`kernels.LayerStack`, the layer loop in
C++): on a small model the Python around ~8 kernel calls per layer cost more than their arithmetic, and on a 0.8B
model it was ~3.5 ms of a 28-72 ms step. An MoE block is one native object in it (`kernels.MoE`: router, the used
experts, the shared expert). The weight reads are shared by the batch; the token mixers run one native call per
sequence on its own state. Served LoRA adapters (qwenrt.served_adapters) are bound into the projections: each
row adds its sequence's adapter product. The MTP head's draft step has a plan of its own (MTPPlan, held to its modules by
tests/test_mtp.py), and a greedy speculative cycle binds both into one native call (CyclePlan). Built at the first
step and kept as qwenrt.native keeps bound objects (rebuilt after a module swap or a dtype change).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from qwenrt.cache import HybridCache, SequenceState
from qwenrt.moe import native_block
from qwenrt.native import bind, cached
from qwenrt.ops.rope import rope_cos_sin
from qwenrt.quant import QuantEmbedding

NO_ROWS = torch.empty(0)  # a cycle's pending rows where no sequence has any (never written)


def _bind_lookup(kernels, embed: nn.Module):
    """The token lookup as a one-weight `kernels.Projection` whose rows are read (Projection.rows): a bf16 table, or
    the quantized head of a tied model (`QuantEmbedding`); None otherwise."""
    if type(embed) is nn.Embedding and embed.weight.dtype == torch.bfloat16:
        return kernels.Projection("bf16", [embed.weight], [], [], 0)
    if type(embed) is not QuantEmbedding or embed.dtype != torch.bfloat16:
        return None
    t, spec = embed.stored, embed.spec
    zeros = [t["zeros"]] if "zeros" in t else []
    return kernels.Projection(spec.kernel_format, [t["qweight"]], [t["scales"]], zeros, spec.group_size or 0)


class _Layer(NamedTuple):
    index: int
    mixer: nn.Module  # GatedDeltaNet or GatedAttention
    linear: bool  # DeltaNet
    input_norm: torch.Tensor  # fp32 norm weights
    post_norm: torch.Tensor
    project: object  # the mixer's input projections, one call
    out: object  # its output projection
    mlp: object  # a dense MLP's (gate_up (SwiGLU fused), down), or a kernels.MoE


def _bind_mlp(kernels, mlp: nn.Module):
    """A layer's MLP as _Layer.mlp holds it, or None where some part has no native format."""
    if not hasattr(mlp, "gate_proj"):
        return native_block(mlp)
    gate_up = bind(kernels, [mlp.gate_proj, mlp.up_proj], one_format=True, adapters=True)
    down = bind(kernels, [mlp.down_proj], adapters=True)
    return None if gate_up is None or down is None else (gate_up, down)


def _bind_layer(kernels, layer: nn.Module) -> _Layer | None:
    """A decoder layer's native calls, or None where some projection has none."""
    if layer.is_linear:
        m = layer.linear_attn
        project = bind(kernels, [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a], adapters=True)
        out = bind(kernels, [m.out_proj], adapters=True)
    else:
        m = layer.self_attn
        project = bind(kernels, [m.q_proj, m.k_proj, m.v_proj], adapters=True)
        out = bind(kernels, [m.o_proj], adapters=True)
    mlp = _bind_mlp(kernels, layer.mlp)
    if project is None or out is None or mlp is None:
        return None
    return _Layer(layer.layer_idx, m, layer.is_linear, layer.input_layernorm.weight.float(),
                  layer.post_attention_layernorm.weight.float(), project, out, mlp)


class RopeTable:
    """cos, sin [P, R] bf16: the rotary rows of text positions 0..P-1 (every M-RoPE axis at the same position), each
    what `model.rotary` gives for that position (YaRN's scaling included); grown by doubling as positions need. A step
    slices its rows instead of computing them (the torch ops took ~60 us a step on qwenrt-tiny). It holds the
    model's frequencies, not the model (plans are kept in a weak map keyed by it)."""

    def __init__(self, model: nn.Module):
        c = model.config.text
        self.inv_freq = model.inv_frequencies(model.device)
        self.mrope = (c.mrope_section, c.mrope_interleaved, c.yarn.attention_factor if c.yarn is not None else 1.0)
        self.cos = self.sin = torch.empty(0, c.rotary_dim, dtype=torch.bfloat16, device=model.device)

    def upto(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables, with rows for every position below `end`."""
        size = self.cos.shape[0]
        if end > size:
            size = max(size, 256)
            while size < end:
                size *= 2
            positions = torch.arange(size, device=self.inv_freq.device)[:, None]  # [P, 1]
            cos, sin = rope_cos_sin(positions, self.inv_freq, *self.mrope)
            self.cos, self.sin = cos[:, 0].to(torch.bfloat16), sin[:, 0].to(torch.bfloat16)
        return self.cos, self.sin

    def rows(self, firsts: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, R]: counts[b] successive positions from firsts[b], in order."""
        cos, sin = self.upto(max(f + n for f, n in zip(firsts, counts)))
        if len(firsts) == 1:
            return cos[firsts[0]:firsts[0] + counts[0]], sin[firsts[0]:firsts[0] + counts[0]]
        return (torch.cat([cos[f:f + n] for f, n in zip(firsts, counts)]),
                torch.cat([sin[f:f + n] for f, n in zip(firsts, counts)]))


class _Rows(NamedTuple):
    """Where N rows go: counts[b] successive tokens of sequences[b], in sequence order."""

    sequences: list[SequenceState]
    counts: list[int]
    cos: torch.Tensor  # [N, R] bf16 rotary tables at each row's position
    sin: torch.Tensor
    lengths: list[torch.Tensor]  # per sequence, the cache slots its rows write (int64 [counts[b]])


def _rows(sequences: list[SequenceState], counts: list[int], rope: RopeTable, device,
          firsts: list[int] | None = None) -> _Rows:
    """firsts[b]: the position of sequence b's first row (default its length + rope_delta)."""
    if firsts is None:
        firsts = [s.length + s.rope_delta for s in sequences]
    cos, sin = rope.rows(firsts, counts)
    lengths = [s.length_tensor() if n == 1 else torch.arange(s.length, s.length + n, device=device)
               for s, n in zip(sequences, counts)]
    return _Rows(sequences, counts, cos, sin, lengths)


def _stack(kernels, layers: list[_Layer], eps: float):
    """The layers as one native call per step (`kernels.LayerStack`: no Python between the kernels)."""
    stack = kernels.LayerStack(eps)
    for layer in layers:
        m = layer.mixer
        common = (layer.index, layer.input_norm, layer.post_norm, layer.project, layer.out)
        if layer.linear:
            stack.add_deltanet(*common, *m.fp32_parameters(), m.num_k_heads, m.num_v_heads, m.head_v_dim,
                               m.norm.eps)
        else:
            stack.add_attention(*common, m.q_norm.weight.float(), m.k_norm.weight.float(), m.num_heads, m.head_dim,
                                m.q_norm.eps, m.gated)
        if isinstance(layer.mlp, tuple):
            stack.add_mlp(*layer.mlp)
        else:
            stack.add_moe(layer.mlp)
    return stack


def _forward(stack, layers: list[_Layer], x: torch.Tensor, where: _Rows, final_norm: torch.Tensor,
             saved: list[list] | None = None) -> torch.Tensor:
    """x [N, D] through `layers` and the final norm -> [N, D] bf16, one native call. saved: as in
    DecodePlan.hidden."""
    seqs = where.sequences
    h, kept = stack.run(x, final_norm, where.cos, where.sin, where.counts, [s.conv for s in seqs],
                        [s.recurrent for s in seqs], [s.keys for s in seqs], [s.values for s in seqs], where.lengths,
                        [s.adapter for s in seqs])
    if saved is not None:  # kept[b]: conv [n-1, ...], recurrent [n-1, ...] per DeltaNet layer in order
        slots = [layer.index for layer in layers if layer.linear]
        for b, states in enumerate(kept):
            for j, i in enumerate(slots if states else ()):
                conv, recurrent = states[2 * j], states[2 * j + 1]
                for t in range(conv.shape[0]):
                    saved[b][t][i] = (conv[t:t + 1], recurrent[t:t + 1])
    return h


class DecodePlan:
    def __init__(self, model: nn.Module, kernels, layers: list[_Layer], head):
        text = model.model
        self.kernels, self.layers, self.head = kernels, layers, head
        self.embed, self.final_norm, self.eps = text.embed_tokens, text.norm.weight.float(), text.norm.eps
        self.stack = _stack(kernels, layers, self.eps)
        self.rope = RopeTable(model)

    @classmethod
    def build(cls, model: nn.Module, kernels) -> DecodePlan | None:
        """The plan for a bf16 model on the CPU, or None where some part has no native decode path."""
        if model.dtype != torch.bfloat16 or model.device.type != "cpu":
            return None
        layers = [_bind_layer(kernels, layer) for layer in model.model.layers]
        head = bind(kernels, [model.lm_head])
        return None if head is None or None in layers else cls(model, kernels, layers, head)

    @classmethod
    def for_model(cls, model: nn.Module) -> DecodePlan | None:
        """The model's plan, built at its first decode step and kept until a registration or a dtype change; None
        without the native kernels or where some part of the model has no native decode path."""
        return cached(model, "decode", model.dtype, lambda kernels: cls.build(model, kernels))

    def __call__(self, input_ids: torch.Tensor, cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, 1] continuing the B sequences of `cache` -> (logits [B, V] fp32, the final-normed hidden
        states [B, D] bf16); the cache advances."""
        cache.reserve(1)
        h = self.hidden(input_ids.reshape(-1), cache.sequences, [1] * cache.batch_size)
        cache.advance(1)
        return self.logits(h), h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states h [N, D] -> logits [N, V] fp32."""
        return self.head(h, mode="bf16_fp32")[0]

    def hidden(self, input_ids: torch.Tensor, sequences: list[SequenceState], counts: list[int],
               saved: list[list] | None = None) -> torch.Tensor:
        """input_ids [N]: counts[b] tokens continuing sequences[b], in sequence order (N = sum(counts)) -> the
        final-normed hidden states [N, D] bf16. Every weight is read once for all N rows; token t of a sequence sees
        its tokens before it. The caller has reserved room and moves `length` on afterwards.

        saved: a list per sequence; it receives, after each of that sequence's tokens but the last, the DeltaNet
        state of every layer as {layer: (conv, recurrent)} copies (speculative verification commits one of them).
        """
        where = _rows(sequences, counts, self.rope, input_ids.device)
        if saved is not None:
            for b, n in enumerate(counts):
                saved[b].extend({} for _ in range(n - 1))
        x = self.embed(input_ids)  # [N, D] (an nn.Embedding or a quantized lookup)
        return _forward(self.stack, self.layers, x, where, self.final_norm, saved)


class MTPPlan:
    """The MTP head's step (mtp.py: fc over the normed embedding and hidden state, one attention layer, a norm)
    and its draft logits over the first `draft_vocab` ids as native kernel calls, like DecodePlan: ~10 calls per
    draft instead of the modules' Python work, which costs more than the step's arithmetic on a small model."""

    def __init__(self, model: nn.Module, kernels, fc, layer: _Layer, head):
        mtp = model.mtp
        self.kernels, self.fc, self.layers, self.head = kernels, fc, [layer], head
        self.embed, self.eps = model.model.embed_tokens, mtp.norm.eps
        self.stack = _stack(kernels, self.layers, self.eps)
        # fp32 norm weights (the kernels' form): the head's may be stored in the model's dtype
        self.norm_embed = mtp.pre_fc_norm_embedding.weight.float()
        self.norm_hidden = mtp.pre_fc_norm_hidden.weight.float()
        self.final_norm = mtp.norm.weight.float()
        self.rope = RopeTable(model)

    @classmethod
    def for_model(cls, model: nn.Module, draft_vocab: int) -> MTPPlan | None:
        """The plan of `model.mtp` with draft logits over the first draft_vocab ids; None without an MTP head, the
        native kernels, or a native path for some part (the modules run then)."""
        from qwenrt.mtp import draft_head

        def build(kernels):
            mtp = getattr(model, "mtp", None)
            if mtp is None or model.dtype != torch.bfloat16 or model.device.type != "cpu":
                return None
            fc, layer = bind(kernels, [mtp.fc]), _bind_layer(kernels, mtp.layers[0])
            head = bind(kernels, [draft_head(model.lm_head, draft_vocab)])
            return None if None in (fc, layer, head) else cls(model, kernels, fc, layer, head)

        return cached(model, ("mtp", draft_vocab), model.dtype, build)

    def hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, sequences: list[SequenceState],
               counts: list[int], firsts: list[int]) -> torch.Tensor:
        """hidden [N, D] (the model's final-normed h_t) and next_ids [N] (token t+1), counts[b] rows continuing the
        head's cache sequences[b] from position firsts[b] -> the head's normed output [N, D]. The caller reserves
        room and moves `length` on, as for DecodePlan.hidden."""
        k = self.kernels
        where = _rows(sequences, counts, self.rope, hidden.device, firsts)
        e = k.rms_norm(self.embed(next_ids), None, self.norm_embed, self.eps)[1]
        h = k.rms_norm(hidden, None, self.norm_hidden, self.eps)[1]
        z = self.fc(torch.cat([e, h], dim=-1), mode="bf16")[0]
        return _forward(self.stack, self.layers, z, where, self.final_norm)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's outputs h [R, D] -> logits [R, draft_vocab] bf16 (an argmax needs no more)."""
        return self.head(h, mode="bf16")[0]


class CyclePlan:
    """A greedy speculative cycle as one native call (`kernels.GreedyCycle`): the decode plan's layers and head and
    the MTP plan's, bound together. It does what verify, the greedy picks, commit and the MTP draft do one call each
    (engine/runner.py), and gives the same tokens, states and drafts; a cycle through those calls cost twice a plain
    step on qwenrt-tiny, far more than its arithmetic. Models with an MTP head whose tokens are looked up in a bf16
    table or a tied quantized head."""

    def __init__(self, native, rope: RopeTable):
        self.native, self.rope = native, rope

    @classmethod
    def for_model(cls, model: nn.Module, draft_vocab: int) -> CyclePlan | None:
        def build(kernels):
            decode, draft = DecodePlan.for_model(model), MTPPlan.for_model(model, draft_vocab)
            lookup = _bind_lookup(kernels, model.model.embed_tokens)
            if decode is None or draft is None or lookup is None:
                return None
            return cls(kernels.GreedyCycle(decode.stack, decode.final_norm, decode.head, lookup,
                                           draft.norm_embed, draft.norm_hidden, draft.fc, draft.stack,
                                           draft.final_norm, draft.head, draft.eps), decode.rope)

        return cached(model, ("cycle", draft_vocab), model.dtype, build)

    def __call__(self, inputs: list[list[int]], sequences: list[SequenceState], ks: list[int],
                 pending: list[tuple[torch.Tensor, list[int]]], heads: list[SequenceState], head_lengths: list[int]):
        """inputs[b]: sequence b's last token and its drafts; ks[b] drafts to make for its next cycle; pending[b]:
        (hidden states [c, D] of the c inputs before, their next tokens) for its MTP head to read first (c = 0 where
        ks[b] = 0); heads[b] the head's cache, written from slot head_lengths[b]. The caller reserves room and moves
        the lengths on. Returns (logits [N, V] fp32, picks [N] int64, hidden [N, D], accepted per sequence, drafts
        per sequence, saved DeltaNet states per sequence: [conv [n-1, ...], recurrent [n-1, ...]] per DeltaNet
        layer)."""
        counts = [len(row) for row in inputs]
        positions = [s.length + s.rope_delta for s in sequences]
        cos, sin = self.rope.upto(max(p + n + max(k - 1, 0) for p, n, k in zip(positions, counts, ks)))
        ids = [t for row in inputs for t in row]  # [N], made a tensor natively (torch.tensor: ~9 us a cycle)
        waiting = [h for h, _ in pending if len(h)]
        rows = torch.cat(waiting) if waiting else NO_ROWS  # [C, D]
        following = [t for _, nxt in pending for t in nxt]
        return self.native.run(ids, counts, positions, ks, cos, sin, [s.conv for s in sequences],
                               [s.recurrent for s in sequences], [s.keys for s in sequences],
                               [s.values for s in sequences], [s.length for s in sequences], rows, following,
                               [len(nxt) for _, nxt in pending], [h.keys[0] for h in heads],
                               [h.values[0] for h in heads], head_lengths, [s.adapter for s in sequences])
