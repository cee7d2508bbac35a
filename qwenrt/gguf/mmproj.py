"""The Qwen3.5 vision tower in a llama.cpp vision projector file (an "mmproj": architecture `clip`, projector
`qwen3vl_merger`) as llama.cpp's converter writes it (`convert_hf_to_gguf.py --mmproj`, conversion/qwen3vl.py), both
ways: the tensor names, the one value transform, and the metadata <-> the tower's vision_config and preprocessing.
Qwen3-VL's tower is read from the same files, with its DeepStack mergers.

Names: qwenrt's are the checkpoint's under `model.visual.`; the file's are `v.*` (the ViT) and `mm.0` / `mm.2` (the
merger's two linears); Qwen3-VL's DeepStack merger n (for block deepstack_visual_indexes[n]) is
`v.deepstack.{that block}.norm|fc1|fc2`, the blocks flagged in `clip.vision.is_deepstack_layers`. The transform: the Conv3d patch embedding [D, C, 2, P, P] is stored as two Conv2d kernels
[D, C, P, P], one per frame of the temporal patch (`v.patch_embd.weight`, `v.patch_embd.weight.1`).

What the file leaves out is what llama.cpp's clip graph fixes for this projector: 3 input channels, 2 frames per
patch, rotary theta 10000, the GELU-tanh MLP; the learned position table is (image_size / patch_size)² rows.
"""

from __future__ import annotations

import json

import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter, size_label

from qwenrt.config import QWEN3_5, QWEN3_VL, ModelConfig, parse_config
from qwenrt.errors import QwenrtError
from qwenrt.gguf.metadata import Metadata
from qwenrt.tokenizer import TokenizerParts
from qwenrt.vision.config import PreprocessConfig, VisionConfig
from qwenrt.vision.tower import LAYER_NORM_EPS

VISUAL = "model.visual."
PROJECTOR = "qwen3vl_merger"
# module after "blocks.{i}." -> after "v.blk.{i}."
BLOCK_NAMES = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
               "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
GLOBAL_NAMES = {"patch_embed.proj": "v.patch_embd", "pos_embed": "v.position_embd", "merger.norm": "v.post_ln",
                "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2"}
DEEPSTACK_NAMES = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}  # after deepstack_merger_list.{n}.
PATCH = VISUAL + "patch_embed.proj.weight"
PATCH_PARTS = ("v.patch_embd.weight", "v.patch_embd.weight.1")
# the prompt's vision tokens, found by their text in the model's tokenizer
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
CHANNELS, FRAMES, ROPE_THETA = 3, 2, 10000.0
# llama.cpp's general.file_type of an mmproj written for each `qwenrt convert --type` (its converter has no 4-bit
# types; a 4-bit model's projector is written F16, as the files people download pair them)
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 1, "q4_k_m": 1}
MATRIX_TYPES = {0: Q.F32, 1: Q.F16, 32: Q.BF16, 7: Q.Q8_0}


def mmproj_names(name: str, deepstack: tuple[int, ...] = ()) -> tuple[str, ...]:
    """The projector-file tensor(s) holding qwenrt vision tensor `name` (two for the patch embedding); () for none.
    deepstack: the tower's deepstack_visual_indexes."""
    if name == PATCH:
        return PATCH_PARTS
    module, _, leaf = name.removeprefix(VISUAL).rpartition(".")
    if module in GLOBAL_NAMES:
        return (f"{GLOBAL_NAMES[module]}.{leaf}",)
    head, _, inner = module.partition(".")
    index, _, inner = inner.partition(".")
    if head == "blocks" and index.isdecimal() and inner in BLOCK_NAMES:
        return (f"v.blk.{index}.{BLOCK_NAMES[inner]}.{leaf}",)
    if head == "deepstack_merger_list" and index.isdecimal() and int(index) < len(deepstack) \
            and inner in DEEPSTACK_NAMES:
        return (f"v.deepstack.{deepstack[int(index)]}.{DEEPSTACK_NAMES[inner]}.{leaf}",)
    return ()


