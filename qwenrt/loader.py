"""Checkpoint directory -> a ready model: config, model built on `meta`, weights assigned after strict accounting."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qwenrt.checkpoint import materialize, open_checkpoint, plan_text_tensors
from qwenrt.classifier import attach_head, classifier_spec
from qwenrt.config import QWEN3_VL, load_config, with_rope_scaling
from qwenrt.default_model import resolve_model
from qwenrt.errors import QwenrtError
from qwenrt.families import qwen3_next, qwen3_vl
from qwenrt.gguf.reader import GGUFCheckpoint, is_gguf, open_gguf
from qwenrt.hub import resolve_model_path
from qwenrt.kernels import cpu_kernels
from qwenrt.meminfo import meminfo
from qwenrt.model import Qwen35ForCausalLM
from qwenrt.mtp import PREFIX as MTP_PREFIX, MTPHead
from qwenrt.quant import (EMBEDDING, LoadQuantizer, QuantEmbedding, QuantLinear, QuantSpec, install_placeholders,
                          install_stored, storage_entries, stored_spec)
from qwenrt.tokenizer import Tokenizer, load_tokenizer
from qwenrt.validation import check_flag, check_path
from qwenrt.writer import DTYPE_NAMES

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
STORED_DTYPES = {**SAFETENSORS_DTYPES, "I8": torch.int8, "U8": torch.uint8}
VISUAL_PREFIX = "model.visual."
GIB = 1 << 30
MEMORY_MARGIN = 512 << 20  # left free beside the weights: activations, caches, the rest of the process
SKIP_MEMORY_CHECK = "QWENRT_SKIP_MEMORY_CHECK"


def resolve_dtype(dtype, stored: str | None) -> torch.dtype:
    """"auto"/None -> the checkpoint's stored float dtype; otherwise a name or a torch.dtype."""
    if dtype in (None, "auto"):
        return SAFETENSORS_DTYPES.get(stored, torch.float32)
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise QwenrtError(f"unsupported dtype {dtype!r} (use one of: auto, {', '.join(DTYPES)})")


def stored_float_dtype(ckpt, plan) -> str:
    """The dtype the checkpoint stores its full-precision weights in: the embedding's, or where a quantized one does
    not store it, the first other weight's but a norm's (qwenrt-tiny stores its norms in fp32: its int4 copy loaded
    in fp32, off the native decode path)."""
    if isinstance(ckpt, GGUFCheckpoint):
        return ckpt.float_dtype
    name = "model.embed_tokens.weight"
    if name not in plan:
        name = next((n for n in plan if n.endswith(".weight") and "norm" not in n.split(".")[-2]), "model.norm.weight")
    return ckpt.dtypes[plan[name].names[0]]


def _name_list(names, limit: int = 6) -> str:
    names = sorted(names)
    more = f" … and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _fp32_parameters(model: torch.nn.Module) -> set[str]:
    """Small precision-critical tensors kept in fp32 whatever the compute dtype: every norm weight, A_log, dt_bias."""
    return {name for name, _ in model.named_parameters()
            if name.endswith(("norm.weight", "layernorm.weight", ".A_log", ".dt_bias"))}


def check_tensors(where, what: str, expected: dict[str, tuple], found: dict[str, tuple]) -> None:
    """Strict accounting: every expected tensor present with its shape, nothing else. One QwenrtError otherwise."""
    missing, unexpected = expected.keys() - found.keys(), found.keys() - expected.keys()
    if missing or unexpected:
        parts = [f"missing {len(missing)} tensor(s): {_name_list(missing)}"] if missing else []
        parts += [f"unexpected {len(unexpected)} tensor(s): {_name_list(unexpected)}"] if unexpected else []
        raise QwenrtError(f"{where}: {what}: " + "; ".join(parts))
    wrong = {n: (found[n], s) for n, s in expected.items() if tuple(found[n]) != tuple(s)}
    if wrong:
        shown = "; ".join(f"{n} is {list(a)}, expected {list(b)}" for n, (a, b) in sorted(wrong.items())[:4])
        raise QwenrtError(f"{where}: {len(wrong)} tensor(s) with the wrong shape: {shown}")


FLOAT_DTYPES = ("F32", "BF16", "F16")


