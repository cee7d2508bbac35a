"""Images and video in chat prompts: media parts -> pixels -> vision tower -> embeddings and 3-D positions.

The vision tower of a VLM checkpoint is loaded on first use, so a text-only prompt costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from qwenrt.checkpoint import open_checkpoint
from qwenrt.errors import ContextLengthError, QwenrtError
from qwenrt.loader import check_tensors
from qwenrt.vision.media import DEFAULT_POLICY, MediaPolicy

VISUAL_PREFIX = "model.visual."
IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video", "video_url")


@dataclass
class VisionPrompt:
    """What prefill needs besides the token ids of a prompt with images or video."""

    pixel_values: torch.Tensor | None  # images [N, C·Tp·P·P]
    image_grid_thw: torch.Tensor | None  # [n, 3]
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    position_ids: torch.Tensor  # [3, 1, T]
    rope_delta: int  # decode position = cached length + rope_delta


def _part_source(part: dict, kinds: tuple[str, str]):
    kind = part.get("type") or next((k for k in kinds if k in part), None)
    value = part.get(kind) if kind in part else part.get(kinds[0])
    if isinstance(value, dict):  # OpenAI style: {"image_url": {"url": ...}}
        value = value.get("url")
    if value is None:
        raise QwenrtError(f"a '{kind}' content part has no {' or '.join(repr(k) for k in kinds)} value")
    return value


def collect_media(messages: list[dict]) -> tuple[list, list]:
    """(image sources, video sources) from OpenAI-style content parts, in order of appearance."""
    images, videos = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, (list, tuple)):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in IMAGE_PART_TYPES or (kind is None and any(k in part for k in IMAGE_PART_TYPES)):
                images.append(_part_source(part, IMAGE_PART_TYPES))
            elif kind in VIDEO_PART_TYPES or (kind is None and any(k in part for k in VIDEO_PART_TYPES)):
                videos.append(_part_source(part, VIDEO_PART_TYPES))
    return images, videos


class VisionEncoder:
    """The checkpoint's vision tower plus its image/video preprocessing configs."""

    def __init__(self, model):
        from qwenrt.vision import VisionConfig, VisionTower, load_preprocess_configs

        config = model.config
        if not config.is_vlm:
            raise QwenrtError(f"{model.checkpoint_path}: this checkpoint has no vision tower (text-only model)")
        self.config = config
        ckpt, where = getattr(model, "vision_checkpoint", None), getattr(model, "mmproj_path", None)
        if ckpt is not None:  # a GGUF model's projector file
            self.image_cfg, self.video_cfg = ckpt.preprocess
        else:
            self.image_cfg, self.video_cfg = load_preprocess_configs(model.checkpoint_path)
            ckpt, where = open_checkpoint(model.checkpoint_path), model.checkpoint_path
        with torch.device("meta"):
            self.tower = VisionTower(VisionConfig.from_dict(config.vision))
        expected = {name: tuple(p.shape) for name, p in self.tower.named_parameters()}
        stored = {n[len(VISUAL_PREFIX):]: n for n in ckpt.names(VISUAL_PREFIX)}
        check_tensors(where, "vision tower tensors do not match vision_config", expected,
                      {n: ckpt.shapes[name] for n, name in stored.items()})
        state = {n: ckpt.get(stored[n]).to(device=model.device, dtype=model.dtype) for n in expected}
        self.tower.load_state_dict(state, strict=True, assign=True)
        self.tower.requires_grad_(False).eval()
        model.vision_checkpoint = None  # its tensors are in the tower now: release the file's map

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patches -> (merged vision embeddings [N / merge², D], the DeepStack features: one more such per
        deepstack block, none for Qwen3.5) in the decoder's dtype."""
        device = next(self.tower.parameters()).device
        main, deepstack = self.tower(pixel_values.to(device=device, dtype=dtype), grid_thw.to(device))
        return main.to(dtype), [d.to(dtype) for d in deepstack]


def vision_encoder(model) -> VisionEncoder:
    """The model's vision encoder, loaded on first use."""
    encoder = getattr(model, "vision_encoder", None)
    if encoder is None:
        encoder = model.vision_encoder = VisionEncoder(model)
    return encoder


def prepare_vision_prompt(model, tokenizer, text: str, images: list, videos: list, max_context: int,
                          policy: MediaPolicy = DEFAULT_POLICY) -> tuple[list[int], VisionPrompt]:
    """Expand the placeholders in a rendered prompt and compute its positions; the tower runs later, in prefill.

    Media are read under `policy` (a server passes a strict one). Checks the context budget before any vision
    compute.
    """
    from qwenrt.vision import expand_prompt, preprocess_images, preprocess_videos, rope_index

    encoder = vision_encoder(model)
    config = model.config
    merge = encoder.image_cfg.merge_size
    image_batch = preprocess_images(images, encoder.image_cfg, policy) if images else None
    video_batch = preprocess_videos(videos, encoder.video_cfg, policy=policy) if videos else None
    expanded = expand_prompt(text, image_grid_thw=image_batch.grid_thw if image_batch else None,
                             video_grid_thw=video_batch.grid_thw if video_batch else None,
                             video_timestamps=video_batch.timestamps if video_batch else None, merge_size=merge)
    ids = tokenizer.encode(expanded)
    if len(ids) >= max_context:
        raise ContextLengthError(f"prompt has {len(ids)} tokens with its images/video expanded; the context limit "
                                 f"is {max_context} (use smaller or fewer images)", len(ids), max_context)
    positions, deltas = rope_index(torch.tensor([ids]), image_batch.grid_thw if image_batch else None,
                                   video_batch.grid_thw if video_batch else None,
                                   image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                                   spatial_merge_size=merge)
    return ids, VisionPrompt(image_batch.pixel_values if image_batch else None,
                             image_batch.grid_thw if image_batch else None,
                             video_batch.pixel_values if video_batch else None,
                             video_batch.grid_thw if video_batch else None, positions, int(deltas[0, 0]))


class VisionInputs(NamedTuple):
    """A prompt's decoder inputs: token embeddings [1, T, D] with the placeholders replaced by the tower's outputs,
    and (Qwen3-VL) per DeepStack block a [1, T, D] that is its features at the placeholders and zero elsewhere, which
    the model adds after its first decoder layers (adding zeros leaves the text positions exactly as they are)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]

    def chunk(self, positions: slice) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """(embeds, deepstack) of a prefill chunk's positions; deepstack None without DeepStack."""
        return self.embeds[:, positions], [d[:, positions] for d in self.deepstack] or None


def vision_embeddings(model, ids: torch.Tensor, prompt: VisionPrompt) -> VisionInputs:
    """The decoder inputs of a prompt's ids [1, T] with its images and video (the tower runs here)."""
    encoder = vision_encoder(model)
    embeds = model.model.embed_tokens(ids)
    deepstack = [torch.zeros_like(embeds) for _ in encoder.tower.cfg.deepstack_visual_indexes]
    for pixels, grid, token in ((prompt.pixel_values, prompt.image_grid_thw, model.config.image_token_id),
                                (prompt.pixel_values_videos, prompt.video_grid_thw, model.config.video_token_id)):
        if pixels is None:
            continue
        features, stacked = encoder.embed(pixels, grid, embeds.dtype)  # [n_tokens, D] each
        mask = ids == token
        if int(mask.sum()) != features.shape[0]:
            raise QwenrtError(f"{int(mask.sum())} placeholder tokens but {features.shape[0]} vision embeddings")
        embeds[mask] = features
        for full, part in zip(deepstack, stacked):
            full[mask] = part
    return VisionInputs(embeds, deepstack)
