"""`qwenrt qa`: the checks to run before trusting a model or a machine, each pass, fail or skipped with its figures
and a one-line reason: the checkpoint's contract, determinism (greedy twice, a batch against each prompt alone,
speculative against plain decoding), parity with transformers, quantization KL, and prefill / decode speed."""

from __future__ import annotations

import importlib.util
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qwenrt import __version__, log
from qwenrt.bench_worker import engine_steps, time_steps
from qwenrt.default_model import DEFAULT_MODEL, resolve_model
from qwenrt.engine import Engine
from qwenrt.engine.runner import decode_step
from qwenrt.errors import QwenrtError
from qwenrt.generate import batch_generate
from qwenrt.gguf.reader import GGUFCheckpoint
from qwenrt.hub import resolve_model_path
from qwenrt.inspect import inspect_checkpoint
from qwenrt.kernels import LEVELS, cpu_level, kernel_path, native_bf16_matmul
from qwenrt.loader import (check_checkpoint, load, prepare_kernels, resolve_dtype, stored_float_dtype, use_threads,
                           verify_checkpoint)
from qwenrt.meminfo import meminfo
from qwenrt.quant import QuantSpec, stored_spec
from qwenrt.sampling import SamplingParams

CHECKS = ("contract", "repeat", "batch", "speculative", "speed", "parity", "kl")
GROUPS = {"determinism": ("repeat", "batch", "speculative")}
PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
PARITY_BOUND = 1e-4  # max |ours - transformers| / max |transformers|, fp32 logits (the tests' bound)
GREEDY_TOKENS = 32  # per prompt, in the determinism checks
PARITY_TOKENS = 16  # greedy tokens per prompt compared with transformers
KL_TOKENS = 128  # of the fixed text: the first half prefilled, the rest decoded one token at a time
DRAFTS = 3  # draft tokens per step in the speculative check: fixed, so that drafts are verified ("auto" may not)
# raw completions (no chat template), of different lengths so a batch holds sequences at different positions
PROMPTS = ("The capital of France is", "Add 482 and 317, then subtract 95.",
           "A long time ago, in a small village by the sea, there lived an old fisherman who every morning",
           "def fibonacci(n):\n")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father had "
        "taught him: one hundred and twelve, no more and no fewer. At the top he trimmed the wick, polished the great "
        "lens until it caught the last of the daylight, and wrote the weather in a ledger whose first pages were older "
        "than the town. Ships no longer needed the light, the harbour master said; they carried their own maps now, "
        "and satellites watched the rocks. Still the keeper climbed. On the night of the storm the power failed "
        "across the coast, the radios fell silent, and a small fishing boat, its engine flooded, drifted toward the "
        "reef. Its crew saw a steady white flash, every ten seconds, exactly where it had always been.")


@dataclass
class Result:
    """One check's outcome: status pass / fail / skipped, why in one line, what it measured."""

    name: str
    status: str
    reason: str
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Subject:
    """The checkpoint under test, from its headers: what the checks need to know before loading it."""

    source: str
    label: str
    path: Path
    dtype: torch.dtype  # of the determinism and speed checks
    broken: str | None  # why the checkpoint fails its contract (headers, tokenizer), else None
    gguf: bool = False
    quantized: str | None = None  # the format of a `qwenrt quantize` checkpoint (the reasons of parity and KL)
    mtp: bool = False
    prompts: list[list[int]] = field(default_factory=list)
    text: list[int] = field(default_factory=list)  # KL_TOKENS ids of TEXT (random ids without a tokenizer)


