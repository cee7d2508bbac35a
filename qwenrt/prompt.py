"""Prompts in, token ids out: raw text, chat messages (chat template, images, video) or token ids, checked against
the context limit and the vocabulary before any model work."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenrt.errors import ContextLengthError, QwenrtError
from qwenrt.multimodal import VisionPrompt, collect_media, prepare_vision_prompt
from qwenrt.vision.media import DEFAULT_POLICY, MediaPolicy


@dataclass
class PreparedPrompt:
    ids: list[int]
    thinking_started: bool  # the prompt ends inside an open <think> block
    vision: VisionPrompt | None = None


def prepare_prompt(model, tokenizer, prompt, enable_thinking: bool | None = None, tools=None,
                   max_context: int | None = None, policy: MediaPolicy = DEFAULT_POLICY,
                   add_generation_prompt: bool = True) -> PreparedPrompt:
    """A string (raw text), chat messages (rendered with the chat template; image/video parts allowed, read under
    `policy`) or token ids. Checks the prompt against the context limit and the vocabulary before any model work.
    """
    limit = max_context or model.config.text.context_limit
    vision = None
    if isinstance(prompt, str):
        if tokenizer is None:
            raise QwenrtError("a text prompt needs a tokenizer; this checkpoint has none (pass token ids)")
        ids, text = _encode(tokenizer, prompt, limit), prompt
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None:
            raise QwenrtError("chat messages need a tokenizer; this checkpoint has none")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking, tools=tools)
        ids = _encode(tokenizer, text, limit)  # with images, a bound first: expanding them only adds tokens
        images, videos = collect_media(prompt)
        if images or videos:
            ids, vision = prepare_vision_prompt(model, tokenizer, text, images, videos, limit, policy)
    elif isinstance(prompt, torch.Tensor) or (isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)):
        ids = [int(t) for t in (prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        text = None  # decoded once the ids are known to be in the vocabulary
    else:
        raise QwenrtError("prompt must be a string, a list of chat messages (dicts) or a list of token ids")
    if not ids:
        raise QwenrtError("the prompt is empty")
    if len(ids) >= limit:
        raise ContextLengthError(f"prompt has {len(ids)} tokens; the context limit is {limit} (leave room for the "
                                 "answer)", len(ids), limit)
    vocab = model.config.text.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise QwenrtError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if text is None:
        text = tokenizer.decode(ids[-4:]) if tokenizer is not None else ""
    # the thinking generation prompt ends with an open "<think>\n": the output starts inside the reasoning
    return PreparedPrompt(ids, text.rstrip().endswith("<think>"), vision)


def _encode(tokenizer, text: str, limit: int) -> list[int]:
    """The ids of `text`, refused once they are known not to fit `limit` (tokenizing stops there)."""
    ids = tokenizer.encode_within(text, limit - 1)
    if ids is None:
        raise ContextLengthError(f"prompt has more than {limit - 1} tokens; the context limit is {limit} (leave room "
                                 "for the answer)", limit, limit, counted=False)
    return ids
