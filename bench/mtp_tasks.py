"""Speculative decoding on the built-in model's own tasks (issue 11's speed side on a trained MTP head). A measurement.

    python bench/mtp_tasks.py                     # qwenrt/tiny/model, held-out add/sub prompts, thinking on
    python bench/mtp_tasks.py --counts 0,1,2,3,auto --prompts 20 --repeats 5

Random prompt tokens (what `qwenrt bench` feeds) are outside what the model was trained on, so its continuations,
and the drafts of its MTP head, are noise there; these prompts are held-out questions of its training families,
answered greedily until the end of the turn, one request at a time (batch 1). For each draft count: decode tok/s
(generated tokens after the first / the time after the first token, summed over the prompts; the median over
repeats, which are interleaved count by count), acceptance per draft position and the mean accepted length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qwenrt  # noqa: E402
from qwenrt.engine import Engine, Request  # noqa: E402
from qwenrt.engine.request import DraftCounts  # noqa: E402
from qwenrt.sampling import SamplingParams  # noqa: E402
from qwenrt.tiny.tasks import quality_tasks  # noqa: E402
from qwenrt.units import speculative_tokens  # noqa: E402


def run(model, tokenizer, prompts: list[list[int]], count) -> tuple[float, DraftCounts]:
    """(decode tok/s, draft statistics) over the prompts, one request at a time through a fresh engine."""
    engine = Engine(model, tokenizer, speculative_tokens=count, prefix_cache_size=0)
    tokens, seconds = 0, 0.0
    for ids in prompts:
        marks = []
        for out in engine.submit(Request(ids, SamplingParams(max_tokens=400, temperature=0.0))):
            marks += [time.perf_counter()] * len(out.token_ids)
        tokens, seconds = tokens + len(marks) - 1, seconds + marks[-1] - marks[0]
    return tokens / seconds, engine.draft_counts  # every request's


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint trained on the built-in tasks (default: the built-in)")
    p.add_argument("--counts", default="0,1,2,3,auto", help="draft counts to compare (0 = off)")
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts per family (add, sub)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = qwenrt.load(args.model)
    counts = [speculative_tokens(c) for c in args.counts.split(",")]
    tasks = quality_tasks("add", args.prompts, 1234) + quality_tasks("sub", args.prompts, 1234)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(t.messages, enable_thinking=True)) for t in tasks]
    run(model, tokenizer, prompts[:4], counts[-1])  # warm-up: kernel builds, first-call allocations
    speeds: dict = {c: [] for c in counts}
    stats: dict = {}
    for _ in range(args.repeats):
        for c in counts:
            tps, stats[c] = run(model, tokenizer, prompts, c)
            speeds[c].append(tps)
    base = statistics.median(speeds[counts[0]]) if counts[0] == 0 else None
    print(f"{len(prompts)} held-out add/sub prompts, thinking on, greedy to the end of the turn, batch 1, "
          f"{args.threads} threads, {args.repeats} interleaved repeats (median, min-max)")
    print(f"{'drafts':>7} {'decode tok/s':>22} {'vs off':>7} {'acceptance per position':>28} {'tokens/step':>12}")
    for c in counts:
        tps = statistics.median(speeds[c])
        d = stats[c]
        per = " ".join(f"{a / max(n, 1):.2f}" for n, a in zip(d.drafted, d.accepted)) or "-"
        ratio = f"{tps / base:.2f}x" if base else "-"
        mean = f"{d.mean_accepted_length:.2f}" if d.rounds else "-"
        spread = f"({min(speeds[c]):,.0f}-{max(speeds[c]):,.0f})"
        print(f"{str(c):>7} {tps:>10,.0f} {spread:>11} {ratio:>7} {per:>28} {mean:>12}")


if __name__ == "__main__":
    main()
