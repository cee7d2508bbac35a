"""The decode step (one new token per sequence) as a flat list of native kernel calls with their weights bound once.

It computes what the modules compute on their native paths (tests/test_kernels.py holds the two together) without
the per-module Python work (module calls, attribute lookups, format checks): ~2 ms of a 17-45 ms step on a 0.8B
model. The weight reads are shared by the batch; the token mixers run one native call per sequence on its own state.
Built at the first decode step and rebuilt after any module, parameter or buffer is registered anywhere in the
process (quantization swaps modules in, load_state_dict(assign=True) replaces parameters) or the dtype changes.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch
from torch import nn

from qwenrt.cache import HybridCache, SequenceState
from qwenrt.kernels import cpu_kernels
from qwenrt.ops.linear import MAX_KERNEL_ROWS, Linear, by_row_groups
from qwenrt.ops.rope import rope_cos_sin
from qwenrt.quant import QuantLinear

_generation = [0]  # bumped by every module / parameter / buffer registration
_plans = weakref.WeakKeyDictionary()  # model -> ((generation, dtype), plan or None); not in the model: it pickles


def _registered(*_args) -> None:
    _generation[0] += 1


for _hook in (nn.modules.module.register_module_module_registration_hook,
              nn.modules.module.register_module_parameter_registration_hook,
              nn.modules.module.register_module_buffer_registration_hook):
    _hook(_registered)


def _bind(kernels, modules: list[nn.Module]):
    """The projections' native call, (x [B, K], mode) -> [B, N_i] per module, or None where they have none."""
    first = modules[0]
    if all(type(m) is Linear and m.weight.dtype == torch.bfloat16 for m in modules):
        return _batched(functools.partial(kernels.gemv_bf16, ws=[m.weight for m in modules]))
    if not all(type(m) is QuantLinear and m.spec == first.spec and m.qweight.dim() == 2 for m in modules):
        return None
    pieces = {"qs": [m.qweight for m in modules], "scales": [m.scales for m in modules]}
    if first.spec.bits == 8:
        return _batched(functools.partial(kernels.gemv_q8, **pieces))
    if first.torch_int4:
        return None
    return _batched(functools.partial(kernels.gemv_q4, **pieces, zeros=[m.zeros for m in modules],
                                      G=first.spec.group_size))


