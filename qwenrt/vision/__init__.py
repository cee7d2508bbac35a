"""Vision input for Qwen3.5: preprocessing, placeholder expansion, the ViT tower and 3-D M-RoPE positions."""

from qwenrt.vision.config import PreprocessConfig, VisionConfig, load_preprocess_configs
from qwenrt.vision.media import DEFAULT_POLICY, MediaPolicy, load_image
from qwenrt.vision.placeholders import expand_prompt, expand_token_ids
from qwenrt.vision.positions import decode_position_ids, rope_index
from qwenrt.vision.preprocess import (
    ImageBatch,
    VideoBatch,
    preprocess_images,
    preprocess_videos,
    sample_frame_indices,
    smart_resize,
)
from qwenrt.vision.tower import VisionTower

__all__ = [
    "DEFAULT_POLICY",
    "ImageBatch",
    "MediaPolicy",
    "PreprocessConfig",
    "VideoBatch",
    "VisionConfig",
    "VisionTower",
    "decode_position_ids",
    "expand_prompt",
    "expand_token_ids",
    "load_image",
    "load_preprocess_configs",
    "preprocess_images",
    "preprocess_videos",
    "rope_index",
    "sample_frame_indices",
    "smart_resize",
]
