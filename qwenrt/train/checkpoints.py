"""Training checkpoints in the Hugging Face layout (config.json, model.safetensors with the `mtp.*` head, the
tokenizer files, generation_config.json), plus training_state.pt in the step directories to resume from.
Training writes only into real directories (files.output_dir): a link planted where it writes is refused, never
followed, and removing a step directory never follows one either."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import stat
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwenrt.adapters import WEIGHTS_FILE as ADAPTER_WEIGHTS
from qwenrt.config import TextConfig
from qwenrt.errors import QwenrtError
from qwenrt.files import TOKENIZER_LIMIT, CheckpointDir, output_dir, read_bytes
from qwenrt.mtp import mtp_state_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
STATE_FILE = "training_state.pt"
STEP_NAME = re.compile(r"step-\d{6,}")
ADAMW_STATE = {"step", "exp_avg", "exp_avg_sq"}  # what AdamW keeps per parameter (amsgrad off)


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
                            "mrope_section": list(c.mrope_section), "mrope_interleaved": c.mrope_interleaved,
                            **(c.yarn.rope_parameters() if c.yarn is not None else {})},
        "mtp_num_hidden_layers": 1 if mtp else 0, "mtp_use_dedicated_embeddings": False,
        **special_ids, "dtype": str(dtype).removeprefix("torch."),
    }


def save_checkpoint(directory: Path, model, mtp, config: dict, tokenizer_dir: Path,
                    dtype: torch.dtype = torch.float32, state: dict | None = None) -> None:
    """Write the model (and its MTP head) in `dtype` as a Hugging Face checkpoint into `directory`;
    `state` (optimizer, step) goes to training_state.pt. The files are written into a fresh private folder inside
    it and then moved in, the state last: a crash never leaves half a file, and a step directory with a state is
    complete. Links are refused where a folder is written, replaced (never followed) where a file is."""
    directory = output_dir(directory, "checkpoint directory")
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=directory))
    try:
        _write_checkpoint(tmp, model, mtp, config, tokenizer_dir, dtype, state)
        names = sorted(os.listdir(tmp), key=lambda name: name == STATE_FILE)
        check_files(directory, names)
        for name in names:  # over an older checkpoint in place: the directory may hold other files
            os.replace(tmp / name, directory / name)
    except OSError as e:
        raise QwenrtError(f"cannot write the checkpoint into {directory}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_checkpoint(folder: Path, model, mtp, config: dict, tokenizer_dir: Path, dtype: torch.dtype,
                      state: dict | None) -> None:
    tensors = {n: t for n, t in model.state_dict().items()
               if not (n == "lm_head.weight" and model.config.text.tie_word_embeddings)}
    if mtp is not None:
        tensors.update(mtp_state_dict(mtp))
    tensors = {n: t.detach().to(torch.float32 if keeps_fp32(n) else dtype).contiguous() for n, t in tensors.items()}
    (folder / "config.json").write_text(json.dumps(dict(config, dtype=str(dtype).removeprefix("torch.")), indent=2)
                                        + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file private (0600); the weights get the mode the umask gives every other file
    (folder / "model.safetensors").chmod((folder / "config.json").stat().st_mode & 0o777)
    copy_tokenizer_files(tokenizer_dir, folder)
    if state is not None:
        torch.save(state, folder / STATE_FILE)


def copy_tokenizer_files(tokenizer_dir: Path, folder: Path) -> None:
    """The tokenizer, template and generation config files of `tokenizer_dir` that exist, into `folder`."""
    source = CheckpointDir(tokenizer_dir)  # read as loading reads it: no link out of it, no FIFO
    for name in TOKENIZER_FILES:
        if source.exists(name):
            (folder / name).write_bytes(read_bytes(source.file(name), TOKENIZER_LIMIT, name))


def check_files(directory: Path, names) -> None:
    """Where a file `name` is to be written into `directory`: nothing, or a regular file (replaced)."""
    for name in names:
        try:
            mode = os.lstat(directory / name).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            kind = "a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file"
            raise QwenrtError(f"{directory / name} is {kind}; training writes a file there (move it away)")


def prepare_output(out: Path, files: tuple[str, ...] = ()) -> Path:
    """The output directory, checked before any work so a run never fails at its first save: a real directory
    to write in (made if absent), nothing but regular files where the checkpoint and `files` will go, and
    checkpoints/ (when there) a real directory without links."""
    out = output_dir(out)
    check_files(out, ("config.json", "model.safetensors", *TOKENIZER_FILES, *files))
    checkpoints = out / "checkpoints"
    if os.path.lexists(checkpoints):
        output_dir(checkpoints, "checkpoints directory")
        links = sorted(e.name for e in os.scandir(checkpoints) if e.is_symlink())
        if links:
            raise QwenrtError(f"{checkpoints / links[0]} is a symlink; training writes only into real directories")
    return out


def check_no_model(out: Path) -> None:
    """Refuse to train into a directory that already holds a model (its config.json or weights, or an adapter's, as
    files), which the run would replace: `qwenrt train` asks for --overwrite (or --resume, to continue that
    directory's run)."""
    held = [name for name in ("config.json", "model.safetensors", ADAPTER_WEIGHTS) if _is_file(Path(out) / name)]
    if held:
        raise QwenrtError(f"{out} already holds a model ({held[0]}); pass --overwrite to replace it, or --resume to "
                          "continue its training")


def _is_file(path: Path) -> bool:
    """A regular file, not through a link (anything else at a checkpoint's name `prepare_output` refuses)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def keeps_fp32(name: str) -> bool:
    # norms, A_log and dt_bias are small and precision-critical; published checkpoints keep some of them in fp32 too
    return name.endswith(("A_log", "dt_bias")) or "norm" in name


def step_dir(out: Path, step: int) -> Path:
    """out/checkpoints/step-NNNNNN, its parent made a real directory if need be."""
    return output_dir(out / "checkpoints", "checkpoints directory") / f"step-{step:06d}"


def _step_dirs(out: Path) -> list[Path]:
    """The real step directories under out/checkpoints, oldest first (links and other names left alone)."""
    folder = out / "checkpoints"
    try:
        entries = [e for e in os.scandir(folder) if STEP_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    return [folder / e.name for e in sorted(entries, key=lambda e: int(e.name.removeprefix("step-")))]


def latest_step_dir(out: Path) -> Path | None:
    """The newest complete step directory under out/checkpoints (its training state a regular file), or None."""
    complete = [d for d in _step_dirs(out) if os.path.isfile(d / STATE_FILE) and not os.path.islink(d / STATE_FILE)]
    return complete[-1] if complete else None


def load_state(step_dir: Path) -> dict:
    """A step directory's training state: {"step": an int >= 0, "optimizer": a state dict}, or one QwenrtError."""
    path = step_dir / STATE_FILE
    try:
        state = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, EOFError):  # torch's text for these is a page advising weights_only=False
        raise QwenrtError(f"{path}: not a training state (damaged, or holding more than tensors and plain "
                          "values)") from None
    except Exception as e:  # torch raises several types for a damaged file
        raise QwenrtError(f"{path}: cannot read the training state ({_one_line(e)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict):
        raise QwenrtError(f"{path}: the training state has no optimizer state")
    step = state.get("step")
    if type(step) is not int or step < 0:  # bool is an int subclass: excluded too
        raise QwenrtError(f"{path}: the training state's step must be an integer >= 0, not {step!r:.40}")
    return state


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict, where: Path) -> None:
    """Load a saved AdamW state into `optimizer`, refusing one that does not fit its parameters (each one's
    moments of its shape, finite); the settings (betas, weight decay, ...) stay this run's."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(saved)
    except Exception as e:  # torch checks group sizes only, and raises several types for the rest
        raise QwenrtError(f"{where}: the optimizer state does not fit this model ({_one_line(e)})") from None
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for n, p in enumerate(params):
        moments = optimizer.state.get(p, {})
        if moments and set(moments) != ADAMW_STATE:
            raise QwenrtError(f"{where}: parameter {n}'s optimizer state has {sorted(moments)}, not "
                              f"{sorted(ADAMW_STATE)}")
        for name, value in moments.items():
            shape = () if name == "step" else p.shape
            if not (torch.is_tensor(value) and value.is_floating_point() and value.shape == shape
                    and bool(torch.isfinite(value).all())):
                got = f"shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
                raise QwenrtError(f"{where}: parameter {n}'s optimizer state {name!r} must be finite floats of "
                                  f"shape {tuple(shape)}, got {got}")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def prune(out: Path, keep: int) -> None:
    """Remove all but the newest `keep` step directories (rmtree never follows a link inside them)."""
    steps = _step_dirs(out)
    for old in steps[:-keep] if keep > 0 else steps:
        shutil.rmtree(old, ignore_errors=True)
