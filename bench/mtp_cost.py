"""What one speculative step costs at batch 1 (issue 11's cost side). Not a test: a measurement.

    python bench/mtp_cost.py                       # the random 0.8B shape with its (random) MTP head, bf16
    python bench/mtp_cost.py --model DIR --quantize int4

In one process, interleaved, medians over --repeats: a plain decode step; a verification of k+1 tokens (the last
token and k drafts, of which the first is kept: the cache stays the same length); the MTP head's drafting of k tokens
(one forward over 2 pending (hidden, next token) pairs, then k-1 steps on its own output, the draft head over the
first --draft-vocab ids). From these, the speedup a step with k drafts gives when each draft is accepted with
probability a (independently): (1 + a + ... + a^k) · decode / (verify(k) + draft(k)).
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
from qwenrt.bench import quantized_checkpoint, shape_checkpoint  # noqa: E402
from qwenrt.engine import Engine, Request  # noqa: E402
from qwenrt.sampling import SamplingParams  # noqa: E402

ACCEPTANCE = (0.6, 0.8, 0.95)


def prefilled_sequence(engine: Engine, prompt_len: int, vocab: int):
    """A sequence of the engine with its prompt prefilled and one token sampled (left in the engine's hands)."""
    ids = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    request = Request(ids, SamplingParams(max_tokens=1 << 20, ignore_eos=True), speculative_tokens=3)
    engine.add_request(request, lambda out: None)
    seq = engine._sequences[request.request_id]
    while seq.prefilling or not seq.tokens:
        engine._take_new([])
        for s in engine.scheduler.admit():
            engine._start(s, [])
        for s, n in engine.scheduler.schedule(4096).prefill:
            engine._prefill(s, n, [])
    return seq


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--model", help="a checkpoint directory (with an MTP head) instead of --shape")
    p.add_argument("--quantize", default="none", help="none, int8 or int4 (a checkpoint written once)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--draft-vocab", type=int, default=32768)
    args = p.parse_args(argv)
    path = Path(args.model) if args.model else shape_checkpoint(args.shape)
    if args.quantize != "none":
        path = quantized_checkpoint(path, args.quantize, None)
    model, _ = qwenrt.load(path)
    if getattr(model, "mtp", None) is None:
        sys.exit(f"{path}: no MTP head")
    engine = Engine(model, speculative_tokens=3, prefix_cache_size=0, draft_vocab=args.draft_vocab)
    runner = engine.runner
    seq = prefilled_sequence(engine, args.prompt_len, model.config.text.vocab_size)
    drafts = [seq.tokens[-1]] * 3

    def verify(k):
        v = runner.verify([seq], [drafts[:k]])[0]
        runner.commit(seq, v, 1)
        seq.tokens.append(seq.tokens[-1])
        return v

    def draft(k):
        v = verify(1)  # fresh (hidden, next token) pairs: the last two positions
        full = seq.prompt.ids + seq.tokens
        seq.mtp_index, seq.mtp_pending, seq.mtp_count = len(full) - 3, [v.hidden[:1], v.hidden[:1]], 2
        return timed(lambda: runner.draft([seq], [k]))

    def decode():
        runner.decode([seq])
        seq.tokens.append(seq.tokens[-1])

    times = {"decode": []} | {f"verify {k}": [] for k in (1, 2, 3)} | {f"draft {k}": [] for k in (1, 2, 3)}
    with torch.inference_mode():
        for _ in range(3):  # warm-up
            decode(), verify(3), draft(3)
        for _ in range(args.repeats):
            times["decode"].append(timed(decode))
            for k in (1, 2, 3):
                times[f"verify {k}"].append(timed(lambda: verify(k)))
                times[f"draft {k}"].append(draft(k))
    med = {name: statistics.median(t) for name, t in times.items()}
    step = med["decode"]
    print(f"{path.name} ({args.quantize}), prompt {args.prompt_len}, draft vocabulary {args.draft_vocab}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"\n| | ms | × decode step |\n|---|---|---|\n| decode step | {1e3 * step:.1f} | 1.00 |")
    for name in list(med)[1:]:
        print(f"| {name} | {1e3 * med[name]:.1f} | {med[name] / step:.2f} |")
    print("\n| drafts k | " + " | ".join(f"speedup at a = {a}" for a in ACCEPTANCE) + " |\n|---|---|---|---|")
    for k in (1, 2, 3):
        cost = med[f"verify {k}"] + med[f"draft {k}"]
        gains = [sum(a ** i for i in range(k + 1)) * step / cost for a in ACCEPTANCE]
        print(f"| {k} | " + " | ".join(f"{g:.2f}×" for g in gains) + " |")


if __name__ == "__main__":
    main()
