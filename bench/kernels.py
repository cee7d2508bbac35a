"""Matrix-product options at the Qwen3.5-0.8B shapes: every linear map of one forward step, distinct weights.

    python bench/kernels.py --m 1      # decode: all 186 layer matrices (~1 GB in bf16: DRAM, not cache) + head
    python bench/kernels.py --m 512    # prefill chunk: the same matrices at M = 512 rows

Options run interleaved, `--reps` times; medians. M = 1 reports GB/s of the weight format, M = 512 GFLOP/s.
The torch.compile'd variants are a reduction over K of (weight · x) with the dequantization fused in.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from qwenrt.ops.linear import linear as qwenrt_linear
from qwenrt.quant import QuantLinear, QuantSpec, _int4_kernel_layout, quantize_weight

GDN = [(6144, 1024), (2048, 1024), (16, 1024), (16, 1024), (1024, 2048)]  # in_proj_qkv, z, b, a, out_proj
ATTN = [(4096, 1024), (512, 1024), (512, 1024), (1024, 2048)]  # q (with gate), k, v, o
MLP = [(3584, 1024), (3584, 1024), (1024, 3584)]
LAYERS = GDN * 18 + ATTN * 6 + MLP * 24
HEAD = (248320, 1024)


def reduce_bf16(x, w):  # x [1, K], w [N, K]
    return (w.float() * x.float()).sum(-1)


def reduce_int8(x, q, s):
    return (q.float() * x.float()).sum(-1) * s.float()


def reduce_int4(x, q, s, z):  # stored layout: q [N, K/2] bytes, two columns G/2 apart per byte
    N, groups = s.shape
    p = q.reshape(N, groups, -1)
    codes = torch.cat([p & 15, p >> 4], -1).float() - 8  # [N, K/G, G]
    xg = x.float().reshape(groups, -1)
    return ((codes * xg).sum(-1) * s.float() + z.float() * xg.sum(-1)).sum(-1)


def _torch_int4(stored: dict, group_size: int) -> dict:
    """Stored int4 pieces -> torch's packed layout and scale-and-zero tensor."""
    sz = torch.stack([stored["scales"], stored["zeros"]], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
    return {"packed": _int4_kernel_layout(stored["qweight"], group_size), "sz": sz}


def options(m: int, group_sizes: list[int], compiled: bool):
    """name -> (prepare(weight) -> state, run(x, state), bytes(state))."""
    bf16_bytes = lambda w: w.numel() * 2  # noqa: E731
    quant_bytes = lambda q: sum(b.numel() * b.element_size() for b in q.buffers())  # noqa: E731
    stored_bytes = lambda st: sum(t.numel() * t.element_size() for t in st.values())  # noqa: E731
    out = {"bf16 F.linear": (lambda w: w, lambda x, w: F.linear(x, w), bf16_bytes),
           "bf16 qwenrt linear (native GEMV at M<=4)": (lambda w: w, qwenrt_linear, bf16_bytes)}
    specs = [QuantSpec(8)] + [QuantSpec(4, g) for g in group_sizes]
    for spec in specs:
        out[f"{spec} QuantLinear"] = (
            lambda w, spec=spec: QuantLinear.from_stored(quantize_weight(w, spec), spec, w.dtype),
            lambda x, q: q(x), quant_bytes)
    # torch's own packed kernels, the alternatives QuantLinear measured against
    out["int8 torch _weight_int8pack_mm"] = (
        lambda w: quantize_weight(w, QuantSpec(8)),
        lambda x, st: torch.ops.aten._weight_int8pack_mm(x, st["qweight"], st["scales"].to(x.dtype)), stored_bytes)
    g = group_sizes[0]
    out[f"int4 g{g} torch _weight_int4pack_mm_for_cpu"] = (
        lambda w: _torch_int4(quantize_weight(w, QuantSpec(4, g)), g),
        lambda x, st: torch.ops.aten._weight_int4pack_mm_for_cpu(x, st["packed"], g, st["sz"]),
        lambda st: st["packed"].numel() + st["sz"].numel() * st["sz"].element_size())
    if m > 1:
        out["int8 dequantize + F.linear"] = (
            lambda w: quantize_weight(w, QuantSpec(8)),
            lambda x, st: F.linear(x, st["qweight"].to(x.dtype) * st["scales"][:, None]),
            lambda st: st["qweight"].numel() + st["scales"].numel() * 2)
    if compiled and m == 1:
        c_bf16, c_int8, c_int4 = (torch.compile(f, dynamic=False) for f in (reduce_bf16, reduce_int8, reduce_int4))
        out["bf16 compiled reduce"] = (lambda w: w, c_bf16, bf16_bytes)
        out["int8 compiled reduce"] = (lambda w: quantize_weight(w, QuantSpec(8)),
                                       lambda x, st: c_int8(x, st["qweight"], st["scales"]),
                                       lambda st: st["qweight"].numel() + st["scales"].numel() * 2)
        g = group_sizes[0]
        out[f"int4 g{g} compiled reduce"] = (lambda w: quantize_weight(w, QuantSpec(4, g)),
                                             lambda x, st: c_int4(x, st["qweight"], st["scales"], st["zeros"]),
                                             lambda st: st["qweight"].numel() + st["scales"].numel() * 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=1, help="activation rows (1 = decode, 512 = a prefill chunk)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--group-sizes", default="32,64,128")
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # one compiled kernel per distinct shape
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for s in LAYERS]
    with_head = args.m == 1  # prefill computes logits for the last position only
    if with_head:
        weights.append((torch.randn(*HEAD, generator=g) * 0.02).to(torch.bfloat16))
    xs = {k: torch.randn(args.m, k, generator=g).to(torch.bfloat16) for k in (1024, 2048, 3584)}
    runs, times = {}, {}
    for name, (prepare, run, nbytes) in options(args.m, [int(s) for s in args.group_sizes.split(",")],
                                                 not args.no_compile).items():
        start = time.perf_counter()
        states = [prepare(w) for w in weights]
        with torch.inference_mode():
            for w, st in zip(weights, states):
                run(xs[w.shape[1]], st)  # warm-up (and compile)
        print(f"{name}: prepared and warmed up in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        runs[name] = (run, states, sum(nbytes(st) for st in states[:len(LAYERS)]),
                      nbytes(states[-1]) if with_head else 0)
        times[name] = ([], [])
    with torch.inference_mode():
        for _ in range(args.reps):
            for name, (run, states, _, _) in runs.items():
                t0 = time.perf_counter()
                for w, st in zip(weights[:len(LAYERS)], states):
                    run(xs[w.shape[1]], st)
                t1 = time.perf_counter()
                if with_head:
                    run(xs[1024], states[-1])
                times[name][0].append(t1 - t0)
                times[name][1].append(time.perf_counter() - t1)
    flops = sum(2 * args.m * n * k for n, k in LAYERS)
    print(f"M = {args.m}, {args.threads} threads, median of {args.reps} interleaved runs\n")
    if with_head:
        print(f"| option | {len(LAYERS)} layer matrices | head 248320×1024 | step |\n|---|---|---|---|")
    else:
        print(f"| option | {len(LAYERS)} layer matrices | GFLOP/s |\n|---|---|---|")
    for name, (_, _, layer_bytes, head_bytes) in runs.items():
        layers, head = statistics.median(times[name][0]), statistics.median(times[name][1])
        if with_head:
            print(f"| {name} | {layers * 1e3:.1f} ms ({layer_bytes / layers / 1e9:.1f} GB/s) | "
                  f"{head * 1e3:.1f} ms ({head_bytes / head / 1e9:.1f} GB/s) | {(layers + head) * 1e3:.1f} ms |")
        else:
            print(f"| {name} | {layers * 1e3:.0f} ms | {flops / layers / 1e9:.0f} |")


if __name__ == "__main__":
    main()
