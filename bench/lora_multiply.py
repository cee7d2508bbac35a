"""LoRA fine-tuning of the built-in model on a task it cannot do (issue 40's check). A measurement.

    python bench/lora_multiply.py                         # the chosen settings; the adapter into a temporary folder
    python bench/lora_multiply.py --out /tmp/mul --steps 200 --n 100 --curve-every 50

Two-digit multiplication with its working (qwenrt.tiny.tasks.mul_reasoning), written as JSONL with a share of the
built-in model's own conversations replayed (tasks.REPLAY_WEIGHTS: calculator calls and copying weighted up, as they
drift most), trains LoRA adapters on every projection of qwenrt-tiny through the
trainer `qwenrt train --lora-rank` runs (the base frozen in fp32). Then greedy exact answers on held-out prompts,
base against adapted (`qwenrt.load(base, adapter=OUT)`): multiplication of held-out pairs, and each old task as
qwenrt.tiny.evaluate measures it, thinking off and on. Prints the table, the training's wall and CPU seconds,
tokens/s and the process's peak RSS; `--curve-every K` also the multiplication accuracy of every K-th step's
adapter against the CPU seconds spent to reach it.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qwenrt  # noqa: E402
from qwenrt.default_model import default_model_path  # noqa: E402
from qwenrt.tiny.evaluate import answer_accuracy, tool_quality  # noqa: E402
from qwenrt.tiny.tasks import multiplication_conversations, quality_tasks  # noqa: E402
from qwenrt.train.data import write_jsonl  # noqa: E402
from qwenrt.train.trainer import LOG_FILE, TrainConfig, train  # noqa: E402

MODES = {False: "off", True: "on"}
OLD_FAMILIES = ("add", "sub", "tool", "sort", "copy")


def accuracy(model, tokenizer, family: str, thinking: bool, n: int, seed: int) -> dict:
    """{row name: share right} for one family and thinking mode, on n held-out prompts (tool: calls and answers)."""
    if family == "tool":
        tasks = quality_tasks("calculator", n // 2, seed) + quality_tasks("capital", n // 2, seed)
        return {f"tool {key}": value for key, value in tool_quality(model, tokenizer, tasks, thinking).items()}
    return {family: answer_accuracy(model, tokenizer, quality_tasks(family, n, seed), thinking)}


def figures(base: str, adapter: str | None, families: tuple[str, ...], n: int, seed: int) -> dict:
    """{(row, thinking): share} for the base model, or with the adapter on it."""
    model, tokenizer = qwenrt.load(base, adapter=adapter)
    out = {}
    for family in families:
        for thinking in (False, True):
            for row, value in accuracy(model, tokenizer, family, thinking, n, seed).items():
                out[row, thinking] = value
    return out


def train_adapter(args, out: Path) -> dict:
    """Write the data under `out`, train the adapter into out/adapter; the summary with peak RSS added."""
    write_jsonl(out / "train.jsonl", multiplication_conversations(args.conversations, args.seed, args.replay,
                                                                    facts=args.facts))
    write_jsonl(out / "eval.jsonl", multiplication_conversations(48, args.seed + 7, heldout=True))
    curve = args.curve_every or args.steps
    cfg = TrainConfig(out=str(out / "adapter"), init=args.base, data=str(out / "train.jsonl"),
                      eval_data=str(out / "eval.jsonl"), lora_rank=args.rank, lr=args.lr, batch_size=args.batch,
                      steps=args.steps, warmup=args.warmup, length_groups=8, eval_every=curve, save_every=curve,
                      keep_checkpoints=args.steps // curve + 1, threads=args.threads, seed=args.seed,
                      progress=not args.quiet)
    summary = train(cfg)
    summary["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return summary


def curve(args, out: Path) -> list[tuple[int, float, float]]:
    """(step, CPU seconds, multiplication accuracy thinking off) for each step checkpoint the run kept."""
    records = [json.loads(line) for line in (out / "adapter" / LOG_FILE).read_text().splitlines()]
    cpu = {r["step"]: r["cpu_s"] for r in records if "cpu_s" in r}
    points = []
    for step_dir in sorted((out / "adapter" / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(step_dir.name.split("-")[1])
        model, tokenizer = qwenrt.load(args.base, adapter=str(step_dir))
        points.append((step, cpu[step], answer_accuracy(model, tokenizer, quality_tasks("mul", args.n, args.eval_seed),
                                                        False)))
    return points


def table(base: dict, tuned: dict, n: int) -> str:
    rows = [f"| held-out exact ({n} prompts each) | base off | base on | LoRA off | LoRA on |", "|---|---|---|---|---|"]
    for row in dict.fromkeys(r for r, _ in base):
        cells = [f"{d[row, t]:.0%}" for d in (base, tuned) for t in (False, True)]
        rows.append(f"| {'multiplication 10-99' if row == 'mul' else row} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default=str(default_model_path()), help="default: the built-in model")
    p.add_argument("--out", help="where the data and the adapter go (default: a temporary folder, removed)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=8, help="conversations per step")
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--replay", type=float, default=0.6, help="share of the built-in model's own conversations")
    p.add_argument("--facts", type=float, default=0.3, help="share of one-digit times-table drills")
    p.add_argument("--conversations", type=int, default=8000, help="training conversations written")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=100, help="held-out prompts per task and mode")
    p.add_argument("--eval-seed", dest="eval_seed", type=int, default=1234)
    p.add_argument("--curve-every", dest="curve_every", type=int, help="also evaluate every K-th step's adapter")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out or scratch)
        out.mkdir(parents=True, exist_ok=True)
        summary = train_adapter(args, out)
        families = ("mul",) + OLD_FAMILIES
        base = figures(args.base, None, families, args.n, args.eval_seed)
        tuned = figures(args.base, str(out / "adapter"), families, args.n, args.eval_seed)
        print(table(base, tuned, args.n))
        print(f"\ntraining: {summary['steps']} steps x {args.batch} conversations (replay {args.replay:.0%}, drills "
              f"{args.facts:.0%}), rank {args.rank}, lr {args.lr:g}, {args.threads} threads: {summary['seconds']:.0f} s wall, "
              f"{summary['cpu_seconds']:.0f} CPU s, {summary['tokens']} tokens, "
              f"{summary['tokens'] / summary['seconds']:.0f} tok/s, peak RSS {summary['peak_rss_mib']:.0f} MiB, "
              f"{summary['parameters']['lora']} adapter parameters")
        if args.curve_every:
            print("\n| step | CPU s | multiplication, thinking off |\n|---|---|---|")
            for step, cpu_s, right in curve(args, out):
                print(f"| {step} | {cpu_s:.0f} | {right:.0%} |")


if __name__ == "__main__":
    main()
