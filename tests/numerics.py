"""Shared measures for the parity tests."""

import torch

from qwenrt.engine.runner import decode_step


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|, in double precision."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def int8_groups(x: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the int4 prefill GEMM takes it: q = round(x·(127/amax)) per row and group of G columns, and
    d = amax/127, both in fp32 as the kernel computes them -> (q·d in fp64 [M, K], d [M, K/G])."""
    xg = x.float().view(x.shape[0], -1, G)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(xg * inv).clamp(-127, 127)  # half to even, as the kernel's conversion
    d = amax / 127
    return (q.double() * d.double()).view_as(x), d.squeeze(-1)


def teacher_forced_logits(model, ids: torch.Tensor, prefill: int, modules: bool = False) -> torch.Tensor:
    """Prefill ids[:, :prefill], then decode the rest one token at a time as the engine does (or through the modules'
    forward): logits [B, T - prefill + 1, V] at the positions prefill-1 .. T-1."""
    cache = model.new_cache(ids.shape[0])
    step = (lambda x: model(x, cache=cache)) if modules else (lambda x: decode_step(model, x, cache)[0][:, None])
    out = [model(ids[:, :prefill], cache=cache, logits_to_keep=1)]
    out += [step(ids[:, i:i + 1]) for i in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)
