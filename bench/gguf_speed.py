"""The 0.8B shape as GGUF (Q8_0, Q4_K_M) in qwenrt against the same file in llama.cpp. Not a test: a benchmark.

    python bench/gguf_speed.py --llama-cpp LLAMA_SRC --llama-build LLAMA_SRC/build/bin
    python bench/gguf_speed.py ... --types Q4_K_M --repeats 1 --prompt-len 128 --gen-len 32   # a quick look

The random-weight 0.8B checkpoint (`qwenrt bench --shape 0.8b`'s, with the Qwen3.5 tokenizer the converter needs)
goes through llama.cpp's convert_hf_to_gguf.py (BF16, no MTP head) and llama-quantize, once, into --workdir. Then,
per repeat and type, interleaved: qwenrt on the file (`qwenrt bench`'s worker: a fresh process, bf16 activations,
a random prompt of --prompt-len tokens, --gen-len greedy steps), `llama-bench -t T -p P -n N -r 1` on the same file,
and llama.cpp's load time (model and context, through its Python bindings). Medians over --repeats; peak RSS is each
process's high-water mark (llama-bench's holds its 512-token context too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gguf_check import LlamaCpp, llama_bindings, warnings_to_stderr  # noqa: E402
from qwenrt.errors import QwenrtError  # noqa: E402

GIB = 1 << 30


def source_checkpoint(work: Path) -> Path:
    """The 0.8B shape's checkpoint files and the Qwen3.5 tokenizer, linked into one directory for the converter."""
    from qwenrt.bench import cache_dir, shape_checkpoint
    from tests.tokenizer_fixture import cached_qwen35_tokenizer

    shape, tokenizer = shape_checkpoint("0.8b"), cached_qwen35_tokenizer(cache_dir())
    linked = work / "src-0.8b"
    linked.mkdir(parents=True, exist_ok=True)
    for file in list(shape.iterdir()) + list(tokenizer.iterdir()):
        if not (linked / file.name).exists():
            (linked / file.name).symlink_to(file.resolve())
    return linked


def gguf_files(llama: LlamaCpp, work: Path, types: list[str]) -> dict[str, Path]:
    bf16 = work / "0.8b-BF16.gguf"
    if not bf16.is_file():
        print("converting the 0.8B shape to GGUF BF16 (llama.cpp's convert_hf_to_gguf.py)", file=sys.stderr)
        llama.convert(source_checkpoint(work), bf16, "BF16", mtp=False)
    files = {}
    for qtype in types:
        files[qtype] = work / f"0.8b-{qtype}.gguf"
        if not files[qtype].is_file():
            llama.quantize(bf16, files[qtype], qtype)
    return files


def qwenrt_sample(path: Path, args) -> dict:
    from qwenrt.bench import _run

    r = _run(dict(engine="qwenrt", path=str(path), dtype="bf16", threads=args.threads, prompt_len=args.prompt_len,
                  gen_len=args.gen_len, seed=0))
    return dict(load_s=r["load_s"], prefill_tps=r["prefill_tps"], decode_tps=r["decode_tps"], peak_rss=r["peak_rss"])


def peak_rss_of(cmd: list[str], env: dict | None = None) -> tuple[str, int]:
    """Run cmd -> (its stdout, its own peak RSS in bytes: reaped with wait4, whose rusage is this child's alone)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait for it again
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            tail = (err.read().strip().splitlines() or ["(no output)"])[-1]
            sys.exit(f"gguf_speed: {' '.join(cmd[:2])} failed (exit {proc.returncode}): {tail}")
        return out.read(), usage.ru_maxrss * 1024


def llama_bench(llama: LlamaCpp, path: Path, args, *options: str) -> dict:
    """`llama-bench -t T -p P -n N -r 1 [options]` on `path` -> prefill_tps, decode_tps, peak_rss."""
    cmd = [str(llama.bin / "llama-bench"), "-m", str(path), "-t", str(args.threads), "-p", str(args.prompt_len),
           "-n", str(args.gen_len), "-r", "1", *options, "-o", "json"]
    out, rss = peak_rss_of(cmd)
    tests = json.loads(out)
    return dict(prefill_tps=next(t["avg_ts"] for t in tests if t["n_prompt"] > 0),
                decode_tps=next(t["avg_ts"] for t in tests if t["n_gen"] > 0), peak_rss=rss)


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs."""
    return {k: statistics.median(s[k] for s in runs) for k in runs[0]}