class Models:
    """The model the current check needs, loaded on first use and kept until a check needs another form of it: one
    at a time, so a large checkpoint needs its memory once."""

    def __init__(self, path: Path):
        self.path, self.key, self.loaded = path, None, None

    def get(self, dtype: torch.dtype, quantize: QuantSpec | None = None):
        """(model, tokenizer) of the checkpoint in `dtype`, quantized in memory to `quantize` when given."""
        if (dtype, quantize) != self.key:
            self.release()  # before the next loads
            form = str(dtype).removeprefix("torch.") + (f", quantized to {quantize.short}" if quantize else "")
            log.info(f"qa: loading {self.path} ({form}) …")
            self.loaded = load(self.path, dtype=dtype, quantize=quantize, progress=log.shows_progress())
            self.key = (dtype, quantize)
        return self.loaded

    def release(self) -> None:
        self.loaded = self.key = None


@dataclass
class Run:
    """One `qwenrt qa` run: its subject, the model slot, the options, and each prompt's greedy tokens alone (the
    determinism checks' reference, computed once)."""

    subject: Subject
    models: Models
    prompt_len: int = 128
    gen_len: int = 64
    assert_tps: float | None = None
    kl: list[QuantSpec] = field(default_factory=list)
    alone: list[list[int]] | None = None


def select_checks(checks: str | None, kl: list[QuantSpec]) -> list[str]:
    """The checks to run, in CHECKS order: those named (groups expanded), or all but kl, which runs when formats are
    given."""
    if checks is None:
        return [c for c in CHECKS if c != "kl" or kl]
    names = [n.strip() for n in checks.split(",") if n.strip()]
    unknown = next((n for n in names if n not in CHECKS and n not in GROUPS), None)
    if unknown is not None or not names:
        raise QwenrtError(f"--checks: {f'unknown check {unknown!r}' if unknown else 'no check named'} "
                          f"(known: {', '.join([*CHECKS, *GROUPS])})")
    chosen = {c for n in names for c in GROUPS.get(n, (n,))}
    if kl and "kl" not in chosen:
        raise QwenrtError("--kl gives the formats of the kl check, which --checks leaves out")
    return [c for c in CHECKS if c in chosen]


def parse_formats(kl: str | None, group_size: int | None) -> list[QuantSpec]:
    """--kl "int8,int4" -> QuantSpecs (int4 in groups of `group_size`, default 64)."""
    if kl is None:
        return []
    try:
        return list(dict.fromkeys(QuantSpec.parse(name.strip(), group_size) for name in kl.split(",")))
    except QwenrtError as e:
        raise QwenrtError(f"--kl: {e}") from None


def _prompt_ids(tokenizer, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(PROMPTS, TEXT's first KL_TOKENS) as token ids; seeded random ids of the same sizes without a tokenizer."""
    if tokenizer is not None:
        return [tokenizer.encode(p) for p in PROMPTS], tokenizer.encode(TEXT)[:KL_TOKENS]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 11, 21, 5)]
    return prompts, torch.randint(0, vocab, (KL_TOKENS,), generator=g).tolist()


def examine(source: str | None, dtype) -> Subject:
    """The Subject of MODEL as the command line names it (None: the built-in model)."""
    where, label = resolve_model(source)
    path = resolve_model_path(where)
    source = DEFAULT_MODEL if source is None else str(source)
    try:
        (config, ckpt, plan, _, _), tokenizer = check_checkpoint(path)
    except QwenrtError as e:
        return Subject(source, label, path, resolve_dtype(dtype, None), broken=str(e))
    gguf = isinstance(ckpt, GGUFCheckpoint)
    stored = None if gguf else stored_spec(config.raw)
    prompts, text = _prompt_ids(tokenizer, config.text.vocab_size)
    return Subject(source, label, path, resolve_dtype(dtype, stored_float_dtype(ckpt, plan)), None, gguf,
                   stored[0].short if stored else None, any(n.startswith("mtp.") for n in plan), prompts, text)


# ---- the checks --------------------------------------------------------------------------------------------------

