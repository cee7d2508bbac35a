"""Shared measures for the parity tests."""

import torch

from qwenrt.engine.runner import decode_step


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|, in double precision."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def teacher_forced_logits(model, ids: torch.Tensor, prefill: int, modules: bool = False) -> torch.Tensor:
    """Prefill ids[:, :prefill], then decode the rest one token at a time as the engine does (or through the modules'
    forward): logits [B, T - prefill + 1, V] at the positions prefill-1 .. T-1."""
    cache = model.new_cache(ids.shape[0])
    step = (lambda x: model(x, cache=cache)) if modules else (lambda x: decode_step(model, x, cache)[0][:, None])
    out = [model(ids[:, :prefill], cache=cache, logits_to_keep=1)]
    out += [step(ids[:, i:i + 1]) for i in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)
