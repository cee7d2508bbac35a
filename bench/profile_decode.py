"""Where the milliseconds of one decode step go: the step as the engine runs it, then the same steps with the layers
called one kernel at a time (each projection, native kernel and torch op timed).

    python bench/profile_decode.py CKPT [--prompt-len 512 --steps 32 --threads 2 --dtype bfloat16]

The engine's decode path runs the layers as one native call per step (`LayerStack`), which hides its kernels from
a profiler; the second pass runs them from a Python loop here that calls the same kernels in the same order
(bit-identical results) and times each: every projection call by role (with the weight bytes it reads, as GB/s;
an MoE block as one call, reading its router, shared expert and top-k experts), the other native kernels, torch
ops' self time (profiler), and what is left: Python and dispatch.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import qwenrt
import qwenrt.decode_plan
import qwenrt.native
from qwenrt.decode_plan import DecodePlan
from qwenrt.engine.runner import decode_step
from qwenrt.kernels import cpu_kernels

seconds, calls = collections.Counter(), collections.Counter()
weight_bytes: dict[str, int] = {}  # per projection role: the bytes one call reads


def timed(name: str, function):
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = function(*args, **kwargs)
        seconds[name] += time.perf_counter() - start
        calls[name] += 1
        return out

    return call


class TimedKernels:
    """The native kernel module with every function call timed (the classes it binds are passed through)."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, name):
        function = getattr(self.kernels, name)
        return function if isinstance(function, type) else timed(name, function)


def nbytes(*modules: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])


def moe_bytes(block: nn.Module) -> int:
    """The weight bytes an MoE block reads for one token: router, shared expert and top-k of its experts."""
    experts = block.experts
    return (nbytes(block.gate, block.shared_expert_gate, block.shared_expert)
            + nbytes(experts) * block.top_k // block.gate.weight.shape[0])


def time_projections(plan: DecodePlan, model: nn.Module) -> None:
    """Wraps each of the plan's projection calls, named by role, and notes the weight bytes a call reads."""
    layers = []
    for layer, module in zip(plan.layers, model.model.layers):
        m, kind = layer.mixer, "DeltaNet" if layer.linear else "attention"
        inputs = ([m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a] if layer.linear
                  else [m.q_proj, m.k_proj, m.v_proj])
        roles = {"project": (f"{kind} in-projections", nbytes(*inputs)),
                 "out": (f"{kind} out-projection", nbytes(m.out_proj if layer.linear else m.o_proj))}
        mlp = module.mlp
        if isinstance(layer.mlp, tuple):
            gate_up, down = layer.mlp
            weight_bytes["MLP gate and up (SwiGLU)"] = nbytes(mlp.gate_proj, mlp.up_proj)
            weight_bytes["MLP down"] = nbytes(mlp.down_proj)
            timed_mlp = (timed("MLP gate and up (SwiGLU)", gate_up), timed("MLP down", down))
        else:
            weight_bytes["MoE block"] = moe_bytes(mlp)
            timed_mlp = timed("MoE block", layer.mlp)
        for name, size in roles.values():
            weight_bytes[name] = size
        layers.append(layer._replace(mlp=timed_mlp,
                                     **{attr: timed(name, getattr(layer, attr)) for attr, (name, _) in roles.items()}))
    plan.layers = layers
    plan.head = timed("LM head", plan.head)
    weight_bytes["LM head"] = nbytes(model.lm_head)


def python_forward(k, eps: float):
    """decode_plan._forward as a Python loop over the plan's layers, a call per kernel (decode: one row per
    sequence)."""

    def forward(stack, layers, x, where, final_norm, saved=None):
        delta = None
        for layer in layers:
            x, h = k.rms_norm(x, delta, layer.input_norm, eps)
            i = layer.index
            if layer.linear:
                mixed, z, b, a = layer.project(h, mode="bf16")
                o = torch.cat([layer.mixer.native_step(k, mixed[r:r + 1], z[r:r + 1], b[r:r + 1], a[r:r + 1],
                                                       s.conv[i], s.recurrent[i])
                               for r, s in enumerate(where.sequences)])
            else:
                o = layer.mixer.native_step(k, *layer.project(h, mode="bf16"), where.cos, where.sin,
                                            where.sequences, where.lengths, where.counts)
            x, h = k.rms_norm(x, layer.out(o, mode="bf16")[0], layer.post_norm, eps)
            if isinstance(layer.mlp, tuple):
                gate_up, down = layer.mlp
                delta = down(gate_up(h, mode="swiglu")[0], mode="bf16")[0]
            else:
                delta = layer.mlp(h)
        return k.rms_norm(x, delta, final_norm, eps)[1]

    return forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is not None:
        qwenrt.native.cpu_kernels = lambda: TimedKernels(kernels)  # the plan's calls, not prefill's
    model, _ = qwenrt.load(args.checkpoint, dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.text.vocab_size, (1, args.prompt_len), generator=g)

    def steps(token, cache) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        for _ in range(args.steps):
            token = decode_step(model, token, cache)[0].argmax(-1, keepdim=True)
        return token, (time.perf_counter() - start) / args.steps * 1e3

    with torch.inference_mode():
        cache = model.new_cache(1, capacity=args.prompt_len + 3 * args.steps + 1)
        token = model(ids, cache=cache, logits_to_keep=1)[:, -1].argmax(-1, keepdim=True)
        token, _ = steps(token, cache)  # warm-up: first-call costs, the plan built
        token, engine_ms = steps(token, cache)
        plan = DecodePlan.for_model(model)
        path = "modules" if plan is None else "native layer stack"
        if plan is not None:  # from here on the Python loop: the same kernels, one call each
            qwenrt.decode_plan._forward = python_forward(plan.kernels, plan.eps)
            time_projections(plan, model)
        seconds.clear(), calls.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            token, loop_ms = steps(token, cache)
    per_token = lambda s: s * 1e3 / args.steps  # noqa: E731
    projections = {n: s for n, s in seconds.items() if n in weight_bytes}
    native = {n: s for n, s in seconds.items() if n not in weight_bytes}
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
    proj_ms, native_ms = per_token(sum(projections.values())), per_token(sum(native.values()))
    print(f"{args.checkpoint} ({args.dtype}), context {args.prompt_len}, {args.threads} threads\n"
          f"engine decode path ({path}): {engine_ms:.1f} ms per token ({1e3 / engine_ms:.1f} tok/s)\n"
          f"called one kernel at a time (profiled): {loop_ms:.1f} ms per token: projections {proj_ms:.1f} ms, other "
          f"native kernels {native_ms:.1f} ms, torch ops {ops_ms:.1f} ms, the rest (Python, dispatch) "
          f"{loop_ms - proj_ms - native_ms - ops_ms:.1f} ms\n")
    print("| projection / native kernel / torch op | calls / token | ms / token | weight GB/s |\n|---|---|---|---|")
    for name, s in sorted(projections.items(), key=lambda kv: -kv[1]):
        rate = weight_bytes[name] * calls[name] / s / 1e9
        print(f"| {name} | {calls[name] / args.steps:.0f} | {per_token(s):.2f} | {rate:.1f} |")
    for name, s in sorted(native.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {calls[name] / args.steps:.0f} | {per_token(s):.2f} | |")
    for e in events[:args.top]:
        print(f"| {e.key} | {e.count / args.steps:.0f} | {e.self_cpu_time_total / 1e3 / args.steps:.2f} | |")


if __name__ == "__main__":
    main()
