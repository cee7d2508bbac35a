"""Write a new task for the built-in model as JSONL conversations for `qwenrt train --data`.

    python -m qwenrt.tiny.finetune_data mul.jsonl --n 8000 --replay 0.45 --facts 0.3   (training conversations)
    python -m qwenrt.tiny.finetune_data mul-eval.jsonl --n 200 --held-out                (held-out pairs only)

The task is two-digit multiplication with its working (tasks.mul_reasoning), which the built-in model cannot do;
`--facts` mixes in that share of one-digit times-table drills (the facts the working needs, in few tokens), `--replay`
that share of the built-in model's own conversations (tasks.REPLAY_WEIGHTS), so that fine-tuning keeps what it knew.
"""

from __future__ import annotations

import argparse
import sys

from qwenrt.tiny.tasks import multiplication_conversations
from qwenrt.train.data import write_jsonl


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--n", type=int, default=8000, help="conversations")
    p.add_argument("--replay", type=float, default=0.0, help="share of the built-in model's own conversations")
    p.add_argument("--facts", type=float, default=0.0, help="share of one-digit times-table drills")
    p.add_argument("--held-out", dest="held_out", action="store_true",
                   help="only held-out operand pairs and countries (for --eval-data and measuring)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n < 1 or not (0 <= args.replay <= 1 and 0 <= args.facts <= 1 - args.replay):
        p.error("--n must be at least 1, and --replay and --facts shares in [0, 1] together")
    try:
        write_jsonl(args.out, multiplication_conversations(args.n, args.seed, args.replay, args.held_out,
                                                          args.facts))
    except OSError as e:
        raise SystemExit(f"qwenrt: error: cannot write {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.n} conversations to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
