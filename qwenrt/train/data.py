"""Chat conversations -> token ids with a loss mask on the assistant's own tokens.

A conversation is {"messages": [...], "tools": [...] (optional)} in the OpenAI `messages` format (assistant turns
may carry `reasoning_content` and `tool_calls`; tool-call arguments as an object or a JSON string). It is rendered
with the model's chat template; the assistant's tokens are what the model would generate after the generation
prompt: the reasoning (thinking on, when the turn has any), the answer, tool calls and the closing <|im_end|>.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qwenrt.errors import QwenrtError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass
class Example:
    """One tokenized conversation: ids [T] and loss_mask [T] (True where the model predicts that token)."""

    ids: list[int]
    loss_mask: list[bool]

    def __len__(self) -> int:
        return len(self.ids)


def read_jsonl(path: str | Path) -> list[dict]:
    """Conversations from a JSONL file, one object with a `messages` list per line."""
    path = Path(path)
    if not path.is_file():
        raise QwenrtError(f"training data not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise QwenrtError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            out.append(check_conversation(record, f"{path}:{n}"))
    if not out:
        raise QwenrtError(f"{path}: no conversations")
    return out


def write_jsonl(path: str | Path, conversations: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for c in conversations:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")


def check_conversation(record, where: str) -> dict:
    """A conversation in canonical form (tool-call arguments as objects), or one QwenrtError saying what is wrong."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise QwenrtError(f"{where}: expected an object with a non-empty 'messages' list")
    messages = []
    for i, m in enumerate(record["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise QwenrtError(f"{where}: message {i} needs a role of system, user, assistant or tool")
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[_call_with_object_arguments(c, f"{where}: message {i}") for c in calls])
        messages.append(m)
    if not any(m["role"] == "assistant" for m in messages):
        raise QwenrtError(f"{where}: no assistant message to learn from")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise QwenrtError(f"{where}: 'tools' must be a list")
    return {"messages": messages, **({"tools": tools} if tools else {})}


def _call_with_object_arguments(call, where: str) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise QwenrtError(f"{where}: a tool call needs a function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string; the template iterates an object
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise QwenrtError(f"{where}: tool call arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise QwenrtError(f"{where}: tool call arguments must be an object")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def encode_conversation(tokenizer, conversation: dict, where: str = "conversation") -> Example:
    """Render and tokenize; every assistant turn's generated tokens get the loss.

    The prompt before each assistant turn is rendered on its own, as it would be at inference, and must tokenize
    to a prefix of the whole conversation's tokens, so training sees exactly what generation will.
    """
    messages, tools = conversation["messages"], conversation.get("tools")
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools))
    end_id = tokenizer.token_to_id(IM_END)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _turn_start(tokenizer, messages[:i], m, tools, ids, where)
        try:
            end = ids.index(end_id, start) + 1
        except ValueError:
            raise QwenrtError(f"{where}: assistant turn {i} has no {IM_END}") from None
        mask[start:end] = [True] * (end - start)
    return Example(ids, mask)


def _turn_start(tokenizer, before: list[dict], turn: dict, tools, ids: list[int], where: str) -> int:
    """Index of the first generated token of `turn`: the length of its generation prompt's tokens."""
    thinking = bool((turn.get("reasoning_content") or "").strip())

    def prompts():  # rendered lazily: the first usually fits, and rendering is most of the encoding time
        yield tokenizer.apply_chat_template(before, add_generation_prompt=True, enable_thinking=thinking, tools=tools)
        # a turn before the last user query is rendered without its think block
        yield tokenizer.apply_chat_template(before, add_generation_prompt=False, tools=tools) + f"{IM_START}assistant\n"

    if any(m["role"] == "user" for m in before):
        for prompt in prompts():
            prefix = tokenizer.encode(prompt)
            if ids[:len(prefix)] == prefix:
                return len(prefix)
    raise QwenrtError(f"{where}: an assistant turn's prompt does not tokenize to a prefix of the conversation "
                      "(the turn must follow a user message)")


def encode_all(tokenizer, conversations: list[dict], max_len: int, where: str = "data") -> list[Example]:
    """Encode every conversation; one longer than max_len tokens is an error, not silently cut."""
    out = []
    for n, c in enumerate(conversations):
        ex = encode_conversation(tokenizer, c, f"{where}: conversation {n}")
        if len(ex) > max_len:
            raise QwenrtError(f"{where}: conversation {n} has {len(ex)} tokens, over max_len {max_len}")
        out.append(ex)
    return out


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and loss mask [B, T]; causal layers never let padding reach a real token."""
    T = max(len(e) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.bool)
    for b, e in enumerate(examples):
        ids[b, :len(e)] = torch.tensor(e.ids)
        mask[b, :len(e)] = torch.tensor(e.loss_mask)
    return ids, mask
