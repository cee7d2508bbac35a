"""Chat conversations -> token ids with a loss mask on the assistant's own tokens.

A conversation is {"messages": [...], "tools": [...] (optional)} in the OpenAI `messages` format (assistant turns
may carry `reasoning_content` and `tool_calls`; tool-call arguments as an object or a JSON string). It is rendered
with the model's chat template; the assistant's tokens are what the model would generate after the generation
prompt: the reasoning (thinking on, when the turn has any), the answer, tool calls and the closing <|im_end|>.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from qwenrt.errors import QwenrtError
from qwenrt.files import JSON_LIMIT
from qwenrt.validation import check_path

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TURN_HEADER = f"{IM_START}assistant\n"
ROLES = ("system", "user", "assistant", "tool")
NOT_A_PREFIX = ("an assistant turn's prompt does not tokenize to a prefix of the conversation (the turn must follow "
                "a user message)")
STRING_FIELDS = ("reasoning_content", "thinking", "reasoning", "name", "tool_call_id")


@dataclass
class Example:
    """One tokenized conversation: ids [T] and loss_mask [T] (True where the model predicts that token)."""

    ids: list[int]
    loss_mask: list[bool]
    label: int | None = None  # a labelled text's class id (classification: the mask is unused)

    def __len__(self) -> int:
        return len(self.ids)


def load_conversations(source: str | Path | list[dict], what: str = "data") -> list[tuple[str, dict]]:
    """(where, conversation) pairs from a JSONL path ("file:line") or a list in memory ("`what`: conversation n")."""
    if isinstance(source, list):
        labelled = [(f"{what}: conversation {n}", c) for n, c in enumerate(source)]
        return [(where, check_conversation(c, where)) for where, c in labelled]
    return read_jsonl(check_path(source, f"{what} (a JSONL file, or a list of conversations)"))


def read_jsonl(path: str | Path, check=None, kind: str = "conversations") -> list[tuple]:
    """Conversations from a JSONL file, one object with a `messages` list per line, each with its "file:line"
    (or, with `check`, what it makes of each line's object and "file:line"). A line is read whole only within the
    JSON file limit, and every fault is one error naming its line."""
    path = Path(path)
    if not path.is_file():
        raise QwenrtError(f"training data not found: {path}")
    out = []
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(iter(lambda: f.readline(JSON_LIMIT + 1), b""), 1):
                where = f"{path}:{n}"
                if len(line) > JSON_LIMIT:
                    raise QwenrtError(f"{where}: the line is over {JSON_LIMIT} bytes")
                if line.strip():
                    out.append((where, (check or check_conversation)(_parse_json(_utf8(line, where), where), where)))
    except OSError as e:
        raise QwenrtError(f"cannot read training data {path}: {e.strerror or e}") from None
    if not out:
        raise QwenrtError(f"{path}: no {kind}")
    return out


def _utf8(line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QwenrtError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _parse_json(text: str, where: str, what: str = "not valid JSON"):
    """JSON without NaN/Infinity; deep nesting and Python's cap on integer digits are faults of the input too."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise QwenrtError(f"{where}: {what} (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise QwenrtError(f"{where}: {what} ({getattr(e, 'msg', None) or str(e).split(':')[0]})") from None


def write_jsonl(path: str | Path, conversations: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for c in conversations:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")


def check_conversation(record, where: str) -> dict:
    """A conversation in canonical form (tool-call arguments as objects), or one QwenrtError saying what is wrong."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise QwenrtError(f"{where}: expected an object with a non-empty 'messages' list")
    messages = [_check_message(m, f"{where}: message {i}") for i, m in enumerate(record["messages"])]
    if not any(m["role"] == "assistant" for m in messages):
        raise QwenrtError(f"{where}: no assistant message to learn from")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise QwenrtError(f"{where}: 'tools' must be a list")
    return {"messages": messages, **({"tools": tools} if tools else {})}


def _check_message(m, where: str) -> dict:
    """A message whose fields have the types the template and the loss mask read (text only: no media parts)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise QwenrtError(f"{where} needs a role of system, user, assistant or tool")
    for key in STRING_FIELDS:
        if m.get(key) is not None and not isinstance(m[key], str):
            raise QwenrtError(f"{where}: '{key}' must be a string, not {type(m[key]).__name__}")
    content = m.get("content")
    if not (content is None or isinstance(content, str) or isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)):
        raise QwenrtError(f"{where}: 'content' must be a string or a list of text parts")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise QwenrtError(f"{where}: 'tool_calls' must be a list, not {type(calls).__name__}")
    return dict(m, tool_calls=[_call_with_object_arguments(c, where) for c in calls]) if calls else m


def _call_with_object_arguments(call, where: str) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise QwenrtError(f"{where}: a tool call needs a function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string; the template iterates an object
        args = _parse_json(args, where, "tool call arguments are not valid JSON")
    if not isinstance(args, dict):
        raise QwenrtError(f"{where}: tool call arguments must be an object")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def encode_conversation(tokenizer, conversation: dict, where: str = "conversation",
                        max_len: int | None = None) -> Example:
    """Render once and tokenize; every assistant turn's generated tokens get the loss.

    A turn's prompt is the conversation's text up to its `<|im_start|>assistant\n`, then what the template appends
    for generation (thinking on when the turn has reasoning), as at inference; failing that, the bare header, as a
    turn before the last user query is rendered without its think block. It must tokenize to a prefix of the
    conversation's tokens. Special tokens are split out before the rest is tokenized, so those are the tokens up
    to the turn's <|im_start|> and then the appended prompt's own: a turn costs its header, not a render of all
    before it (which made encoding quadratic in turns). Earlier turns are as the whole conversation renders them
    (Qwen3.5 drops the think blocks of turns before the last user query). With `max_len`, a longer conversation
    is refused before its turns are looked at.
    """
    messages, tools = conversation["messages"], conversation.get("tools")
    text = _render(tokenizer, messages, tools, where, add_generation_prompt=False)
    ids = tokenizer.encode(text)
    if max_len is not None and len(ids) > max_len:
        raise QwenrtError(f"{where}: {len(ids)} tokens, over max_len {max_len}")
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    headers = _turn_headers(tokenizer, text, ids, where)
    if len(headers) != len(assistants):
        raise QwenrtError(f"{where}: {len(headers)} {TURN_HEADER!r} in the text for {len(assistants)} assistant "
                          "messages (a message holds the turn marker)")
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    if first_user > assistants[0]:
        raise QwenrtError(f"{where}: {NOT_A_PREFIX}")
    prompts = _generation_prompts(tokenizer, messages[:first_user + 1], tools, where)
    end_id = tokenizer.token_to_id(IM_END)
    mask = [False] * len(ids)
    for i, at in zip(assistants, headers):
        thinking = bool((messages[i].get("reasoning_content") or "").strip())
        start = next((at + len(p) for p in (prompts[thinking], prompts[None])
                      if p is not None and ids[at:at + len(p)] == p), None)
        if start is None:
            raise QwenrtError(f"{where}: {NOT_A_PREFIX}")
        try:
            end = ids.index(end_id, start) + 1
        except ValueError:
            raise QwenrtError(f"{where}: assistant turn {i} has no {IM_END}") from None
        mask[start:end] = [True] * (end - start)
    return Example(ids, mask)


def _render(tokenizer, messages: list[dict], tools, where: str, **options) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, **options)
    except QwenrtError as e:
        raise QwenrtError(f"{where}: {e}") from None


def _turn_headers(tokenizer, text: str, ids: list[int], where: str) -> list[int]:
    """Index in `ids` of each assistant turn's <|im_start|> token: the n-th <|im_start|> of the text is the n-th
    such token, as the tokenizer splits special tokens out before anything else."""
    start_id = tokenizer.token_to_id(IM_START)
    tokens = [k for k, token in enumerate(ids) if token == start_id]
    found = [m.start() for m in re.finditer(re.escape(IM_START), text)]
    if len(tokens) != len(found):
        raise QwenrtError(f"{where}: {IM_START} is not one token of this tokenizer")
    return [k for k, at in zip(tokens, found) if text.startswith(TURN_HEADER, at)]


def _generation_prompts(tokenizer, context: list[dict], tools, where: str) -> dict:
    """Token ids of what the template appends for generation, thinking on (True) and off (False), taken from the
    first user message's prompt (the template appends the same after any conversation), and of the bare turn
    header (None); None for a template whose generation prompt is not an appendix."""
    plain = _render(tokenizer, context, tools, where, add_generation_prompt=False)
    prompts = {None: tokenizer.encode(TURN_HEADER)}
    for thinking in (True, False):
        prompt = _render(tokenizer, context, tools, where, add_generation_prompt=True, enable_thinking=thinking)
        prompts[thinking] = tokenizer.encode(prompt[len(plain):]) if prompt.startswith(plain) else None
    return prompts


def encode_all(tokenizer, conversations: list[tuple[str, dict]], max_len: int) -> list[Example]:
    """Encode every (where, conversation); one longer than max_len tokens is an error, not silently cut."""
    return [encode_conversation(tokenizer, c, where, max_len) for where, c in conversations]


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and loss mask [B, T]; causal layers never let padding reach a real token."""
    T = max(len(e) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.bool)
    for b, e in enumerate(examples):
        ids[b, :len(e)] = torch.tensor(e.ids)
        mask[b, :len(e)] = torch.tensor(e.loss_mask)
    return ids, mask
