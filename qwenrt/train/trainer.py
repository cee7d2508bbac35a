"""Full-parameter training of a Qwen3.5 model (and its MTP head) on chat conversations, LoRA adapters on a frozen
one, or a LoRA-adapted sequence classifier on labelled texts (task "classify", qwenrt.train.classify).

The model is the inference model (qwenrt/model.py): the chunked DeltaNet is differentiable and the native kernels
step aside while autograd records. The loss is the cross-entropy on assistant tokens only; the MTP head learns
token t+2 at the same positions, weighted by `mtp_weight`, and with `mtp_depths` > 1 also t+3.. from its own
output, as the engine chains it for further drafts (`mtp_only` fits the head alone to a trained model). AdamW over
the trainable parameters (so adapters can later train alone), linear warm-up then cosine decay, gradient
accumulation and clipping. The data order is a
function of (seed, step), so a run resumed from a checkpoint continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from qwenrt.adapters import (CONFIG_FILE as ADAPTER_CONFIG, WEIGHTS_FILE as ADAPTER_WEIGHTS, read_adapter, read_head,
                             save_adapter)
from qwenrt.classifier import attach_head, init_head
from qwenrt.config import parse_config
from qwenrt.errors import QwenrtError
from qwenrt.lora import DEFAULT_TARGETS, LoraSpec, add_adapters, lora_modules, trainable_count, wrap
from qwenrt.mtp import MTPHead, chained_hidden
from qwenrt.train.checkpoints import (STATE_FILE, config_json, latest_step_dir, load_state, prepare_output, prune,
                                      restore_optimizer, save_checkpoint, step_dir)
from qwenrt.train.classify import classification_loss, classifier_config, evaluate_classifier, save_classifier
from qwenrt.train.data import Example, collate, encode_all, load_conversations
from qwenrt.train.labels import encode_labelled, label_map, label_names, read_labelled
from qwenrt.validation import check_path

LOG_FILE = "train_log.jsonl"
LORA_BASES = ("float32", "bfloat16", "int8", "int4")
TASKS = ("sft", "classify")
LOSS_SLICE = 256  # rows of logits alive at a time in a checkpointed loss (a 248K vocabulary: 250 MB fp32)
SHOWN = {"eval_accuracy": "acc", "eval_macro_f1": "f1"}  # held-out figures in the progress bar, by their short name


@dataclass
class TrainConfig:
    """What to train and how. Start from `init` (a checkpoint directory: its config, tokenizer and weights) or from
    scratch with `model_config` (a text config.json dict) and `tokenizer` (a directory with the tokenizer files)."""

    out: str
    data: str | list[dict]  # a JSONL path, or the conversations themselves
    eval_data: str | list[dict] | None = None
    init: str | None = None
    model_config: dict | None = None
    tokenizer: str | None = None
    steps: int = 1000
    batch_size: int = 32  # conversations per optimizer step
    micro_batch_tokens: int = 4096  # gradients accumulate over micro-batches of at most this many padded tokens
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None  # default: a tenth of the steps, at most 50 (a short fine-tune still reaches lr)
    hold: int = 0  # steps at the peak learning rate after the warm-up, before the cosine decay begins
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    mtp_weight: float | None = None  # 0: leave the MTP head out (default 0.3; with LoRA 0, the head is not adapted)
    mtp_depths: int = 1  # the head's loss over this many chained drafts (mtp.chained_hidden)
    mtp_only: bool = False  # the model frozen: only the MTP head learns
    max_len: int = 1024
    eval_every: int = 100
    eval_batch: int = 64
    save_every: int = 500
    keep_checkpoints: int = 2
    save_dtype: str = "float32"  # the final checkpoint's dtype (step checkpoints are always fp32)
    in_order: bool = False  # the first pass over the data in its given order (a curriculum); later passes shuffled
    length_groups: int = 1  # >1: each run of this many steps is regrouped by length (less padding), then shuffled
    seed: int = 0
    threads: int | None = None  # torch threads (default: torch's); 1 is faster on a machine busy with other work
    resume: bool = False
    progress: bool = True
    gradient_checkpointing: bool = False  # recompute each layer (and the loss in slices) in the backward: less memory
    lora_rank: int | None = None  # train LoRA adapters of this rank on the frozen `init` model instead of the model
    lora_alpha: float | None = None  # default 2·rank
    lora_targets: tuple[str, ...] | None = None  # default: every projection and expert bank (lora.DEFAULT_TARGETS)
    lora_dropout: float = 0.0
    lora_base: str = "float32"  # the frozen base: float32, bfloat16, int8 or int4 (QLoRA; computed in fp32)
    task: str = "sft"  # "sft": chat conversations; "classify": labelled texts, LoRA plus a classification head
    num_labels: int | None = None  # classify: the classes (the data's labels are checked against it)
    eval_split: float = 0.0  # without eval_data: this share of the data is held out (a seeded choice)

    def __post_init__(self):
        """A one-line error for settings no run can use (they come from the command line)."""
        if self.mtp_weight is None:
            self.mtp_weight = 0.0 if self.lora_rank else 0.3
        counts = ("steps", "batch_size", "micro_batch_tokens", "max_len", "eval_every", "eval_batch", "save_every",
                  "keep_checkpoints", "length_groups", "mtp_depths")
        for name in counts:
            if getattr(self, name) < 1:
                raise QwenrtError(f"training: {name} must be at least 1, not {getattr(self, name)}")
        if self.warmup is None:
            self.warmup = min(50, self.steps // 10)
        if self.threads is not None and self.threads < 1:
            raise QwenrtError(f"training: threads must be at least 1, not {self.threads}")
        checks = {"lr": self.lr > 0, "warmup": self.warmup >= 0, "hold": self.hold >= 0,
                  "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
                  "weight_decay": self.weight_decay >= 0, "clip": self.clip > 0, "mtp_weight": self.mtp_weight >= 0}
        for name, ok in checks.items():
            if not ok:
                raise QwenrtError(f"training: {name} {getattr(self, name)} is out of range")
        if self.mtp_only and self.mtp_weight <= 0:
            raise QwenrtError("training: mtp_only trains the MTP head alone, so mtp_weight must be above 0")
        check_path(self.out, "training: output directory")
        for name in ("data", "eval_data"):
            value = getattr(self, name)
            if not (isinstance(value, list) or (value is None and name == "eval_data")):
                check_path(value, f"training: {name} (a JSONL file, or a list of conversations)")
        if self.save_dtype not in ("float32", "bfloat16", "float16"):
            raise QwenrtError(f"training: save_dtype must be float32, bfloat16 or float16, not {self.save_dtype!r}")
        if self.lora_rank is not None:
            self.lora_spec()
            if self.mtp_weight or self.mtp_only:
                raise QwenrtError("training: LoRA adapts the model, not its MTP head: leave mtp_weight at 0")
            if self.init is None:
                raise QwenrtError("training: LoRA trains adapters on a checkpoint: give `init`")
        if self.lora_base not in LORA_BASES:
            raise QwenrtError(f"training: lora_base must be one of {', '.join(LORA_BASES)}, not {self.lora_base!r}")
        if not 0 <= self.eval_split < 1:
            raise QwenrtError(f"training: eval_split must be in [0, 1), not {self.eval_split!r:.40}")
        self._check_task()

    def _check_task(self) -> None:
        from qwenrt.classifier import MAX_LABELS

        if self.task not in TASKS:
            raise QwenrtError(f"training: task must be one of {', '.join(TASKS)}, not {self.task!r:.40}")
        if self.task == "classify":
            if self.lora_rank is None:
                raise QwenrtError("training: a classifier trains LoRA adapters and its head: give lora_rank")
            if type(self.num_labels) is not int or not 1 <= self.num_labels <= MAX_LABELS:
                raise QwenrtError(f"training: task classify needs num_labels (--num-labels), an integer in "
                                  f"[1, {MAX_LABELS}], not {self.num_labels!r:.40}")
        elif self.num_labels is not None:
            raise QwenrtError("training: num_labels is for task classify")

    def lora_spec(self) -> LoraSpec:
        """The adapters to train (one-line errors for bad settings)."""
        alpha = 2 * self.lora_rank if self.lora_alpha is None and isinstance(self.lora_rank, int) else self.lora_alpha
        return LoraSpec(self.lora_rank, alpha, tuple(self.lora_targets or DEFAULT_TARGETS), self.lora_dropout)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over cfg.warmup steps, cfg.hold steps at cfg.lr, then cosine down to cfg.lr·min_lr_ratio at
    cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    start = cfg.warmup + cfg.hold
    progress = min(1.0, max(0, step - start) / max(1, cfg.steps - start))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def init_weights(modules: dict[str, torch.nn.Module], layers: int, seed: int) -> None:
    """Fresh weights for modules by name prefix ("" the model, "mtp." its head): matrices N(0, 1/fan_in), the
    residual-output projections further scaled by 1/sqrt(2·layers), embeddings N(0, 1/hidden), zero (1 + w)
    norms, the DeltaNet decay rates A spread over heads and their step sizes dt small, so the layers remember from
    the start (transformers' placeholder dt_bias = 1 forgets within a few tokens). GPT-2's fixed 0.02 is far too
    small at small widths: through the gated attention and SwiGLU products the layers would start silent."""
    g = torch.Generator().manual_seed(seed)
    for prefix, module in modules.items():
        for name, p in module.named_parameters():
            name = prefix + name
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):  # softplus(dt_bias) = dt log-uniform in [1e-3, 1e-1], as Mamba2 / FLA
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.empty(p.shape).uniform_(-1, 1, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                residual = name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))
                std = 1 / math.sqrt(p.shape[-1] * (2 * layers if residual else 1))
                p.copy_(torch.randn(p.shape, generator=g) * std)


def build_model(config: dict, mtp: bool, seed: int):
    """A freshly initialised fp32 model (and MTP head) from a config.json dict."""
    from qwenrt.model import Qwen35ForCausalLM

    model_config = parse_config(config)
    model = Qwen35ForCausalLM(model_config)
    head = MTPHead(model_config.text) if mtp else None
    init_weights({"": model} | ({"mtp.": head} if head is not None else {}), model_config.text.num_hidden_layers,
                 seed)
    return model, head


def load_model_for_training(path: str | Path, mtp: bool, seed: int):
    """fp32 model (and MTP head: the checkpoint's, or fresh) from a checkpoint directory, trainable."""
    from qwenrt.loader import load_model
    from qwenrt.mtp import load_mtp_head

    model = load_model(path, dtype=torch.float32)
    head = None
    if mtp:
        try:
            head = load_mtp_head(model, torch.float32)
        except QwenrtError as e:
            if "has no MTP head" not in str(e):
                raise
            head = MTPHead(model.config.text)
            init_weights({"mtp.": head}, model.config.text.num_hidden_layers, seed)
    model.requires_grad_(True)
    if head is not None:
        head.requires_grad_(True)
    return model, head


def base_quantization(cfg: TrainConfig) -> str | None:
    """What a LoRA run quantizes its base to while loading: int8 / int4, or None (a quantized checkpoint is used as
    stored: its lora_base must be int8 or int4)."""
    from qwenrt.config import load_config
    from qwenrt.quant import stored_spec

    quantized = cfg.lora_base in ("int8", "int4")
    if stored_spec(load_config(Path(cfg.init)).raw) is None:
        return cfg.lora_base if quantized else None
    if not quantized:
        raise QwenrtError(f"{cfg.init} is quantized: train adapters on it with lora_base int8 or int4 (its weights "
                          "as stored), or on its full-precision original")
    return None


def base_dtype(cfg: TrainConfig) -> str:
    """The compute dtype of a LoRA run: the base's, fp32 for a quantized one."""
    return "float32" if cfg.lora_base in ("int8", "int4") else cfg.lora_base


def load_lora_model(cfg: TrainConfig, adapter_dir: Path | None = None):
    """The frozen base `cfg.init` in cfg.lora_base with trainable adapters: fresh, or those saved in `adapter_dir`."""
    from qwenrt.loader import load_model

    model = load_model(cfg.init, dtype=base_dtype(cfg), quantize=base_quantization(cfg))
    spec = cfg.lora_spec()
    if cfg.task == "classify":  # a trainable fp32 head, fresh or saved
        attach_head(model, cfg.num_labels)
        init_head(model, cfg.seed)
        if adapter_dir is not None:
            with torch.no_grad():
                model.score.weight.copy_(read_head(adapter_dir, cfg.num_labels, model.config.text.hidden_size))
    if adapter_dir is None:
        add_adapters(model, spec, cfg.seed)
    else:
        saved, adapters = read_adapter(adapter_dir, model)
        if saved.rank != spec.rank or saved.scaling != spec.scaling:
            raise QwenrtError(f"{adapter_dir}: the saved adapter has rank {saved.rank}, scaling {saved.scaling:g}; "
                              f"this run trains rank {spec.rank}, scaling {spec.scaling:g}")
        wrap(model, adapters, spec.scaling, spec.dropout, trainable=True)
    return model


def sequence_losses(model, mtp: MTPHead | None, ids: torch.Tensor, mask: torch.Tensor, depths: int = 1):
    """Summed cross-entropies over a micro-batch: (main, MTP per depth, main token count, MTP token count per depth).

    ids, mask [B, T]; position t predicts ids[t+1] where mask[t+1] (the head runs only there), and the MTP head at t
    and depth d predicts ids[t+d+1] where mask[t+d+1].
    """
    hidden = model.hidden_states(ids)  # [B, T, D]
    target = mask[:, 1:]
    main = _cross_entropy(model, hidden[:, :-1][target], ids[:, 1:][target])
    n_main = int(target.sum())
    extras, counts = [], []
    if mtp is None:
        return main, extras, n_main, counts
    for d, h in enumerate(chained_hidden(model, mtp, ids, min(depths, ids.shape[1] - 2), hidden), start=1):
        wanted = mask[:, d + 1:]  # row t of depth d predicts ids[t+d+1]
        h = h[:, :ids.shape[1] - d - 1][wanted]
        extras.append(F.cross_entropy(model.lm_head(h).float(), ids[:, d + 1:][wanted], reduction="sum"))
        counts.append(int(wanted.sum()))
    return main, extras, n_main, counts


def _cross_entropy(model, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the head over h [N, D] against targets [N]; with gradient checkpointing LOSS_SLICE
    rows at a time, each recomputed in the backward (the logits [N, V] of a large vocabulary never all exist)."""
    def loss(h_part, t_part):
        return F.cross_entropy(model.lm_head(h_part).float(), t_part, reduction="sum")

    if not (model.gradient_checkpointing and torch.is_grad_enabled()):
        return loss(h, targets)
    parts = [checkpoint(loss, h[i:i + LOSS_SLICE], targets[i:i + LOSS_SLICE], use_reentrant=False)
             for i in range(0, h.shape[0], LOSS_SLICE)]
    return sum(parts, h.new_zeros((), dtype=torch.float32))


@torch.no_grad()
def evaluate(model, mtp, examples: list[Example], pad_id: int, batch: int, depths: int = 1) -> dict:
    """Held-out mean cross-entropy per assistant token (and the MTP head's: on t+2 `eval_mtp_loss`, on t+d+1 from
    its chained drafts `eval_mtp{d}_loss`)."""
    was_training = model.training
    model.eval()
    loss, tokens = 0.0, 0
    extras, counts = [0.0] * depths, [0] * depths
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
    for start in range(0, len(order), batch):
        ids, mask = collate([examples[i] for i in order[start:start + batch]], pad_id)
        main, extra, n_main, n_extra = sequence_losses(model, mtp, ids, mask, depths)
        loss, tokens = loss + float(main), tokens + n_main
        for d, (value, n) in enumerate(zip(extra, n_extra)):
            extras[d], counts[d] = extras[d] + float(value), counts[d] + n
    model.train(was_training)
    out = {"eval_loss": loss / max(tokens, 1)}
    if mtp is not None:
        for d in range(depths):
            out[f"eval_mtp{d + 1 if d else ''}_loss"] = extras[d] / max(counts[d], 1)
    return out


def step_examples(examples: list[Example], step: int, batch_size: int, seed: int, in_order: bool = False,
                  length_groups: int = 1) -> list[Example]:
    """The conversations of one optimizer step: consecutive slices of a per-epoch permutation of the data (the
    first epoch's the identity when `in_order`). With `length_groups` > 1 the conversations of each run of that
    many steps are sorted by length and dealt out again, a step per band of like lengths, in a seeded order: the
    run sees the same data, padded far less (a curriculum keeps its order between runs)."""
    if length_groups > 1:
        group, slot = divmod(step, length_groups)
        first = group * length_groups
        pooled = [e for s in range(first, first + length_groups)
                  for e in step_examples(examples, s, batch_size, seed, in_order)]
        band = np.random.default_rng([seed, group, 1]).permutation(length_groups)[slot]
        return sorted(pooled, key=len)[band * batch_size:(band + 1) * batch_size]
    n = len(examples)
    orders: dict[int, np.ndarray] = {}
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(k, n)
        if epoch not in orders:
            orders[epoch] = (np.arange(n) if in_order and epoch == 0 else
                             np.random.default_rng([seed, epoch]).permutation(n))
        out.append(examples[orders[epoch][i]])
    return out


def micro_batches(examples: list[Example], max_tokens: int) -> list[list[Example]]:
    """Split a step's conversations, sorted by length, into micro-batches of at most `max_tokens` padded tokens
    (one conversation alone may exceed it): gradients accumulate over them, and like lengths pad little."""
    parts, current = [], []
    for e in sorted(examples, key=len):
        if current and len(e) * (len(current) + 1) > max_tokens:
            parts.append(current)
            current = []
        current.append(e)
    return parts + [current]


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) a training; returns the final evaluation and timing. Writes checkpoints under cfg.out."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig) -> dict:
    from qwenrt.tokenizer import Tokenizer

    out = prepare_output(Path(cfg.out), (LOG_FILE, ADAPTER_CONFIG, ADAPTER_WEIGHTS))
    lora = cfg.lora_rank is not None
    torch.manual_seed(cfg.seed)
    use_mtp = cfg.mtp_weight > 0
    resume_dir = latest_step_dir(out) if cfg.resume else None
    if resume_dir is not None:
        state = load_state(resume_dir)
        if state["step"] > cfg.steps:
            raise QwenrtError(f"{resume_dir / STATE_FILE}: the training state is at step {state['step']}, past "
                              f"steps {cfg.steps}")
        model, mtp = (load_lora_model(cfg, resume_dir), None) if lora else \
            load_model_for_training(resume_dir, use_mtp, cfg.seed)
        tokenizer_dir = Path(cfg.init) if lora else resume_dir
    elif lora:
        model, mtp, tokenizer_dir = load_lora_model(cfg), None, Path(cfg.init)
    elif cfg.init is not None:
        model, mtp = load_model_for_training(cfg.init, use_mtp, cfg.seed)
        tokenizer_dir = Path(cfg.init)
    else:
        if cfg.model_config is None or cfg.tokenizer is None:
            raise QwenrtError("training needs `init` (a checkpoint) or both `model_config` and `tokenizer`")
        model, mtp = build_model(cfg.model_config, use_mtp, cfg.seed)
        tokenizer_dir = Path(cfg.tokenizer)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise QwenrtError(f"{tokenizer_dir}: no tokenizer.json")
    tokenizer = Tokenizer(tokenizer_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_ids[0]
    special = {"bos_token_id": pad_id, "eos_token_id": tokenizer.eos_token_ids, "pad_token_id": pad_id}
    config = config_json(model.config.text, special, use_mtp, torch.float32)
    if tokenizer.vocab_size > model.config.text.vocab_size:
        raise QwenrtError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                          f"{model.config.text.vocab_size} embeddings")

    classify = cfg.task == "classify"
    if classify:
        _check_classifier_base(cfg, model)
        train_set, eval_set, labels = _labelled_sets(cfg, tokenizer, pad_id)
        config = classifier_config(config, labels, pad_id)
    else:
        train_set = encode_all(tokenizer, load_conversations(cfg.data, "training data"), cfg.max_len)
        eval_set = (encode_all(tokenizer, load_conversations(cfg.eval_data, "eval data"), cfg.max_len)
                    if cfg.eval_data else [])
    held_out = _describe(cfg.eval_data)
    if not cfg.eval_data and cfg.eval_split:
        train_set, eval_set = split_held_out(train_set, cfg.eval_split, cfg.seed)
        held_out = f"{len(eval_set)} of the {len(train_set) + len(eval_set)} training examples ({cfg.eval_split:.0%})"
    if held_out and cfg.progress:
        print(f"held out: {held_out}", file=sys.stderr)

    model.train()
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if cfg.mtp_only:
        model.requires_grad_(False)
        mtp.requires_grad_(True)  # a loaded head is the model's submodule (model.mtp)
    modules = [model] + ([mtp] if mtp is not None else [])
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    params = list({id(p): p for p in params}.values())  # the tied head once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=True)
    start = 0
    if resume_dir is not None:
        restore_optimizer(optimizer, state["optimizer"], resume_dir / STATE_FILE)
        start = state["step"]

    log = _open_log(out / LOG_FILE, append=bool(start))
    if not start:
        log.write(json.dumps({"config": asdict(cfg) | {"data": _describe(cfg.data), "eval_data": _describe(
            cfg.eval_data)}, "parameters": _count(modules), "train_conversations": len(train_set),
            "held_out": held_out}) + "\n")
    history = []
    if eval_set and not start:  # the untrained model's held-out loss, for comparison
        history.append({"step": 0, **_evaluate(model, mtp, eval_set, pad_id, cfg)})
        log.write(json.dumps(history[0]) + "\n")
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="training", unit="step",
               disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True)
    began, cpu_began, tokens_seen = time.perf_counter(), time.process_time(), 0
    shown = {}  # the last held-out figures, in the bar's postfix
    for step in bar:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = step_examples(train_set, step, cfg.batch_size, cfg.seed, cfg.in_order, cfg.length_groups)
        n_main = len(batch) if classify else sum(sum(e.loss_mask[1:]) for e in batch)
        n_mtp = sum(sum(e.loss_mask[d + 1:]) for e in batch for d in range(1, cfg.mtp_depths + 1))
        loss_value = 0.0
        for part in micro_batches(batch, cfg.micro_batch_tokens):
            ids, mask = collate(part, pad_id)
            if classify:
                main, extra = classification_loss(model, part, pad_id), []
            else:
                main, extra, _, _ = sequence_losses(model, mtp, ids, mask, cfg.mtp_depths)
            loss = 0 if cfg.mtp_only else main / max(n_main, 1)
            if mtp is not None:
                loss = loss + cfg.mtp_weight * sum(extra) / max(n_mtp, 1)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:  # not a head-only part too short to predict
                loss.backward()
            loss_value += main.item() / max(n_main, 1)
            tokens_seen += ids.numel()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rate = tokens_seen / (time.perf_counter() - began)
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.1e}", tok_s=f"{rate:.0f}", **shown)
        record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": float(norm), "tok_s": rate,
                  "cpu_s": time.process_time() - cpu_began}  # CPU time: what a shared machine does not distort
        done = step + 1 == cfg.steps
        if eval_set and ((step + 1) % cfg.eval_every == 0 or done):
            record.update(_evaluate(model, mtp, eval_set, pad_id, cfg))
            history.append(record)
            shown = {SHOWN[k]: f"{v:.3f}" for k, v in record.items() if k in SHOWN}
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.1e}", tok_s=f"{rate:.0f}", **shown)
            bar.write(f"step {step + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items()
                                                        if k.startswith("eval")), file=sys.stderr)
        log.write(json.dumps(record) + "\n")
        log.flush()
        if (step + 1) % cfg.save_every == 0 and not done:
            state = {"step": step + 1, "optimizer": optimizer.state_dict()}
            if lora:
                _save_adapter_step(step_dir(out, step + 1), model, cfg, state)
            else:
                save_checkpoint(step_dir(out, step + 1), model, mtp, config, tokenizer_dir, state=state)
            prune(out, cfg.keep_checkpoints)
    bar.close()
    log.close()
    if classify:
        save_classifier(out, model, cfg, config, tokenizer_dir)
    elif lora:
        save_adapter(out, model, cfg.lora_spec(), cfg.init)
    else:
        save_checkpoint(out, model, mtp, config, tokenizer_dir, dtype=getattr(torch, cfg.save_dtype))
    return {"steps": cfg.steps, "seconds": time.perf_counter() - began, "cpu_seconds": time.process_time() - cpu_began,
            "tokens": tokens_seen,
            "parameters": _count(modules), "history": history}


def _evaluate(model, mtp, examples: list[Example], pad_id: int, cfg: TrainConfig) -> dict:
    if cfg.task == "classify":
        return evaluate_classifier(model, examples, pad_id, cfg.eval_batch)
    return evaluate(model, mtp, examples, pad_id, cfg.eval_batch, cfg.mtp_depths)


def split_held_out(examples: list, share: float, seed: int) -> tuple[list, list]:
    """(the rest, a seeded `share` of the examples, at least one), each in the data's order."""
    n = len(examples)
    if n < 2:
        raise QwenrtError(f"training: holding out {share:.0%} of {n} example(s) leaves nothing to train on; give "
                          "more data or eval data")
    held = set(np.random.default_rng([seed, 2]).permutation(n)[:max(1, round(share * n))].tolist())
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def _labelled_sets(cfg: TrainConfig, tokenizer, pad_id: int) -> tuple[list[Example], list[Example], tuple[str, ...]]:
    """The training and held-out labelled texts, encoded, and the class names (the training data's labels)."""
    records = read_labelled(cfg.data, "training data")
    ids = label_map(records, cfg.num_labels)
    train_set = encode_labelled(tokenizer, records, ids, pad_id, cfg.max_len)
    eval_set = (encode_labelled(tokenizer, read_labelled(cfg.eval_data, "eval data"), ids, pad_id, cfg.max_len)
                if cfg.eval_data else [])
    return train_set, eval_set, label_names(ids)


def _check_classifier_base(cfg: TrainConfig, model) -> None:
    """A classifier is written merged into its base as transformers has it: a dense, full-precision checkpoint."""
    from qwenrt.config import load_config
    from qwenrt.quant import stored_spec

    if model.config.text.is_moe:
        raise QwenrtError(f"{cfg.init}: a MoE model; transformers has no sequence-classification class for Qwen3.5 "
                          "MoE, so classifiers are trained on dense bases")
    if stored_spec(load_config(Path(cfg.init)).raw) is not None:
        raise QwenrtError(f"{cfg.init} is quantized: train the classifier on its full-precision original (with "
                          "lora_base int8 / int4 to quantize it while loading)")


def _save_adapter_step(directory: Path, model, cfg: TrainConfig, state: dict) -> None:
    """A LoRA run's step checkpoint: the adapter, then the training state (its presence marks the step complete)."""
    from qwenrt.files import output_dir

    save_adapter(directory, model, cfg.lora_spec(), cfg.init)
    torch.save(state, output_dir(directory) / STATE_FILE)


def _open_log(path: Path, append: bool):
    """The training log, opened without following a link that appeared in its place since the start."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    try:
        return os.fdopen(os.open(path, flags, 0o666), "a" if append else "w", encoding="utf-8")
    except OSError as e:
        raise QwenrtError(f"cannot write the training log {path}: {e.strerror or e}") from None


def _describe(source) -> str | None:
    return source if source is None or isinstance(source, str) else f"{len(source)} conversations (in memory)"


def _count(modules) -> dict:
    model = modules[0]
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    out = {"model": total}
    if lora_modules(model):
        out["lora"] = trainable_count(model)
    if len(modules) > 1:
        out["mtp"] = sum(p.numel() for p in modules[1].parameters())
    return out
