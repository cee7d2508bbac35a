"""Request fields -> engine requests: sampling parameters over the checkpoint's generation defaults (as
`qwenrt run` does), one engine request per choice, and vLLM's context-length check once the prompt is tokenized."""

from __future__ import annotations

from qwenrt.console import sampling_params
from qwenrt.engine import RequestHandle
from qwenrt.errors import QwenrtError
from qwenrt.sampling import SamplingParams
from qwenrt.server.errors import APIError, context_length_error
from qwenrt.server.protocol import SamplingFields
from qwenrt.server.structured import ENGINE_FIELDS

_SAMPLING = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop")


def choice_params(body: SamplingFields, tokenizer, max_tokens: int | None, max_model_len: int,
                  constraint: dict | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice (choice j of a seeded request gets seed + j, so the choices differ);
    `constraint`: the output constraint's keywords (structured.constraint_options).

    Without max_tokens a request may run to the end of the context (as vLLM): the engine stops it there."""
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    options = {name: getattr(body, name) for name in _SAMPLING}
    options.update(top_k=max(body.top_k, 0) if body.top_k is not None else None,
                   max_tokens=max_tokens or max_model_len, stop_token_ids=tuple(body.stop_token_ids or ()),
                   ignore_eos=body.ignore_eos, **(constraint or {}))
    params = []
    for j in range(body.n):
        seed = (body.seed + j) % 2**64 if body.seed is not None else None
        try:
            params.append(sampling_params(dict(options, seed=seed), tokenizer))
        except QwenrtError as e:
            field = e.field or str(e).split()[0]
            param = ENGINE_FIELDS.get(field, field if field in SamplingFields.model_fields else None)
            raise APIError(400, str(e), param) from None
    return params


def check_context(handles: list[RequestHandle], max_tokens: int | None, max_model_len: int, prompt_field: str,
                  max_tokens_field: str) -> None:
    """A prompt plus the max_tokens the client asked for must fit the context (vLLM's rule)."""
    for handle in handles:
        if max_tokens is not None and handle.prompt_tokens + max_tokens > max_model_len:
            raise context_length_error(max_model_len, handle.prompt_tokens, prompt_field, max_tokens=max_tokens,
                                       max_tokens_field=max_tokens_field)
