"""Tokenizer for a checkpoint directory: `tokenizers`-backed encode/decode, the chat template rendered in a jinja2
sandbox exactly as transformers renders it, and an incremental detokenizer for streaming."""

from __future__ import annotations

import dataclasses
import functools
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken
from tokenizers import Tokenizer as _BackendTokenizer

from qwenrt.errors import QwenrtError
from qwenrt.files import TOKENIZER_LIMIT, CheckpointDir, read_text
from qwenrt.template import SOURCE_LIMIT, TemplateEnvironment, TemplateLimits, compile_template, render_template
from qwenrt.validation import (check_flag, check_messages, check_path, check_text, check_token_id, check_token_ids,
                               check_tools)

# generation_config.json keys exposed as `Tokenizer.generation_defaults`.
# Qwen3.5's pre-tokenizer (shared/reference.md §1.4; llama.cpp's `qwen35`): a word takes the space (or other mark)
# before it, each digit stands alone
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's, kept by Qwen3, Qwen3-VL and Qwen3-Next (llama.cpp's `qwen2`): letters without combining marks
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
SAMPLING_KEYS = (
    "do_sample", "temperature", "top_k", "top_p", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty",
)

# Used when the checkpoint ships no template: plain ChatML, text parts of list contents concatenated.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- elif message.content is iterable %}"
    "{%- for part in message.content if part.type == 'text' %}{{- part.text }}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"  # where tokenizer_config.json has none (vision-language repos)
_ADDED_TOKEN_FLAGS = ("normalized", "lstrip", "rstrip", "single_word")

# encode_within hands the library this many characters at a time (about 8k tokens of English, ~30 ms)
PIECE_CHARS = 1 << 15
# cut points need text after them, so a pattern's lookahead or a special token at the piece's end cannot move them
_CUT_MARGIN = 16
# input characters per UTF-8 byte a Unicode normalizer outputs, at most: NFC/NFKC compose up to 4 code points into
# one character, which takes at least 2 bytes
_COMPOSING = {"NFC": 2, "NFKC": 2, "NFD": 1, "NFKD": 1}
_SPLIT_PROBE = ("Hello, world!  It's 2024:\n\n\tfoo_bar(x) -- 'quoted'   end.\r\nMore text\u00e9 "
                "\u4f60\u597d\uff0c\u4e16\u754c x")

# Names a message's reasoning may arrive under; transformers copies it to `reasoning_content` and `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclasses.dataclass(frozen=True)
class TokenizerParts:
    """What a tokenizer is made of: tokenizers' JSON, tokenizer_config.json and generation_config.json's contents
    and the chat template's source (None: tokenizer_config's, if any), each with where it came from (for errors).
    Read from a checkpoint directory, or built from a GGUF file's metadata (qwenrt.gguf.metadata)."""

    backend_json: str
    where: Path
    config: dict
    config_where: Path
    generation: dict
    generation_where: Path
    template: str | None = None
    template_where: Path | None = None


def _directory_parts(path: str | Path) -> TokenizerParts:
    files = CheckpointDir(check_path(path))
    if not files.exists("tokenizer.json"):
        raise QwenrtError(f"no tokenizer.json in {files.path}")
    tok_file = files.file("tokenizer.json")
    cfg_file, gen_file, template_file = (files.path / n for n in ("tokenizer_config.json", "generation_config.json",
                                                                   TEMPLATE_FILE))
    template = (read_text(files.file(TEMPLATE_FILE), 4 * SOURCE_LIMIT, TEMPLATE_FILE)
                if files.exists(TEMPLATE_FILE) else None)
    config = files.optional_json(cfg_file.name) or {}
    if template is None and "chat_template" not in config and files.exists(PROCESSOR_TEMPLATE_FILE):
        # a vision-language repo's processor template (Qwen3-VL's), {"chat_template": source}
        template_file = files.path / PROCESSOR_TEMPLATE_FILE
        template = files.read_json(PROCESSOR_TEMPLATE_FILE).get("chat_template")
        if not isinstance(template, str):
            raise QwenrtError(f"{template_file}: chat_template must be a string")
    return TokenizerParts(read_text(tok_file, TOKENIZER_LIMIT, "tokenizer.json"), tok_file, config, cfg_file,
                          files.optional_json(gen_file.name) or {}, gen_file, template, template_file)