def check_dtypes(where, ckpt, plan: dict, buffers: dict[str, torch.Tensor]) -> None:
    """Every planned tensor stored in a float dtype, or, for a stored quantized piece, exactly its buffer's dtype."""
    for name, source in plan.items():
        names = [n for parts in source.names for n in parts] if source.stacked else list(source.names)
        stored = {ckpt.dtypes[n] for n in names}
        allowed = (DTYPE_NAMES[buffers[name].dtype],) if name in buffers else FLOAT_DTYPES
        if not stored <= set(allowed):
            found = ", ".join(sorted(stored - set(allowed)))
            hint = " (FP8 checkpoints are not supported)" if found.startswith("F8") else ""
            raise QwenrtError(f"{where}: tensor '{names[0]}' is stored as {found}; expected "
                              f"{' or '.join(allowed)}{hint}")


def _check_vision(path: Path, config, ckpt) -> None:
    """A VLM's vision tensors, when it has any, match its vision_config (the tower itself loads on first use)."""
    from qwenrt.checkpoint import Source
    from qwenrt.vision import VisionConfig, VisionTower

    stored = {n[len(VISUAL_PREFIX):]: n for n in ckpt.names(VISUAL_PREFIX)}
    if not config.is_vlm or not stored:
        return
    with torch.device("meta"):
        tower = VisionTower(VisionConfig.from_dict(config.vision))
    check_tensors(path, "vision tower tensors do not match vision_config",
                  {name: tuple(p.shape) for name, p in tower.named_parameters()},
                  {n: ckpt.shapes[name] for n, name in stored.items()})
    check_dtypes(path, ckpt, {n: Source((name,), ckpt.shapes[name]) for n, name in stored.items()}, {})


def verify_checkpoint(path: str | Path, mmproj: str | Path | None = None, blocks: bool = True,
                      rope_scaling: dict | None = None):
    """Config plus strict tensor accounting from the headers alone, nothing read. mmproj: a llama.cpp vision
    projector file giving a GGUF model its vision tower.

    Returns (config, checkpoint, plan, names set aside, the model on `meta`). Raises QwenrtError listing what is
    missing, unexpected, wrongly shaped or stored in the wrong dtype. blocks: a GGUF file's quantized blocks held as
    they are where qwenrt has their format (the CPU); False: dequantized. rope_scaling: replaces the config's
    (`config.with_rope_scaling`).
    """
    path = Path(check_path(path))
    if is_gguf(path):
        ckpt = open_gguf(path, mmproj, blocks)
        config = ckpt.config
    elif mmproj is not None:
        raise QwenrtError(f"{path}: a vision projector file (mmproj) goes with a GGUF model; a checkpoint directory "
                          "holds its own vision tower")
    else:
        config = load_config(path)
        ckpt = open_checkpoint(path)
    config = with_rope_scaling(config, rope_scaling)
    plan, aside = plan_text_tensors(ckpt)
    if config.text.model_type == qwen3_next.MODEL_TYPE:
        plan = qwen3_next.split_fused(plan, config.text, path)
    if config.text.family == QWEN3_VL:
        plan = qwen3_vl.map_tensors(plan, config.text)
    with torch.device("meta"):
        model = Qwen35ForCausalLM(config)
        if any(name.startswith(MTP_PREFIX) for name in plan):  # loaded, quantized and checked with the rest
            model.mtp = MTPHead(config.text)
        classifier = classifier_spec(config.raw, str(path / "config.json")) if not is_gguf(path) else None
        if classifier is not None:
            attach_head(model, classifier.num_labels)
            model.classifier = classifier
    stored = stored_spec(config.raw, str(path / "config.json"))
    quantized = install_placeholders(model, *stored) if stored else {}  # stored quantized weights: their pieces
    if isinstance(ckpt, GGUFCheckpoint):
        quantized = install_stored(model, {name.rpartition(".")[0]: spec for name, (_, spec, _) in ckpt.pieces.items()})
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()} | quantized  # a tied head once
    if config.text.tie_word_embeddings:
        plan.pop("lm_head.weight", None)  # some exports store the tied head too; the reference ignores it
    check_tensors(path, "checkpoint does not match its config", expected, {n: src.shape for n, src in plan.items()})
    buffers = dict(model.named_buffers())
    if isinstance(model.model.embed_tokens, QuantEmbedding):  # an untied table's pieces are no module's buffers
        buffers |= {f"{EMBEDDING}.{key}": t for key, t in model.model.embed_tokens.stored.items()}
    check_dtypes(path, ckpt, plan, buffers)
    _check_vision(getattr(ckpt, "mmproj", None) or path, config, ckpt)
    return config, ckpt, plan, aside, model