def check_contract(run: Run) -> Result:
    """The checkpoint against its config: inspect's checks, the NaN/Inf scan of every weight included."""
    subject = run.subject
    if subject.broken:
        return Result("contract", FAIL, subject.broken)
    try:
        report = inspect_checkpoint(subject.path)
    except QwenrtError as e:
        return Result("contract", FAIL, str(e))
    figures = {k: report[k] for k in ("model_type", "layers", "params_decoder", "stored_dtypes", "quantization", "mtp",
                                      "file_bytes")}
    return Result("contract", PASS, report["verdict"].removeprefix("OK: "), figures)


def greedy_tokens(engine: Engine, prompts: list[list[int]], together: bool, n: int = GREEDY_TOKENS):
    """(each prompt's n greedy tokens, EOS not stopping them, the engine's draft counts): the prompts submitted
    together (decoded in one batch) or one after another (each alone)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    groups = [prompts] if together else [[p] for p in prompts]
    tokens = [c.tokens for group in groups for c in batch_generate(engine, None, group, params=params)]
    return tokens, engine.draft_counts


def _engine(model, tokenizer, drafts: int = 0) -> Engine:
    return Engine(model, tokenizer, speculative_tokens=drafts, prefix_cache_size=0, max_running=len(PROMPTS))


def _first_difference(expected: list[list[int]], got: list[list[int]], what: str, against: str) -> str | None:
    """"prompt 2, token 7: 45 alone, 12 batched" for the first token where `got` differs, or None."""
    for p, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"prompt {p + 1}, token {t + 1}: {_token(a, t)} {against}, {_token(b, t)} {what}"
    return None


def _token(tokens: list[int], t: int) -> int | str:
    return tokens[t] if t < len(tokens) else "nothing"


def _alone(run: Run) -> list[list[int]]:
    """Each prompt's greedy tokens decoded alone, without drafts: the determinism checks' reference (once a run)."""
    if run.alone is None:
        run.alone = greedy_tokens(_engine(*run.models.get(run.subject.dtype)), run.subject.prompts, together=False)[0]
    return run.alone


def check_repeat(run: Run) -> Result:
    """Greedy generation twice, each prompt alone on a fresh engine: the same tokens."""
    first = _alone(run)
    second, _ = greedy_tokens(_engine(*run.models.get(run.subject.dtype)), run.subject.prompts, together=False)
    figures = {"prompts": len(first), "tokens": GREEDY_TOKENS}
    diff = _first_difference(first, second, "the second time", "the first time")
    if diff:
        return Result("repeat", FAIL, f"greedy generation differs from run to run: {diff}", figures)
    return Result("repeat", PASS, f"{len(first)} prompts x {GREEDY_TOKENS} greedy tokens, twice: identical", figures)


def check_batch(run: Run) -> Result:
    """The prompts decoded in one batch: each the tokens it gives alone."""
    alone = _alone(run)
    batched, _ = greedy_tokens(_engine(*run.models.get(run.subject.dtype)), run.subject.prompts, together=True)
    figures = {"prompts": len(alone), "tokens": GREEDY_TOKENS}
    diff = _first_difference(alone, batched, "batched", "alone")
    if diff:
        return Result("batch", FAIL, f"a batch differs from its prompts alone: {diff}", figures)
    return Result("batch", PASS, f"a batch of {len(alone)} prompts == each alone, {GREEDY_TOKENS} greedy tokens "
                  "each", figures)


def check_speculative(run: Run) -> Result:
    """The prompts in one batch with the MTP head's drafts verified: plain decoding's tokens."""
    if not run.subject.mtp:
        return Result("speculative", SKIPPED, "the checkpoint has no MTP head (no mtp.* tensors) to draft with")
    alone = _alone(run)
    drafted, counts = greedy_tokens(_engine(*run.models.get(run.subject.dtype), drafts=DRAFTS), run.subject.prompts,
                                    together=True)
    figures = {"prompts": len(alone), "tokens": GREEDY_TOKENS, "drafts_per_step": DRAFTS,
               "draft_tokens": counts.draft_tokens, "accepted_tokens": counts.accepted_tokens}
    diff = _first_difference(alone, drafted, "with drafts", "plain")
    if diff:
        return Result("speculative", FAIL, f"speculative decoding differs from plain: {diff}", figures)
    if not counts.draft_tokens:
        return Result("speculative", FAIL, "the MTP head drafted nothing: speculation was not exercised", figures)
    return Result("speculative", PASS, f"{DRAFTS} MTP drafts per step, batched == plain alone "
                  f"({100 * counts.accepted_tokens / counts.draft_tokens:.0f}% of {counts.draft_tokens} drafts "
                  "accepted)", figures)


def check_speed(run: Run) -> Result:
    """Prefill and decode tokens/s through the engine (greedy, no drafts), timed as `qwenrt bench` times them."""
    model, _ = run.models.get(run.subject.dtype)
    prompt_len, gen_len, floor = run.prompt_len, run.gen_len, run.assert_tps
    ids = torch.randint(0, model.config.text.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    ttft, decode_s = time_steps(engine_steps, model, ids, gen_len)
    figures = {"prefill_tps": prompt_len / ttft, "decode_tps": gen_len / decode_s, "ttft_s": ttft,
               "prompt_len": prompt_len, "gen_len": gen_len, "threads": torch.get_num_threads(),
               "dtype": str(model.dtype).removeprefix("torch."), "assert_tps": floor}
    said = (f"prefill {figures['prefill_tps']:,.0f} tok/s ({prompt_len} random tokens), decode "
            f"{figures['decode_tps']:,.1f} tok/s ({gen_len} greedy steps), {figures['threads']} threads")
    if floor is not None and figures["decode_tps"] < floor:
        return Result("speed", FAIL, f"{said}: decode below --assert-tps {floor:g}", figures)
    return Result("speed", PASS, said + (f" (>= --assert-tps {floor:g})" if floor is not None else ""), figures)


def _parity_skip(subject: Subject) -> str | None:
    """Why transformers cannot be the reference for this checkpoint, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    if subject.gguf:
        return "a GGUF file: transformers' reference reads safetensors checkpoints"
    if subject.quantized:
        return f"stored quantized ({subject.quantized}): transformers reads full-precision checkpoints"
    return None


