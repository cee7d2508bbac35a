"""`qwenrt bench`: load time, prefill and decode tokens/s, time to first token, peak RSS and achieved GB/s.

Every measurement runs in a fresh process (so peak RSS is honest); configurations, and transformers with
`--compare transformers`, are interleaved repeat by repeat and reported as medians, since separate processes on
shared CPUs differ by 10-30% while samples inside one run agree. Quantized configurations load a checkpoint
written once by `qwenrt quantize` (as a user would), not quantized at load time; a random --shape is written directly
in each format (the same weights: see qwenrt.shapes).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from qwenrt.cache import KV_CACHE_DTYPES
from qwenrt.default_model import DEFAULT_MODEL
from qwenrt.errors import QwenrtError
from qwenrt.kernels import kernel_path
from qwenrt.quant import QuantSpec

GIB = 1 << 30


@dataclass(frozen=True)
class Config:
    """One measured configuration: engine, compute dtype, weight quantization ("none", "int8", "int4"), draft
    tokens and the KV cache's dtype ("auto": the compute dtype, or "int8")."""

    engine: str
    dtype: str
    quantize: str = "none"
    speculative: int | str = 0  # draft tokens per step (qwenrt): 0, k or "auto"
    kv_cache_dtype: str = "auto"

    @property
    def label(self) -> str:
        if self.engine == "transformers":
            return f"transformers {self.dtype}"
        label = f"qwenrt {self.dtype}" if self.quantize == "none" else f"qwenrt {self.quantize} ({self.dtype} act.)"
        return (label + (f", speculative {self.speculative}" if self.speculative else "")
                + (f", {self.kv_cache_dtype} KV" if self.kv_cache_dtype != "auto" else ""))


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "qwenrt" / "bench"


def shape_checkpoint(shape: str, seed: int = 0, quantize: QuantSpec | None = None) -> Path:
    """The random checkpoint at a published shape, built once into the cache (with a progress bar): bf16, or written
    directly quantized (a QuantSpec), never through the bf16 one (the 35B-A3B's is 70 GB)."""
    from qwenrt.shapes import title, write_random_checkpoint

    name = f"random-{shape}-mtp-seed{seed}"
    if quantize is not None:
        name += f"-int{quantize.bits}" + (f"g{quantize.group_size}" if quantize.group_size else "")
    path = cache_dir() / name
    if not path.exists():
        print(f"building a random-weight {title(shape)} checkpoint in {path}", file=sys.stderr)
        write_random_checkpoint(shape, path, seed=seed, progress=True, quantize=quantize)
    return path