def to_mmproj(name: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """qwenrt vision tensor `name` -> the file's tensor(s), in `mmproj_names` order."""
    if name == PATCH:
        return tuple(t[:, :, frame].contiguous() for frame in range(FRAMES))  # [D, C, 2, P, P] -> 2 × [D, C, P, P]
    return (t,)


def from_mmproj(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The file's tensor(s) of qwenrt vision tensor `name` -> that tensor."""
    return torch.stack(parts, dim=2) if name == PATCH else parts[0]


def mmproj_shapes(name: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """PyTorch shapes of the file's tensor(s) of qwenrt vision tensor `name` of `shape`."""
    if name == PATCH:
        return [(*shape[:2], *shape[3:])] * shape[2]
    return [tuple(shape)]


def mmproj_shape(name: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The qwenrt shape of `name` from its parts' (PyTorch-order) shapes."""
    if name == PATCH:
        return (*shapes[0][:2], len(shapes), *shapes[0][2:])
    return shapes[0]


def vision_config(meta: Metadata, hidden_size: int, family: str = QWEN3_5) -> dict:
    """The Hugging Face vision_config of the tower a projector file describes, for a model of `hidden_size` of
    `family` (Qwen3.5's or Qwen3-VL's: DeepStack for the latter only)."""
    arch = meta.str("general.architecture")
    if arch != "clip":
        raise QwenrtError(f"{meta.where}: not a vision projector file (general.architecture {arch!r}, expected 'clip')")
    projector = meta.str("clip.vision.projector_type", None) or meta.str("clip.projector_type")
    if projector != PROJECTOR or not meta.flag("clip.has_vision_encoder", False):
        raise QwenrtError(f"{meta.where}: projector {projector!r} is not {family}'s vision tower ('{PROJECTOR}')")
    depth, patch = meta.int("clip.vision.block_count"), meta.int("clip.vision.patch_size")
    image_size, projection = meta.int("clip.vision.image_size"), meta.int("clip.vision.projection_dim")
    if projection != hidden_size:
        raise QwenrtError(f"{meta.where}: projection_dim {projection} does not match the model's hidden size "
                          f"{hidden_size} (a projector made for another model)")
    if not 0 < patch <= image_size or image_size % patch:
        raise QwenrtError(f"{meta.where}: image_size {image_size} is not a whole number of {patch}-pixel patches")
    if not meta.flag("clip.use_gelu", True):
        raise QwenrtError(f"{meta.where}: clip.use_gelu is false; Qwen3.5's vision MLP is GELU")
    eps = meta.float("clip.vision.attention.layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise QwenrtError(f"{meta.where}: layer_norm_epsilon {eps} is not Qwen3.5's vision LayerNorm's "
                          f"{LAYER_NORM_EPS}")
    key = "clip.vision.is_deepstack_layers"
    deepstack = [i for i, flag in enumerate(meta.ints(key, depth)) if flag] if meta.has(key) else []
    if deepstack and family != QWEN3_VL:
        raise QwenrtError(f"{meta.where}: a projector with DeepStack layers (Qwen3-VL's) for a {family} model, "
                          "which has none")
    return {
        "depth": depth, "hidden_size": meta.int("clip.vision.embedding_length"),
        "intermediate_size": meta.int("clip.vision.feed_forward_length"),
        "num_heads": meta.int("clip.vision.attention.head_count"), "in_channels": CHANNELS, "patch_size": patch,
        "spatial_merge_size": meta.int("clip.vision.spatial_merge_size", 2), "temporal_patch_size": FRAMES,
        "out_hidden_size": projection, "num_position_embeddings": (image_size // patch) ** 2,
        "hidden_act": "gelu_pytorch_tanh", "rope_parameters": {"rope_type": "axial", "rope_theta": ROPE_THETA},
        "deepstack_visual_indexes": deepstack,
    }


def preprocess_configs(meta: Metadata, vision: dict) -> tuple[PreprocessConfig, PreprocessConfig]:
    """(image, video) preprocessing: the file's patch, merge, mean and std; Qwen3.5's published pixel bounds."""
    d = {"patch_size": vision["patch_size"], "temporal_patch_size": FRAMES, "merge_size": vision["spatial_merge_size"],
         "image_mean": meta.floats("clip.vision.image_mean", CHANNELS),
         "image_std": meta.floats("clip.vision.image_std", CHANNELS)}
    where = f"{meta.where} metadata"
    return PreprocessConfig.from_dict(d, where=where), PreprocessConfig.from_dict(d, video=True, where=where)


def vision_token_ids(tokenizer: TokenizerParts | None, vocab_size: int, where) -> dict[str, int]:
    """The vision token ids from the model's tokenizer (Qwen3.5's own ids without one), each within the vocabulary:
    a model without them is text-only."""
    ids = {}
    if tokenizer is not None:
        added = {t["content"]: t["id"] for t in _added_tokens(tokenizer.backend_json)}
        ids = {key: added.get(text, -1) for key, text in VISION_TOKENS.items()}
    for key, text in VISION_TOKENS.items():
        token = ids.get(key, getattr(ModelConfig, key))
        if not 0 <= token < vocab_size:
            raise QwenrtError(f"{where}: a text-only model (no {text} token in its vocabulary of {vocab_size}) "
                              "cannot take a vision projector")
        ids[key] = token
    return ids


def _added_tokens(backend_json: str) -> list[dict]:
    """A tokenizer JSON's added tokens, decoded alone where they come first (as qwenrt.gguf.metadata writes them):
    the whole JSON of a 248K-token vocabulary takes a second to decode."""
    key = '"added_tokens": '
    at = backend_json.find(key)
    if at < 0:
        return json.loads(backend_json).get("added_tokens", [])
    return json.JSONDecoder().raw_decode(backend_json, at + len(key))[0]


def vlm_config(text: ModelConfig, vision: dict, token_ids: dict[str, int], where) -> ModelConfig:
    """The VLM config of a GGUF text model with a projector file's tower."""
    family = "qwen3_vl" if text.text.family == QWEN3_VL else "qwen3_5"
    d = {"model_type": f"{family}_moe" if text.text.is_moe else family, "text_config": text.raw,
         "vision_config": vision, "tie_word_embeddings": text.text.tie_word_embeddings, **token_ids}
    try:
        return parse_config(d, where=f"{where} metadata")
    except QwenrtError as e:  # the vision checks name no file
        message = str(e)
        raise QwenrtError(message if message.startswith(str(where)) else f"{where}: {message}") from None


def tensor_type(name: str, shape: tuple[int, ...], file_type: int) -> Q:
    """The type llama.cpp's converter gives projector tensor `name` (the file's name, PyTorch shape): F32 for
    vectors and the position table, the patch kernels F16 in an F16 file and F32 otherwise, the rest the file's
    type (F16 where a row is not whole Q8_0 blocks)."""
    if len(shape) < 2 or name == "v.position_embd.weight":
        return Q.F32
    if name in PATCH_PARTS:
        return Q.F16 if file_type == 1 else Q.F32
    kind = MATRIX_TYPES[file_type]
    return Q.F16 if kind == Q.Q8_0 and shape[-1] % 32 else kind


def write_metadata(writer: GGUFWriter, vision: VisionConfig, image: PreprocessConfig, projection_dim: int,
                   file_type: int, name: str, n_params: int) -> None:
    """The metadata llama.cpp's converter writes for a Qwen3.5 projector (its layer-norm epsilon being the tower's,
    where the converter copies the text model's RMSNorm epsilon, 1e-6 in every Qwen3.5)."""
    writer.add_type("mmproj")
    writer.add_name(name)
    writer.add_size_label(size_label(n_params, 0, 0, 0))
    writer.add_file_type(file_type)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(projection_dim)
    writer.add_vision_image_size(vision.num_grid_per_side * vision.patch_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.depth)
    writer.add_vision_head_count(vision.num_heads)
    writer.add_vision_image_mean(list(image.image_mean))
    writer.add_vision_image_std(list(image.image_std))
    writer.add_clip_projector_type(PROJECTOR)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision.spatial_merge_size)
    writer.add_vision_attention_layernorm_eps(LAYER_NORM_EPS)
    writer.add_vision_is_deepstack_layers([False] * vision.depth)
    writer.add_quantization_version(2)


def check_exportable(vision: VisionConfig, where) -> None:
    """What llama.cpp's clip graph for this projector fixes, the tower must have."""
    fixed = {"in_channels": CHANNELS, "temporal_patch_size": FRAMES, "rope_theta": ROPE_THETA}
    wrong = [f"{k} {getattr(vision, k)} (llama.cpp's is {v})" for k, v in fixed.items() if getattr(vision, k) != v]
    if wrong:
        raise QwenrtError(f"{where}: the vision tower cannot be written as a llama.cpp projector: {', '.join(wrong)}")