def check_checkpoint(path: str | Path, mmproj: str | Path | None = None, blocks: bool = True,
                     rope_scaling: dict | None = None) -> tuple[tuple, Tokenizer | None]:
    """Everything `load` checks before it reads a weight, and `inspect` with it: `verify_checkpoint`, then the
    tokenizer's files opened as load opens them (regular files inside the checkpoint, size-capped), parsed, the chat
    template compiled. Returns (verify_checkpoint's tuple, the tokenizer or None when there is no tokenizer.json)."""
    verified = verify_checkpoint(path, mmproj, blocks, rope_scaling)
    vocab, ckpt = verified[0].text.vocab_size, verified[1]
    if isinstance(ckpt, GGUFCheckpoint):
        return verified, ckpt.tokenizer and Tokenizer(ckpt.tokenizer, model_vocab_size=vocab)
    return verified, load_tokenizer(path, model_vocab_size=vocab)


def scan_finite(where, name: str, tensor: torch.Tensor) -> None:
    """Refuse a weight holding NaN or ±Inf: it would silently poison every output. One pass: NaN and ±Inf show in
    the minimum or the maximum (aminmax propagates NaN), the fastest exact reduction torch has on the CPU."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    if all(bool(torch.isfinite(v)) for v in torch.aminmax(tensor)):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    raise QwenrtError(f"{where}: tensor '{name}' holds {bad} NaN/Inf value(s) in {tensor.dtype} "
                      "(load with check_finite=False / --no-finite-check to skip this scan)")


def resolve_device(device) -> torch.device:
    """A torch.device this build can use, or one QwenrtError."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise QwenrtError(f"unknown device {device!r} (use cpu, cuda, cuda:N or mps)") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if resolved.type not in available:
        raise QwenrtError(f"device {device!r} is not supported (use cpu, cuda, cuda:N or mps)")
    if not available[resolved.type]:
        raise QwenrtError(f"device {device!r}: this torch build or machine has no {resolved.type.upper()} support")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise QwenrtError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return resolved


def _quantizer(model, config, quantize, dtype, device) -> LoadQuantizer | None:
    stored = next((m.spec for m in model.modules() if isinstance(m, QuantLinear)), None)  # placeholders
    if stored and quantize:
        raise QwenrtError(f"the checkpoint is already quantized ({stored}): load it without quantize=")
    if not (stored or quantize):
        return None
    if torch.device(device).type != "cpu":
        raise QwenrtError(f"weight-only quantization runs on the CPU, not on {device}")
    return LoadQuantizer(model, None if stored else QuantSpec.parse(quantize), dtype)


def weight_bytes(model, dtype: torch.dtype, quantizer: LoadQuantizer | None) -> int:
    """The bytes the weights of `model` (on `meta`) hold once loaded: stored quantized pieces (placeholders' buffers,
    a GGUF file's blocks among them) at their stored sizes, the weights `quantizer` quantizes while loading at
    theirs, the fp32 parameters in fp32 and the other float tensors in `dtype`."""
    params = dict(model.named_parameters())
    quantized, replaced = 0, set()
    if quantizer is not None and not quantizer.stored:
        for source, paths in quantizer.claimed.items():  # a tied embedding: the head's source
            replaced.add(source)
            quantized += sum(math.prod(shape) * d.itemsize for path in paths for shape, d in
                             storage_entries(tuple(params[source].shape), quantizer.specs[path]).values())
    keep_fp32 = _fp32_parameters(model)
    floats = sum(p.numel() * (4 if name in keep_fp32 else dtype.itemsize)
                 for name, p in params.items() if name not in replaced)
    embed = model.model.embed_tokens  # an untied table stored quantized: its pieces are no module's buffers
    pieces = [*model.buffers(), *(embed.stored.values() if isinstance(embed, QuantEmbedding) else ())]
    stored = sum(t.numel() * t.element_size() for t in {id(t): t for t in pieces}.values())
    return floats + quantized + stored