def llama_sample(llama: LlamaCpp, path: Path, args) -> dict:
    job = dict(gguf=str(path), bindings=str(llama.python), threads=args.threads, n_ctx=args.prompt_len + args.gen_len)
    load, _ = peak_rss_of([sys.executable, __file__, "--load-worker", json.dumps(job)],
                          dict(os.environ, LLAMA_CPP_LIB_PATH=str(llama.bin)))
    return dict(llama_bench(llama, path, args), load_s=json.loads(load)["load_s"])


def load_worker(job: dict) -> None:
    """llama.cpp's load time: the model and a context for the benchmark's tokens (what llama-bench does first)."""
    lc = llama_bindings(Path(job["bindings"]))
    log = warnings_to_stderr(lc)  # noqa: F841 (held: llama.cpp keeps the pointer)
    lc.llama_backend_init()
    start = time.perf_counter()
    model = lc.llama_model_load_from_file(job["gguf"].encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_threads, params.n_threads_batch = job["n_ctx"], job["threads"], job["threads"]
    ctx = lc.llama_init_from_model(model, params)
    if not model or not ctx:
        sys.exit(f"llama.cpp could not load {job['gguf']}")
    print(json.dumps({"load_s": time.perf_counter() - start}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    LlamaCpp.add_options(p)
    p.add_argument("--types", default="Q8_0,Q4_K_M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--workdir", type=Path, help="GGUF files (default ~/.cache/qwenrt/bench/gguf-speed)")
    p.add_argument("--load-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load_worker:
        load_worker(json.loads(args.load_worker))
        return 0
    llama = LlamaCpp.find(args)
    from qwenrt.bench import cache_dir

    work = args.workdir or cache_dir() / "gguf-speed"
    work.mkdir(parents=True, exist_ok=True)
    files = gguf_files(llama, work, [t.upper() for t in args.types.split(",") if t])
    samples = {(engine, qtype): [] for qtype in files for engine in ("qwenrt", "llama.cpp")}
    for repeat in range(args.repeats):
        for qtype, path in files.items():
            print(f"[{repeat + 1}/{args.repeats}] {qtype}: qwenrt, llama.cpp", file=sys.stderr, flush=True)
            try:
                samples["qwenrt", qtype].append(qwenrt_sample(path, args))
            except QwenrtError as e:
                sys.exit(f"gguf_speed: {e}")
            samples["llama.cpp", qtype].append(llama_sample(llama, path, args))
    print(f"0.8B shape (random weights) as GGUF: prompt {args.prompt_len}, {args.gen_len} greedy tokens, "
          f"{args.threads} threads, medians of {args.repeats} interleaved runs\n")
    print("| file | engine | MiB | load s | prefill tok/s | decode tok/s | peak RSS GiB | prefill × | decode × |")
    print("|---|---|---|---|---|---|---|---|---|")
    for qtype, path in files.items():
        ref = medians(samples["llama.cpp", qtype])
        for engine in ("qwenrt", "llama.cpp"):
            runs = samples[engine, qtype]
            m = medians(runs)
            print(f"| {qtype} | {engine} | {path.stat().st_size / 2**20:.0f} | {m['load_s']:.2f} | "
                  f"{m['prefill_tps']:.0f} | {m['decode_tps']:.1f} | {max(s['peak_rss'] for s in runs) / GIB:.2f} | "
                  f"{m['prefill_tps'] / ref['prefill_tps']:.2f} | {m['decode_tps'] / ref['decode_tps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
