"""Vision tower and preprocessing configuration: `vision_config` (HF names) and the preprocessor JSON files."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from qwenrt.errors import QwenrtError
from qwenrt.fields import Fields
from qwenrt.files import CheckpointDir

IMAGE_CONFIG_FILE = "preprocessor_config.json"
VIDEO_CONFIG_FILE = "video_preprocessor_config.json"
MAX_PIXELS = 1 << 28  # a resize target beyond this is no real preprocessor's
MAX_FRAMES = 1 << 16
PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@dataclass(frozen=True)
class VisionConfig:
    """The ViT's hyper-parameters; defaults are transformers' `Qwen3_5VisionConfig` defaults."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose outputs feed the first decoder layers

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: C·Tp·P·P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        """Parse a checkpoint's `vision_config`; refuse what this tower does not implement."""
        f = Fields(d, "vision_config")
        rope = f.obj("rope_parameters", {})
        if rope.d.get("rope_type", "axial") != "axial":
            raise QwenrtError(f"vision config rope_type {rope.d.get('rope_type')!r} is not supported (expected 'axial')")
        limits = {"depth": 1024, "in_channels": 16, "patch_size": 1024, "spatial_merge_size": 64,
                  "temporal_patch_size": 64, "num_position_embeddings": 1 << 24}
        ints = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings")
        values = {k: f.int(k, getattr(cls, k), hi=limits.get(k, 1 << 16)) for k in ints}
        deepstack = f.ints("deepstack_visual_indexes", (), lo=0, hi=values["depth"] - 1, max_len=64)
        if len(set(deepstack)) != len(deepstack):
            raise QwenrtError(f"vision_config: deepstack_visual_indexes {list(deepstack)} name a block twice")
        cfg = cls(**values, hidden_act=f.str("hidden_act", cls.hidden_act),
                  rope_theta=rope.float("rope_theta", cls.rope_theta, lo=0.0, open_low=True),
                  deepstack_visual_indexes=deepstack)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.hidden_act != "gelu_pytorch_tanh":
            raise QwenrtError(f"vision config hidden_act {self.hidden_act!r} is not supported (expected 'gelu_pytorch_tanh')")
        if self.hidden_size % self.num_heads:
            raise QwenrtError(f"vision hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.head_dim % 4:
            raise QwenrtError(f"vision head_dim ({self.head_dim}) must be divisible by 4 for the 2-D axial rotary")
        if self.num_grid_per_side ** 2 != self.num_position_embeddings:
            raise QwenrtError(f"vision num_position_embeddings ({self.num_position_embeddings}) must be a perfect square")


@dataclass(frozen=True)
class PreprocessConfig:
    """One of preprocessor_config.json (images) or video_preprocessor_config.json (videos).

    min_pixels/max_pixels are HF's size.shortest_edge/longest_edge; defaults are the published Qwen3.5 files.
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL bicubic
    fps: float = 2.0  # video: frames sampled per second
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False  # video: qwen-vl-utils' per-frame pixel cap (transformers' default: off)
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        """Resized sides are multiples of patch·merge."""
        return self.patch_size * self.merge_size

    @classmethod
    def video_defaults(cls) -> PreprocessConfig:
        return cls(min_pixels=4096, max_pixels=25165824)

    @classmethod
    def from_dict(cls, d: dict, *, video: bool = False, where: str = "preprocessor") -> PreprocessConfig:
        """Parse a preprocessor JSON dict; `min_pixels`/`max_pixels` keys override `size` as in transformers."""
        base = cls.video_defaults() if video else cls()
        f = Fields(d, where)
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if d.get(flag, True) is not True:
                raise QwenrtError(f"{where}: {flag}={d[flag]!r} is not supported (only true)")
        size = f.obj("size", {})

        def pixels(key: str, edge: str, default: int) -> int:
            return f.int(key, size.int(edge, default, hi=MAX_PIXELS), hi=MAX_PIXELS)

        def floats(key: str, default: tuple) -> tuple[float, ...]:
            return tuple(Fields({key: x}, where).float(key) for x in f.list(key, list(default), max_len=4))

        cfg = cls(
            patch_size=f.int("patch_size", base.patch_size, hi=1024),
            temporal_patch_size=f.int("temporal_patch_size", base.temporal_patch_size, hi=64),
            merge_size=f.int("merge_size", base.merge_size, hi=64),
            min_pixels=pixels("min_pixels", "shortest_edge", base.min_pixels),
            max_pixels=pixels("max_pixels", "longest_edge", base.max_pixels),
            image_mean=floats("image_mean", base.image_mean),
            image_std=floats("image_std", base.image_std),
            rescale_factor=f.float("rescale_factor", base.rescale_factor),
            resample=f.int("resample", base.resample, lo=0, hi=5),
            fps=f.float("fps", base.fps, lo=0.0, hi=1000.0, open_low=True),
            min_frames=f.int("min_frames", base.min_frames, hi=MAX_FRAMES),
            max_frames=f.int("max_frames", base.max_frames, hi=MAX_FRAMES),
            cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame") or False),
            max_video_tokens=f.int("max_video_tokens", base.max_video_tokens, hi=1 << 24),
        )
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                     "min_frames", "max_frames", "max_video_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QwenrtError(f"preprocessor {name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise QwenrtError(f"preprocessor min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        if self.min_frames > self.max_frames:
            raise QwenrtError(f"preprocessor min_frames ({self.min_frames}) exceeds max_frames ({self.max_frames})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0.0 in self.image_std:
            raise QwenrtError(f"preprocessor image_mean {self.image_mean} / image_std {self.image_std} need 3 values, std non-zero")
        if self.resample not in PIL_RESAMPLE:
            raise QwenrtError(f"preprocessor resample {self.resample!r} is not a PIL filter (0-5)")
        if not self.fps > 0:
            raise QwenrtError(f"preprocessor fps must be positive, got {self.fps}")


def load_preprocess_configs(model_dir: str | Path) -> tuple[PreprocessConfig, PreprocessConfig]:
    """(image, video) preprocessing configs from a checkpoint directory; published defaults for absent files."""
    where = CheckpointDir(model_dir)
    image, video = where.optional_json(IMAGE_CONFIG_FILE), where.optional_json(VIDEO_CONFIG_FILE)
    return (PreprocessConfig.from_dict(image, where=IMAGE_CONFIG_FILE) if image is not None else PreprocessConfig(),
            PreprocessConfig.from_dict(video, video=True, where=VIDEO_CONFIG_FILE) if video is not None
            else PreprocessConfig.video_defaults())
