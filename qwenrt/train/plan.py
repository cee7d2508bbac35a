"""`qwenrt train --lora-rank R --plan`: the adapters a LoRA run would train, their parameters and an estimate of its
memory, from the checkpoint's headers alone (the model is built on `meta`; nothing is read or trained)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from qwenrt.lora import add_adapters, expert_banks, kind, lora_modules, projections, trainable_count
from qwenrt.train.trainer import LOSS_SLICE, base_dtype, base_quantization

ADAMW_BYTES = 16  # an fp32 trainable parameter: itself, its gradient, AdamW's two moments
# activations autograd keeps per token and layer, in units of the layer's summed projection widths (inputs and
# outputs): the projections' inputs, the DeltaNet / attention intermediates, norms and gates; a rough figure
SAVED_PER_WIDTH = 2
# a DeltaNet layer's backward keeps two fp32 [Hv, Dk, Dv] states per token (the state after each token and its
# gradient): most of the per-token memory (0.8B shape: 2 MiB a token)
DELTANET_STATES = 2
RUNTIME_BYTES = 0.45 * (1 << 30)  # the process before any weight: Python, torch, qwenrt (RSS, measured)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def lora_plan(cfg) -> str:
    """The plan of the LoRA run `cfg` (a TrainConfig) as lines of text."""
    from qwenrt.loader import verify_checkpoint, weight_bytes
    from qwenrt.quant import LoadQuantizer, QuantLinear, QuantSpec

    config, _, _, _, model = verify_checkpoint(cfg.init)
    spec = cfg.lora_spec()
    quantize = base_quantization(cfg)
    dtype = getattr(torch, base_dtype(cfg))
    quantizer = LoadQuantizer(model, QuantSpec.parse(quantize), dtype) if quantize else None
    base_bytes = weight_bytes(model, dtype, quantizer)
    total = sum(p.numel() for p in model.parameters()) + sum(  # and the weights stored quantized
        math.prod(m.qweight.shape[:-1]) * m.in_features for m in model.modules() if isinstance(m, QuantLinear))
    c = config.text
    # a layer's projection widths (inputs + outputs), on average over the layers; a routed expert's per token routed
    width = (sum(m.in_features + m.out_features for m in projections(model).values()) + c.num_experts_per_tok *
             sum(N + K for _, N, K in expert_banks(model).values())) / c.num_hidden_layers
    add_adapters(model, spec)
    adapters = lora_modules(model)
    trainable = trainable_count(model)
    kinds = Counter(kind(path) for path in adapters)
    params = Counter()
    for path, m in adapters.items():
        params[kind(path)] += m.lora_A.numel() + m.lora_B.numel()
    lines = [f"LoRA rank {spec.rank}, alpha {spec.alpha:g} (scaling {spec.scaling:g}), dropout {spec.dropout:g}, on "
             f"{cfg.init} ({cfg.lora_base}, frozen)", "adapters:"]
    lines += [f"  {name:<32} {kinds[name]:>4} x  {params[name]:>12,} parameters" for name in kinds]
    if cfg.task == "classify":  # the head trains whole, beside the adapters
        head = cfg.num_labels * c.hidden_size
        lines.append(f"  {'score (classification head)':<32} {1:>4} x  {head:>12,} parameters")
        trainable += head
    lines.append(f"  {'total':<32} {len(adapters):>4}    {trainable:>12,} trainable parameters "
                 f"({100 * trainable / total:.2f}% of {total:,})")
    tokens = cfg.micro_batch_tokens
    act = dtype.itemsize
    deltanet = DELTANET_STATES * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    if cfg.gradient_checkpointing:  # every layer's input kept; one layer's intermediates at a time
        per_token = 2 * c.num_hidden_layers * c.hidden_size * act + SAVED_PER_WIDTH * width * act + deltanet
        logits = 3 * min(tokens, LOSS_SLICE) * c.vocab_size * 4
    else:
        per_token = SAVED_PER_WIDTH * width * act * c.num_hidden_layers + deltanet * len(c.linear_attention_layers)
        logits = 3 * tokens * c.vocab_size * 4
    activations = per_token * tokens
    states = trainable * ADAMW_BYTES
    estimate = RUNTIME_BYTES + base_bytes + states + activations + logits
    lines.append(f"memory (estimate): base weights {_gib(base_bytes)}, adapters with gradients and AdamW "
                 f"state {_gib(states)}, activations {_gib(activations + logits)} at "
                 f"{tokens} tokens per micro-batch{' with' if cfg.gradient_checkpointing else ' without'} gradient "
                 f"checkpointing, the runtime {_gib(RUNTIME_BYTES)}: about {_gib(estimate)} at its peak")
    return "\n".join(lines)

