"""Training checkpoints in the Hugging Face layout (config.json, model.safetensors with the `mtp.*` head, the
tokenizer files, generation_config.json), plus training_state.pt in the step directories to resume from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwenrt.config import TextConfig
from qwenrt.errors import QwenrtError
from qwenrt.mtp import mtp_state_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
STATE_FILE = "training_state.pt"


def config_json(c: TextConfig, special_ids: dict[str, int | list[int]], mtp: bool, dtype: torch.dtype) -> dict:
    """config.json of a text-only Qwen3.5 checkpoint (what transformers' Qwen3_5ForCausalLM reads)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": c.model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "layer_types": list(c.layer_types),
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "attention_bias": False, "attn_output_gate": True,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim, "linear_key_head_dim": c.linear_key_head_dim,
        "linear_value_head_dim": c.linear_value_head_dim, "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor,
                            "mrope_section": list(c.mrope_section), "mrope_interleaved": c.mrope_interleaved},
        "mtp_num_hidden_layers": 1 if mtp else 0, "mtp_use_dedicated_embeddings": False,
        **special_ids, "dtype": str(dtype).removeprefix("torch."),
    }


def save_checkpoint(directory: Path, model, mtp, config: dict, tokenizer_dir: Path,
                    dtype: torch.dtype = torch.float32, state: dict | None = None) -> None:
    """Write the model (and its MTP head) in `dtype` as a Hugging Face checkpoint into `directory`; `state`
    (optimizer, step) goes to training_state.pt. The files are written beside it first and then moved in, so a
    crash never leaves half a file."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {n: t for n, t in model.state_dict().items()
               if not (n == "lm_head.weight" and model.config.text.tie_word_embeddings)}
    if mtp is not None:
        tensors.update(mtp_state_dict(mtp))
    tensors = {n: t.detach().to(torch.float32 if _keeps_fp32(n) else dtype).contiguous() for n, t in tensors.items()}
    (tmp / "config.json").write_text(json.dumps(dict(config, dtype=str(dtype).removeprefix("torch.")), indent=2)
                                     + "\n")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file private (0600); the weights get the mode the umask gives every other file
    (tmp / "model.safetensors").chmod((tmp / "config.json").stat().st_mode & 0o777)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, tmp / name)
    if state is not None:
        torch.save(state, tmp / STATE_FILE)
    directory.mkdir(parents=True, exist_ok=True)
    for file in tmp.iterdir():  # over an older checkpoint in place: the directory may hold other files
        file.replace(directory / file.name)
    tmp.rmdir()


def _keeps_fp32(name: str) -> bool:
    # norms, A_log and dt_bias are small and precision-critical; published checkpoints keep some of them in fp32 too
    return name.endswith(("A_log", "dt_bias")) or "norm" in name


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:06d}"


def latest_step_dir(out: Path) -> Path | None:
    """The newest complete step directory under out/checkpoints, or None."""
    steps = sorted(p for p in (out / "checkpoints").glob("step-*") if (p / STATE_FILE).is_file()
                   and not p.name.endswith(".tmp"))
    return steps[-1] if steps else None


def load_state(step_dir: Path) -> dict:
    try:
        return torch.load(step_dir / STATE_FILE, weights_only=True)
    except Exception as e:  # torch raises several types for a damaged file
        raise QwenrtError(f"{step_dir / STATE_FILE}: cannot read the training state ({e})") from None


def prune(out: Path, keep: int) -> None:
    """Remove all but the newest `keep` step directories."""
    steps = sorted((out / "checkpoints").glob("step-*"))
    for old in steps[:-keep] if keep > 0 else steps:
        shutil.rmtree(old, ignore_errors=True)
