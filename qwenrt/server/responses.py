"""Response bodies: usage, log-probabilities, server-sent events."""

from __future__ import annotations

import json
import time
import uuid

from qwenrt.engine import RequestOutput, TokenLogprob

_BYTE_OF_CHAR = None  # byte-level BPE: the printable stand-in character of each byte -> the byte


def _byte_of_char() -> dict[str, int]:
    global _BYTE_OF_CHAR
    if _BYTE_OF_CHAR is None:  # GPT-2's bytes_to_unicode, inverted
        kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        shifted = [b for b in range(256) if b not in kept]
        _BYTE_OF_CHAR = {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(shifted)}
    return _BYTE_OF_CHAR


def token_bytes(tokenizer, token: int) -> list[int]:
    """The bytes a token stands for (a piece of a multi-byte character is a byte sequence, not text)."""
    piece = tokenizer.id_to_token(token) or ""
    table = _byte_of_char()
    if all(c in table for c in piece):
        return [table[c] for c in piece]
    return list(piece.encode())  # an added token (<think>, <|im_end|>): its text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """cached_tokens: prompt tokens restored from the prefix cache rather than computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class LogprobCollector:
    """The log-probabilities of the tokens that count as output (a stop token does not), in the request's order."""

    def __init__(self):
        self.entries: list[TokenLogprob] = []

    def add(self, out: RequestOutput) -> list[TokenLogprob]:
        """The entries `out` adds (empty when logprobs were not asked for)."""
        new = (out.logprobs or [])[:max(0, out.generation_tokens - len(self.entries))]
        self.entries += new
        return new


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    def one(token: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([token]), "logprob": logprob, "bytes": token_bytes(tokenizer, token)}

    return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(tokenizer, entries: list[TokenLogprob | None], offset: int,
                        ids: list[int] | None = None) -> dict:
    """The legacy shape; `offset`: characters of this choice's text before these tokens. An echoed prompt's entries
    come with their token `ids`: its first entry is None (nothing predicts it) and its logprobs null."""
    ids = [e.token for e in entries] if ids is None else ids
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two legacy logprobs objects of consecutive text (an echoed prompt, its completion) as one."""
    return {key: first[key] + then[key] for key in first}


def next_offset(logprobs: dict, offset: int) -> int:
    """The text_offset of the token after a legacy logprobs object (`offset` when it has none)."""
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if logprobs["tokens"] else offset
