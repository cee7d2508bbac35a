"""One benchmark measurement in this process: load, prefill a random prompt, decode a fixed number of greedy steps.

Run as `python -m qwenrt.bench_worker JOB_JSON` by `qwenrt bench`, one fresh process per measurement so that peak
RSS is this configuration's alone. Prints one JSON line of results.
"""

from __future__ import annotations

import functools
import json
import re
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

WARMUP_PROMPT, WARMUP_STEPS = 16, 4
PREFILL_CHUNK = 512
FILL_CHUNK = 16384  # tokens of random keys and values made at a time (fill_random)


def decode_bytes(model: nn.Module, top_k: int = 0, experts: int = 0) -> int:
    """Weight bytes one decode step reads: every weight once (a tied head once), the embedding table not at all
    (one row is looked up) unless it is the head, and of the MoE experts only top_k of `experts`; not the MTP
    head's (read by drafting, not by the step)."""
    embed = getattr(model.model.embed_tokens, "weight", None)  # None: looked up in the quantized head
    head = getattr(model.lm_head, "weight", None)
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen or (t is embed and head is not embed) or "rotary" in name or name.startswith("mtp."):
            continue
        seen.add(t.data_ptr())
        n = t.numel() * t.element_size()
        total += n * top_k // experts if ".experts." in f".{name}" and experts else n
    return total


def _load(job: dict):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[job["dtype"]]
    if job["engine"] == "transformers":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(job["path"], dtype=dtype).eval()
    from qwenrt.loader import load_model

    return load_model(job["path"], dtype=dtype, rope_scaling=job.get("rope_scaling"))


