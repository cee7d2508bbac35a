"""LoRA adapters in PEFT's format, both ways: a directory holding adapter_config.json and adapter_model.safetensors,
the tensors under transformers' module names as PEFT saves them,

    base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight   [r, K]
    base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_B.weight   [N, r]

(`model.language_model.layers.` for a vision-language base), so `peft.PeftModel.from_pretrained` loads ours and
adapters trained with PEFT load here. The routed MoE experts' fused banks [E, N, K] are adapted as PEFT's
`target_parameters` do: one pair per bank, lora_A [r·E, K] and lora_B [N, r·E] (expert e's A rows e·r..e·r+r-1, its
B columns e, e+E, ...), several banks of one module nested (`experts.base_layer.lora_A` the first one the config
names, `experts.lora_A` the last). A classifier's adapter (task_type SEQ_CLS) also holds its whole score head,
`base_model.model.score.weight`, as PEFT's modules_to_save keeps it. Read strictly: an adapter that does not fit
the base is one error naming the file.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from qwenrt.checkpoint import canonical_name
from qwenrt.config import QWEN3_NEXT
from qwenrt.errors import QwenrtError
from qwenrt.families import qwen3_next
from qwenrt.files import CheckpointDir, output_dir
from qwenrt.lora import BANK_NAMES, LoraBank, LoraSpec, expert_banks, kind, lora_modules, projections

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
PIECES = (".lora_A.weight", ".lora_B.weight")
EXPERTS, NESTED = "mlp.experts", ".base_layer"  # a routed experts module; PEFT's wrapper around a wrapped bank
BANKS = ("experts.gate_up_proj", "experts.down_proj")
HEAD = PREFIX + "score.weight"  # a SEQ_CLS adapter's head [num_labels, hidden]
HEAD_MODULES = {"score", "classifier"}  # what PEFT lists in a SEQ_CLS adapter's modules_to_save
MAX_PATTERNS, MAX_PATTERN_CHARS = 4096, 256  # rank_pattern / alpha_pattern keys
# PEFT settings whose adapters compute something else than base + scaling·B·A on projections: refused when set
UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "modules_to_save": "modules_to_save (whole modules)",
               "fan_in_fan_out": "fan_in_fan_out (Conv1D bases)", "trainable_token_indices": "trainable tokens",
               "layer_replication": "layer replication"}


def _transformers_path(path: str, vlm: bool) -> str:
    """Our module path -> transformers' (the text decoder of a vision-language model sits in model.language_model)."""
    return "model.language_model." + path[len("model."):] if vlm else path


def save_adapter(directory: str | Path, model: nn.Module, spec: LoraSpec, base: str | None) -> None:
    """Write the model's adapters into `directory` in PEFT's format; `base` goes to base_model_name_or_path."""
    directory = output_dir(directory, "adapter directory")
    adapters = lora_modules(model)
    vlm = model.config.is_vlm
    banks = {path: m for path, m in adapters.items() if isinstance(m, LoraBank)}
    pairs = {path: _peft_pair(m) for path, m in adapters.items()}
    if model.config.text.family == QWEN3_NEXT:
        pairs = _fuse_next(pairs, model.config.text)
    tensors, rank_pattern, alpha_pattern = {}, {}, {}
    for path, (A, B) in pairs.items():
        name = _transformers_path(_peft_path(path, banks), vlm)
        tensors[PREFIX + name + PIECES[0]], tensors[PREFIX + name + PIECES[1]] = A, B
        rank = A.shape[0]
        if path not in banks and rank != spec.rank:  # a fused pair: its own rank, alpha kept to the same scaling
            rank_pattern[re.escape(name)] = rank
            alpha_pattern[re.escape(name)] = spec.scaling * (math.sqrt(rank) if spec.rslora else rank)
    head = getattr(model, "score", None)
    if head is not None:
        tensors[HEAD] = head.weight.detach().float().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM" if head is None else "SEQ_CLS",
              "base_model_name_or_path": base, "revision": None,
              "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "use_rslora": spec.rslora,
              "target_modules": sorted({kind(path) for path in pairs if path not in banks}), "bias": "none",
              "fan_in_fan_out": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None if head is None else ["score"], "layers_to_transform": None,
              "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}
    if banks:  # in the order PEFT wraps them, as _bank_path reads them back
        config["target_parameters"] = sorted({kind(path) for path in banks},
                                             key=lambda p: BANK_NAMES.index(p.rpartition(".")[2]))
    try:
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    except OSError as e:
        raise QwenrtError(f"cannot write the adapter into {directory}: {e.strerror or e}") from None


