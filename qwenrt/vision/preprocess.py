"""Images and videos -> flattened ViT patches, as transformers' `Qwen2VLImageProcessorPil` / `Qwen3VLVideoProcessor`.

Shapes: N patches, C channels, Tp temporal patch, P patch side, m merge size, F frames.
A patch row holds C·Tp·P·P values (C outermost, matching the Conv3d weight [D, C, Tp, P, P]); rows are emitted
frame-group by frame-group in m×m merge-block order: (t, h/m, w/m, m, m).
Video frames are resized with PIL like images; transformers' video processor resizes with torchvision, whose
bicubic can differ from PIL's by a grey level here and there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from qwenrt.errors import QwenrtError
from qwenrt.vision.config import PreprocessConfig
from qwenrt.vision.media import (
    DECODE_BUDGET,
    DEFAULT_POLICY,
    MediaPolicy,
    decode_video_file,
    load_frame,
    load_image,
    resize_rgb,
)

MAX_ASPECT_RATIO = 200
PATCH_BYTES_PER_PIXEL = 40  # normalizing and patchifying a resized pixel: its uint8 copies, fp32 frames, patches
DEFAULT_VIDEO_FPS = 24.0  # transformers' assumption when frames come without a frame rate


@dataclass
class ImageBatch:
    pixel_values: torch.Tensor  # [N, C·Tp·P·P] fp32
    grid_thw: torch.Tensor  # [n_images, 3] int64, t = 1


@dataclass
class VideoBatch:
    pixel_values: torch.Tensor  # [N, C·Tp·P·P] fp32
    grid_thw: torch.Tensor  # [n_videos, 3] int64
    timestamps: list[list[float]]  # per video, seconds per temporal patch (mean of its first and last frame)


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise QwenrtError(f"image aspect ratio {max(height, width) / min(height, width):.1f} ({width}x{height}) "
                          f"exceeds {MAX_ASPECT_RATIO}")


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Image target (h, w): multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(num_frames: int, height: int, width: int, *, factor: int, temporal_factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Video target (h, w): like `smart_resize` but the pixel budget counts all frames; tiny sides grow first."""
    if num_frames < temporal_factor:
        raise QwenrtError(f"video has {num_frames} sampled frame(s); at least {temporal_factor} are needed")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalize(frames: np.ndarray, cfg: PreprocessConfig) -> torch.Tensor:
    """uint8 [F, H, W, C] -> fp32 [F, C, H, W]; rescale in fp64 then normalize in fp32, as transformers does (a
    channel at a time, in place: one fp64 channel is the only temporary)."""
    F, H, W, C = frames.shape
    out = np.empty((F, C, H, W), np.float32)
    for c in range(C):
        rescaled = frames[..., c].astype(np.float64)
        rescaled *= cfg.rescale_factor
        channel = out[:, c]
        channel[...] = rescaled  # rounded to fp32 as astype would
        del rescaled
        channel -= np.float32(cfg.image_mean[c])
        channel /= np.float32(cfg.image_std[c])
    return torch.from_numpy(out)


