"""Quantized vs full-precision logits on a checkpoint: top-1 agreement, mean KL and cosine over a fixed prompt set.

    python bench/quality.py [CKPT] [--prompts 8 --tokens 64] [--tasks] [--shape 35b-a3b]

The reference is the checkpoint's weights computed in fp32; every other configuration is scored against it on the
same prompts (seeded): the first half of each prefilled, the rest decoded one token at a time, so both paths count
(prefill: dequantize + GEMM; decode: the native matrix-vector kernels), at the positions T/2-1 .. T-1. The prompts
are random tokens, or with --tasks the built-in model's held-out conversations (what it was trained on). Random-weight
checkpoints give flat distributions (small KL whatever happens), so read top-1 and cosine there; on a trained
checkpoint all three mean what they say. Without CKPT: the built-in model.

The "int4 ..." variants quantize the bf16 model in memory with a format per tensor (`VARIANTS`), whatever the stored
format would keep precise; each row also gives the bytes its weights take on disk and the bytes a decoded token
reads (routed experts at top-k / E of theirs, an untied embedding at none), relative to int4 everywhere: for the
checkpoint, and with --shape for that published shape's random model (its sizes only, nothing built).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import qwenrt
from qwenrt.default_model import default_model_path
from qwenrt.loader import load_config
from qwenrt.mlp import Experts
from qwenrt.quant import (QuantEmbedding, QuantLinear, QuantSpec, default_predicate, install, quantize_weight,
                          spec_for, storage_entries)

CONFIGS = {"bf16": ("bfloat16", None), "int8": ("bfloat16", QuantSpec(8)),
           "int4 g32": ("bfloat16", QuantSpec(4, 32)), "int4 g64": ("bfloat16", QuantSpec(4, 64)),
           "int4 g128": ("bfloat16", QuantSpec(4, 128))}
# int4 g64 with these weights (module path suffix) at 8 bits or kept in bf16 (None); "int4 uniform": every projection
# at int4, the tiny model's 4-row in_proj_a/b too (the native kernels take them; the stored format keeps them precise)
AB = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")
VARIANTS = {
    "int4 uniform": {},
    "int4: in_proj_a/b bf16": dict.fromkeys(AB),
    "int4: in_proj_a/b int8": dict.fromkeys(AB, 8),
    "int4: out_proj int8": {"linear_attn.out_proj": 8},
    "int4: in_proj_a/b bf16 & out_proj int8": dict.fromkeys(AB) | {"linear_attn.out_proj": 8},
    "int4: in_proj_a/b int8 & out_proj int8": dict.fromkeys(AB, 8) | {"linear_attn.out_proj": 8},
    "int4: o_proj int8": {"self_attn.o_proj": 8},
    "int4: down_proj int8": {"down_proj": 8},
    "int4: in_proj_qkv int8": {"linear_attn.in_proj_qkv": 8},
    "int4: in_proj_z int8": {"linear_attn.in_proj_z": 8},
    "int4: lm_head int8": {"lm_head": 8},
}
BASE = QuantSpec(4, 64)


def choice(path: str, choices: dict[str, int | None]) -> QuantSpec | None:
    """The format of weight `path` (the longest matching suffix's, as qwenrt's overrides); None: bf16."""
    return spec_for(path, BASE, {s: None if bits is None else QuantSpec.parse(bits) for s, bits in choices.items()})


def projections(model: nn.Module) -> dict[str, dict[str, nn.Parameter]]:
    """The projections int4 quantizes: module path -> {weight path: parameter}."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, Experts):
            out[path] = {f"{path}.gate_up_proj": module.gate_up_proj, f"{path}.down_proj": module.down_proj}
        elif isinstance(module, nn.Linear) and default_predicate(path, module):
            out[path] = {path: module.weight}
    return out


@torch.no_grad()
def quantize_as(model: nn.Module, choices: dict[str, int | None]) -> None:
    """Quantize the bf16 `model` in place, each weight to its `choice`; a tied embedding is then looked up in the
    quantized head, as qwenrt's own int4 does."""
    for path, weights in projections(model).items():
        specs = {p: choice(p, choices) for p in weights}
        if None not in specs.values():
            install(model, path, {p: QuantLinear.from_stored(quantize_weight(w, specs[p], p), specs[p], model.dtype)
                                  for p, w in weights.items()})
    head = model.lm_head
    if isinstance(head, QuantLinear) and model.config.text.tie_word_embeddings:
        model.model.embed_tokens = QuantEmbedding({k: getattr(head, k) for k in head.spec.pieces}, head.spec,
                                                  model.dtype)


