"""Issue 40's classifier check: `qwenrt finetune --task classify` on the built-in model for "is this sum correct?"
over statements the project generates (qwenrt.tiny.tasks.sum_statements: half right, half near misses), held out
by operand pair (pairs never trained on). Prints the command, wall time, held-out accuracy and macro-F1 (of the
final evaluation in train_log.jsonl) and the run's peak RSS; --json writes them too.

    python bench/classify_sums.py --working --steps 400 --threads 1   # statements after their column working
    python bench/classify_sums.py --digits 2 --steps 600 --threads 1   # the bare "37 + 48 = 85"
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--digits", type=int, default=2, help="operands of up to this many digits")
    p.add_argument("--working", action="store_true", help="statements after their column working (the built-in "
                   "model computes sums through its working)")
    p.add_argument("--train", type=int, default=8000, help="training statements")
    p.add_argument("--eval", type=int, default=1000, help="held-out statements (operand pairs never trained on)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="output directory (default: a temporary one, removed)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from qwenrt.tiny.tasks import sum_statements
    from qwenrt.train.data import write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_jsonl(tmp / "train.jsonl", sum_statements(args.train, 1, digits=args.digits, working=args.working))
        write_jsonl(tmp / "eval.jsonl", sum_statements(args.eval, 2, heldout=True, digits=args.digits,
                                                       working=args.working))
        out = Path(args.out) if args.out else tmp / "out"
        command = ["qwenrt", "finetune", str(out), "--task", "classify", "--data", str(tmp / "train.jsonl"),
                   "--eval-data", str(tmp / "eval.jsonl"), "--num-labels", "2", "--steps", str(args.steps),
                   "--eval-every", str(max(1, args.steps // 4)), "--lr", str(args.lr), "--threads",
                   str(args.threads), "--overwrite", "-q"]
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "qwenrt", *command[1:]], cwd=ROOT, check=True)
        seconds = time.perf_counter() - start
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    final = [r for r in log if "eval_accuracy" in r][-1]
    figures = {"command": " ".join(command), "seconds": round(seconds, 1), "steps": final["step"],
               "eval_accuracy": final["eval_accuracy"], "eval_macro_f1": final["eval_macro_f1"],
               "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
