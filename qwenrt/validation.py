"""Request checks that belong before any work: prompt text, token ids, chat messages, tools, the context limit.

`check_request` is what an engine calls once per request; the tokenizer uses `check_text` / `check_token_ids`
on everything it encodes and decodes, so nothing malformed reaches the tokenizers library.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

from qwenrt.errors import QwenrtError

TOKEN_ID_LIMIT = 1 << 32  # what the tokenizers library can hold; a model's vocabulary is far smaller


def check_path(path: Any, what: str = "checkpoint path") -> str | os.PathLike:
    """A non-empty filesystem path given as a str or an os.PathLike of one (what pathlib takes; bytes paths are
    refused rather than guessed at)."""
    name = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(name, str):
        raise QwenrtError(f"{what} must be a str or an os.PathLike, got {type(path).__name__}")
    if not name:
        raise QwenrtError(f"{what} is empty")
    if "\0" in name:
        raise QwenrtError(f"{what} {name!r:.80} holds a NUL character")
    try:
        os.fsencode(name)
    except UnicodeEncodeError as e:
        raise QwenrtError(f"{what} {name!r:.80} is not valid Unicode (lone surrogate at character {e.start})") from None
    return path


def check_flag(value: Any, what: str) -> bool:
    """A bool, not something merely truthy (the string "no" would switch a flag on)."""
    if not isinstance(value, bool):
        raise QwenrtError(f"{what} must be True or False, got {value!r:.40}")
    return value


def check_text(text: Any, what: str = "prompt text") -> str:
    """A str that is valid Unicode (no lone surrogates, which UTF-8 cannot encode)."""
    if not isinstance(text, str):
        raise QwenrtError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise QwenrtError(f"{what} is not valid Unicode: lone surrogate {text[e.start]!r} at character {e.start} "
                          "(invalid UTF-8 input?)") from None
    return text


def check_token_ids(ids: Any, vocab_size: int = TOKEN_ID_LIMIT, what: str = "token ids") -> list[int]:
    """A list of integers in [0, vocab_size) (numpy and torch integers accepted; bools and floats refused)."""
    if hasattr(ids, "reshape") and hasattr(ids, "tolist"):  # a tensor or an array, of any rank
        ids = ids.reshape(-1).tolist()
    if not isinstance(ids, (list, tuple)):
        raise QwenrtError(f"{what} must be a list of integers, got {type(ids).__name__}")
    out = []
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)
        except TypeError:
            raise QwenrtError(f"{what} must be integers, got {t!r:.40}") from None
        if not 0 <= t < vocab_size:
            raise QwenrtError(f"{what}: {t} is outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def check_token_id(token: Any, vocab_size: int = TOKEN_ID_LIMIT, what: str = "token id") -> int:
    """One integer in [0, vocab_size), as check_token_ids takes them."""
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        raise QwenrtError(f"{what} must be an integer, got {token!r:.40}")
    return check_token_ids([token], vocab_size, what)[0]


def _check_strings(value: Any, where: str, depth: int = 0) -> None:
    """Every string inside a message (content, parts, tool calls) is valid Unicode."""
    if depth > 32:
        raise QwenrtError(f"{where} is nested more than 32 levels deep")
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_strings(key, where, depth + 1)
            _check_strings(item, f"{where}.{key}" if isinstance(key, str) else where, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]", depth + 1)


def check_messages(messages: Sequence) -> None:
    """Chat messages: a list of dicts with a string role; every string in them valid Unicode."""
    if not isinstance(messages, (list, tuple)):
        raise QwenrtError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise QwenrtError("a chat prompt needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise QwenrtError(f"message {i} must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise QwenrtError(f"message {i} needs a string 'role', got {message.get('role')!r:.40}")
        _check_strings(message, f"message {i}")


def check_tools(tools: Any) -> None:
    """OpenAI-style tools: {"type": "function", "function": {"name": str, "parameters": object}} (or the bare
    function dict), so the template and the tool-call parser can read them."""
    if tools is None:
        return
    if not isinstance(tools, (list, tuple)):
        raise QwenrtError(f"tools must be a list of tool dicts, got {type(tools).__name__}", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise QwenrtError(f"tool {i} must be a dict with a function name, got {tool!r:.60}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise QwenrtError(f"tool {fn['name']!r}: 'parameters' must be a JSON-schema object, got "
                              f"{type(params).__name__}", "tools")
        try:
            _check_strings(tool, f"tool {i}")
        except QwenrtError as e:
            raise QwenrtError(str(e), "tools") from None


def check_prompt(prompt: Any, vocab_size: int) -> None:
    """One prompt: a string, chat messages, or token ids (a list or a 1-D tensor), each checked."""
    if isinstance(prompt, str):
        check_text(prompt)
        if not prompt:
            raise QwenrtError("the prompt is empty")
    elif isinstance(prompt, (list, tuple)) and any(isinstance(m, Mapping) for m in prompt):
        check_messages(prompt)
    elif isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
        if any(n != 1 for n in getattr(prompt, "shape", ())[:-1]):  # the rows of a [B, T] tensor would run together
            raise QwenrtError(f"prompt token ids must be one row, got shape {list(prompt.shape)} (batch_generate "
                              "takes a list of prompts)")
        if not check_token_ids(prompt, vocab_size, "prompt token ids"):
            raise QwenrtError("the prompt is empty")
    else:
        raise QwenrtError("a prompt must be a string, a list of chat messages (dicts) or a list of token ids, "
                          f"got {type(prompt).__name__}")


def check_max_context(max_context: Any, model_limit: int) -> int:
    """The context limit to use: the model's by default; an explicit one must be an integer in [2, model's]."""
    if max_context is None:
        return model_limit
    if isinstance(max_context, bool) or not isinstance(max_context, int) or not 2 <= max_context <= model_limit:
        raise QwenrtError(f"max_context must be an integer in [2, {model_limit}] (the model's context limit: "
                          f"max_position_embeddings, or YaRN's factor x original), got {max_context!r}")
    return max_context


def check_prompt_list(prompts: Any) -> Sequence:
    """A batch of prompts: a list (not a string, whose characters would each become a prompt) of at least one."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise QwenrtError(f"prompts must be a list, got {type(prompts).__name__}")
    if not prompts:
        raise QwenrtError("no prompts given (batch_generate needs at least one)")
    return prompts


def check_request(prompts: Sequence, *, vocab_size: int, model_limit: int, tools: Any = None,
                  max_context: Any = None) -> int:
    """Everything about a request that can be refused before any work: at least one prompt, each prompt, the tools
    and the context limit. Returns the context limit to use."""
    for prompt in check_prompt_list(prompts):
        check_prompt(prompt, vocab_size)
    check_tools(tools)
    return check_max_context(max_context, model_limit)
