"""vLLM's POST /tokenize and POST /detokenize: the ids the chat and completions endpoints would use for a prompt,
and the text of ids. The tokenizer runs in a worker thread, bounded by the context limit as a request's prompt is."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from qwenrt.errors import QwenrtError
from qwenrt.prompt import prepare_prompt
from qwenrt.server.chat import chat_messages
from qwenrt.server.errors import APIError, from_engine
from qwenrt.server.protocol import DetokenizeRequest, TokenizeRequest


async def tokenize(body: TokenizeRequest, state) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"} (token_strs null unless return_token_strs)."""
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give prompt (text) or messages (chat), one of them", "prompt")
    field = "prompt" if body.prompt is not None else "messages"
    prompt = body.prompt if body.prompt is not None else chat_messages(body.messages, state)
    try:
        ids, strs = await run_in_threadpool(_tokenize, body, prompt, state)
    except QwenrtError as e:
        raise from_engine(e, field) from None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def _tokenize(body: TokenizeRequest, prompt, state) -> tuple[list[int], list[str | None] | None]:
    """In a worker thread: the prompt's ids, as the engine prepares them for a request, and their strings if asked."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else None
    ids = prepare_prompt(state.engine.model, state.tokenizer, prompt, thinking, tools, state.max_model_len,
                         state.media_policy, add_generation_prompt=body.add_generation_prompt).ids
    return ids, [state.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None


async def detokenize(body: DetokenizeRequest, state) -> dict:
    """{"prompt": the text of `tokens`}; at most a context's worth of ids, each in the vocabulary."""
    state.check_model(body.model)
    limit = state.max_model_len
    if len(body.tokens) > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, tokens has "
                            f"{len(body.tokens)} ids. Please send at most {limit}.", "tokens",
                       "context_length_exceeded")
    try:
        return {"prompt": await run_in_threadpool(state.tokenizer.decode, body.tokens)}
    except QwenrtError as e:
        raise APIError(400, str(e), "tokens") from None
