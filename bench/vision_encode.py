"""The time to encode one image with a vision tower at a published shape (random bf16 weights, built in memory),
preprocessing and the tower apart: the ViT blocks, the 2×2 merger and, for Qwen3-VL, the DeepStack mergers. Not a
test: a benchmark.

    python bench/vision_encode.py                               # Qwen3-VL-2B's tower, one 1024×1024 image
    python bench/vision_encode.py --shape qwen3-vl-8b --size 512 --repeats 3

GFLOP per image: ~2·params·patches for the blocks' matrices (patches = (size/16)², 4096 at 1024) plus attention's
4·patches²·hidden per block (full attention inside the image).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwenrt.vision import VisionConfig, VisionTower, preprocess_images  # noqa: E402
from qwenrt.vision.config import PreprocessConfig  # noqa: E402

# the published vision_config of each model (Qwen/Qwen3-VL-*-Instruct config.json)
TOWERS = {
    "qwen3-vl-2b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                        deepstack_visual_indexes=[5, 11, 17]),
    "qwen3-vl-8b": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                        deepstack_visual_indexes=[8, 16, 24]),
}


def tower(shape: str) -> VisionTower:
    cfg = VisionConfig.from_dict(dict(TOWERS[shape], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                      num_position_embeddings=2304))
    model = VisionTower(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.to(torch.bfloat16).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=TOWERS, default="qwen3-vl-2b")
    p.add_argument("--size", type=int, default=1024, help="image side in pixels")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = tower(args.shape)
    params = sum(t.numel() for t in model.parameters())
    pixels = np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    cfg = PreprocessConfig.from_dict({"size": {"shortest_edge": 64 * 64, "longest_edge": 4096 * 4096}})
    start = time.perf_counter()
    batch = preprocess_images([image], cfg)
    preprocess_s = time.perf_counter() - start
    times = []
    with torch.inference_mode():
        for _ in range(args.repeats):
            start = time.perf_counter()
            main_out, deepstack = model(batch.pixel_values, batch.grid_thw)
            times.append(time.perf_counter() - start)
    t, h, w = batch.grid_thw[0].tolist()
    print(f"{args.shape} tower ({params / 1e6:.0f}M parameters, bf16, {args.threads} threads): one {args.size}×"
          f"{args.size} image = {t * h * w} patches -> {main_out.shape[0]} tokens + {len(deepstack)} DeepStack "
          f"features; preprocess {preprocess_s * 1e3:.0f} ms, tower median {statistics.median(times):.2f} s "
          f"(min {min(times):.2f}, max {max(times):.2f}, {args.repeats} runs)")


if __name__ == "__main__":
    main()