def quantized_checkpoint(src: Path, quantize: str, group_size: int | None) -> Path:
    """`src` quantized, written once into the cache next to the other benchmark checkpoints."""
    from qwenrt.convert import quantize_checkpoint

    spec = QuantSpec.parse(quantize, group_size)
    stat = (src / "config.json").stat()
    key = hashlib.sha1(f"{src.resolve()}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    path = cache_dir() / (f"{src.name}-{key}-int{spec.bits}" + (f"g{spec.group_size}" if spec.group_size else ""))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        quantize_checkpoint(src, path, spec.bits, spec.group_size, progress=True)
    return path


def _checkpoint(args, source: Path | None, quantize: str) -> Path:
    """What a configuration loads: the random checkpoint of --shape in its format, or `source` as it is or quantized
    once into the cache."""
    group_size = args.group_size if quantize == "int4" else None
    if args.shape is not None:
        spec = None if quantize == "none" else QuantSpec.parse(quantize, group_size)
        return shape_checkpoint(args.shape, quantize=spec)
    return source if quantize == "none" else quantized_checkpoint(source, quantize, group_size)


def _run(job: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-m", "qwenrt.bench_worker", json.dumps(job)], capture_output=True,
                          text=True, env=env)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise QwenrtError(f"benchmark of {job['engine']} on {job['path']} failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(samples: list[dict]) -> dict:
    out = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    out["decode_tps_range"] = (min(s["decode_tps"] for s in samples), max(s["decode_tps"] for s in samples))
    out["peak_rss"] = max(s["peak_rss"] for s in samples)
    return out


def format_table(results: dict[Config, dict], reference: Config | None) -> str:
    """A markdown table, one row per configuration (medians); ratios against `reference` when given."""
    head = ["configuration", "load s", "prefill tok/s", "TTFT s", "decode tok/s (min-max)", "GB/s", "peak RSS GiB"]
    depth = any("depth_prefill_tps" in r for r in results.values())
    if depth:
        head[1:1] = ["depth prefill s", "depth prefill tok/s"]
    speculative = any(c.speculative for c in results)
    if speculative:
        head += ["drafts accepted", "tokens/step"]
    if reference is not None:
        head += ["prefill ×", "decode ×"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config, r in results.items():
        lo, hi = r["decode_tps_range"]
        cells = [config.label, f"{r['load_s']:.1f}", f"{r['prefill_tps']:.0f}", f"{r['ttft_s']:.2f}",
                 f"{r['decode_tps']:.1f} ({lo:.1f}-{hi:.1f})", f"{r['decode_bytes'] * r['decode_tps'] / 1e9:.1f}",
                 f"{r['peak_rss'] / GIB:.2f}"]
        if depth:
            cells[1:1] = [f"{r['depth_prefill_s']:.1f}", f"{r['depth_prefill_tps']:.0f}"]
        if speculative:
            cells += [f"{100 * r['acceptance']:.0f}%", f"{r['tokens_per_step']:.2f}"] if "acceptance" in r else ["", ""]
        if reference is not None:
            ref = results[reference]
            cells += [f"{r['prefill_tps'] / ref['prefill_tps']:.2f}", f"{r['decode_tps'] / ref['decode_tps']:.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _check_context(ckpt: Path, args) -> None:
    """depth + prompt + generated tokens within the checkpoint's context limit (with --rope-scaling's)."""
    from qwenrt.loader import verify_checkpoint

    limit = verify_checkpoint(ckpt, rope_scaling=args.rope_scaling)[0].text.context_limit
    need = args.depth + args.prompt_len + args.gen_len
    if need > limit:
        raise QwenrtError(f"--depth {args.depth} + --prompt-len {args.prompt_len} + --gen-len {args.gen_len} = {need}"
                          f" tokens exceed the model's context limit of {limit} (YaRN extends it: --rope-scaling)")


def run(args) -> str:
    """Measure every configuration `args.repeats` times, interleaved; returns the table (also printed)."""
    if args.model is not None and args.shape is not None:
        raise QwenrtError("give a checkpoint (MODEL) or --shape, not both")
    from qwenrt.shapes import SHAPES

    if args.shape is not None and args.shape not in SHAPES:
        raise QwenrtError(f"unknown --shape {args.shape!r} (known: {', '.join(SHAPES)})")
    if args.threads is None:
        import torch

        args.threads = torch.get_num_threads()
    if args.prompt_len < 1 or args.gen_len < 1 or args.repeats < 1 or args.threads < 1:
        raise QwenrtError("--prompt-len, --gen-len, --repeats and --threads must be >= 1")
    if args.depth < 0:
        raise QwenrtError(f"--depth must be >= 0, got {args.depth}")
    if args.depth and (args.compare or args.speculative_tokens != "0"):
        raise QwenrtError("--depth measures plain decoding on qwenrt: not with --compare or --speculative-tokens")
    if args.depth_fill not in ("prefill", "random"):
        raise QwenrtError(f"--depth-fill must be prefill or random, got {args.depth_fill!r}")
    if args.depth_fill == "random" and not args.depth:
        raise QwenrtError("--depth-fill random fills a --depth: give one")
    if args.dtype not in ("bf16", "fp32"):
        raise QwenrtError(f"--dtype must be bf16 or fp32, got {args.dtype!r}")
    if args.compare not in (None, "transformers"):
        raise QwenrtError(f"--compare supports only 'transformers', got {args.compare!r}")
    path = None  # --shape: each configuration's random checkpoint is built in its own format
    if args.shape is None:
        from qwenrt.hub import resolve_model_path

        path = resolve_model_path(DEFAULT_MODEL if args.model is None else args.model)
    from qwenrt.units import speculative_tokens

    try:
        counts = [speculative_tokens(k) for k in args.speculative_tokens.split(",")]
    except Exception as e:
        raise QwenrtError(f"--speculative-tokens: {e}") from None
    configs = {Config("qwenrt", args.dtype, q, k, kv): None for q in args.quantize.split(",") for k in counts
               for kv in args.kv_cache_dtype.split(",")}
    for config in configs:
        if config.quantize not in ("none", "int8", "int4"):
            raise QwenrtError(f"--quantize takes none, int8 or int4 (comma-separated), got {config.quantize!r}")
        if config.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise QwenrtError(f"--kv-cache-dtype takes {' or '.join(KV_CACHE_DTYPES)} (comma-separated), got "
                              f"{config.kv_cache_dtype!r}")
    for config in configs:  # built (once) after every argument is checked
        configs[config] = _checkpoint(args, path, config.quantize)
    reference = Config("transformers", "bf16") if args.compare else None
    if reference is not None:
        configs[reference] = _checkpoint(args, path, "none")
    for ckpt in configs.values():
        _check_context(ckpt, args)
    from qwenrt.loader import prepare_kernels

    prepare_kernels(progress=True)  # compiled once here on a fresh install, not inside a measured load
    samples: dict[Config, list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for config, ckpt in configs.items():
            print(f"[{repeat + 1}/{args.repeats}] {config.label}", file=sys.stderr, flush=True)
            samples[config].append(_run(dict(engine=config.engine, path=str(ckpt), dtype=config.dtype,
                                              speculative=config.speculative,
                                              kv_cache_dtype=config.kv_cache_dtype,
                                              threads=args.threads, prompt_len=args.prompt_len,
                                              gen_len=args.gen_len, seed=args.seed, depth=args.depth,
                                              depth_fill=args.depth_fill,
                                              rope_scaling=args.rope_scaling)))
    results = {c: _summary(s) for c, s in samples.items()}
    at = f" at depth {args.depth}" if args.depth else ""
    filled = ", the depth a random context (--depth-fill random)" if args.depth_fill == "random" else ""
    title = (f"{args.shape or path}: prompt {args.prompt_len}{at}, {args.gen_len} greedy tokens{at}{filled}, "
             f"{args.threads} threads, "
             f"CPU kernels: {kernel_path()}, "
             f"median of {args.repeats} interleaved runs")
    table = f"{title}\n\n{format_table(results, reference)}"
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "results": [
            {"configuration": c.label, **r} for c, r in results.items()], "samples": [
            {"configuration": c.label, **x} for c, s in samples.items() for x in s]}, indent=2))
    return table
