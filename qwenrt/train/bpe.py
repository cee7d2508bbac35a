"""A Qwen3.5-form tokenizer trained on your own text: byte-level BPE with the Qwen3.5 pre-tokenizer (one token per
digit) or a variant that also keeps capitals apart, every Qwen3.5 special token, and the published Qwen3.5 chat
template.

`build_tokenizer(dir, conversations, vocab_size)` writes tokenizer.json, tokenizer_config.json,
chat_template.jinja and generation_config.json, the files `qwenrt.tokenizer.Tokenizer` and transformers read.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from qwenrt.errors import QwenrtError
from qwenrt.tokenizer import QWEN35_SPLIT

TEMPLATE_FILE = Path(__file__).with_name("qwen3_5_chat_template.jinja")  # as published with the checkpoints

# Qwen3.5's added tokens in id order (ids 248044.. in the published vocabulary; here they follow the BPE vocabulary)
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
# Qwen checkpoints mark these as added but not special: skip_special_tokens keeps them
NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                         "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                         "<|file_sep|>"})
PRETOKENIZERS = {
    "qwen3.5": QWEN35_SPLIT,
    # the same, but a capital letter stands alone and nothing joins it: a name has the same tokens after a space, a
    # newline or a '>' (in a question, a tool call's argument, a tool's response), as digits do in Qwen3.5
    "capitals-apart": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{Lu}|[^\r\n\p{L}\p{N}]?[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|\p{N}"
                      r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_SPECIAL_SPLIT = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def chat_template() -> str:
    """The Qwen3.5 chat template, verbatim."""
    return TEMPLATE_FILE.read_text(encoding="utf-8")


def _empty_bpe(pretokenizer: str) -> BackendTokenizer:
    if pretokenizer not in PRETOKENIZERS:
        raise QwenrtError(f"unknown pre-tokenizer {pretokenizer!r} (known: {', '.join(PRETOKENIZERS)})")
    tok = BackendTokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZERS[pretokenizer]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, pretokenizer: str = "qwen3.5",
              min_count: int = 0) -> BackendTokenizer:
    """Byte-level BPE over `texts` (special-token strings in them are cut out first), then the Qwen3.5 special
    tokens appended as added tokens; vocab_size counts them (a cap: merges can run out first). `pretokenizer`: a
    PRETOKENIZERS key. `min_count`: drop every merged token that encoding `texts` uses fewer times (`_drop_rare`)."""
    bpe_size = vocab_size - len(SPECIAL_TOKENS)
    if bpe_size <= 256:
        raise QwenrtError(f"vocab_size {vocab_size} leaves no room for merges beyond the 256 bytes and "
                          f"{len(SPECIAL_TOKENS)} special tokens")
    tok = _empty_bpe(pretokenizer)
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    pieces = [piece for text in texts for piece in _SPECIAL_SPLIT.split(text) if piece]
    tok.train_from_iterator(pieces, trainer)
    if min_count > 0:
        _drop_rare(tok, pieces, min_count)
    _add_special_tokens(tok)
    return tok


def _drop_rare(tok: BackendTokenizer, pieces: list[str], min_count: int) -> None:
    """Remove the merged tokens that the encoding of `pieces` uses fewer than `min_count` times, and the merges
    that make or use them, until none is left. BPE keeps every intermediate of its merge chains ("way" on the way
    to " always"): a token that only a held-out name brings out has an embedding training never moved, and a small
    model cannot copy it. Without it the name falls into pieces that training used often."""
    while True:
        counts = Counter(i for enc in tok.encode_batch(pieces, add_special_tokens=False) for i in enc.ids)
        model = json.loads(tok.to_str())["model"]
        rare = {t for t, i in model["vocab"].items() if len(t) > 1 and counts[i] < min_count}
        if not rare:
            return
        kept = sorted((i, t) for t, i in model["vocab"].items() if t not in rare)
        merges = [(a, b) for a, b in model["merges"] if not {a, b, a + b} & rare]
        tok.model = models.BPE(vocab={t: new for new, (_, t) in enumerate(kept)}, merges=merges, ignore_merges=True)


def byte_tokenizer() -> BackendTokenizer:
    """The 256 byte tokens and the special tokens, no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = _empty_bpe("qwen3.5")
    tok.model = models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[], ignore_merges=True)
    _add_special_tokens(tok)
    return tok


def _add_special_tokens(tok: BackendTokenizer) -> None:
    for content in SPECIAL_TOKENS:  # one call per token: each takes the next free id
        token = AddedToken(content, normalized=False, special=content not in NOT_SPECIAL)
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])


def write_tokenizer(directory: Path, tok: BackendTokenizer) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json (greedy by default:
    a small model is at its best greedy) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": t not in NOT_SPECIAL} for t, i in ids.items()}
    # tokenizer.json as written: a Qwen tokenizer class makes transformers rebuild its own pre-tokenizer over this
    # vocabulary (other ids); PreTrainedTokenizerFast is TokenizersBackend in transformers 5 and known to 4
    config = {"add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": None,
              "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
              "model_max_length": 262144, "pad_token": "<|endoftext|>", "split_special_tokens": False,
              "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                  "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def build_tokenizer(directory: str | Path, conversations: list[dict], vocab_size: int,
                    pretokenizer: str = "qwen3.5", min_count: int = 0) -> None:
    """Train the tokenizer on `conversations` ({"messages", "tools"} dicts) as the chat template renders them, and
    write its files into `directory`. `pretokenizer`, `min_count`: as train_bpe's."""
    from qwenrt.tokenizer import Tokenizer

    directory = Path(directory)
    write_tokenizer(directory, byte_tokenizer())  # enough to render the template with
    renderer = Tokenizer(directory)
    texts = [renderer.apply_chat_template(c["messages"], add_generation_prompt=False, tools=c.get("tools"))
             for c in conversations]
    write_tokenizer(directory, train_bpe(texts, vocab_size, pretokenizer, min_count))