def engine_steps(model, ids: torch.Tensor, steps: int, speculative=0, drafts: list | None = None,
                 kv_cache_dtype: str = "auto"):
    """Yield once after prefill (first token chosen) and once per generated token, through the engine (with
    speculation several tokens come at once: they are yielded together). `drafts` receives the DraftCounts."""
    from qwenrt.engine import Engine, Request
    from qwenrt.sampling import SamplingParams

    engine = Engine(model, max_batched_tokens=PREFILL_CHUNK, speculative_tokens=speculative, prefix_cache_size=0,
                    kv_cache_dtype=kv_cache_dtype)
    request = Request(ids[0].tolist(), SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    for out in engine.submit(request):
        if drafts is not None and out.drafts is not None:
            drafts[:] = [out.drafts]
        for _ in out.token_ids:
            yield


def _transformers_steps(model, ids: torch.Tensor, steps: int):
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    yield
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        yield


def time_steps(steps, model, ids: torch.Tensor, gen_len: int) -> tuple[float, float]:
    """(time to first token, seconds of the `gen_len` steps after it) of `steps` (engine_steps or
    _transformers_steps) on the prompt ids [1, T], after a short warm-up run."""
    with torch.inference_mode():
        for _ in steps(model, ids[:, :WARMUP_PROMPT], WARMUP_STEPS):  # first-call costs (allocations, kernel setup)
            pass
        marks = [time.perf_counter()]
        for _ in steps(model, ids, gen_len):
            marks.append(time.perf_counter())
    return marks[1] - marks[0], marks[-1] - marks[1]


def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Prefill ids [1, T] into `cache` in PREFILL_CHUNK pieces (the engine's step size) -> the last logits [1, V]."""
    for start in range(0, ids.shape[1], PREFILL_CHUNK):
        logits = model(ids[:, start:start + PREFILL_CHUNK], cache=cache, logits_to_keep=1)
    return logits[:, -1]


def text_config(model):
    """The text decoder's config (a VLM's config holds it as .text)."""
    return model.config.text if hasattr(model.config, "text") else model.config


def fill_random(model, cache, depth: int, seed: int = 0) -> None:
    """The first `depth` tokens of a one-sequence cache as random keys and values (N(0, 1), stored as the cache
    stores them) and random DeltaNet states, written directly: a decode step reads as many bytes and runs the same
    kernels over them as over a prefilled context, in seconds rather than the prefill's minutes."""
    seq, g = cache.sequences[0], torch.Generator().manual_seed(seed)
    text = text_config(model)
    for layer in text.full_attention_layers:
        for start in range(0, depth, FILL_CHUNK):
            shape = (1, text.num_key_value_heads, min(FILL_CHUNK, depth - start), text.head_dim)
            seq.length = start  # write_kv writes after `length`
            seq.write_kv(layer, *(torch.randn(shape, generator=g).to(model.dtype) for _ in range(2)))
    for layer in text.linear_attention_layers:
        for state in (seq.conv[layer], seq.recurrent[layer]):
            state.copy_(torch.randn(state.shape, generator=g) * 0.1)
    seq.length = depth


def at_depth(model, ids: torch.Tensor, depth: int, gen_len: int, kv_dtype: torch.dtype | None = None,
             fill: str = "prefill") -> tuple[float, float, float]:
    """As `llama-bench -d`: prefill the first `depth` tokens of ids [1, depth + N], then the N prompt tokens after
    them, then `gen_len` greedy decode steps (the engine's native step), each timed apart -> (depth prefill s,
    prompt prefill s, decode s). fill "random": the depth's context from `fill_random` instead of its prefill (its
    time then that of the fill). The ids stay a tensor (a 262K-token prompt as a Python list is ~10 MB of
    objects)."""
    from qwenrt.engine.runner import decode_step

    def run(ids: torch.Tensor, depth: int, steps: int) -> list[float]:
        cache = model.new_cache(1, capacity=ids.shape[1] + steps, kv_dtype=kv_dtype)
        marks = [time.perf_counter()]
        if depth and fill == "random":
            fill_random(model, cache, depth)
        elif depth:
            prefill(model, ids[:, :depth], cache)
        marks.append(time.perf_counter())
        token = prefill(model, ids[:, depth:], cache).argmax(-1, keepdim=True)
        marks.append(time.perf_counter())
        for _ in range(steps):
            token = decode_step(model, token, cache)[0].argmax(-1, keepdim=True)
        marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])]

    with torch.inference_mode():
        run(ids[:, :WARMUP_PROMPT], WARMUP_PROMPT // 2, WARMUP_STEPS)  # first-call costs (allocations, kernel setup)
        return tuple(run(ids, depth, gen_len))


def measure(job: dict) -> dict:
    """job: engine (qwenrt|transformers), path, dtype, threads, prompt_len, gen_len, seed; depth (tokens of context
    before the prompt, qwenrt only), depth_fill ("prefill", or "random": at_depth's fill), rope_scaling (as `load`
    takes it) and kv_cache_dtype optional. At a depth the decode bytes include the keys and values each step reads
    (at the mean context of the decode)."""
    from qwenrt.cache import kv_bytes_per_token, parse_kv_cache_dtype

    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    model = _load(job)
    load_s = time.perf_counter() - start
    text = text_config(model)
    vocab = text.vocab_size
    g = torch.Generator().manual_seed(job["seed"])
    depth = job.get("depth", 0)
    ids = torch.randint(0, vocab, (1, depth + job["prompt_len"]), generator=g)
    top_k, experts = getattr(text, "num_experts_per_tok", 0) or 0, getattr(text, "num_experts", 0) or 0
    kv_cache_dtype = job.get("kv_cache_dtype", "auto")
    if depth:
        kv_dtype = parse_kv_cache_dtype(kv_cache_dtype)
        fill = job.get("depth_fill", "prefill")
        depth_s, prefill_s, decode_s = at_depth(model, ids, depth, job["gen_len"], kv_dtype, fill)
        context = depth + job["prompt_len"] + job["gen_len"] // 2
        kv = kv_bytes_per_token(text, kv_dtype or model.dtype) * context
        measured = {"depth_prefill_s": depth_s, "depth_prefill_tps": depth / depth_s} if fill == "prefill" else {}
        return {"load_s": load_s, **measured, "ttft_s": prefill_s, "prefill_tps": job["prompt_len"] / prefill_s,
                "decode_tps": job["gen_len"] / decode_s, "decode_bytes": decode_bytes(model, top_k, experts) + kv,
                "peak_rss": peak_rss()}
    drafts = []
    if job["engine"] == "qwenrt":
        steps = functools.partial(engine_steps, speculative=job.get("speculative", 0), drafts=drafts,
                                  kv_cache_dtype=kv_cache_dtype)
    else:
        steps = _transformers_steps
    ttft, decode_s = time_steps(steps, model, ids, job["gen_len"])
    return {
        "load_s": load_s,
        "ttft_s": ttft,
        "prefill_tps": job["prompt_len"] / ttft,
        "decode_tps": job["gen_len"] / decode_s,
        "decode_bytes": decode_bytes(model, top_k, experts),
        "peak_rss": peak_rss(),
        **({"acceptance": drafts[0].acceptance, "tokens_per_step": drafts[0].mean_accepted_length} if drafts else {}),
    }


def peak_rss() -> int:
    """This process's peak resident set in bytes. Linux's getrusage ru_maxrss survives exec, so a worker started by
    a large parent would report the parent's peak: read the kernel's per-process high-water mark instead."""
    try:
        return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