def _fp32_memory_short(path: Path) -> str | None:
    """Why two fp32 copies of the model (ours and transformers') do not fit the available memory, or None."""
    model = verify_checkpoint(path)[4]  # on `meta`
    need = 2 * 4 * sum(p.numel() for p in model.parameters()) + (512 << 20)
    available = meminfo("MemAvailable")
    if available is not None and need > available:
        return f"two fp32 copies of the model need {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB is available"
    return None


@torch.inference_mode()
def _reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `ids` (argmax each step through its cache; EOS does not stop it)."""
    out = ref(input_ids=torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = ref(input_ids=torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def _reference(path: Path):
    """transformers' fp32 model of the checkpoint, or (None, why) where it does not load all of its weights."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # our check says what matters; its load report would bury it
    transformers.logging.disable_progress_bar()
    log.info(f"qa: loading transformers' fp32 model of {path} …")
    try:
        ref, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except (ValueError, KeyError, OSError) as e:
        return None, f"transformers {transformers.__version__} does not load it: {str(e).splitlines()[0][:200]}"
    if info["missing_keys"]:
        return None, (f"transformers {transformers.__version__} finds no weights for "
                      f"{len(info['missing_keys'])} of its tensors, e.g. {sorted(info['missing_keys'])[0]}")
    return ref.eval(), None