def weight_bytes(model: nn.Module, choices: dict[str, int | None]) -> tuple[int, int]:
    """(bytes of the model's weights stored with `choices`, bytes a decoded token reads); non-projections in bf16."""
    text = model.config.text
    active = text.num_experts_per_tok / text.num_experts if text.is_moe else 1.0
    seen, stored, read = set(), 0, 0.0
    for weights in projections(model).values():
        for path, w in weights.items():
            spec = choice(path, choices)
            entries = storage_entries(tuple(w.shape), spec).values() if spec else [(w.shape, torch.bfloat16)]
            size = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in entries)
            seen.add(id(w))
            stored += size
            read += size * (active if w.dim() == 3 else 1)
    for name, p in model.named_parameters():
        if id(p) not in seen:
            stored += 2 * p.numel()
            read += 0 if name == "model.embed_tokens.weight" else 2 * p.numel()
    return stored, int(read)


def bytes_cell(model: nn.Module, choices: dict[str, int | None]) -> str:
    pairs = zip(weight_bytes(model, choices), weight_bytes(model, {}))  # (stored, uniform), (read, uniform)
    return " / ".join(f"{n / 2**20:,.2f} MiB ({n / base - 1:+.2%})" for n, base in pairs)


@torch.inference_mode()
def logits(path, dtype, spec, ids: torch.Tensor, choices: dict | None = None) -> torch.Tensor:
    """[P, T - T/2 + 1, V] fp32: prefill T/2 tokens, then decode the rest teacher-forced."""
    model, _ = qwenrt.load(path, dtype=dtype, quantize=spec)
    if choices is not None:
        quantize_as(model, choices)
    half, out = ids.shape[1] // 2, []
    for row in ids[:, None]:  # [1, T] each
        cache = model.new_cache(1)
        steps = [model(row[:, :half], cache=cache, logits_to_keep=1)]
        steps += [model(row[:, i:i + 1], cache=cache) for i in range(half, ids.shape[1])]
        out.append(torch.cat(steps, 1))
    return torch.cat(out)


def task_prompts(path, prompts: int, tokens: int) -> torch.Tensor:
    """[prompts, tokens]: the last `tokens` tokens (the answers: tool conversations share a long opening) of distinct
    held-out task conversations at least that long."""
    from qwenrt.tiny.tasks import conversations

    _, tokenizer = qwenrt.load(path)
    rows, seed = {}, 0
    while len(rows) < prompts:
        for c in conversations(4 * prompts, seed, heldout=True):
            ids = tokenizer.encode(tokenizer.apply_chat_template(c["messages"], False, tools=c.get("tools")))
            if len(ids) >= tokens and len(rows) < prompts:
                rows[tuple(ids[-tokens:])] = None
        seed += 1
    return torch.tensor(list(rows))


def scores(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    kl = F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    cos = F.cosine_similarity(out, ref, dim=-1)
    return (out.argmax(-1) == ref.argmax(-1)).float().mean().item(), kl.mean().item(), cos.mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", default=str(default_model_path()))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tasks", action="store_true", help="prompts from the built-in model's held-out tasks")
    p.add_argument("--shape", help="also the weight bytes of this published shape (qwenrt.shapes), e.g. 35b-a3b")
    p.add_argument("--configs", default=",".join([*CONFIGS, *VARIANTS]))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vocab = load_config(args.checkpoint).text.vocab_size
    ids = task_prompts(args.checkpoint, args.prompts, args.tokens) if args.tasks else \
        torch.randint(0, vocab, (args.prompts, args.tokens), generator=torch.Generator().manual_seed(0))
    ref = logits(args.checkpoint, "float32", None, ids)
    own, _ = qwenrt.load(args.checkpoint, dtype="bfloat16")
    shape = None
    if args.shape:
        from qwenrt.shapes import meta_model

        shape = meta_model(args.shape)
    print(f"{args.checkpoint}: {args.prompts} x {args.tokens} {'task' if args.tasks else 'random'} tokens, "
          "reference fp32; bytes: on disk / read per decoded token (vs int4 uniform)\n")
    print("| configuration | top-1 agreement | mean KL (nats) | logit cosine | bytes |"
          + (f" bytes, {args.shape} |" if shape else "") + "\n|---|---|---|---|---|" + ("---|" if shape else ""))
    for name in args.configs.split(","):
        print(f"scoring {name}", file=sys.stderr, flush=True)
        config = CONFIGS.get(name) or ("bfloat16", None, VARIANTS[name])
        top1, kl, cos = scores(logits(args.checkpoint, *config[:2], ids, *config[2:]), ref)
        sizes = [bytes_cell(m, VARIANTS[name]) if name in VARIANTS else "" for m in (own, shape) if m is not None]
        print(f"| {name} | {top1:.3f} | {kl:.5f} | {cos:.5f} | " + " | ".join(sizes) + " |", flush=True)


if __name__ == "__main__":
    main()
