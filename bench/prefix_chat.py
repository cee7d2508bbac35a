"""Time to first token per turn of a long chat, with and without the prefix cache, in one process, interleaved.

    python bench/prefix_chat.py [--shape 0.8b] [--turns 10] [--user-tokens 200] [--gen 64] [--dtype bf16] [--server]

Two conversations with the same user turns run side by side on one model: one on an engine with the prefix cache,
one without; turn k of each runs back to back, so drift in the machine's speed hits both alike. The model is a
random-weight checkpoint at a published shape with the real Qwen3.5 tokenizer and chat template (needs the test
extra); answers are 64 greedy tokens (end-of-sequence ignored), thinking off, speculation off (a random MTP head
predicts nothing). --server: the same through two `qwenrt serve` processes (one with `--prefix-cache-size 0`),
a streamed chat completion per turn, and the cached server's prefix-cache counters from /metrics.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

import qwenrt
from qwenrt.bench import cache_dir, shape_checkpoint
from qwenrt.engine import Engine, Request
from qwenrt.sampling import SamplingParams
from qwenrt.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.server_process import ServerProcess  # noqa: E402
from tests.tokenizer_fixture import cached_qwen35_tokenizer  # noqa: E402

WORDS = ("river valley mountain farmer harvest season weather market village bridge stone winter summer road "
         "forest animal water light story question answer number history language music garden").split()


def user_turn(tok, n: int, rng: random.Random) -> str:
    words = []
    while len(tok.encode(" ".join(words))) < n:
        words.append(rng.choice(WORDS))
    return " ".join(words) + "?"


def turn(engine: Engine, history: list[dict], gen: int) -> tuple[float, int, int | None, str]:
    """(TTFT s, prompt tokens, cached tokens, answer text) of one turn."""
    stream = engine.submit(Request(history, SamplingParams(max_tokens=gen, ignore_eos=True), enable_thinking=False))
    start, first, text, last = time.perf_counter(), None, [], None
    for last in stream:
        first = first or time.perf_counter()
        text.append(last.text)
    return first - start, last.prompt_tokens, last.cached_tokens, "".join(text)


def server_turn(server: ServerProcess, history: list[dict], gen: int) -> tuple[float, int, int | None, str]:
    """turn() through a server: a streamed chat completion (cached tokens are not reported per request: None)."""
    body = dict(model="bench", messages=history, max_tokens=gen, temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, chat_template_kwargs={"enable_thinking": False})
    start, first, text, usage = time.perf_counter(), None, [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=None) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", ()):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    return first - start, usage["prompt_tokens"], None, "".join(text)


def start_servers(checkpoint: Path, tokenizer: Path, args, log_dir: Path) -> dict[str, ServerProcess]:
    options = ["--tokenizer", str(tokenizer), "--dtype", args.dtype, "--served-model-name", "bench",
               "--speculative-tokens", "0"]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    return {"cached": ServerProcess(checkpoint, log_dir / "cached.log", *options, env=env, timeout=900),
            "uncached": ServerProcess(checkpoint, log_dir / "uncached.log", *options, "--prefix-cache-size", "0",
                                      env=env, timeout=900)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--server", action="store_true", help="through two `qwenrt serve` processes")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint, tokenizer = shape_checkpoint(args.shape), cached_qwen35_tokenizer(cache_dir())
    tok = load_tokenizer(tokenizer)
    if args.server:
        servers = start_servers(checkpoint, tokenizer, args, Path(tempfile.mkdtemp(prefix="prefix-chat-")))
        runs = {name: functools.partial(server_turn, server) for name, server in servers.items()}
    else:
        model, _ = qwenrt.load(checkpoint, dtype=args.dtype)
        engines = {"cached": Engine(model, tok, speculative_tokens=0),
                   "uncached": Engine(model, tok, prefix_cache_size=0, speculative_tokens=0)}
        runs = {name: functools.partial(turn, engine) for name, engine in engines.items()}
    try:
        table(args, tok, runs)
        if args.server:
            cached = servers["cached"]
            queried, hit = cached.metric("prefix_cache_queries_total"), cached.metric("prefix_cache_hits_total")
            print(f"server /metrics: prefix_cache_hits_total {hit:.0f} of prefix_cache_queries_total {queried:.0f} "
                  f"prompt tokens ({hit / max(queried, 1):.0%})")
        else:
            stats = engines["cached"].prefix_cache
            print(f"prefix cache: {stats.hits}/{stats.queries} requests hit, {stats.hit_tokens}/{stats.query_tokens} "
                  f"prompt tokens reused, {stats.nbytes / 2**20:.0f} MiB held in {len(stats)} snapshots")
    finally:
        for server in servers.values() if args.server else ():
            server.stop()


def table(args, tok, runs: dict) -> None:
    """The conversations turn by turn, printed as a table. runs: name -> (history, gen) -> turn()'s figures."""
    histories = {name: [{"role": "system", "content": "You are a helpful assistant."}] for name in runs}
    rng = random.Random(0)
    for run in runs.values():  # first calls, and the engine's measured prefill speed (which sizes prompt chunks)
        run([{"role": "user", "content": "warm up " * 40}], 4)
    where = "through qwenrt serve, " if args.server else ""
    print(f"{args.shape} {args.dtype}, {where}{args.threads} threads: {args.turns} turns of ~{args.user_tokens} user "
          f"tokens and {args.gen} generated\n")
    print("| turn | prompt tokens | TTFT with cache s (cached tokens) | TTFT without s | ratio |")
    print("|---|---|---|---|---|")
    first = {}
    for k in range(1, args.turns + 1):
        question = user_turn(tok, args.user_tokens, rng)
        row = {}
        for name, run in runs.items():
            histories[name].append({"role": "user", "content": question})
            ttft, n, cached, answer = run(histories[name], args.gen)
            histories[name].append({"role": "assistant", "content": answer})
            row[name] = (ttft, n, cached)
            first.setdefault(name, ttft)
        (c, n, cached), (u, _, _) = row["cached"], row["uncached"]
        hits = f" ({cached})" if cached is not None else ""
        print(f"| {k} | {n} | {c:.2f}{hits} | {u:.2f} | {u / c:.1f}x |", flush=True)
    print(f"\nturn {args.turns} / turn 1 TTFT: with the cache {row['cached'][0] / first['cached']:.2f}, "
          f"without {row['uncached'][0] / first['uncached']:.2f}")


if __name__ == "__main__":
    main()