@torch.inference_mode()
def check_parity(run: Run) -> Result:
    """fp32 logits of the prompts and the text against transformers' (<= PARITY_BOUND relative), and their greedy
    tokens identical."""
    subject, models = run.subject, run.models
    why = _parity_skip(subject) or _fp32_memory_short(subject.path)
    if why:
        return Result("parity", SKIPPED, why)
    import transformers

    models.release()  # at most the two fp32 copies at once
    ref, why = _reference(subject.path)
    if ref is None:
        return Result("parity", SKIPPED, why)
    model, tokenizer = models.get(torch.float32)
    worst = 0.0
    for ids in [*subject.prompts, subject.text]:
        ours, theirs = model(torch.tensor([ids])).double(), ref(input_ids=torch.tensor([ids])).logits.double()
        worst = max(worst, ((ours - theirs).abs().max() / theirs.abs().max()).item())
    expected = [_reference_greedy(ref, ids, PARITY_TOKENS) for ids in subject.prompts]
    got, _ = greedy_tokens(_engine(model, tokenizer), subject.prompts, together=True, n=PARITY_TOKENS)
    figures = {"transformers": transformers.__version__, "max_rel_diff": worst, "bound": PARITY_BOUND,
               "prompts": len(subject.prompts) + 1, "greedy_tokens": PARITY_TOKENS}
    said = (f"fp32 logits of {figures['prompts']} prompts: max |diff| / max |ref| {worst:.1e} (bound "
            f"{PARITY_BOUND:.0e}) against transformers {transformers.__version__}")
    if worst > PARITY_BOUND:
        return Result("parity", FAIL, said, figures)
    diff = _first_difference(expected, got, "ours", "transformers'")
    if diff:
        return Result("parity", FAIL, f"greedy tokens differ from transformers': {diff}", figures)
    return Result("parity", PASS, f"{said}; {len(expected)} x {PARITY_TOKENS} greedy tokens identical", figures)


@torch.inference_mode()
def teacher_forced_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax [T - T/2 + 1, V] fp32 at positions T/2-1 .. T-1: the first half of `ids` prefilled, the rest
    decoded one token at a time through the engine's decode step, so both paths count."""
    x, half = torch.tensor([ids]), len(ids) // 2
    cache = model.new_cache(1)
    rows = [model(x[:, :half], cache=cache, logits_to_keep=1)[0].float()]
    rows += [decode_step(model, x[:, i:i + 1], cache)[0].float() for i in range(half, len(ids))]
    return torch.cat(rows).log_softmax(-1)


def check_kl(run: Run) -> Result:
    """Per-token KL(bf16 || quantized) and top-1 agreement over TEXT for each format of --kl, quantized in memory as
    `qwenrt quantize` quantizes. Reported, not judged (no bound fits every model): fails only on non-finite logits."""
    subject, models = run.subject, run.models
    if subject.gguf:
        return Result("kl", SKIPPED, "a GGUF file runs as its own blocks; quantize takes a checkpoint directory")
    if subject.quantized:
        return Result("kl", SKIPPED, f"already quantized ({subject.quantized}): no full-precision reference")
    reference = teacher_forced_logprobs(models.get(torch.bfloat16)[0], subject.text)
    figures, said = {"tokens": len(subject.text), "positions": reference.shape[0], "reference": "bf16"}, []
    for spec in run.kl:
        logprobs = teacher_forced_logprobs(models.get(torch.bfloat16, spec)[0], subject.text)
        if not torch.isfinite(logprobs).all():
            return Result("kl", FAIL, f"{spec.short}: non-finite logits", figures)
        kl = (reference.exp() * (reference - logprobs)).sum(-1)  # [positions]
        top1 = (reference.argmax(-1) == logprobs.argmax(-1)).float().mean().item()
        figures[spec.short] = {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "top1_agreement": top1}
        said.append(f"{spec.short} mean {kl.mean().item():.1e} max {kl.max().item():.1e} nats, top-1 {100 * top1:.1f}%")
    return Result("kl", PASS, f"KL(bf16 || q) per token over {reference.shape[0]} positions: " + "; ".join(said)
                  + " (reported; no pass bound)", figures)


RUNNERS: dict[str, Callable[[Run], Result]] = {
    "contract": check_contract, "repeat": check_repeat, "batch": check_batch, "speculative": check_speculative,
    "speed": check_speed, "parity": check_parity, "kl": check_kl}


