"""Multi-turn chat through replicas: prefix-cache hit rate and time to first token, `qwenrt serve` alone vs
`qwenrt serve --ray` with prefix-affinity or power-of-two routing. Not a test: a measurement.

    python bench/ray_chat.py                          # the built-in model, 16 conversations of 4 turns
    python bench/ray_chat.py --shape 0.8b --conversations 16 --turns 4 --json out.json

Every configuration gets the same conversations: each has its own system prompt (--system-words words) and
--turns user turns of --user-words words, all running at once, each turn streamed (greedy, --gen tokens, EOS
ignored, thinking off) after the previous one's answer. Figures over turns 2.. (a first turn has nothing to reuse):
hit rate = prompt tokens restored from the prefix cache / prompt tokens (from each answer's usage), TTFT p50/p95.
Configurations: plain (one server, every core), affinity and pow2 (--replicas replicas of --threads-per-replica
threads on a local Ray cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `bench.*`, `tests.*` when run as a script

from bench.serve_load import WORDS, percentile, request, tokenizer_dir  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402


def conversations(n: int, system_words: int, user_words: int, turns: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))
    return [{"system": f"Conversation {i}. " + words(system_words), "users": [words(user_words) for _ in range(turns)]}
            for i in range(n)]


async def converse(url: str, convo: dict, gen: int) -> list[dict]:
    """One conversation's turns in order: per turn TTFT, prompt and cached tokens, the replica that answered."""
    messages = [{"role": "system", "content": convo["system"]}]
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        for text in convo["users"]:
            messages.append({"role": "user", "content": text})
            body = dict(model="bench", messages=messages, max_tokens=gen, temperature=0, ignore_eos=True, stream=True,
                        stream_options={"include_usage": True}, chat_template_kwargs={"enable_thinking": False})
            r = await request(client, "/v1/chat/completions", body)
            if r.status != 200 or not r.done or r.usage is None:
                raise SystemExit(f"a turn failed: {r}")
            usage = r.usage
            out.append(dict(ttft=r.ttft, prompt=usage["prompt_tokens"],
                            cached=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
            messages.append({"role": "assistant", "content": f"answer {len(out)}"})
    return out


def run(url: str, convos: list[dict], gen: int) -> dict:
    async def all_of_them():
        return await asyncio.gather(*(converse(url, c, gen) for c in convos))
    start = time.perf_counter()
    turns = asyncio.run(all_of_them())
    wall = time.perf_counter() - start
    later = [t for conv in turns for t in conv[1:]]
    ttft = [t["ttft"] for t in later]
    return dict(wall_s=wall, hit_rate=sum(t["cached"] for t in later) / sum(t["prompt"] for t in later),
                ttft_p50=percentile(ttft, 50), ttft_p95=percentile(ttft, 95),
                first_ttft_p50=percentile([conv[0]["ttft"] for conv in turns], 50))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", help="random weights at a published shape (default: the built-in model)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, default=40)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--configs", default="plain,affinity,pow2")
    p.add_argument("--serve-args", default="--max-model-len 4096", help="options every server gets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    checkpoint, options = None, ["--served-model-name", "bench", *args.serve_args.split()]
    if args.shape:
        from qwenrt.bench import shape_checkpoint

        checkpoint = shape_checkpoint(args.shape)
        options += ["--tokenizer", str(tokenizer_dir(argparse.Namespace(tokenizer=None, model=None)))]
    convos = conversations(args.conversations, args.system_words, args.user_words, args.turns, args.seed)
    ray = ["--ray", "--replicas", str(args.replicas), "--threads-per-replica", str(args.threads_per_replica)]
    configs = {"plain": [], "affinity": [*ray, "--routing", "affinity"], "pow2": [*ray, "--routing", "pow2"]}
    log_dir = Path(tempfile.mkdtemp(prefix="ray-chat-"))
    rows = {}
    for name in args.configs.split(","):
        print(f"== {name}: starting the server", file=sys.stderr, flush=True)
        server = ServerProcess(checkpoint, log_dir / f"{name}.log", *options, *configs[name], timeout=900)
        try:
            run(server.url, conversations(2, 10, 5, 2, args.seed + 1), 2)  # warm-up, other prompts
            rows[name] = run(server.url, convos, args.gen)
        finally:
            server.stop()
        print(f"   {rows[name]}", file=sys.stderr, flush=True)
    title = (f"{args.conversations} conversations x {args.turns} turns at once ({args.shape or 'qwenrt-tiny'}; "
             f"system {args.system_words} words, turns {args.user_words} words, {args.gen} tokens each); Ray: "
             f"{args.replicas} replicas x {args.threads_per_replica} thread(s); figures over turns 2..{args.turns}")
    lines = [title, "", "| configuration | prefix-cache hit rate | TTFT p50 s | TTFT p95 s | first turn TTFT p50 s | "
             "wall s |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['hit_rate']:.1%} | {r['ttft_p50']:.3f} | {r['ttft_p95']:.3f} | "
                     f"{r['first_ttft_p50']:.3f} | {r['wall_s']:.1f} |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(title=title, rows=rows), indent=2))


if __name__ == "__main__":
    main()
