"""The Qwen3.5 / Qwen3-VL ViT (transformers' `Qwen3_5VisionModel`, `Qwen3VLVisionModel`): patch embed,
interpolated learned positions, 2-D axial rotary, pre-LN blocks with attention inside each frame, the 2×2 patch
merger, and (Qwen3-VL) DeepStack: the outputs of the `deepstack_visual_indexes` blocks, each through a merger of its
own that normalises after the shuffle, for the decoder's first layers.

Shapes: N patches (all images/frames packed, merge-block order), D = hidden_size, H heads, Dh = D / H,
m merge size, O = out_hidden_size. Attribute names are the checkpoint's names under `model.visual.`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.errors import QwenrtError
from qwenrt.vision.config import VisionConfig

LAYER_NORM_EPS = 1e-6


def interpolation_taps(grid_thw: list[list[int]], side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) taps into the side×side learned table for every patch in merge-block order:
    (indices [N, 4] int64, weights [N, 4] fp32), repeated over each grid's t frames."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        block = torch.arange(h * w)
        in_col, in_row = block % merge, (block // merge) % merge
        block_col, block_row = (block // merge ** 2) % (w // merge), block // (merge ** 2 * (w // merge))
        row, col = block_row * merge + in_row, block_col * merge + in_col  # [h·w] merge-block order
        h_taps, h_weights = _axis_taps(row, h, side)
        w_taps, w_weights = _axis_taps(col, w, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wts = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        indices.append(idx.repeat(t, 1))
        weights.append(wts.repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps per position along one axis; fp32 arithmetic in transformers' order so weights match bit for bit."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)  # endpoints map to 0 and side-1
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def rotary_positions(grid_thw: list[list[int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch in merge-block order: [N, 2] int64, repeated over each grid's t frames."""
    out = []
    for t, h, w in grid_thw:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C·Tp·P·P] -> [N, D]. Kernel == stride, so the Conv3d is one matmul over the flattened patch."""
        weight = self.proj.weight.flatten(1)  # [D, C·Tp·P·P]
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[tuple[int, int]]
                ) -> torch.Tensor:
        """x [N, D]; cos, sin [N, Dh] fp32; frames: (count, length) per grid, in order. Attention is full within
        each frame and absent across frames."""
        N, D = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, -1).unbind(1)  # 3 × [N, H, Dh]
        # rotary in fp32, as the reference does, then back to the activation dtype
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, Dh]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        out, start = [], 0
        for count, length in frames:
            end = start + count * length
            qs, ks, vs = (a[start:end].view(count, length, self.num_heads, -1).transpose(1, 2) for a in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)  # [count, H, length, Dh]
            out.append(o.transpose(1, 2).reshape(count * length, D))
            start = end
        return self.proj(torch.cat(out))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[tuple[int, int]]
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig, postshuffle: bool = False):
        """postshuffle: the LayerNorm over the merged m²·D vector (DeepStack's mergers), not over each patch's D."""
        super().__init__()
        self.unit = cfg.spatial_merge_size ** 2
        merged = cfg.hidden_size * self.unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(merged if postshuffle else cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N / m², O]; consecutive m² patches are one merge block."""
        merged = (-1, self.unit * x.shape[-1])
        x = self.norm(x.view(merged)) if self.postshuffle else self.norm(x).view(merged)  # [N / m², m²·D]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # exact-erf GELU here (gelu-tanh in the blocks)


class VisionTower(nn.Module):
    """pixel_values [N, C·Tp·P·P] + grid_thw [n, 3] -> (merged embeddings [N / m², O], one row per pad token; the
    DeepStack features, one [N / m², O] per deepstack_visual_indexes block, in that order; none for Qwen3.5)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        shape = (cfg.num_position_embeddings, cfg.hidden_size)  # no random init (loaded), as TextModel's embedding
        self.pos_embed = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        if cfg.deepstack_visual_indexes:
            self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True)
                                                       for _ in cfg.deepstack_visual_indexes)

    def _rotary(self, grids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, Dh] fp32: row angles then column angles over Dh/2, duplicated for rotate_half."""
        half = self.cfg.head_dim // 2
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))  # [Dh/4]
        angles = rotary_positions(grids, self.cfg.spatial_merge_size).float()[..., None] * inv_freq  # [N, 2, Dh/4]
        angles = angles.flatten(1)  # [N, Dh/2]: rows | cols
        angles = torch.cat([angles, angles], dim=-1).to(device)  # [N, Dh]
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cfg, grids = self.cfg, grid_thw.tolist()
        m = cfg.spatial_merge_size
        if any(h % m or w % m for _, h, w in grids):
            raise QwenrtError(f"vision grid_thw {grids} has h or w not divisible by spatial_merge_size {m}")
        expected = sum(t * h * w for t, h, w in grids)
        if tuple(pixel_values.shape) != (expected, cfg.patch_dim):
            raise QwenrtError(f"pixel_values shape {list(pixel_values.shape)} != [{expected}, {cfg.patch_dim}] "
                              f"for grid_thw {grids}")
        device = self.pos_embed.weight.device
        x = self.patch_embed(pixel_values.to(device))  # [N, D]
        idx, wts = interpolation_taps(grids, cfg.num_grid_per_side, m)  # [N, 4] each
        # the 4-tap blend runs in fp32 (fp32 weights promote the table), then joins the activation dtype
        pos = (self.pos_embed(idx.to(device)) * wts.to(device)[..., None]).sum(1)  # [N, D]
        x = x + pos.to(x.dtype)
        cos, sin = self._rotary(grids, device)
        frames = [(t, h * w) for t, h, w in grids]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