def _batched(call):
    """`call` for any batch: the kernels take up to MAX_KERNEL_ROWS rows, a larger batch goes in groups of them."""
    def run(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
        if x.shape[0] <= MAX_KERNEL_ROWS:  # every decode step of up to 8 sequences: the call itself
            return call(x, mode=mode)
        return by_row_groups(functools.partial(call, mode=mode), x)

    return run


class _Layer(NamedTuple):
    index: int
    mixer: nn.Module  # GatedDeltaNet or GatedAttention
    linear: bool  # DeltaNet
    input_norm: torch.Tensor  # fp32 norm weights
    post_norm: torch.Tensor
    project: object  # the mixer's input projections, one call
    out: object  # its output projection
    gate_up: object | None  # the dense MLP (SwiGLU fused), or None: call `mlp` (MoE)
    down: object | None
    mlp: nn.Module


class DecodePlan:
    def __init__(self, model: nn.Module, kernels, layers: list[_Layer], head):
        text, c = model.model, model.config.text
        self.kernels, self.layers, self.head = kernels, layers, head
        self.embed, self.final_norm, self.eps = text.embed_tokens, text.norm.weight, text.norm.eps
        self.inv_freq, self.mrope = model.inv_frequencies(model.device), (c.mrope_section, c.mrope_interleaved)

    @classmethod
    def build(cls, model: nn.Module, kernels) -> DecodePlan | None:
        """The plan for a bf16 model on the CPU, or None where some part has no native decode path."""
        if model.dtype != torch.bfloat16 or model.device.type != "cpu":
            return None
        layers = []
        for layer in model.model.layers:
            if layer.is_linear:
                m = layer.linear_attn
                project = _bind(kernels, [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a])
                out = _bind(kernels, [m.out_proj])
            else:
                m = layer.self_attn
                project, out = _bind(kernels, [m.q_proj, m.k_proj, m.v_proj]), _bind(kernels, [m.o_proj])
            dense = hasattr(layer.mlp, "gate_proj")
            gate_up = _bind(kernels, [layer.mlp.gate_proj, layer.mlp.up_proj]) if dense else None
            down = _bind(kernels, [layer.mlp.down_proj]) if dense else None
            if project is None or out is None or (dense and (gate_up is None or down is None)):
                return None
            layers.append(_Layer(layer.layer_idx, m, layer.is_linear, layer.input_layernorm.weight,
                                 layer.post_attention_layernorm.weight, project, out, gate_up, down, layer.mlp))
        head = _bind(kernels, [model.lm_head])
        return None if head is None else cls(model, kernels, layers, head)

    @classmethod
    def for_model(cls, model: nn.Module) -> DecodePlan | None:
        """The model's plan, built at its first decode step and kept until a registration or a dtype change; None
        without the native kernels or where some part of the model has no native decode path."""
        kernels = cpu_kernels()
        if kernels is None:
            return None
        key = (_generation[0], model.dtype)
        cached = _plans.get(model)
        if cached is None or cached[0] != key:
            cached = _plans[model] = (key, cls.build(model, kernels))
        return cached[1]

    def __call__(self, input_ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """input_ids [B, 1] continuing the B sequences of `cache` -> logits [B, 1, V] fp32; the cache advances."""
        cache.reserve(1)
        h = self.hidden(input_ids.reshape(-1), cache.sequences, [1] * cache.batch_size)
        cache.advance(1)
        return self.logits(h)[:, None]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states h [N, D] -> logits [N, V] fp32."""
        return self.head(h, mode="bf16")[0].float()

    def hidden(self, input_ids: torch.Tensor, sequences: list[SequenceState], counts: list[int],
               saved: list[list] | None = None) -> torch.Tensor:
        """input_ids [N]: counts[b] tokens continuing sequences[b], in sequence order (N = sum(counts)) -> the
        final-normed hidden states [N, D] bf16. Every weight is read once for all N rows; token t of a sequence sees
        its tokens before it. The caller has reserved room and moves `length` on afterwards.

        saved: a list per sequence; it receives, after each of that sequence's tokens but the last, the DeltaNet
        state of every layer as {layer: (conv, recurrent)} copies (speculative verification commits one of them).
        """
        k, eps = self.kernels, self.eps
        rows = [(b, s, t) for b, (s, n) in enumerate(zip(sequences, counts)) for t in range(n)]  # one per token
        starts = torch.tensor([s.length + s.rope_delta + t for _, s, t in rows], device=input_ids.device)
        cos, sin = rope_cos_sin(starts[:, None], self.inv_freq, *self.mrope)
        cos, sin = cos[:, 0].to(torch.bfloat16), sin[:, 0].to(torch.bfloat16)  # [N, R]
        lengths = [torch.tensor([s.length + t]) if t else s.length_tensor() for _, s, t in rows]
        if saved is not None:
            for b, n in enumerate(counts):
                saved[b].extend({} for _ in range(n - 1))
        x = self.embed(input_ids)  # [N, D] (an nn.Embedding or a quantized lookup)
        delta = None  # the previous layer's MLP output, added in the next norm
        for layer in self.layers:
            x, h = k.rms_norm(x, delta, layer.input_norm, eps)
            i = layer.index
            if layer.linear:
                mixed, z, b, a = layer.project(h, mode="bf16")
                out = []
                for r, (seq, s, t) in enumerate(rows):
                    out.append(layer.mixer.native_step(k, mixed[r:r + 1], z[r:r + 1], b[r:r + 1], a[r:r + 1],
                                                       s.conv[i], s.recurrent[i]))
                    if saved is not None and t < counts[seq] - 1:
                        saved[seq][t][i] = (s.conv[i].clone(), s.recurrent[i].clone())
                o = out[0] if len(out) == 1 else torch.cat(out)
            else:
                o = layer.mixer.native_step(k, *layer.project(h, mode="bf16"), cos, sin,
                                            [s for _, s, _ in rows], lengths)
            x, h = k.rms_norm(x, layer.out(o, mode="bf16")[0], layer.post_norm, eps)
            if layer.gate_up is not None:
                delta = layer.down(layer.gate_up(h, mode="swiglu")[0], mode="bf16")[0]
            else:
                delta = layer.mlp(h[:, None])[:, 0]
        return k.rms_norm(x, delta, self.final_norm, eps)[1]

