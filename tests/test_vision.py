"""qwenrt.vision against transformers 5.23 on tiny random weights: preprocessing, placeholders, tower, positions."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import av
import PIL.Image as PIL_Image
import tokenizers

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5VisionModel
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_video_smart_resize

from qwenrt.errors import QwenrtError
from qwenrt.vision import (
    PreprocessConfig,
    VisionConfig,
    VisionTower,
    decode_position_ids,
    expand_prompt,
    expand_token_ids,
    load_image,
    load_preprocess_configs,
    preprocess_images,
    preprocess_videos,
    rope_index,
    sample_frame_indices,
)
from qwenrt.vision.preprocess import _normalize, _patchify, frame_timestamps, smart_resize_video
from tests.numerics import rel_err

VISION = dict(depth=2, hidden_size=64, hidden_act="gelu_pytorch_tanh", intermediate_size=96, num_heads=2,
              in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
              num_position_embeddings=64)  # an 8×8 learned table: grids both smaller and larger than it
MIN_PIXELS, MAX_PIXELS = 64 * 64, 256 * 256  # small, so most test images are resized up or down
IMAGE_ID, VIDEO_ID, START_ID, END_ID = 256, 257, 258, 259
SPECIALS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # ids 256..259


def random_image(h: int, w: int, mode: str = "RGB", seed: int = 0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return PIL_Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


@pytest.fixture(scope="module")
def pre_cfg() -> PreprocessConfig:
    return PreprocessConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.fixture(scope="module")
def hf_image_processor():
    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


# ---------------------------------------------------------------- image preprocessing


@pytest.mark.parametrize("h, w, mode", [
    (64, 64, "RGB"),  # already on the 32 grid
    (100, 150, "RGB"),  # rounding only
    (20, 37, "RGB"),  # below min_pixels: upscaled
    (500, 260, "RGB"),  # above max_pixels: downscaled
    (3, 450, "RGB"),  # aspect 150, both limits involved
    (77, 91, "L"),  # grayscale
    (90, 70, "RGBA"),  # alpha composited onto white
])
def test_images_match_qwen2vl_processor(h, w, mode, pre_cfg, hf_image_processor):
    image = random_image(h, w, mode)
    ref = hf_image_processor(images=[image], return_tensors="np")
    ours = preprocess_images([image], pre_cfg)
    assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert ours.pixel_values.dtype == torch.float32
    assert np.array_equal(ours.pixel_values.numpy(), ref["pixel_values"])


def test_image_batch_and_sources_match(tmp_path, pre_cfg, hf_image_processor):
    images = [random_image(120, 80, seed=1), random_image(40, 300, "RGBA", seed=2)]
    path = tmp_path / "b.png"
    images[1].save(path)
    uri = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    # transformers decodes paths / URIs with convert("RGB") (alpha dropped), in-memory images are composited
    ref = hf_image_processor(images=[images[0], str(path), uri], return_tensors="np")
    ours = preprocess_images([images[0], path, uri], pre_cfg)
    assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert np.array_equal(ours.pixel_values.numpy(), ref["pixel_values"])
    n0, n2 = (int(ours.grid_thw[i].prod()) for i in (0, 2))
    other = preprocess_images([path.read_bytes(), np.asarray(images[0])], pre_cfg)  # encoded bytes, uint8 array
    assert torch.equal(other.pixel_values, torch.cat([ours.pixel_values[-n2:], ours.pixel_values[:n0]]))


def test_bad_images_raise(tmp_path, pre_cfg):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image at all")
    cases = [
        PIL_Image.new("RGB", (0, 10)),  # zero size
        random_image(1, 201),  # aspect ratio 201 > 200
        garbage,  # unreadable
        tmp_path / "missing.png",
        "data:image/png;base64,@@@",
        "http://127.0.0.1:9/none.png",  # nothing listens on the discard port
        3.5,
    ]
    for case in cases:
        with pytest.raises(QwenrtError) as err:
            preprocess_images([case], pre_cfg)
        assert "\n" not in str(err.value)
    with pytest.raises(QwenrtError, match="cannot connect to 127.0.0.1"):
        load_image("http://127.0.0.1:9/none.png")


# ---------------------------------------------------------------- video preprocessing


@pytest.mark.parametrize("total, fps", [(4, None), (10, 4.0), (100, 30.0), (31, 2.0), (3000, 25.0)])
def test_frame_sampling_matches_qwen3vl(total, fps):
    cfg = PreprocessConfig.video_defaults()
    hf_self = SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    ref = Qwen3VLVideoProcessor.sample_frames(hf_self, metadata=SimpleNamespace(total_num_frames=total, fps=fps))
    ours = sample_frame_indices(total, fps, cfg)
    assert ours == ref.tolist()
    hf_proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    assert frame_timestamps(ours, fps, 2) == hf_proc._calculate_timestamps(list(ours), fps or 24, 2)


@pytest.mark.parametrize("frames, h, w", [(4, 36, 50), (5, 480, 640), (2, 8, 300), (64, 720, 1280)])
def test_video_resize_matches_qwen3vl(frames, h, w):
    cfg = PreprocessConfig.video_defaults()
    kwargs = dict(factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    ref = hf_video_smart_resize(frames, h, w, temporal_factor=2, **kwargs)
    assert smart_resize_video(frames, h, w, temporal_factor=2, **kwargs) == ref


def test_video_patches_match_qwen3vl_patchify():
    cfg = PreprocessConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    frames = np.stack([np.asarray(random_image(64, 96, seed=s)) for s in range(5)])  # 5 frames: padded to 6
    pixels = _normalize(frames, cfg)  # [5, 3, 64, 96]
    ours, grid = _patchify(pixels, cfg)
    ref, t, h, w = Qwen3VLVideoProcessor.patchify(None, pixels[None], patch_size=16, merge_size=2, temporal_patch_size=2)
    assert grid == [t, h, w] == [3, 4, 6]
    assert torch.equal(ours, ref[0])


def test_preprocess_videos_frames_and_timestamps():
    cfg = PreprocessConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    clip = [random_image(60, 80, seed=s) for s in range(10)]
    out = preprocess_videos([clip, [np.asarray(f) for f in clip[:4]]], cfg, frames_fps=4.0)
    # 10 frames at 4 fps, sampled at 2 fps -> 5 frames (padded to 6) -> 3 temporal patches; 4 frames -> 2
    indices = sample_frame_indices(10, 4.0, cfg)
    assert out.grid_thw[:, 0].tolist() == [3, 2]
    assert out.timestamps == [frame_timestamps(indices, 4.0, 2), frame_timestamps([0, 1, 2, 3], 4.0, 2)]
    assert out.pixel_values.shape == (int(out.grid_thw.prod(-1).sum()), 3 * 2 * 16 * 16)
    with pytest.raises(QwenrtError, match="differ in size"):
        preprocess_videos([[random_image(60, 80), random_image(61, 80)]], cfg)
    with pytest.raises(QwenrtError, match="1 sampled frame"):  # transformers refuses fewer than Tp frames too
        preprocess_videos([[random_image(60, 80)]], cfg)


def test_video_file_decodes(tmp_path):
    cfg = PreprocessConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    path = tmp_path / "clip.mp4"
    with pytest.raises(QwenrtError, match="not found"):
        preprocess_videos([path], cfg)
    with av.open(str(path), "w") as container:  # 30 frames at 10 fps
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for i in range(30):
            frame = av.VideoFrame.from_ndarray(np.full((64, 96, 3), 8 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    out = preprocess_videos([path], cfg)
    indices = sample_frame_indices(30, 10.0, cfg)  # 3 s at 2 fps: 6 frames
    assert out.grid_thw.tolist() == [[3, 4, 6]]
    assert out.timestamps == [frame_timestamps(indices, 10.0, 2)]


# ---------------------------------------------------------------- placeholders


def hf_processor():
    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    proc.image_token_id, proc.video_token_id = IMAGE_ID, VIDEO_ID
    proc.image_processor = SimpleNamespace(merge_size=2)
    proc.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    return proc


def hf_expand(text: str, image_grid: torch.Tensor, video_grid: torch.Tensor, indices: list, fps: float) -> str:
    proc = hf_processor()
    images = {"image_grid_thw": image_grid.numpy()}
    videos = {"video_grid_thw": video_grid.numpy(),
              "video_metadata": [SimpleNamespace(fps=fps, frames_indices=np.array(ix)) for ix in indices]}
    image_repl = [proc.replace_image_token(images, i) for i in range(len(image_grid))]
    video_repl = [proc.replace_video_token(videos, i) for i in range(len(video_grid))]
    return proc.get_text_with_replacements([text], image_repl, video_repl)[0][0]


def tiny_tokenizer():
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(SPECIALS)
    assert tok.token_to_id("<|vision_end|>") == END_ID
    return tok


PROMPT = ("<|im_start|>user\nA <|vision_start|><|image_pad|><|vision_end|> then "
          "<|vision_start|><|video_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>?")


def test_expansion_matches_qwen3vl_processor():
    image_grid = torch.tensor([[1, 4, 6], [1, 2, 8]])
    video_grid = torch.tensor([[3, 4, 4]])
    indices, fps = [[0, 7, 15, 22, 30]], 15.0  # 5 frames padded to 6 -> 3 temporal patches
    stamps = [frame_timestamps(indices[0], fps, 2)]
    ref = hf_expand(PROMPT, image_grid, video_grid, indices, fps)
    ours = expand_prompt(PROMPT, image_grid_thw=image_grid, video_grid_thw=video_grid, video_timestamps=stamps,
                         merge_size=2)
    assert ours == ref
    tok = tiny_tokenizer()
    ids = expand_token_ids(tok.encode(PROMPT).ids, image_grid_thw=image_grid, video_grid_thw=video_grid,
                           video_timestamps=stamps, merge_size=2, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                           vision_start_token_id=START_ID, vision_end_token_id=END_ID,
                           encode=lambda s: tok.encode(s).ids)
    assert ids == tok.encode(ref).ids


def test_placeholder_count_mismatch_raises():
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(QwenrtError, match="2 image placeholder"):
        expand_prompt("<|image_pad|><|image_pad|>", image_grid_thw=grid, merge_size=2)
    with pytest.raises(QwenrtError, match="0 image placeholder"):
        expand_prompt("no images", image_grid_thw=grid, merge_size=2)
    with pytest.raises(QwenrtError, match="1 video placeholder"):
        expand_prompt("<|video_pad|>", merge_size=2)
    with pytest.raises(QwenrtError, match="1 image placeholder"):
        expand_token_ids([1, IMAGE_ID, 2], image_grid_thw=torch.tensor([[1, 2, 2]] * 2), merge_size=2,
                         image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
                         vision_end_token_id=END_ID)


# ---------------------------------------------------------------- tower


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random, LayerNorm weights/biases and pos_embed included."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module.eval()


@pytest.fixture(scope="module")
def towers():
    hf_cfg = Qwen3_5VisionConfig(**VISION)
    hf_cfg._attn_implementation = "sdpa"
    ref = randomized(Qwen3_5VisionModel(hf_cfg))
    ours = VisionTower(VisionConfig.from_dict(VISION))
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    return ref, ours


@pytest.mark.parametrize("grid", [
    [[1, 4, 6]],  # one image, smaller than the 8×8 table
    [[1, 10, 12], [1, 4, 2]],  # two images of different sizes, one larger than the table
    [[4, 6, 8]],  # a video: 4 temporal patches (8 frames)
])
def test_tower_matches_reference(grid, towers):
    ref, ours = towers
    grid_thw = torch.tensor(grid)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(pixels, grid_thw=grid_thw).pooler_output  # merger output; last_hidden_state is pre-merger
        got, deepstack = ours(pixels, grid_thw)
        assert deepstack == []  # Qwen3.5 has none
    assert got.shape == expected.shape == (grid_thw.prod(-1).sum() // 4, VISION["out_hidden_size"])
    assert rel_err(got, expected) <= 1e-5


def test_tower_bf16_matches_reference(towers):
    ref32, ours32 = towers
    ref = Qwen3_5VisionModel(ref32.config).eval()
    ref.load_state_dict(ref32.state_dict())
    ref.to(torch.bfloat16)
    # from_pretrained keeps the rotary inv_freq buffer in fp32; `.to(bf16)` would round it, so restore it
    ref.rotary_pos_emb.inv_freq = ref.rotary_pos_emb.compute_axial_rope_parameters(ref.config)[0]
    ours = VisionTower(ours32.cfg)
    ours.load_state_dict(ours32.state_dict(), assign=True)
    ours.to(torch.bfloat16)
    grid_thw = torch.tensor([[1, 10, 12], [2, 4, 6]])
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), 1536, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        conv = ref.patch_embed(pixels.bfloat16())
        assert rel_err(ours.patch_embed(pixels), conv) <= 2 ** -7  # matmul vs Conv3d: bf16 rounding only
        # share the patch embedding so the rest is compared cast for cast (a misplaced bf16 cast costs ~5e-3)
        ref.patch_embed.register_forward_hook(lambda module, args, out: ours.patch_embed(args[0]))
        expected = ref(pixels.bfloat16(), grid_thw=grid_thw).pooler_output
        got = ours(pixels, grid_thw)[0]
    assert got.dtype == torch.bfloat16
    assert rel_err(got, expected) <= 1e-3


def test_tower_end_to_end_from_pixels(towers, pre_cfg, hf_image_processor):
    ref, ours = towers
    images = [random_image(100, 150, seed=3), random_image(300, 90, seed=4)]
    batch = preprocess_images(images, pre_cfg)
    hf = hf_image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = ref(hf["pixel_values"], grid_thw=hf["image_grid_thw"]).pooler_output
        got = ours(batch.pixel_values, batch.grid_thw)[0]
    assert rel_err(got, expected) <= 1e-5


def test_vision_config_refusals():
    with pytest.raises(QwenrtError, match="deepstack_visual_indexes"):
        VisionConfig.from_dict({**VISION, "deepstack_visual_indexes": [2]})
    with pytest.raises(QwenrtError, match="twice"):
        VisionConfig.from_dict({**VISION, "deepstack_visual_indexes": [1, 1]})
    with pytest.raises(QwenrtError, match="hidden_act"):
        VisionConfig.from_dict({**VISION, "hidden_act": "silu"})
    with pytest.raises(QwenrtError, match="divisible"):
        VisionConfig.from_dict({**VISION, "num_heads": 3})
    assert VisionConfig.from_dict({**VISION, "deepstack_visual_indexes": []}).head_dim == 32
    with pytest.raises(QwenrtError, match="grid_thw"):
        VisionTower(VisionConfig.from_dict(VISION))(torch.zeros(4, 1536), torch.tensor([[1, 2, 3]]))


def test_preprocess_config_files(tmp_path):
    image, video = load_preprocess_configs(tmp_path)
    assert (image.min_pixels, image.max_pixels, video.min_pixels, video.max_pixels) == (65536, 16777216, 4096, 25165824)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 1024, "longest_edge": 4096}, "max_pixels": 8192, "image_mean": [0.1, 0.2, 0.3]}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1, "max_frames": 8}))
    image, video = load_preprocess_configs(tmp_path)
    assert (image.min_pixels, image.max_pixels, image.image_mean) == (1024, 8192, (0.1, 0.2, 0.3))
    assert (video.fps, video.max_frames, video.min_pixels) == (1.0, 8, 4096)
    with pytest.raises(QwenrtError, match="do_normalize"):
        PreprocessConfig.from_dict({"do_normalize": False})


# ---------------------------------------------------------------- 3-D positions


@pytest.fixture(scope="module")
def hf_model():
    cfg = Qwen3_5Config(
        text_config=dict(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=32, layer_types=["full_attention"]),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=32,
                           num_position_embeddings=16),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID, vision_end_token_id=END_ID)
    return Qwen3_5Model(cfg).eval()


def mm_token_type_ids(ids: torch.Tensor) -> torch.Tensor:
    types = hf_processor().create_mm_token_type_ids(ids.tolist())
    return torch.tensor(types)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, rows))
    ids = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def expanded_ids(text: str, image_grid=None, video_grid=None, stamps=None) -> list[int]:
    tok = tiny_tokenizer()
    return expand_token_ids(tok.encode(text).ids, image_grid_thw=image_grid, video_grid_thw=video_grid,
                            video_timestamps=stamps, merge_size=2, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                            vision_start_token_id=START_ID, vision_end_token_id=END_ID,
                            encode=lambda s: tok.encode(s).ids)


def check_rope_index(hf_model, ids, mask, image_grid, video_grid):
    ref_pos, ref_delta = hf_model.get_rope_index(
        ids, mm_token_type_ids=mm_token_type_ids(ids), image_grid_thw=image_grid,
        video_grid_thw=None if video_grid is None else video_grid.clone(), attention_mask=mask)
    pos, delta = rope_index(ids, image_grid, video_grid, mask, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                            spatial_merge_size=2)
    assert torch.equal(pos, ref_pos)
    assert torch.equal(delta, ref_delta)
    return pos, delta


def test_rope_index_images_batch_left_padded(hf_model):
    text = "a <|vision_start|><|image_pad|><|vision_end|> b c <|vision_start|><|image_pad|><|vision_end|> d"
    grids = torch.tensor([[1, 4, 6], [1, 8, 2], [1, 2, 2], [1, 6, 6]])
    rows = [expanded_ids(text, grids[:2]), expanded_ids("xy " + text, grids[2:])]
    ids, mask = left_pad(rows)
    check_rope_index(hf_model, ids, mask, grids, None)
    check_rope_index(hf_model, ids[:1, -len(rows[0]):], None, grids[:2], None)  # unpadded, no mask


def test_rope_index_video_and_decode_positions(hf_model):
    text = "watch <|vision_start|><|video_pad|><|vision_end|> now"
    video_grid = torch.tensor([[3, 4, 6]])
    stamps = [[0.25, 1.25, 2.0]]
    prompt = expanded_ids(text, video_grid=video_grid, stamps=stamps)
    ids, mask = left_pad([prompt, expanded_ids("text only, longer than the rest of it by far " * 3)])
    pos, delta = check_rope_index(hf_model, ids, mask, None, video_grid)
    # generated text continues where the prompt's positions leave off: n_real + rope_delta
    extended = torch.cat([ids, torch.full((2, 3), 65)], dim=1)
    full, _ = rope_index(extended, None, video_grid, torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1),
                         image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, spatial_merge_size=2)
    assert torch.equal(full[:, :, -3:], decode_position_ids(mask.sum(1), delta, 3))
    assert torch.equal(full[:, :, :ids.shape[1]], pos)


def test_rope_index_grid_mismatch_raises():
    ids = torch.tensor([[1] + [IMAGE_ID] * 6 + [2]])
    with pytest.raises(QwenrtError, match="does not match its grid"):
        rope_index(ids, torch.tensor([[1, 4, 4]]), image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                   spatial_merge_size=2)
    with pytest.raises(QwenrtError, match="more image grids"):
        rope_index(ids, torch.tensor([[1, 4, 6], [1, 2, 2]]), image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                   spatial_merge_size=2)


def test_load_image_rejects_unknown_type():
    with pytest.raises(QwenrtError, match="unsupported image input"):
        load_image(io.BytesIO(b""))
