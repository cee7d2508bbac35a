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

    return load_model(job["path"], dtype=dtype)


def engine_steps(model, ids: torch.Tensor, steps: int, speculative=0, drafts: list | None = None):
    """Yield once after prefill (first token chosen) and once per generated token, through the engine (with
    speculation several tokens come at once: they are yielded together). `drafts` receives the DraftCounts."""
    from qwenrt.engine import Engine, Request
    from qwenrt.sampling import SamplingParams

    engine = Engine(model, max_batched_tokens=PREFILL_CHUNK, speculative_tokens=speculative, prefix_cache_size=0)
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


def measure(job: dict) -> dict:
    """job: engine (qwenrt|transformers), path, dtype, threads, prompt_len, gen_len, seed."""
    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    model = _load(job)
    load_s = time.perf_counter() - start
    text = model.config.text if hasattr(model.config, "text") else model.config
    vocab = text.vocab_size
    g = torch.Generator().manual_seed(job["seed"])
    ids = torch.randint(0, vocab, (1, job["prompt_len"]), generator=g)
    drafts = []
    if job["engine"] == "qwenrt":
        steps = functools.partial(engine_steps, speculative=job.get("speculative", 0), drafts=drafts)
    else:
        steps = _transformers_steps
    ttft, decode_s = time_steps(steps, model, ids, job["gen_len"])
    top_k, experts = getattr(text, "num_experts_per_tok", 0) or 0, getattr(text, "num_experts", 0) or 0
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