def _fuse_next(pairs: dict[str, tuple], c) -> dict[str, tuple]:
    """Qwen3-Next: each layer's pairs on the parts of a fused projection (in_proj_qkv and in_proj_z; in_proj_b and
    in_proj_a) as one pair on the fused module transformers has (in_proj_qkvz; in_proj_ba)."""
    out = dict(pairs)
    for fused, parts in qwen3_next.fused_rows(c).items():
        for owner in sorted({p.rpartition(".")[0] for p in pairs if p.rpartition(".")[2] in parts}):
            mine = {part: out.pop(f"{owner}.{part}") for part in parts if f"{owner}.{part}" in out}
            out[f"{owner}.{fused}"] = qwen3_next.fuse_adapters(fused, mine, c)
    return out


def _peft_path(path: str, banks: dict[str, LoraBank]) -> str:
    """The module PEFT keeps a pair under: a projection's path; an expert bank's experts module, inside one
    `.base_layer` per bank of that module PEFT wraps after it ("...experts.base_layer" for gate_up_proj beside
    down_proj)."""
    if path not in banks:
        return path
    module, _, bank = path.rpartition(".")
    later = [b for b in BANK_NAMES[BANK_NAMES.index(bank) + 1:] if f"{module}.{b}" in banks]
    return module + NESTED * len(later)


