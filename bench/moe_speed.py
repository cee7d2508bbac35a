"""Qwen3.5-35B-A3B (random weights) in qwenrt int4 against llama.cpp Q4_0 on the same weights. Not a test: a
benchmark.

    python bench/moe_speed.py --llama-cpp LLAMA_SRC --llama-build LLAMA_SRC/build/bin
    python bench/moe_speed.py ... --repeats 1 --prompt-len 128 --gen-len 16   # a quick look

The int4 checkpoint is `qwenrt bench --shape 35b-a3b --quantize int4`'s (written directly in int4, never in bf16);
`qwenrt convert --type q4_0` writes the same weights as llama.cpp's Q4_0 (int4 groups of 64 re-rounded to Q4_0's
blocks of 32; the Qwen3.5 tokenizer beside them, which llama.cpp needs), once, into --workdir (~12 minutes). The
two files do not fit in RAM together: before each engine runs, the other's file leaves the page cache and its own
is read in, so neither timing includes the disk. Then, per repeat, interleaved: qwenrt on its checkpoint, memory-
mapped (`qwenrt bench`'s worker: a fresh process, bf16 activations, a random prompt of --prompt-len tokens,
--gen-len greedy steps) and `llama-bench -t T -p P -n N -r 1 -lm none` on the GGUF, read into llama.cpp's own
memory (mapped, its repacked weights sit beside the file's pages: 22.9 GiB, more than a 24 GiB machine holds, and
both its speeds halve). Medians;
peak RSS is each process's high-water mark. Also printed: the weight bytes a decode step reads (top 8 of the 256
experts, the shared expert, attention, DeltaNet, the head) and the read bandwidth of this machine measured in the
same run, which bound decode at bandwidth / bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gguf_check import LlamaCpp  # noqa: E402
from bench.gguf_speed import llama_bench, medians  # noqa: E402

GIB = 1 << 30
SHAPE = "35b-a3b"


def with_tokenizer(checkpoint: Path, work: Path) -> Path:
    """The checkpoint's files and the Qwen3.5 tokenizer linked into one directory: llama.cpp loads no GGUF file
    without a vocabulary, and the random checkpoint has none."""
    from qwenrt.bench import cache_dir
    from tests.tokenizer_fixture import cached_qwen35_tokenizer

    linked = work / f"src-{checkpoint.name}"
    linked.mkdir(parents=True, exist_ok=True)
    for file in list(checkpoint.iterdir()) + list(cached_qwen35_tokenizer(cache_dir()).iterdir()):
        if not (linked / file.name).exists():
            (linked / file.name).symlink_to(file.resolve())
    return linked


def files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())


def read_into_cache(path: Path) -> None:
    """Read every file of `path` once (into the page cache)."""
    for file in files(path):
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


def drop_from_cache(path: Path) -> None:
    """Let the page cache drop the files of `path` (they are not in use)."""
    for file in files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bandwidth(threads: int) -> float:
    """GB/s of a `threads`-thread sum over 1 GiB of bf16 (what a decode step's weight reads amount to)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(GIB // 2, dtype=torch.bfloat16)
    x.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return GIB / statistics.median(times) / 1e9


def qwenrt_sample(path: Path, args) -> dict:
    from qwenrt.bench import _run

    r = _run(dict(engine="qwenrt", path=str(path), dtype="bf16", threads=args.threads, prompt_len=args.prompt_len,
                  gen_len=args.gen_len, seed=0))
    return dict(prefill_tps=r["prefill_tps"], decode_tps=r["decode_tps"], peak_rss=r["peak_rss"],
                decode_bytes=r["decode_bytes"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    LlamaCpp.add_options(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--workdir", type=Path, help="the GGUF file (default ~/.cache/qwenrt/bench/moe-speed)")
    args = p.parse_args(argv)
    llama = LlamaCpp.find(args)
    from qwenrt.bench import cache_dir, shape_checkpoint
    from qwenrt.quant import QuantSpec

    checkpoint = shape_checkpoint(SHAPE, quantize=QuantSpec.parse("int4"))
    work = args.workdir or cache_dir() / "moe-speed"
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / f"{SHAPE}-Q4_0.gguf"
    if not gguf.is_file():
        print(f"writing {gguf} (qwenrt convert --type q4_0)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "qwenrt", "convert", str(with_tokenizer(checkpoint, work)), str(gguf),
                        "--type", "q4_0"], check=True)
    bandwidth = read_bandwidth(args.threads)
    samples = {"qwenrt int4": [], "llama.cpp Q4_0": []}
    for repeat in range(args.repeats):
        print(f"[{repeat + 1}/{args.repeats}] qwenrt, llama.cpp", file=sys.stderr, flush=True)
        drop_from_cache(gguf)
        read_into_cache(checkpoint)
        samples["qwenrt int4"].append(qwenrt_sample(checkpoint, args))
        drop_from_cache(checkpoint)
        samples["llama.cpp Q4_0"].append(llama_bench(llama, gguf, args, "-lm", "none"))
    step_bytes = samples["qwenrt int4"][0]["decode_bytes"]
    bound = bandwidth * 1e9 / step_bytes
    print(f"Qwen3.5-{SHAPE} shape (random weights): prompt {args.prompt_len}, {args.gen_len} greedy tokens, "
          f"{args.threads} threads, medians of {args.repeats} interleaved runs\n"
          f"a qwenrt int4 decode step reads {step_bytes / 1e9:.2f} GB of weights; read bandwidth {bandwidth:.1f} GB/s "
          f"-> bound {bound:.1f} tok/s\n")
    print("| engine | size GiB | prefill tok/s | decode tok/s | of the bound | peak RSS GiB | prefill × | decode × |")
    print("|---|---|---|---|---|---|---|---|")
    sizes = {"qwenrt int4": sum(f.stat().st_size for f in checkpoint.iterdir()), "llama.cpp Q4_0": gguf.stat().st_size}
    ref = medians(samples["llama.cpp Q4_0"])
    for engine, runs in samples.items():
        m = medians(runs)
        print(f"| {engine} | {sizes[engine] / GIB:.1f} | {m['prefill_tps']:.1f} | {m['decode_tps']:.2f} | "
              f"{m['decode_tps'] / bound:.0%} | {max(s['peak_rss'] for s in runs) / GIB:.2f} | "
              f"{m['prefill_tps'] / ref['prefill_tps']:.2f} | {m['decode_tps'] / ref['decode_tps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
