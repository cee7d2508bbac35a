"""Constrained decoding: JSON Schema, any JSON, regular expressions and Lark grammars, compiled by llguidance into
a mask of the tokens that may come next.

llguidance (the engine behind OpenAI's structured outputs, a backend of vLLM, SGLang and llama.cpp) is used rather
than xgrammar: it needs no other package (xgrammar pulls transformers and triton), builds its token tables from the
tokenizer's JSON in ~10 ms, computes a mask in tens of microseconds without ahead-of-time compilation, and its Lark
grammars embed JSON Schemas (`%json {...}`), which is how tool calls are constrained (qwenrt/tool_grammar.py).

Shapes: V the model's vocabulary (logits width; ids past the tokenizer's are never allowed), W = ceil(V / 32) mask
words.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from qwenrt.errors import QwenrtError

KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_SOURCE_CHARS = 1 << 20  # a schema, regex or grammar's text at most
CACHE_SIZE = 64  # compiled grammars kept (a schema sent again starts from a copy)
# JSON is written in one layout, Python's json.dumps one: `{"a": 1, "b": [2, 3]}` (free whitespace lets a model
# pad every gap until max_tokens)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# limits on what one grammar may cost (llguidance's defaults, its grammar size lowered): a request that exceeds them
# is refused at compile time or ends with an error, never stalls the engine
LIMITS = dict(max_grammar_size=200_000, step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=100_000)


@dataclass(frozen=True)
class Constraint:
    """What a generation must match. kind: one of KINDS; source: the JSON Schema as JSON text, the regex, the Lark
    grammar (llguidance's dialect), or "" for any JSON object."""

    kind: str
    source: str

    def grammar(self, after_thinking: bool = False) -> str:
        """llguidance's grammar text for this constraint. after_thinking: it follows `</think>`, where JSON may start
        after the blank line the chat template puts there."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        schema = json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}
        if after_thinking:
            embedded = json.dumps({**schema, "x-guidance": json_options()}, ensure_ascii=False)
            return llguidance.LLMatcher.grammar_from_lark(f"start: /\\n{{0,2}}/ json\njson: %json {embedded}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options())


def json_options() -> dict:
    return dict(JSON_LAYOUT)


def _schema_text(schema) -> str:
    """A JSON Schema given as a dict, JSON text or a pydantic model class -> JSON text (keys in their order: a
    schema's property order is the output's)."""
    if hasattr(schema, "model_json_schema"):  # a pydantic model class
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        if len(schema) > MAX_SOURCE_CHARS:
            raise QwenrtError(f"json_schema has {len(schema)} characters; at most {MAX_SOURCE_CHARS} are taken",
                              "json_schema")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise QwenrtError("json_schema is not valid JSON", "json_schema") from None
    if not isinstance(schema, dict):
        raise QwenrtError(f"json_schema must be a JSON Schema object (a dict, JSON text or a pydantic model), "
                          f"got {type(schema).__name__}", "json_schema")
    _check_size(schema)
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise QwenrtError(f"json_schema cannot be written as JSON: {e}", "json_schema") from None
    if len(text) > MAX_SOURCE_CHARS:
        raise QwenrtError(f"json_schema has {len(text)} characters; at most {MAX_SOURCE_CHARS} are taken",
                          "json_schema")
    return text


def _check_size(schema: dict) -> None:
    """Refuse a schema whose JSON text would pass MAX_SOURCE_CHARS before writing it: a dict that holds the same
    list eight times at each of 40 levels is a few objects in memory and 8^40 in JSON."""
    size, stack = 0, [schema]
    while stack:
        value = stack.pop()
        size += len(value) + 2 if isinstance(value, str) else 4
        if size > MAX_SOURCE_CHARS:
            raise QwenrtError(f"json_schema is over {MAX_SOURCE_CHARS} characters as JSON", "json_schema")
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)


def constraint_of(json_schema=None, json_object: bool = False, regex: str | None = None,
                  grammar: str | None = None) -> Constraint | None:
    """The one constraint these keywords ask for (None: none); more than one is refused."""
    given = [name for name, value in zip(KINDS, (json_schema, json_object, regex, grammar))
             if value is not None and value is not False]
    if len(given) > 1:
        raise QwenrtError(f"give at most one of json_schema, json_object, regex and grammar, got {', '.join(given)}",
                          given[1])
    if not given:
        return None
    kind = given[0]
    if kind == "json_schema":
        return Constraint(kind, _schema_text(json_schema))
    if kind == "json_object":
        if json_object is not True:
            raise QwenrtError(f"json_object must be true or false, got {json_object!r}", kind)
        return Constraint(kind, "")
    source = regex if kind == "regex" else grammar
    if not isinstance(source, str) or not source:
        raise QwenrtError(f"{kind} must be a non-empty string, got {source!r:.60}", kind)
    if len(source) > MAX_SOURCE_CHARS:
        raise QwenrtError(f"{kind} has {len(source)} characters; at most {MAX_SOURCE_CHARS} are taken", kind)
    return Constraint(kind, source)


def _one_line(message: str) -> str:
    """llguidance's message on one line (a regex error spans several), without its position in the grammar's JSON
    ("at 2(7): ")."""
    lines = [line for line in message.splitlines()  # without the grammar excerpts and carets it points with
             if not re.match(r"\s*\d+ \|", line) and line.strip(" ^")]
    line = " ".join(" ".join(lines).split()) or "invalid"
    line = re.sub(r"^at \d+\(\d+\): ", "", line)
    return line if len(line) <= 300 else line[:297] + "..."


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary; keeps the CACHE_SIZE most recent. Thread-safe:
    requests are compiled in the threads that add them, not in the engine's loop."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size,
                                                eos_token=sorted(tokenizer.eos_token_ids))
        self._limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def token_rule(self, text: str, token_id: int | None) -> str:
        """How a Lark grammar names the tokenizer's token `text` (id `token_id`, None when it has none): a special
        token by its id, `<[id]>`, since llguidance matches those by id rather than by text; any other by its text."""
        if token_id is not None and self.tokenizer.is_special_token(token_id):
            return f"<[{token_id}]>"
        return json.dumps(text, ensure_ascii=False)

    def matcher(self, grammar: str, field: str) -> llguidance.LLMatcher:
        """A fresh matcher for llguidance grammar text; a grammar it refuses is a QwenrtError naming `field`."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if compiled.is_error():
            raise QwenrtError(f"{field}: {_one_line(compiled.get_error())}", field)
        try:  # a grammar that compiles may still match nothing (a schema that only refers to itself)
            first = TokenMask(compiled.deep_copy(), self.vocab_size).allowed()
        except QwenrtError as e:
            raise QwenrtError(f"{field}: nothing can match it ({str(e).split(': ', 1)[-1]})", field) from None
        if not first.any():
            raise QwenrtError(f"{field}: nothing can match it", field)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled.deep_copy()


class AllowedTokens:
    """The tokens a constraint allows at one step, as llguidance's packed bits (words [W] uint32, bit i of word
    i // 32 for token i; the bits past V are never set): greedy picks read them natively; the [V] bool tensor is
    unpacked only to sample with a temperature or off the CPU."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)  # [W], llguidance writes it
        self.packed = torch.from_numpy(self.words.view(np.int32))  # [W], the same memory, for the native pick

    def any(self) -> bool:
        return bool(self.words.any())

    def tensor(self) -> torch.Tensor:
        """[V] bool."""
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")  # [32 W]: ~100x torch's shifts
        return torch.from_numpy(bits[:self.vocab_size].view(np.bool_))


class TokenMask:
    """One sequence's constraint while it generates: the tokens allowed next, advanced with each token taken.

    `after` (a token id, e.g. `</think>`): the constraint starts once that token has been generated (thinking comes
    first, unconstrained); None: from the first token.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, after: int | None = None):
        self.matcher, self.after = matcher, after
        self.tokens = AllowedTokens(vocab_size)  # refilled at each step
        self._filled = False  # tokens hold the mask of the matcher's current state

    @property
    def active(self) -> bool:
        return self.after is None

    def allowed(self) -> AllowedTokens | None:
        """The tokens the constraint allows now (valid until it advances); None while it has not started."""
        if not self.active:
            return None
        if not self._filled:
            self.fill()
        return self.tokens

    def fill(self) -> None:
        """Compute the tokens allowed now, ahead of `allowed`."""
        words = self.tokens.words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self.matcher.is_error():
            raise QwenrtError(f"the output constraint failed: {_one_line(self.matcher.get_error())}")
        self._filled = True

    def drafts(self, proposed: list[int]) -> list[int]:
        """Speculative drafts worth verifying: the tokens the grammar forces from here where it forces more than
        the proposal's valid start, else that start (a draft it forbids would be rejected anyway). As many as
        proposed at most."""
        if not self.active or not proposed:
            return proposed
        valid = self.matcher.validate_tokens(proposed)
        forced = self.matcher.compute_ff_tokens()
        return forced[:len(proposed)] if len(forced) > valid else proposed[:valid]

    def advance(self, token: int) -> None:
        """Take a generated token (one `allowed` allows)."""
        if not self.active:
            if token == self.after:
                self.after = None
            return
        self._filled = False
        if not self.matcher.consume_token(token):
            raise QwenrtError(f"the output constraint failed: {_one_line(self.matcher.get_error())}")