def _peft_pair(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter's (lora_A, lora_B) as PEFT stores them, fp32: a bank's [E, r, K], [E, N, r] as [r·E, K] and
    [N, r·E] (expert e's A rows e·r.., its B columns e, e+E, ...)."""
    A, B = m.lora_A.detach().float(), m.lora_B.detach().float()
    if isinstance(m, LoraBank):
        A, B = A.flatten(0, 1), B.permute(1, 2, 0).flatten(1)
    return A.contiguous(), B.contiguous()


def read_config(directory: str | Path) -> tuple[LoraSpec, Path, tuple[str, ...], tuple[dict, dict]]:
    """An adapter directory's adapter_config.json -> (its LoraSpec, the weights file, its target_parameters: the
    expert banks it adapts, its (rank_pattern, alpha_pattern)), or one QwenrtError."""
    where = CheckpointDir(directory)
    if not where.exists(CONFIG_FILE):
        raise QwenrtError(f"{where.path}: no {CONFIG_FILE} (a PEFT LoRA adapter holds {CONFIG_FILE} and "
                          f"{WEIGHTS_FILE})")
    file = where.file(CONFIG_FILE)
    raw = where.read_json(CONFIG_FILE)
    if raw.get("peft_type") != "LORA":
        raise QwenrtError(f"{file}: peft_type {raw.get('peft_type')!r:.40} is not a LoRA adapter (LORA)")
    for key, what in UNSUPPORTED.items():
        if raw.get(key) and not (key == "modules_to_save" and _head_only(raw)):
            raise QwenrtError(f"{file}: {what} not supported")
    targets = raw.get("target_modules")
    targets = (targets,) if isinstance(targets, str) else tuple(targets or ())
    parameters = raw.get("target_parameters") or []
    if not (isinstance(parameters, list) and all(isinstance(p, str) and p.endswith(BANKS) for p in parameters)):
        raise QwenrtError(f"{file}: target_parameters {parameters!r:.120} must name the MoE experts' banks "
                          f"(mlp.experts.gate_up_proj, mlp.experts.down_proj)")
    try:
        spec = LoraSpec(raw.get("r"), raw.get("lora_alpha"), targets or ("?",), rslora=bool(raw.get("use_rslora")))
    except QwenrtError as e:
        raise QwenrtError(f"{file}: {e}") from None
    patterns = _pattern(file, raw, "rank_pattern", int), _pattern(file, raw, "alpha_pattern", (int, float))
    if not where.exists(WEIGHTS_FILE):
        pickled = " (adapter_model.bin, a pickle, is not read: save with safe_serialization=True)" \
            if where.exists("adapter_model.bin") else ""
        raise QwenrtError(f"{where.path}: no {WEIGHTS_FILE}{pickled}")
    return spec, where.file(WEIGHTS_FILE, "adapter weights"), tuple(parameters), patterns


def _pattern(file: Path, raw: dict, key: str, kinds) -> dict[str, float]:
    """rank_pattern / alpha_pattern: {regular expression: a positive number}, as PEFT reads them. An adapter may come
    from a stranger: at most MAX_PATTERNS keys of MAX_PATTERN_CHARS, and no repetition of a repeated group (the
    patterns that can backtrack for minutes over a module name)."""
    pattern = raw.get(key) or {}
    if not isinstance(pattern, dict) or len(pattern) > MAX_PATTERNS:
        raise QwenrtError(f"{file}: {key} must be an object of at most {MAX_PATTERNS} module patterns")
    for name, value in pattern.items():
        if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < 1e9:
            raise QwenrtError(f"{file}: {key}[{name!r:.80}] must be a positive number, got {value!r:.40}")
        if len(name) > MAX_PATTERN_CHARS or _repeats_a_repetition(name):
            raise QwenrtError(f"{file}: {key} key {name!r:.80} is longer than {MAX_PATTERN_CHARS} characters or "
                              "repeats a repeated group")
        try:
            re.compile(name)
        except re.error as e:
            raise QwenrtError(f"{file}: {key} key {name!r:.80} is not a regular expression ({e})") from None
    return pattern


def _repeats_a_repetition(pattern: str) -> bool:
    """Whether a regular expression repeats (*, +, {}) a group that holds a repetition at any depth: (a+)+, ((x*))*."""
    inside, i = [False], 0  # per open group: whether it holds a repetition
    while i < len(pattern):
        c, following = pattern[i], pattern[i + 1:i + 2]
        if c == "\\":
            i += 1  # an escaped character is a literal
        elif c == "(":
            inside.append(False)
        elif c == ")" and len(inside) > 1:
            held = inside.pop()
            if held and following in ("*", "+", "{"):
                return True
            inside[-1] = inside[-1] or held or following in ("*", "+", "{")
        elif c in "*+{":
            inside[-1] = True
        i += 1
    return False


def _module_rank_scaling(key: str, spec: LoraSpec, patterns: tuple[dict, dict]) -> tuple[int, float]:
    """(rank, scaling) of the module at transformers path `key`: the first pattern matching it, as PEFT's
    get_pattern_key picks, else the config's r and lora_alpha."""
    def pick(pattern: dict, default):
        return next((v for k, v in pattern.items() if re.match(rf"(.*\.)?({k})$", key)), default)

    rank, alpha = pick(patterns[0], spec.rank), pick(patterns[1], spec.alpha)
    return rank, alpha / (math.sqrt(rank) if spec.rslora else rank)


def _head_only(raw: dict) -> bool:
    """A SEQ_CLS adapter whose modules_to_save are the classification head's names (as PEFT writes them)."""
    saved = raw.get("modules_to_save")
    return raw.get("task_type") == "SEQ_CLS" and isinstance(saved, list) and set(saved) <= HEAD_MODULES


def read_adapter(directory: str | Path, model: nn.Module) -> tuple[LoraSpec, dict[str, tuple[torch.Tensor, ...]]]:
    """Read and check an adapter against `model` (loaded, or on `meta`): (its spec, path -> (lora_A, lora_B) fp32):
    a projection's path -> ([r, K], [N, r]); an expert bank's ("model.layers.0.mlp.experts.gate_up_proj") ->
    ([E, r, K], [E, N, r]), expert by expert. Every tensor must be a lora_A / lora_B pair of a projection or bank the
    model has, of its shape and the config's rank, finite; a classifier's head (read_head) only where the model has
    one."""
    spec, file, parameters, patterns = read_config(directory)
    tensors = _read_tensors(file)
    if HEAD in tensors:
        if getattr(model, "score", None) is None:
            raise QwenrtError(f"{file}: a classifier's adapter (it holds the score head): it goes on a sequence "
                              "classifier, not on a causal LM")
        del tensors[HEAD]
    found, banks, fused = projections(model), expert_banks(model), _fused_projections(model)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    keys: dict[str, str] = {}  # our path -> the module's path in transformers, which patterns match
    for name, t in tensors.items():
        piece = next((p for p in PIECES if name.endswith(p)), None)
        key = name[len(PREFIX):-len(piece)] if name.startswith(PREFIX) and piece else None
        path = canonical_name(key) if key else None
        if path is None:
            raise QwenrtError(f"{file}: tensor '{name:.120}' is not a LoRA weight (base_model.model.<module>"
                              ".lora_A.weight / .lora_B.weight)")
        if path.endswith(EXPERTS) or path.endswith(EXPERTS + NESTED):
            path = _bank_path(file, name, path, parameters)
        if path not in found and path not in banks and path not in fused:
            raise QwenrtError(f"{file}: tensor '{name:.120}' adapts {path:.120}, which is no projection of this "
                              "model")
        pairs.setdefault(path, {})[piece] = t
        keys[path] = key
    if not pairs:
        raise QwenrtError(f"{file}: holds no LoRA weights")
    out = {}
    for path, pieces in pairs.items():
        rank, scaling = _module_rank_scaling(keys[path], spec, patterns)
        A, B = _checked_pair(file, path, pieces, found.get(path) or banks.get(path) or fused[path], rank)
        if scaling != spec.scaling:  # its own alpha or rank: the adapter's one scaling applies to every module
            B = B * (scaling / spec.scaling)
        if path in fused:
            owner, _, name = path.rpartition(".")
            out.update({f"{owner}.{part}": pair
                        for part, pair in qwen3_next.split_adapter(name, A, B, model.config.text).items()})
        else:
            out[path] = (A, B)
    return spec, out


def _fused_projections(model: nn.Module) -> dict[str, SimpleNamespace]:
    """Qwen3-Next's fused projections transformers has and qwenrt holds split, by path -> their in/out features."""
    c = model.config.text
    if c.family != QWEN3_NEXT:
        return {}
    rows = {fused: sum(len(r) for r in parts.values()) for fused, parts in qwen3_next.fused_rows(c).items()}
    return {f"model.layers.{i}.linear_attn.{fused}": SimpleNamespace(out_features=n, in_features=c.hidden_size)
            for i in c.linear_attention_layers for fused, n in rows.items()}


def _bank_path(file: Path, name: str, module: str, parameters: tuple[str, ...]) -> str:
    """The bank a pair nested `depth` wrappers deep in an experts module adapts: PEFT wraps the banks in the order
    target_parameters names them, the first innermost."""
    depth = module.count(NESTED)
    module = module.replace(NESTED, "")
    banks = [p.rpartition(".")[2] for p in parameters]
    if depth >= len(banks):
        raise QwenrtError(f"{file}: tensor '{name:.120}' adapts an expert bank that target_parameters does not name")
    return f"{module}.{banks[len(banks) - 1 - depth]}"


def read_head(directory: str | Path, num_labels: int, hidden: int) -> torch.Tensor:
    """A classifier adapter's score head [num_labels, hidden] fp32, checked."""
    file = read_config(directory)[1]
    head = _read_tensors(file).get(HEAD)
    if head is None:
        raise QwenrtError(f"{file}: no classification head ({HEAD})")
    if tuple(head.shape) != (num_labels, hidden) or not head.is_floating_point() or not bool(
            torch.isfinite(head).all()):
        raise QwenrtError(f"{file}: {HEAD} must hold finite floats of shape [{num_labels}, {hidden}], not "
                          f"{list(head.shape)} {head.dtype}")
    return head.float()


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise QwenrtError(f"{file}: cannot read the adapter weights ({' '.join(str(e).split())[:200]})") from None


def _checked_pair(file: Path, path: str, pieces: dict[str, torch.Tensor], base: nn.Module | tuple, rank: int):
    """A projection's pair (base: the module) or an expert bank's (base: (E, N, K)), checked, fp32, expert by
    expert for a bank."""
    missing = [p for p in PIECES if p not in pieces]
    if missing:
        raise QwenrtError(f"{file}: {path} has no {missing[0][1:]}")
    A, B = pieces[PIECES[0]], pieces[PIECES[1]]
    E, N, K = base if isinstance(base, tuple) else (1, base.out_features, base.in_features)
    if A.dim() != 2 or B.dim() != 2 or A.shape[1] != K or B.shape[0] != N:
        raise QwenrtError(f"{file}: {path}: lora_A {list(A.shape)} and lora_B {list(B.shape)} do not fit the base's "
                          f"[{N}, {K}] weight{' per expert' * (E > 1)} (expected [r{'·E' * (E > 1)}, {K}] and "
                          f"[{N}, r{'·E' * (E > 1)}])")
    if A.shape[0] != rank * E or B.shape[1] != rank * E:
        raise QwenrtError(f"{file}: {path} has rank {A.shape[0] // E} (lora_A) / {B.shape[1] // E} (lora_B), but "
                          f"{CONFIG_FILE} says r = {rank} for it")
    for name, t in (("lora_A", A), ("lora_B", B)):
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise QwenrtError(f"{file}: {path}.{name} must hold finite floats ({t.dtype})")
    if not isinstance(base, tuple):
        return A.float(), B.float()
    return A.float().reshape(E, rank, K), B.float().reshape(N, rank, E).permute(2, 0, 1).contiguous()
