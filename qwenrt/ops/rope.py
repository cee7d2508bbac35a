"""Partial rotary embeddings with interleaved multimodal (M-RoPE) positions.

Only the first `rotary_dim` channels of each head rotate (NeoX rotate_half over those); the rest pass through.
With M-RoPE, frequency j takes its position from the T, H or W axis: interleaved, j%3 == 1 -> H (j < 3·sec_H),
j%3 == 2 -> W (j < 3·sec_W), else T. Text tokens have T = H = W, where this is ordinary 1-D RoPE.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(rotary_dim: int, theta: float, device=None, yarn=None) -> torch.Tensor:
    """[rotary_dim / 2] fp32; with `yarn` (qwenrt.config.Yarn) YaRN's blend of interpolated and original ones."""
    if yarn is not None:
        return yarn_inv_frequencies(rotary_dim, theta, yarn).to(device)
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def yarn_inv_frequencies(dim: int, base: float, yarn) -> torch.Tensor:
    """[dim / 2] fp32, as transformers 5.23's `_compute_yarn_parameters` computes them (same ops, same order):
    frequencies that turn fewer than beta_slow times over the original context are divided by `factor`, those that
    turn more than beta_fast times are kept, with a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # the share of the original frequency
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section, interleaved: bool = True,
                 scale: float = 1.0):
    """positions [B, T] (text) or [3, B, T] (T/H/W axes) -> cos, sin [B, T, rotary_dim] fp32, both times `scale`
    (YaRN's attention factor; it scales the rotated channels of q and k, as transformers applies it)."""
    if positions.dim() == 2:
        freqs = positions[..., None].float() * inv_freq  # [B, T, F]
    else:
        axes = positions[..., None].float() * inv_freq  # [3, B, T, F]
        freqs = axes[0].clone()
        if interleaved:
            for axis in (1, 2):
                span = slice(axis, mrope_section[axis] * 3, 3)
                freqs[..., span] = axes[axis][..., span]
        else:  # sectioned (Qwen2-VL style): contiguous frequency blocks per axis
            start = 0
            for axis, size in enumerate(mrope_section):
                freqs[..., start:start + size] = axes[axis][..., start:start + size]
                start += size
    angles = torch.cat([freqs, freqs], dim=-1)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, Dh]; cos, sin [B, T, R] with R <= Dh, already in x's dtype."""
    R = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, R]
    rot, rest = x[..., :R], x[..., R:]
    half = R // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
