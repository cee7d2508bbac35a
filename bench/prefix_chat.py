"""Time to first token per turn of a long chat, with and without the prefix cache, in one process, interleaved.

    python bench/prefix_chat.py [--shape 0.8b] [--turns 10] [--user-tokens 200] [--gen 64] [--dtype bf16]

Two conversations with the same user turns run side by side on one model: one on an engine with the prefix cache,
one without; turn k of each runs back to back, so drift in the machine's speed hits both alike. The model is a
random-weight checkpoint at a published shape with the real Qwen3.5 tokenizer and chat template (needs the test
extra); answers are 64 greedy tokens (end-of-sequence ignored), thinking off.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import qwenrt
from qwenrt.bench import shape_checkpoint
from qwenrt.engine import Engine, Request
from qwenrt.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.tokenizer_fixture import build_qwen35_tokenizer  # noqa: E402

WORDS = ("river valley mountain farmer harvest season weather market village bridge stone winter summer road "
         "forest animal water light story question answer number history language music garden").split()


def checkpoint_with_tokenizer(shape: str) -> Path:
    weights = shape_checkpoint(shape)
    folder = Path(tempfile.mkdtemp(prefix=f"qwenrt-{shape}-chat-"))
    for f in weights.iterdir():
        (folder / f.name).symlink_to(f)
    build_qwen35_tokenizer(folder)
    return folder


def user_turn(tok, n: int, rng: random.Random) -> str:
    words = []
    while len(tok.encode(" ".join(words))) < n:
        words.append(rng.choice(WORDS))
    return " ".join(words) + "?"


def turn(engine: Engine, history: list[dict], gen: int) -> tuple[float, int, int, str]:
    """(TTFT s, prompt tokens, cached tokens, answer text) of one turn."""
    stream = engine.submit(Request(history, SamplingParams(max_tokens=gen, ignore_eos=True), enable_thinking=False))
    start, first, text, last = time.perf_counter(), None, [], None
    for last in stream:
        first = first or time.perf_counter()
        text.append(last.text)
    return first - start, last.prompt_tokens, last.cached_tokens, "".join(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = qwenrt.load(checkpoint_with_tokenizer(args.shape), dtype=args.dtype)
    engines = {"cached": Engine(model, tok), "uncached": Engine(model, tok, prefix_cache_size=0)}
    histories = {name: [{"role": "system", "content": "You are a helpful assistant."}] for name in engines}
    rng = random.Random(0)
    turn(engines["uncached"], [{"role": "user", "content": "warm up"}], 4)
    print(f"{args.shape} {args.dtype}, {args.threads} threads: {args.turns} turns of ~{args.user_tokens} user tokens "
          f"and {args.gen} generated\n")
    print("| turn | prompt tokens | TTFT with cache s (cached tokens) | TTFT without s | ratio |")
    print("|---|---|---|---|---|")
    first = {}
    for k in range(1, args.turns + 1):
        question = user_turn(tok, args.user_tokens, rng)
        row = {}
        for name, engine in engines.items():
            histories[name].append({"role": "user", "content": question})
            ttft, n, cached, answer = turn(engine, histories[name], args.gen)
            histories[name].append({"role": "assistant", "content": answer})
            row[name] = (ttft, n, cached)
            first.setdefault(name, ttft)
        (c, n, cached), (u, _, _) = row["cached"], row["uncached"]
        print(f"| {k} | {n} | {c:.2f} ({cached}) | {u:.2f} | {u / c:.1f}x |", flush=True)
    print(f"\nturn {args.turns} / turn 1 TTFT: with the cache {row['cached'][0] / first['cached']:.2f}, "
          f"without {row['uncached'][0] / first['uncached']:.2f}")
    stats = engines["cached"].prefix_cache
    print(f"prefix cache: {stats.hits}/{stats.queries} requests hit, {stats.hit_tokens}/{stats.query_tokens} prompt "
          f"tokens reused, {stats.nbytes / 2**20:.0f} MiB held in {len(stats)} snapshots")


if __name__ == "__main__":
    main()
