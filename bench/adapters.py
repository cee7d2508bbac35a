"""What serving LoRA adapters costs at decode: a batch of rows with no adapter, all with one adapter, and a mix of
two adapters and the base, interleaved in one process (medians over --repeats).

    python bench/adapters.py                                  # the built-in model, bf16
    python bench/adapters.py --shape 0.8b --quantize int4     # the random 0.8B (bench's cached checkpoint), int4

Adapters: rank --rank on every projection of every layer (random, non-zero), written in PEFT's format and loaded
with qwenrt.load(adapters=...), as `qwenrt serve --lora` does. Decode tok/s = generated tokens of the whole batch
over the decode time (each row's first token excluded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import qwenrt  # noqa: E402
from qwenrt.adapters import save_adapter  # noqa: E402
from qwenrt.engine import Engine  # noqa: E402
from qwenrt.lora import LoraSpec, add_adapters, lora_modules  # noqa: E402


def random_adapter(path: Path, out: Path, rank: int, seed: int) -> None:
    model, _ = qwenrt.load(path, dtype="float32")
    spec = LoraSpec(rank, 2 * rank)
    add_adapters(model, spec, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.01)
    save_adapter(out, model, spec, str(path))


def decode_tps(engine: Engine, names: list[str | None], prompt_len: int, gen_len: int) -> float:
    prompts = [[100 + 7 * b + t for t in range(prompt_len)] for b in range(len(names))]
    done = qwenrt.batch_generate(engine, None, prompts, adapter=names, max_tokens=gen_len, temperature=0.0,
                                 ignore_eos=True, speculative_tokens=0)
    return sum(c.generation_tps for c in done)  # the rows decode together: their rates add up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", help="a bench shape (e.g. 0.8b: its cached random checkpoint); default the built-in "
                   "model")
    p.add_argument("--quantize", choices=["int8", "int4"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.shape:
        from qwenrt.bench import shape_checkpoint

        path = shape_checkpoint(args.shape)
    else:
        from qwenrt.default_model import default_model_path

        path = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {name: Path(tmp) / name for name in ("a", "b")}
        for seed, (name, d) in enumerate(dirs.items()):
            random_adapter(path, d, args.rank, seed)
        model, _ = qwenrt.load(path, dtype="bfloat16", quantize=args.quantize, adapters=dirs)
    engine = Engine(model, None, prefix_cache_size=0)
    B = args.batch
    cases = {"base only": [None] * B, "one adapter": ["a"] * B,
             "two adapters + base": [[None, "a", "b"][i % 3] for i in range(B)]}
    decode_tps(engine, cases["two adapters + base"], args.prompt_len, 8)  # warm-up: plans, kernels
    samples: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case, names in cases.items():
            samples[case].append(decode_tps(engine, names, args.prompt_len, args.gen_len))
    base = statistics.median(samples["base only"])
    name = f"random {args.shape}" if args.shape else "qwenrt-tiny"
    print(f"{name}, bf16{' ' + args.quantize if args.quantize else ''}, batch {B}, rank {args.rank} on every "
          f"projection, {torch.get_num_threads()} threads; decode tok/s (median of {args.repeats}, min-max)")
    for case, values in samples.items():
        median = statistics.median(values)
        print(f"  {case:<22} {median:8.1f}  ({min(values):.1f}-{max(values):.1f})  {median / base:.2f}x")


if __name__ == "__main__":
    main()