# ---- the run and its report ------------------------------------------------------------------------------------

def machine() -> dict:
    """The CPU, the kernel level qwenrt uses on it and the ISA flags that choose it, threads, versions."""
    first = {}  # /proc/cpuinfo's fields of the first CPU
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            first.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(first.get("flags", "").split())
    known = set().union(*(needs for needs, _ in LEVELS.values()))
    return {"cpu": first.get("model name", platform.machine()), "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "kernels": kernel_path(),
            "kernel_level": cpu_level(), "isa_flags": sorted(flags & known), "bf16_hardware": native_bf16_matmul(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "qwenrt": __version__}


def run_qa(source: str | None, checks: str | None = None, kl: str | None = None, group_size: int | None = None,
           dtype="auto", threads: int | None = None, prompt_len: int = 128, gen_len: int = 64,
           assert_tps: float | None = None) -> dict:
    """Run the chosen checks on MODEL (None: the built-in model); returns the report: model, machine, each check's
    status, reason, figures and seconds, and `passed` (every check that ran passed)."""
    specs = parse_formats(kl, group_size)
    chosen = select_checks(checks, specs)
    if prompt_len < 1 or gen_len < 1:
        raise QwenrtError("--prompt-len and --gen-len must be >= 1")
    if assert_tps is not None and not assert_tps > 0:
        raise QwenrtError(f"--assert-tps must be a number of tokens/s > 0, got {assert_tps:g}")
    use_threads(threads)
    subject = examine(source, dtype)
    prepare_kernels(log.shows_progress())  # a first build's minutes before the checks, not inside one
    run = Run(subject, Models(subject.path), prompt_len, gen_len, assert_tps, specs)
    results: list[Result] = []
    unchecked = f": {subject.broken}" if subject.broken and "contract" not in chosen else ""
    for name in chosen:
        blocked = subject.broken or any(r.name == "contract" and r.status == FAIL for r in results)
        if name != "contract" and blocked:
            results.append(Result(name, SKIPPED, "the checkpoint fails its contract" + unchecked))
            continue
        log.info(f"qa: {name} …")
        start = time.perf_counter()
        try:
            result = RUNNERS[name](run)
        except QwenrtError as e:  # e.g. a weight that does not load: this check fails, the next ones still run
            result = Result(name, FAIL, str(e))
        result.seconds = time.perf_counter() - start
        results.append(result)
    return {"model": {"source": subject.source, "name": subject.label, "path": str(subject.path),
                      "dtype": str(subject.dtype).removeprefix("torch.")},
            "machine": machine(), "checks": [asdict(r) for r in results],
            "passed": all(r.status != FAIL for r in results)}


def format_report(report: dict) -> str:
    """The report as a table: one row per check (status, seconds, reason), the model and machine above it."""
    m = report["machine"]
    lines = [f"model    {report['model']['name']}, {report['model']['dtype']}",
             f"machine  {m['cpu']}, {m['cpus']} CPUs, {m['threads']} threads, CPU kernels {m['kernels']} "
             f"(flags: {' '.join(m['isa_flags']) or 'none'}; bf16 products "
             f"{'in hardware' if m['bf16_hardware'] else 'emulated'})"
             + (f", load average {m['load_average']:.1f}" if m["load_average"] is not None else ""), ""]
    width = max(map(len, CHECKS))
    lines += [f"{'check':<{width}}  status   time    result"]
    for c in report["checks"]:
        lines.append(f"{c['name']:<{width}}  {c['status']:<7}  {c['seconds']:5.1f}s  {c['reason']}")
    failed = [c["name"] for c in report["checks"] if c["status"] == FAIL]
    lines += ["", "PASS: every check that ran passed" if report["passed"] else f"FAIL: {', '.join(failed)}"]
    return "\n".join(lines)
