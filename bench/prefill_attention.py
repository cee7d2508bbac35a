"""A prefill chunk's attention against a long KV cache, at a 0.8B full-attention layer's shape (H 8, Hkv 2, Dh 256):
the native tiled kernel (kernels.attention_prefill) against torch's SDPA with the [T, S] mask it replaced.

    python bench/prefill_attention.py                      # T 512 at S 4K, 16K, 64K, bf16
    python bench/prefill_attention.py --contexts 262144 --reps 1

Per option: median seconds, GFLOP/s (2 multiply-adds per query-key pair: Q·Kᵀ and P·V, causal rows only), GFLOP
per CPU-second of all threads (what a core achieves while it runs: steadier than wall time on a shared machine) and
the call's peak memory above what the inputs hold (VmHWM reset through /proc/self/clear_refs before each call). Also a
decode row (T = 1): the fused native decode step against the tiled kernel, to show which the decode should take.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qwenrt.kernels import cpu_kernels, kernel_path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def peak_bytes(fn) -> int:
    """Peak RSS during fn() above the RSS before it."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def timed(fn, reps: int) -> tuple[float, float]:
    """Median (wall seconds, CPU seconds of all threads) of a call."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="T, the chunk's rows")
    ap.add_argument("--contexts", default="4096,16384,65536", help="S values: keys the chunk's last row sees")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="the tiled kernel alone (torch's path is slow at 262K)")
    args = ap.parse_args()
    kernels, dtype = cpu_kernels(), getattr(torch, args.dtype)
    H, Hkv, D, T = 8, 2, 256, args.tokens
    print(f"kernels: {kernel_path()}, threads {torch.get_num_threads()}, {args.dtype}, T {T}, H {H}, Hkv {Hkv}, "
          f"Dh {D}")
    print(f"{'S':>7} {'path':<28} {'seconds':>9} {'GFLOP/s':>8} {'GFLOP/CPU-s':>11} {'peak MiB':>9}")
    g = torch.Generator().manual_seed(0)
    for S in (int(s) for s in args.contexts.split(",")):
        keys = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
        values = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
        start = S - T
        flops = 4 * H * D * (T * start + T * (T + 1) // 2)
        q = torch.randn(T, H, D, generator=g).to(dtype)  # [T, H, Dh], as the model's rows lie
        options = {"tiled (native)": lambda: kernels.attention_prefill(q, keys, values, start)}
        if not args.no_torch:
            def sdpa():
                mask = torch.arange(S)[None, :] <= start + torch.arange(T)[:, None]  # [T, S]
                return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                                      enable_gqa=True)
            options["torch SDPA + [T, S] mask"] = sdpa
        for name, fn in options.items():
            with torch.inference_mode():
                peak = peak_bytes(fn)
                sec, cpu = timed(fn, args.reps)
            print(f"{S:>7} {name:<28} {sec:>9.4f} {flops / sec / 1e9:>8.1f} {flops / cpu / 1e9:>11.1f} "
                  f"{peak / 2**20:>9.1f}", flush=True)
        # decode: one new token, the fused step (norms, RoPE, KV write, attention, gate) vs the tiled kernel alone
        qg = torch.randn(1, H, 2 * D, generator=g).to(dtype)
        kv = torch.randn(1, Hkv, D, generator=g).to(dtype)
        w = torch.zeros(D)
        cos, sin = torch.ones(1, 64, dtype=dtype), torch.zeros(1, 64, dtype=dtype)
        length = torch.tensor([S - 1])
        step = {"decode: fused step": lambda: kernels.attention_decode_step(qg, kv, kv, w, w, cos, sin, keys, values,
                                                                          length, 1e-6, True),
                "decode: tiled kernel": lambda: kernels.attention_prefill(q[:1].contiguous(), keys, values, S - 1)}
        for name, fn in step.items():
            with torch.inference_mode():
                sec, cpu = timed(fn, 5 * args.reps)
            print(f"{S:>7} {name:<28} {sec:>9.5f} {4 * H * D * S / sec / 1e9:>8.1f} {4 * H * D * S / cpu / 1e9:>11.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