class Tokenizer:
    """The tokenizer of one checkpoint directory (tokenizer.json plus its config files).

    Attributes: `eos_token_ids` (generation_config's, then tokenizer_config's eos_token), `pad_token_id` (or None),
    `generation_defaults` (sampling keys of generation_config.json), `chat_template` (its source, None for the
    ChatML fallback), `id_limit` (ids below it are valid: the vocabulary's, and a model's padded embedding rows,
    which decode to nothing, when `model_vocab_size` is given; `qwenrt.load` gives it).
    Every failure of the tokenizers library, a Rust panic included, becomes a QwenrtError.
    """

    def __init__(self, path: str | Path | TokenizerParts, template_limits: TemplateLimits = TemplateLimits(),
                 model_vocab_size: int | None = None):
        parts = path if isinstance(path, TokenizerParts) else _directory_parts(path)
        tok_file, cfg_file, gen_file = parts.where, parts.config_where, parts.generation_where
        self._file = tok_file
        self._tok = _library(f"cannot load {tok_file}", _BackendTokenizer.from_str, parts.backend_json)
        # as transformers encodes by default: the file's padding (a length of 10^12 aborts the process) and
        # truncation (a prompt cut silently) do not apply
        self._tok.no_padding()
        self._tok.no_truncation()
        config, gen = parts.config, parts.generation

        self._add_declared_tokens(config.get("added_tokens_decoder", {}), cfg_file)
        self._special_tokens = {
            key: content for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(config.get(key), cfg_file, key)) is not None
        }
        self.eos_token_ids = self._eos_ids(gen.get("eos_token_id"), gen_file, cfg_file)
        pad = self._special_tokens.get("pad_token")
        self.pad_token_id = self._id_of(pad, cfg_file, "pad_token") if pad else _int_or_none(
            gen.get("pad_token_id"), gen_file, "pad_token_id")
        self.generation_defaults = {key: gen[key] for key in SAMPLING_KEYS if key in gen}

        self.template_limits = template_limits
        env = TemplateEnvironment()
        if parts.template is not None:
            source, where = parts.template, parts.template_where
        else:
            source, where = config.get("chat_template"), cfg_file
        self.chat_template = source
        named = {"default": CHATML_TEMPLATE} if source is None else _named_templates(source, where)
        self._templates = {name: compile_template(env, text, where) for name, text in named.items()}
        self.id_limit = max(self.vocab_size, model_vocab_size or 0)

    # ---- vocabulary ----

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The tokenizer as tokenizers' JSON (added tokens included), for libraries that build their own tables."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary or added token string, or None."""
        return _library(f"{self._file}: cannot look up a token", self._tok.token_to_id, check_text(token, "token"))

    def id_to_token(self, token_id: int) -> str | None:
        """Token string (byte-level form for BPE pieces) of an id below `id_limit`, or None for an id with none."""
        return _library(f"{self._file}: cannot look up a token id", self._tok.id_to_token,
                        check_token_id(token_id, self.id_limit, "token id"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings inside it become their ids, as in transformers."""
        text = check_text(text, "text to encode")
        add_special_tokens = check_flag(add_special_tokens, "add_special_tokens")
        return _library(f"{self._file} cannot encode the text", self._tok.encode, text,
                        add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`, each below `id_limit`; invalid UTF-8 becomes U+FFFD, a padded embedding row nothing."""
        if isinstance(ids, (Iterator, range)):
            ids = list(ids)
        return self._decode(check_token_ids(ids, self.id_limit, "token ids to decode"),
                            check_flag(skip_special_tokens, "skip_special_tokens"))

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """`decode` without its checks, for the ids a model sampled (each below its vocabulary size)."""
        return _library(f"{self._file} cannot decode the token ids", self._tok.decode, ids,
                        skip_special_tokens=skip_special_tokens)

    # ---- chat template ----

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` to the prompt string, identical to transformers'
        `apply_chat_template(..., tokenize=False)`. `enable_thinking=None` leaves the template's default; `tools` are
        OpenAI-style dicts passed through as given; `extra` become template variables."""
        check_messages(messages)
        check_flag(add_generation_prompt, "add_generation_prompt")
        if enable_thinking is not None:
            check_flag(enable_thinking, "enable_thinking")
        check_tools(tools)
        if tools is not None:
            tools = _plain(list(tools))
        # Like transformers: drop None-valued keys (OpenAI's content=None), copy into plain data, alias reasoning.
        chat = _alias_reasoning(_plain([{k: v for k, v in m.items() if v is not None} for m in messages]))
        variables = {**self._special_tokens, **extra}
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        template = self._templates.get(name)
        if template is None:
            raise QwenrtError(f"no default chat template among {sorted(self._templates)}")
        return render_template(template, self.template_limits, dict(
            messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **_plain(variables)))

    # ---- bounded encoding ----

    def encode_within(self, text: str, limit: int) -> list[int] | None:
        """`encode(text)`, or None as soon as that is known to be more than `limit` ids: a text far over a context
        limit costs about a limit's worth of tokenizing, not its whole length (10 MB took 12 s and held the GIL).

        Text longer than `limit` of the vocabulary's longest tokens could cover is refused before any work; the rest
        goes to the library a piece at a time, each cut where a word starts (the ids equal a whole encode's), without
        the GIL.
        """
        text = check_text(text, "text to encode")
        if len(text) > limit * self._chars_per_token:
            return None
        if not self._splits_exactly:
            ids = self._encode_free(text).ids
            return ids if len(ids) <= limit else None
        ids, start, size = [], 0, PIECE_CHARS
        while start < len(text):
            piece = text[start:start + size]
            encoding = self._encode_free(piece)
            if start + len(piece) == len(text):
                ids += encoding.ids
                break
            cut = self._word_cut(piece, encoding)
            if cut is None:  # one word runs on past the piece: a piece past its end, if the word can fit
                word = self._counted_word(text, start, limit - len(ids))
                if word is None:
                    return None
                size = word + PIECE_CHARS
                continue
            token, offset = cut
            ids += encoding.ids[:token]
            if len(ids) > limit:
                return None
            start, size = start + offset, PIECE_CHARS
        return ids if len(ids) <= limit else None

    def _counted_word(self, text: str, start: int, limit: int) -> int | None:
        """Characters in the word at `start` (one longer than a piece: a string with no space or punctuation),
        counted in pieces cut anywhere, since the library cannot stop inside a word. A cut changes the ids beside it,
        not the count's order: None when the pieces hold more than twice `limit` ids."""
        count, at = 0, start
        while at < len(text):
            encoding = self._encode_free(text[at:at + PIECE_CHARS])
            count += len(encoding.ids)
            if count > 2 * limit:
                return None
            words = encoding.word_ids
            end = next((offset for k, (offset, _) in enumerate(encoding.offsets) if words[k] != words[0]), None)
            if at > start and end is not None:
                return at + end - start
            at += PIECE_CHARS
        return len(text) - start

    def _encode_free(self, text: str):
        """The library's Encoding of `text` (no special tokens added); encode_batch runs without the GIL."""
        return _library(f"{self._file} cannot encode the text", self._tok.encode_batch, [text],
                        add_special_tokens=False)[0]

    def _word_cut(self, piece: str, encoding) -> tuple[int, int] | None:
        """(token index, character offset) of the last word start in `piece` that the text after the piece cannot
        move: a margin before its end, on a character that combines with nothing before it. None: there is none."""
        words, offsets = encoding.word_ids, encoding.offsets
        horizon = len(piece) - self._cut_margin
        for k in range(len(words) - 1, 0, -1):
            at = offsets[k][0]
            if 0 < at <= horizon and words[k] != words[k - 1] and not unicodedata.combining(piece[at]):
                return k, at
        return None

    @functools.cached_property
    def _longest_token(self) -> int:
        """Characters in the vocabulary's longest token string (byte-level BPE: one per byte, so >= its text's)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def _cut_margin(self) -> int:
        return self._longest_token + _CUT_MARGIN

    @functools.cached_property
    def _chars_per_token(self) -> float:
        """The most input characters one token can stand for; infinite when the normalizer may drop text."""
        normalizer = self._tok.normalizer
        composing = 1 if normalizer is None else _COMPOSING.get(type(normalizer).__name__)
        return float("inf") if composing is None else composing * self._longest_token

    @functools.cached_property
    def _splits_exactly(self) -> bool:
        """Whether encoding in pieces cut at word starts gives the whole encoding's ids: not with a normalizer or
        pre-tokenizer that treats a text's start or end specially (Strip, a prefix space)."""
        whole = self._encode_free(_SPLIT_PROBE)
        return all(self._encode_free(_SPLIT_PROBE[:at]).ids + self._encode_free(_SPLIT_PROBE[at:]).ids == whole.ids
                   for k, (at, _) in enumerate(whole.offsets) if k and whole.word_ids[k] != whole.word_ids[k - 1])

    # ---- loading helpers ----

    def _id_of(self, content: str, where: Path, key: str) -> int:
        token_id = self.token_to_id(content)
        if token_id is None:
            raise QwenrtError(f"{where}: {key} {content!r} is not in tokenizer.json")
        return token_id

    def _add_declared_tokens(self, declared: Any, where: Path) -> None:
        # transformers adds tokens that tokenizer_config declares but tokenizer.json lacks; ids must agree.
        if not isinstance(declared, Mapping):
            raise QwenrtError(f"{where}: added_tokens_decoder must be an object")
        for key, spec in sorted(declared.items(), key=lambda kv: _key_id(kv[0], where)):
            if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
                raise QwenrtError(f"{where}: added_tokens_decoder[{key}] must be an object with a 'content' string")
            content, flags = spec["content"], {f: bool(spec.get(f, False)) for f in _ADDED_TOKEN_FLAGS}
            have = self.token_to_id(content)
            if have is None:
                token = AddedToken(content, special=bool(spec.get("special", True)), **flags)
                _library(f"{where}: cannot add token {content!r:.40}",
                         self._tok.add_special_tokens if token.special else self._tok.add_tokens, [token])
                have = self.token_to_id(content)
            if have != int(key):
                raise QwenrtError(f"{where}: added token {content!r} has id {key} but tokenizer.json gives {have}")

    def _eos_ids(self, gen_eos: Any, gen_file: Path, cfg_file: Path) -> list[int]:
        ids = [] if gen_eos is None else gen_eos if isinstance(gen_eos, list) else [gen_eos]
        ids = [_int(i, gen_file, "eos_token_id") for i in ids]
        eos = self._special_tokens.get("eos_token")
        if eos is not None:
            ids.append(self._id_of(eos, cfg_file, "eos_token"))
        return list(dict.fromkeys(ids))


def load_tokenizer(path: str | Path, template_limits: TemplateLimits = TemplateLimits(),
                   model_vocab_size: int | None = None) -> Tokenizer | None:
    """The tokenizer of checkpoint directory `path`, or None when it has no tokenizer.json. model_vocab_size: the
    embedding rows of the model it serves (see `Tokenizer.id_limit`)."""
    if not Path(check_path(path)).is_dir():
        raise QwenrtError(f"checkpoint directory not found: {path}")
    if not CheckpointDir(path).exists("tokenizer.json"):
        return None
    return Tokenizer(path, template_limits, model_vocab_size)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals `tokenizer.decode(all_ids)`.

    Only a small window is decoded per token: the ids of the last emitted chunk (decoded as a prefix, so decoders
    that depend on context stay exact) plus the ids not yet emitted. A delta is held back while the window's text
    ends in U+FFFD, i.e. a multi-byte character split across tokens is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # window: emitted prefix, then pending ids
        self._prefix_len = 0
        self._prefix_text = ""

    def add(self, token_id: int) -> str:
        """Feed one token id; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        text = self._tokenizer._decode(self._ids, self._skip)
        if text.endswith("\ufffd") or len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever is still held back (a trailing incomplete character decodes as U+FFFD)."""
        if len(self._ids) == self._prefix_len:
            return ""
        return self._emit(self._tokenizer._decode(self._ids, self._skip))

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._ids = self._ids[self._prefix_len:]
        self._prefix_len = len(self._ids)
        self._prefix_text = self._tokenizer._decode(self._ids, self._skip)
        return delta


def _plain(value: Any) -> Any:
    """Deep copy into plain JSON-like types; anything else becomes an inert "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# ---- file parsing ----


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _library(what: str, call, *args, **kwargs):
    """call(*args, **kwargs) into the tokenizers library, its failures one QwenrtError `what: why`. A Rust panic
    (e.g. a tokenizer.json regex that backtracks past Oniguruma's retry limit) arrives as pyo3's PanicException,
    a BaseException that `except Exception` misses; KeyboardInterrupt and SystemExit pass."""
    try:
        return call(*args, **kwargs)
    except BaseException as e:
        if not isinstance(e, Exception) and type(e).__module__ != "pyo3_runtime":
            raise
        raise QwenrtError(f"{what}: {_one_line(e)}") from None


def _token_content(value: Any, where: Path, key: str) -> str | None:
    """A token given as a string or as a serialized AddedToken ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise QwenrtError(f"{where}: {key} must be a string or an object with 'content', got {value!r}")


def _int(value: Any, where: Path, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise QwenrtError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _key_id(key: str, where: Path) -> int:
    try:
        return int(key)
    except ValueError:
        raise QwenrtError(f"{where}: added_tokens_decoder key {key!r} is not an integer id") from None


def _int_or_none(value: Any, where: Path, key: str) -> int | None:
    return None if value is None else _int(value, where, key)


def _named_templates(source: Any, where: Path) -> dict[str, str]:
    """A single template, or transformers' list of {"name", "template"} entries ("default", "tool_use", ...)."""
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in source
    ):
        return {t["name"]: t["template"] for t in source}
    raise QwenrtError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")
