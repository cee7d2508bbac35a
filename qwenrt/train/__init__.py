"""Training Qwen3.5-architecture models on chat conversations: `qwenrt train`, or in Python

    from qwenrt.train import TrainConfig, train
    train(TrainConfig(out="ckpt", data="chats.jsonl", init="base-model", steps=500))
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qwenrt import log
from qwenrt.errors import QwenrtError
from qwenrt.files import read_json
from qwenrt.train.checkpoints import check_no_model
from qwenrt.train.trainer import TrainConfig, train

__all__ = ["TrainConfig", "train", "train_command", "finetune_command"]
FINETUNE_DEFAULTS = {"lora_rank": 16}
FINETUNE_EVAL_SPLIT = 0.1  # held out of the data when no eval data is given


def train_command(out: str, recipe: str | None = None, **options) -> str:
    """`qwenrt train`: a recipe (the built-in model, rebuilt from scratch) or a training run on given data.
    Returns the closing summary line (with `plan`, a LoRA run's plan, nothing trained). OUT holding a model is
    refused unless `overwrite` or `resume`; progress shows unless -q (`qwenrt.log`)."""
    plan = options.pop("plan", False)
    if plan and "lora_rank" not in options:
        raise QwenrtError("--plan describes a LoRA run: give --lora-rank")
    if not (plan or options.pop("overwrite", False) or options.get("resume")):
        check_no_model(Path(out))
    progress = log.shows_progress()
    if recipe is not None:
        from qwenrt.tiny.recipe import Recipe, build

        unknown = set(options) - {"steps", "seed", "threads"}
        if unknown:
            raise QwenrtError(f"--recipe takes only --steps, --seed, --threads and --overwrite, not "
                              f"--{', --'.join(sorted(unknown))}")
        full = Recipe()
        if "steps" in options:  # shortened: the same share of the run copies first, and the head's stage alike
            options["copy_steps"] = full.copy_steps * options["steps"] // full.steps
            options["mtp_steps"] = max(1, full.mtp_steps * options["steps"] // full.steps)
        summary = build(out, replace(full, **options), progress)
    else:
        if "data" not in options:
            raise QwenrtError("qwenrt train needs --data (or --recipe tiny)")
        if "init" in options or "model_config" not in options:  # fine-tune: the built-in model unless named
            from qwenrt.default_model import DEFAULT_MODEL
            from qwenrt.hub import resolve_model_path

            options["init"] = str(resolve_model_path(options.get("init", DEFAULT_MODEL)))
        if "model_config" in options:
            options["model_config"] = read_json(Path(options["model_config"]), what="model config")
        if "lora_targets" in options:
            options["lora_targets"] = tuple(t.strip() for t in options["lora_targets"].split(","))
        cfg = TrainConfig(out=out, progress=progress, **options)
        if plan:
            from qwenrt.train.plan import lora_plan

            return lora_plan(cfg)
        summary = train(cfg)
    last = summary["history"][-1] if summary["history"] else {}
    figures = ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("eval"))
    written = ("classifier (adapters merged) in {0}, its PEFT adapter in {0}/adapter" if options.get("task") ==
               "classify" else "adapter in {0}" if "lora_rank" in options else "model in {0}").format(out)
    return (f"trained {summary['steps']} steps in {summary['seconds']:.0f} s ({summary['tokens']} tokens)"
            f"{'; ' + figures if figures else ''}; {written}")


def finetune_command(out: str, task: str = "sft", **options) -> str:
    """`qwenrt finetune`: `train` with LoRA (rank 16 unless given) on a checkpoint (the built-in model unless
    --init), a share of the data held out unless --eval-data, for chat conversations (sft) or labelled texts
    (classify)."""
    options = FINETUNE_DEFAULTS | options
    if "eval_data" not in options:
        options.setdefault("eval_split", FINETUNE_EVAL_SPLIT)
    return train_command(out, task=task, **options)

