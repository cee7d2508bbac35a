"""Quantized vs full-precision logits on a checkpoint: top-1 agreement, mean KL and cosine over a fixed prompt set.

    python bench/quality.py CKPT [--prompts 8 --tokens 64]

The reference is the checkpoint's weights computed in fp32; every other configuration is scored against it on the
same random-token prompts (seeded): the first half of each prefilled, the rest decoded one token at a time, so both
paths count (prefill: dequantize + GEMM; decode: the native matrix-vector kernels), at the positions T/2-1 .. T-1. Random-weight checkpoints give flat distributions
(small KL whatever happens), so read top-1 and cosine there; on a trained checkpoint all three mean what they say.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import qwenrt
from qwenrt.quant import QuantSpec

CONFIGS = {"bf16": ("bfloat16", None), "int8": ("bfloat16", QuantSpec(8)),
           "int4 g32": ("bfloat16", QuantSpec(4, 32)), "int4 g64": ("bfloat16", QuantSpec(4, 64)),
           "int4 g128": ("bfloat16", QuantSpec(4, 128))}


@torch.inference_mode()
def logits(path, dtype, spec, ids: torch.Tensor) -> torch.Tensor:
    """[P, T - T/2 + 1, V] fp32: prefill T/2 tokens, then decode the rest teacher-forced."""
    model, _ = qwenrt.load(path, dtype=dtype, quantize=spec)
    half, out = ids.shape[1] // 2, []
    for row in ids[:, None]:  # [1, T] each
        cache = model.new_cache(1)
        steps = [model(row[:, :half], cache=cache, logits_to_keep=1)]
        steps += [model(row[:, i:i + 1], cache=cache) for i in range(half, ids.shape[1])]
        out.append(torch.cat(steps, 1))
    return torch.cat(out)


def scores(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    kl = F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    cos = F.cosine_similarity(out, ref, dim=-1)
    return (out.argmax(-1) == ref.argmax(-1)).float().mean().item(), kl.mean().item(), cos.mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vocab = qwenrt.loader.load_config(args.checkpoint).text.vocab_size
    ids = torch.randint(0, vocab, (args.prompts, args.tokens), generator=torch.Generator().manual_seed(0))
    ref = logits(args.checkpoint, "float32", None, ids)
    print(f"{args.checkpoint}: {args.prompts} x {args.tokens} random tokens, reference fp32\n")
    print("| configuration | top-1 agreement | mean KL (nats) | logit cosine |\n|---|---|---|---|")
    for name in args.configs.split(","):
        print(f"scoring {name}", file=sys.stderr, flush=True)
        top1, kl, cos = scores(logits(args.checkpoint, *CONFIGS[name], ids), ref)
        print(f"| {name} | {top1:.3f} | {kl:.4f} | {cos:.4f} |", flush=True)


if __name__ == "__main__":
    main()
