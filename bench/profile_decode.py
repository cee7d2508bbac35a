"""Where the milliseconds of one decode step go: the native kernels (timed per call) and torch's ops (profiler), on
the engine's decode path (the native decode plan where there is one, else the modules).

    python bench/profile_decode.py CKPT [--prompt-len 512 --steps 32 --threads 2 --dtype bfloat16]

Prints the wall time per token, each native kernel's calls and time per token, torch ops' self time per token (top
ops), and what is left: Python and dispatch.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import qwenrt
import qwenrt.decode_plan
import qwenrt.deltanet
import qwenrt.model
import qwenrt.ops.linear
import qwenrt.quant
from qwenrt.engine.runner import decode_step
from qwenrt.kernels import cpu_kernels


class TimedKernels:
    """The native kernel module with every function call timed."""

    def __init__(self, kernels):
        self.kernels, self.seconds, self.calls = kernels, collections.Counter(), collections.Counter()

    def __getattr__(self, name):
        function = getattr(self.kernels, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = function(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return out

        return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    timed = TimedKernels(cpu_kernels()) if cpu_kernels() is not None else None
    if timed is not None:
        for module in (qwenrt.model, qwenrt.deltanet, qwenrt.ops.linear, qwenrt.quant, qwenrt.decode_plan):
            if hasattr(module, "cpu_kernels"):
                module.cpu_kernels = lambda: timed
            if hasattr(module, "inference_kernels"):
                module.inference_kernels = lambda *tensors: timed
    model, _ = qwenrt.load(args.checkpoint, dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.text.vocab_size, (1, args.prompt_len), generator=g)
    with torch.inference_mode():
        cache = model.new_cache(1, capacity=args.prompt_len + 2 * args.steps + 1)
        logits = model(ids, cache=cache, logits_to_keep=1)
        token = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(args.steps):  # warm-up
            token = decode_step(model, token, cache)[0].argmax(-1, keepdim=True)
        if timed is not None:
            timed.seconds.clear(), timed.calls.clear()
        wall = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                start = time.perf_counter()
                token = decode_step(model, token, cache)[0].argmax(-1, keepdim=True)
                wall.append(time.perf_counter() - start)
    per_token = sum(wall) / len(wall) * 1e3
    native = timed.seconds if timed is not None else {}
    native_ms = sum(native.values()) * 1e3 / args.steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
    print(f"{args.checkpoint} ({args.dtype}), context {args.prompt_len}: {per_token:.1f} ms per token (mean, "
          f"profiled): native kernels {native_ms:.1f} ms, torch ops {ops_ms:.1f} ms, the rest (Python, dispatch) "
          f"{per_token - native_ms - ops_ms:.1f} ms\n")
    print("| native kernel / torch op | calls / token | ms / token |\n|---|---|---|")
    for name, seconds in sorted(native.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {timed.calls[name] / args.steps:.0f} | {seconds * 1e3 / args.steps:.2f} |")
    for e in events[:args.top]:
        print(f"| {e.key} | {e.count / args.steps:.0f} | {e.self_cpu_time_total / 1e3 / args.steps:.2f} |")


if __name__ == "__main__":
    main()