def _patchify(frames: torch.Tensor, cfg: PreprocessConfig) -> tuple[torch.Tensor, list[int]]:
    """fp32 [F, C, H, W] -> ([t·h·w, C·Tp·P·P], [t, h, w]); F is padded to Tp by repeating the last frame (a lone
    frame, an image, as a view: the reshape below is then the only copy)."""
    if pad := -frames.shape[0] % cfg.temporal_patch_size:
        frames = (frames.expand(cfg.temporal_patch_size, -1, -1, -1) if frames.shape[0] == 1 else
                  torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)]))
    F, C, H, W = frames.shape
    P, m, Tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    t, h, w = F // Tp, H // P, W // P
    x = frames.view(t, Tp, C, h // m, m, P, w // m, m, P)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, h/m, w/m, m, m, C, Tp, P, P]
    return x.reshape(t * h * w, C * Tp * P * P), [t, h, w]


def _patches(frames: np.ndarray, cfg: PreprocessConfig, policy: MediaPolicy, what: str
             ) -> tuple[torch.Tensor, list[int]]:
    """Resized uint8 [F, H, W, C] -> `_patchify`'s (patches, grid), within the decode budget (it takes copies)."""
    with DECODE_BUDGET.hold(frames[..., 0].size * PATCH_BYTES_PER_PIXEL, policy, f"preprocessing {what}"):
        return _patchify(_normalize(frames, cfg), cfg)


def _joined(patches: list[torch.Tensor]) -> torch.Tensor:
    """The patches of every item in one tensor; a lone item's as they are (a copy of a 16M-pixel image's is 400 MB)."""
    return patches[0] if len(patches) == 1 else torch.cat(patches)


def preprocess_images(images: list, cfg: PreprocessConfig, policy: MediaPolicy = DEFAULT_POLICY) -> ImageBatch:
    """Images (anything `load_image` takes, read under `policy`) -> ImageBatch; each still image fills one temporal
    patch."""
    def resize_to(height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)

    patches, grids = [], []
    for number, source in enumerate(images, 1):
        image = load_image(source, policy, resize_to, cfg.resample)
        flat, grid = _patches(np.asarray(image)[None], cfg, policy, f"image {number}")
        patches.append(flat)
        grids.append(grid)
    if not patches:
        raise QwenrtError("preprocess_images got no images")
    return ImageBatch(_joined(patches), torch.tensor(grids, dtype=torch.long))


def sample_frame_indices(total_frames: int, video_fps: float | None, cfg: PreprocessConfig) -> list[int]:
    """Qwen3-VL sampling: int(duration·cfg.fps) frames clamped to [min_frames, max_frames] and the total,
    spread evenly over [0, total - 1] and rounded."""
    if total_frames < 1:
        raise QwenrtError("video has no frames")
    n = int(total_frames / (video_fps or DEFAULT_VIDEO_FPS) * cfg.fps)
    n = min(max(n, cfg.min_frames), cfg.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()


def frame_timestamps(indices: list[int], video_fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds per temporal patch: the mean of its first and last frame time (indices padded like the frames)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / (video_fps or DEFAULT_VIDEO_FPS) for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def _video_size(n: int, height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    """The (h, w) every frame of a video of `n` sampled height×width frames is resized to."""
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:  # qwen-vl-utils: per-frame budget capped, floored at 1.05·min_pixels
        per_frame = max(min(cfg.max_video_tokens * cfg.factor ** 2, cfg.max_pixels // n), int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * n
    return smart_resize_video(n, height, width, factor=cfg.factor, temporal_factor=cfg.temporal_patch_size,
                              min_pixels=cfg.min_pixels, max_pixels=max_pixels)


def _resized_frames(frames: list[np.ndarray], cfg: PreprocessConfig) -> list[np.ndarray]:
    """Sampled uint8 frames (all one size) resized to the video grid."""
    sizes = {f.shape[:2] for f in frames}
    if len(sizes) != 1:
        raise QwenrtError(f"video frames differ in size: {sorted(sizes)}")
    h, w = _video_size(len(frames), *sizes.pop(), cfg)
    return [resize_rgb(f, h, w, cfg.resample) for f in frames]


def preprocess_videos(videos: list, cfg: PreprocessConfig, *, frames_fps: float | None = None,
                      policy: MediaPolicy = DEFAULT_POLICY) -> VideoBatch:
    """Videos -> VideoBatch. A video is a file path (decoded with PyAV under `policy`) or a list of frames (PIL /
    uint8 arrays) recorded at `frames_fps` (None: 24, as transformers assumes). Frames are sampled at `cfg.fps`."""
    if frames_fps is not None and not frames_fps > 0:
        raise QwenrtError(f"frames_fps must be positive, got {frames_fps}")
    patches, grids, stamps = [], [], []
    for number, video in enumerate(videos, 1):
        if isinstance(video, (str, os.PathLike)):
            frames, indices, fps = decode_video_file(
                video, lambda total, fps: sample_frame_indices(total, fps, cfg), policy,
                lambda n, height, width: _video_size(n, height, width, cfg), cfg.resample)
        else:
            if not isinstance(video, (list, tuple)) or not video:
                raise QwenrtError(f"a video must be a file path or a non-empty list of frames, got {type(video).__name__}")
            fps = frames_fps
            indices = sample_frame_indices(len(video), fps, cfg)
            frames = _resized_frames([load_frame(video[i]) for i in indices], cfg)
        flat, grid = _patches(np.stack(frames), cfg, policy, f"video {number}")
        patches.append(flat)
        grids.append(grid)
        stamps.append(frame_timestamps(indices, fps, cfg.temporal_patch_size))
    if not patches:
        raise QwenrtError("preprocess_videos got no videos")
    return VideoBatch(_joined(patches), torch.tensor(grids, dtype=torch.long), stamps)