def check_memory(path, needed: int) -> None:
    """Refuse, in one line, weights of `needed` bytes beyond the memory available less a margin; not checked where
    /proc/meminfo is missing or QWENRT_SKIP_MEMORY_CHECK=1."""
    available = meminfo("MemAvailable")
    if available is None or os.environ.get(SKIP_MEMORY_CHECK) == "1" or needed + MEMORY_MARGIN <= available:
        return
    raise QwenrtError(f"{path}: needs {(needed + MEMORY_MARGIN) / GIB:.1f} GiB of memory to load (weights "
                      f"{needed / GIB:.1f} GiB), {available / GIB:.1f} GiB is available; free memory, use a smaller "
                      f"or quantized model, or set {SKIP_MEMORY_CHECK}=1 to load it anyway")


def prepare_kernels(progress: bool) -> None:
    """Build (first time) or load the native CPU kernels now rather than inside the first token."""
    start = time.perf_counter()
    if cpu_kernels() is not None and progress and time.perf_counter() - start > 2:
        print(f"compiled the native CPU kernels in {time.perf_counter() - start:.0f} s (cached for next time)",
              file=sys.stderr)


def read_weights(path, verified: tuple, dtype: torch.dtype, device: torch.device, quantizer: LoadQuantizer | None,
                 check_finite: bool):
    """Yield (name, tensor) for every planned tensor as `load` takes it: a quantizer's as stored (quantized from the
    stored values, as `qwenrt quantize` does), the fp32 parameters in fp32, the rest in `dtype` on `device`. Each is
    refused if it holds NaN/Inf after that cast (float16 can overflow to Inf), unless check_finite is False."""
    _, ckpt, plan, _, model = verified
    keep_fp32 = _fp32_parameters(model)
    for name, source in plan.items():
        if quantizer is not None and quantizer.claims(name):
            first = source.names[0][0] if source.stacked else source.names[0]
            tensor = materialize(ckpt, source, STORED_DTYPES.get(ckpt.dtypes[first], torch.float32))
        else:
            tensor = materialize(ckpt, source, torch.float32 if name in keep_fp32 else dtype).to(device)
        if check_finite:
            scan_finite(path, name, tensor)
        yield name, tensor


def scan_weights(path, verified: tuple) -> None:
    """`load`'s NaN/Inf scan at its defaults (dtype "auto", CPU), each weight dropped once scanned: for `inspect`."""
    config, ckpt, plan, _, model = verified
    dtype = resolve_dtype("auto", stored_float_dtype(ckpt, plan))
    cpu = torch.device("cpu")
    for _ in read_weights(path, verified, dtype, cpu, _quantizer(model, config, None, dtype, cpu), True):
        pass


def load_model(path: str | Path, dtype="auto", device: str | torch.device = "cpu", progress: bool = False,
               quantize: str | QuantSpec | None = None, check_finite: bool = True,
               rope_scaling: dict | None = None) -> Qwen35ForCausalLM:
    """Load the text decoder of a Qwen3.5 checkpoint directory. Raises QwenrtError on any inconsistency.

    quantize: "int8" | "int4" | a QuantSpec: weight-only quantization while loading (see qwenrt.quant).
    A checkpoint written by `qwenrt quantize` loads quantized without it. check_finite: refuse weights holding
    NaN/Inf (one pass over the weights; False skips it). rope_scaling: as `load` takes it.
    """
    device = resolve_device(device)
    verified = verify_checkpoint(path, blocks=device.type == "cpu", rope_scaling=rope_scaling)
    return _load_verified(path, verified, dtype, device, progress, quantize, check_finite)


def _load_verified(path, verified: tuple, dtype, device: torch.device, progress: bool, quantize,
                   check_finite: bool) -> Qwen35ForCausalLM:
    """The model of a checkpoint `verify_checkpoint` passed, its weights read, checked and assigned."""
    config, ckpt, plan, aside, model = verified
    dtype = resolve_dtype(dtype, stored_float_dtype(ckpt, plan))
    quantizer = _quantizer(model, config, quantize, dtype, device)
    if device.type == "cpu":  # before any weight is read
        check_memory(path, weight_bytes(model, dtype, quantizer))
    state = {}
    weights = read_weights(path, verified, dtype, device, quantizer, check_finite)
    for name, tensor in tqdm(weights, total=len(plan), desc="loading weights", unit="tensor", disable=not progress,
                             file=sys.stderr):
        if quantizer is not None and quantizer.claims(name):
            quantizer.add(name, tensor)
        else:
            state[name] = tensor
    model.load_state_dict(state, strict=False, assign=True)
    if quantizer is not None:
        quantizer.finish(model)
    if config.text.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    model.eval()
    if model.device.type == "cpu":
        prepare_kernels(progress)
    model.checkpoint_path = Path(path)
    model.extra_tensors = sorted(aside)  # model.visual.*, for the vision tower
    model.mmproj_path = getattr(ckpt, "mmproj", None)
    # a projector file's tensors, kept until the tower loads (the text file's map is released with the rest)
    model.vision_checkpoint = ckpt.vision_part() if model.mmproj_path else None
    return model


