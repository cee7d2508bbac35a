"""The recipe of the built-in model: generated data -> tokenizer -> training (the model and its MTP head
together, then the head alone on its own chained drafts) -> bf16 checkpoint, from scratch.

    qwenrt train OUT --recipe tiny

Everything is seeded: the same command gives the same data, tokenizer and (on the same machine and thread count)
the same weights. `Recipe.quick()` is the shortened run the tests use.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qwenrt.files import output_dir
from qwenrt.tiny.tasks import conversations, copy_conversations
from qwenrt.train.bpe import build_tokenizer
from qwenrt.train.checkpoints import TOKENIZER_FILES, check_files, prepare_output
from qwenrt.train.data import write_jsonl
from qwenrt.train.trainer import LOG_FILE, TrainConfig, train

ROPE_FRACTION = 0.25  # Qwen3.5's partial rotary factor
ROPE_THETA = 10_000.0  # Qwen3.5's 10M spreads 8 rotary frequencies over 262K tokens; short prompts need fine ones


@dataclass(frozen=True)
class Recipe:
    hidden_size: int = 128
    layer_pattern: str = "LLFLLF"  # L: Gated DeltaNet, F: gated full attention (Qwen3.5 repeats LLLF)
    intermediate_size: int = 384
    attention_heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    linear_key_heads: int = 2
    linear_value_heads: int = 4  # > key heads, as in the larger Qwen3.5 models
    linear_head_dim: int = 32
    vocab_size: int = 1024  # a cap: the BPE stops where merges run out, and tokenizer_min_count cuts it
    pretokenizer: str = "capitals-apart"  # names keep their tokens wherever they stand (bpe.py), or "qwen3.5"
    tokenizer_conversations: int = 4000
    tokenizer_min_count: int = 40  # tokens its corpus uses fewer times are dropped: a held-out name falls into
    # pieces training used often (bpe.train_bpe's min_count)
    train_conversations: int = 41600  # each seen once
    eval_conversations: int = 200
    steps: int = 3800  # copy_steps of them, then train_conversations / batch_size
    copy_steps: int = 1200  # the run opens with this many steps of copying alone, at the peak lr
    batch_size: int = 16
    micro_batch_tokens: int = 2048  # small: like lengths together, little padding
    length_groups: int = 8  # steps regrouped by length: 25% fewer tokens padded and run than steps as drawn
    lr: float = 2e-3
    warmup: int = 40
    mtp_weight: float = 0.3
    mtp_steps: int = 400  # then the MTP head alone, the model frozen, on its first mtp_depths chained drafts
    mtp_depths: int = 3  # (trained jointly on the first alone, its second draft was right 36% of the time)
    mtp_lr: float = 2e-3
    eval_every: int = 600
    seed: int = 0
    threads: int | None = 2  # the same weights need the same thread count (on 2 busy cores 1 is faster)

    @classmethod
    def quick(cls) -> Recipe:
        """The same recipe cut to seconds (a smaller model, little data, few steps, a tokenizer cut at its own
        corpus's scale): the tests check that the held-out loss falls."""
        return cls(hidden_size=64, intermediate_size=128, attention_heads=2, kv_heads=1, head_dim=32,
                   linear_head_dim=16, vocab_size=1024, tokenizer_conversations=800, tokenizer_min_count=8,
                   train_conversations=400, eval_conversations=40, steps=12, copy_steps=2, batch_size=8, lr=1e-2,
                   mtp_steps=8, mtp_lr=1e-2, warmup=2, eval_every=4, threads=1)

    def model_config(self, vocab_size: int) -> dict:
        """The text config.json dict (HF names) for a tokenizer of `vocab_size` tokens (padded to a multiple of 64)."""
        rotary_pairs = int(self.head_dim * ROPE_FRACTION) // 2
        width = rotary_pairs // 3
        height = (rotary_pairs - width) // 2
        sections = [rotary_pairs - height - width, height, width]  # T, H, W: [11, 11, 10] at Qwen3.5's 32 pairs
        types = ["full_attention" if c == "F" else "linear_attention" for c in self.layer_pattern]
        return {"model_type": "qwen3_5_text", "vocab_size": -(-vocab_size // 64) * 64,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": len(types), "layer_types": types,
                "num_attention_heads": self.attention_heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "linear_num_key_heads": self.linear_key_heads,
                "linear_num_value_heads": self.linear_value_heads, "linear_key_head_dim": self.linear_head_dim,
                "linear_value_head_dim": self.linear_head_dim, "tie_word_embeddings": True,
                "max_position_embeddings": 4096,
                "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                                    "partial_rotary_factor": ROPE_FRACTION, "mrope_section": sections,
                                    "mrope_interleaved": True}}


def stages(recipe: Recipe, out: Path, config: dict, progress: bool = True) -> tuple[TrainConfig, TrainConfig]:
    """The two trainings of a build into `out` (data and tokenizer already there): the model and its MTP head
    together into out/joint, then the head alone from there into `out` (the frozen model's bf16 weights pass
    through unchanged)."""
    data = out / "data"
    shared = dict(data=str(data / "train.jsonl"), eval_data=str(data / "eval.jsonl"), batch_size=recipe.batch_size,
                  micro_batch_tokens=recipe.micro_batch_tokens, warmup=recipe.warmup, eval_every=recipe.eval_every,
                  save_dtype="bfloat16", length_groups=recipe.length_groups, seed=recipe.seed,
                  threads=recipe.threads, progress=progress)
    joint = TrainConfig(out=str(out / "joint"), model_config=config, tokenizer=str(out / "tokenizer"),
                        steps=recipe.steps, lr=recipe.lr, hold=recipe.copy_steps, mtp_weight=recipe.mtp_weight,
                        save_every=max(recipe.steps // 4, 1), in_order=True, **shared)
    head = TrainConfig(out=str(out), init=str(out / "joint"), steps=recipe.mtp_steps, lr=recipe.mtp_lr,
                       mtp_weight=1.0, mtp_depths=recipe.mtp_depths, mtp_only=True, save_every=recipe.mtp_steps,
                       **shared)
    return joint, head


def build(out: str | Path, recipe: Recipe = Recipe(), progress: bool = True) -> dict:
    """Build the model into `out` (its data under out/data, the tokenizer under out/tokenizer, the joint training's
    checkpoint and log under out/joint); returns the joint training's summary, the head's under "mtp_stage", with
    the wall time of each stage."""
    from qwenrt.tokenizer import Tokenizer

    out = prepare_output(Path(out), (LOG_FILE, "recipe.json"))  # all checked before the minutes of data and tokenizer
    prepare_output(out / "joint", (LOG_FILE,))
    for folder, files in (("data", ("train.jsonl", "eval.jsonl")), ("tokenizer", TOKENIZER_FILES)):
        check_files(output_dir(out / folder), files)
    began = time.perf_counter()
    data = out / "data"
    write_jsonl(data / "train.jsonl", copy_conversations(recipe.copy_steps * recipe.batch_size, recipe.seed + 4)
                + conversations(recipe.train_conversations, recipe.seed + 1, curriculum=True))
    write_jsonl(data / "eval.jsonl", conversations(recipe.eval_conversations, recipe.seed + 2, heldout=True))
    build_tokenizer(out / "tokenizer", conversations(recipe.tokenizer_conversations, recipe.seed + 3),
                    recipe.vocab_size, recipe.pretokenizer, recipe.tokenizer_min_count)
    prepared = time.perf_counter() - began
    joint, head = stages(recipe, out, recipe.model_config(Tokenizer(out / "tokenizer").vocab_size), progress)
    summary = train(joint)
    summary["mtp_stage"] = train(head)
    summary.update(recipe=asdict(recipe), data_seconds=prepared, total_seconds=time.perf_counter() - began)
    (out / "recipe.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
