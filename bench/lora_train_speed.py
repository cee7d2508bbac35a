"""LoRA training throughput and peak memory on a published shape (issue 40's benchmark): `qwenrt train --lora-rank R`
on a frozen bf16 and int4 base, each run a fresh process, the bases interleaved over --repeats.

    python bench/lora_train_speed.py                       # 0.8B shape, rank 16, checkpointing, 2 threads
    python bench/lora_train_speed.py --bases bfloat16 int4 float32 --tokens 384 --steps 8

The base is the random checkpoint `qwenrt bench --shape` builds (cached), given the Qwen3.5 tokenizer; the data are
conversations of about --tokens tokens of random words, --batch per step. Training tokens/s is the trainer's own
(tokens over the training loop's time, the first step's allocations included); peak RSS is the training process's
(its ru_maxrss from wait4).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwenrt.bench import shape_checkpoint  # noqa: E402
from qwenrt.train.data import write_jsonl  # noqa: E402
from qwenrt.train.trainer import LOG_FILE  # noqa: E402


def with_tokenizer(model: Path, out: Path) -> Path:
    """A checkpoint directory of `model`'s weights (hard-linked where the file system allows, else copied) and the
    Qwen3.5 tokenizer."""
    from tests.tokenizer_fixture import build_qwen35_tokenizer

    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        try:
            os.link(model / name, out / name)
        except OSError:
            shutil.copyfile(model / name, out / name)
    build_qwen35_tokenizer(out)
    return out


def conversations(n: int, tokens: int, seed: int) -> list[dict]:
    """n chats of about `tokens` tokens: a question and an answer of random lowercase words."""
    rng = random.Random(seed)

    def words(count: int) -> str:
        return " ".join("".join(rng.choice("abcdefghijklmnoprstuw") for _ in range(rng.randint(3, 8)))
                        for _ in range(count))

    return [{"messages": [{"role": "user", "content": words(tokens // 6)},
                          {"role": "assistant", "content": words(tokens // 3)}]} for _ in range(n)]


def run(base: Path, data: Path, out: Path, lora_base: str, args) -> dict:
    """One training process: {tok/s, peak RSS GiB, wall s}."""
    command = [sys.executable, "-m", "qwenrt", "train", str(out), "--init", str(base), "--data", str(data),
               "--lora-rank", str(args.rank), "--lora-base", lora_base, "--steps", str(args.steps),
               "--batch-size", str(args.batch), "--threads", str(args.threads), "--quiet"]
    if args.checkpointing:
        command.append("--gradient-checkpointing")
    began = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"qwenrt train failed ({status}): {' '.join(command)}")
    last = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()][-1]
    return {"tok_s": last["tok_s"], "peak_gib": usage.ru_maxrss / 2**20, "wall_s": time.perf_counter() - began}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--bases", nargs="+", default=["bfloat16", "int4"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=384, help="tokens per conversation, about")
    p.add_argument("--batch", type=int, default=1, help="conversations per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = with_tokenizer(shape_checkpoint(args.shape), tmp / "base")
        data = tmp / "data.jsonl"
        write_jsonl(data, conversations(args.batch * args.steps, args.tokens, 0))
        samples = {b: [] for b in args.bases}
        for r in range(args.repeats):
            for b in args.bases:
                samples[b].append(run(base, data, tmp / f"out-{b}-{r}", b, args))
    print(f"LoRA rank {args.rank} on every projection, {args.shape} shape, {args.batch} x ~{args.tokens} tokens per "
          f"step, {args.steps} steps, {args.threads} threads, checkpointing {'on' if args.checkpointing else 'off'}; "
          f"median of {args.repeats} (min-max)")
    for b, runs in samples.items():
        rates, peaks = [s["tok_s"] for s in runs], [s["peak_gib"] for s in runs]
        print(f"  base {b:<9} {statistics.median(rates):7.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})   "
              f"peak RSS {statistics.median(peaks):.2f} GiB   wall {statistics.median(s['wall_s'] for s in runs):.0f} s")


if __name__ == "__main__":
    main()