def use_threads(threads: int | None) -> None:
    """Run torch's CPU ops and the native kernels (which split their work on torch's pool) on `threads` threads;
    None leaves the count as it is."""
    if threads is None:
        return
    if type(threads) is not int or threads < 1:
        raise QwenrtError(f"threads must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(threads)


def _attach_adapters(model, adapter, adapters) -> None:
    from qwenrt.served_adapters import NAME, attach

    if adapter is not None and adapters is not None:
        raise QwenrtError("give adapter (one, for every request) or adapters (several, by name), not both")
    if adapter is not None:
        name = Path(check_path(adapter, "adapter")).name
        name = name if NAME.fullmatch(name) else "adapter"
        attach(model, {name: adapter}, default=name)
    else:
        if not isinstance(adapters, dict):
            raise QwenrtError(f"adapters must be a dict {{name: adapter directory}}, got {type(adapters).__name__}")
        attach(model, {name: check_path(where, f"adapter {name!r:.40}") for name, where in adapters.items()})


def load(path: str | Path | None = None, dtype="auto", device: str | torch.device = "cpu", revision: str | None = None,
         progress: bool = False, quantize: str | QuantSpec | None = None, check_finite: bool = True,
         threads: int | None = None, mmproj: str | Path | None = None, adapter: str | Path | None = None,
         adapters: dict[str, str | Path] | None = None, rope_scaling: dict | None = None, **engine_options):
    """Load a Qwen3.5 checkpoint (a directory, a hub repo id, or a `qwen35`/`qwen35moe` GGUF file; None: the
    built-in model): returns (model, tokenizer).

    dtype: "auto" (as stored; bf16 for a quantized GGUF), "float32", "bfloat16", "float16" or a torch.dtype. The tokenizer is None when the
    checkpoint has no tokenizer.json. quantize: "int8" | "int4" (weight-only, CPU), see `load_model`.
    check_finite=False skips the NaN/Inf scan of the weights. threads: CPU threads of torch and the native kernels
    in this process from now on (torch.set_num_threads; None leaves them: torch's default is the physical cores).
    mmproj: a llama.cpp vision projector file (`clip`, as `convert_hf_to_gguf.py --mmproj` writes it) giving a GGUF
    model its vision tower.
    adapter: a LoRA adapter directory in PEFT's format (qwenrt.adapters) every request runs with. adapters: {name:
    adapter directory}, served side by side (qwenrt.served_adapters): a request runs with the one it names
    (`adapter="name"`), or none; different adapters and none share one batched step.
    rope_scaling: replaces the checkpoint's RoPE scaling, as rope_parameters' keys: {"rope_type": "yarn", "factor":
    4.0, "original_max_position_embeddings": 262144} (YaRN; the context limit becomes factor x original), or
    {"rope_type": "default"} (none).
    engine_options: settings of the engine that generation on this model uses (`qwenrt.engine.Engine`: max_running,
    max_model_len, prefix_cache_size, prefix_cache_dir, ...), checked when it is made.
    """
    check_flag(progress, "progress")
    check_flag(check_finite, "check_finite")
    use_threads(threads)
    device = resolve_device(device)
    path = resolve_model_path(resolve_model(path)[0], revision)
    # before any weight is read
    verified, tokenizer = check_checkpoint(path, mmproj, device.type == "cpu", rope_scaling)
    model = _load_verified(path, verified, dtype, device, progress, quantize, check_finite)
    if adapter is not None or adapters is not None:
        _attach_adapters(model, adapter, adapters)
    model.engine_options = engine_options
    return model, tokenizer
