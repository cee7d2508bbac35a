"""Checkpoint directory -> a ready model: config, model built on `meta`, weights assigned after strict accounting."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qwenrt.checkpoint import materialize, open_checkpoint, plan_text_tensors
from qwenrt.config import load_config
from qwenrt.default_model import resolve_model
from qwenrt.errors import QwenrtError
from qwenrt.hub import resolve_model_path
from qwenrt.kernels import cpu_kernels
from qwenrt.model import Qwen35ForCausalLM
from qwenrt.quant import LoadQuantizer, QuantSpec, install_placeholders, stored_spec
from qwenrt.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
STORED_DTYPES = {**SAFETENSORS_DTYPES, "I8": torch.int8, "U8": torch.uint8}


def resolve_dtype(dtype, stored: str | None) -> torch.dtype:
    """"auto"/None -> the checkpoint's stored float dtype; otherwise a name or a torch.dtype."""
    if dtype in (None, "auto"):
        return SAFETENSORS_DTYPES.get(stored, torch.float32)
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise QwenrtError(f"unsupported dtype {dtype!r} (use one of: auto, {', '.join(DTYPES)})")


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


def verify_checkpoint(path: str | Path):
    """Config plus strict tensor accounting from the headers alone, nothing read.

    Returns (config, checkpoint, plan, names set aside, the model on `meta`). Raises QwenrtError listing what is missing, unexpected
    or wrongly shaped.
    """
    path = Path(path)
    if not path.is_dir():
        raise QwenrtError(f"{path}: not a directory")
    config = load_config(path)
    ckpt = open_checkpoint(path)
    plan, aside = plan_text_tensors(ckpt)
    with torch.device("meta"):
        model = Qwen35ForCausalLM(config)
    stored = stored_spec(config.raw)
    quantized = install_placeholders(model, *stored) if stored else {}  # stored quantized weights: their pieces
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()} | quantized  # a tied head once
    if config.text.tie_word_embeddings:
        plan.pop("lm_head.weight", None)  # some exports store the tied head too; the reference ignores it
    check_tensors(path, "checkpoint does not match its config", expected, {n: src.shape for n, src in plan.items()})
    return config, ckpt, plan, aside, model


def _quantizer(model, config, quantize, dtype, device) -> LoadQuantizer | None:
    stored = stored_spec(config.raw)
    if stored and quantize:
        raise QwenrtError(f"the checkpoint is already quantized ({stored[0]}): load it without quantize=")
    if not (stored or quantize):
        return None
    if torch.device(device).type != "cpu":
        raise QwenrtError(f"weight-only quantization runs on the CPU, not on {device}")
    return LoadQuantizer(model, stored[0] if stored else QuantSpec.parse(quantize), stored is not None, dtype)


def prepare_kernels(progress: bool) -> None:
    """Build (first time) or load the native CPU kernels now rather than inside the first token."""
    start = time.perf_counter()
    if cpu_kernels() is not None and progress and time.perf_counter() - start > 2:
        print(f"compiled the native CPU kernels in {time.perf_counter() - start:.0f} s (cached for next time)",
              file=sys.stderr)


def load_model(path: str | Path, dtype="auto", device: str | torch.device = "cpu", progress: bool = False,
               quantize: str | QuantSpec | None = None) -> Qwen35ForCausalLM:
    """Load the text decoder of a Qwen3.5 checkpoint directory. Raises QwenrtError on any inconsistency.

    quantize: "int8" | "int4" | a QuantSpec: weight-only quantization while loading (see qwenrt.quant).
    A checkpoint written by `qwenrt quantize` loads quantized without it.
    """
    config, ckpt, plan, aside, model = verify_checkpoint(path)
    dtype = resolve_dtype(dtype, ckpt.dtypes[plan["model.embed_tokens.weight"].names[0]])
    keep_fp32 = _fp32_parameters(model)
    quantizer = _quantizer(model, config, quantize, dtype, device)
    state = {}
    for name, source in tqdm(plan.items(), desc="loading weights", unit="tensor", disable=not progress,
                             file=sys.stderr):
        target = torch.float32 if name in keep_fp32 else dtype
        if quantizer is not None and quantizer.claims(name):
            # quantized from the stored values, as `qwenrt quantize` does, whatever the compute dtype
            first = source.names[0][0] if source.stacked else source.names[0]
            tensor = materialize(ckpt, source, STORED_DTYPES.get(ckpt.dtypes[first], torch.float32))
            if not quantizer.add(name, tensor):
                continue
        else:
            tensor = materialize(ckpt, source, target)
        state[name] = tensor.to(device=device, dtype=target)
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
    model.extra_tensors = sorted(aside)  # mtp.* and model.visual.*, for the MTP head and vision tower
    return model


def load(path: str | Path | None = None, dtype="auto", device: str | torch.device = "cpu", revision: str | None = None,
         progress: bool = False, quantize: str | QuantSpec | None = None):
    """Load a Qwen3.5 checkpoint (a directory or a hub repo id; None: the built-in model): returns (model, tokenizer).

    dtype: "auto" (as stored), "float32", "bfloat16", "float16" or a torch.dtype. The tokenizer is None when the
    checkpoint has no tokenizer.json. quantize: "int8" | "int4" (weight-only, CPU), see `load_model`.
    """
    path = resolve_model_path(resolve_model(path)[0], revision)
    model = load_model(path, dtype=dtype, device=device, progress=progress, quantize=quantize)
    return model, load_tokenizer(path)
