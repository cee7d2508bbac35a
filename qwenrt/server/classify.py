"""vLLM's POST /classify (and /v1/classify): the label and class probabilities of each input text from a classifier
checkpoint (`qwenrt finetune --task classify`), each text one engine request that only prefills."""

from __future__ import annotations

import time
import uuid

from starlette.concurrency import run_in_threadpool

from qwenrt.classifier import classify
from qwenrt.errors import QwenrtError
from qwenrt.server.errors import APIError, from_engine
from qwenrt.server.protocol import ClassificationRequest


async def classify_texts(body: ClassificationRequest, state) -> dict:
    """{"id", "object": "list", "created", "model", "data": [{"index", "label", "probs", "num_classes"}], "usage"}."""
    name = state.check_model(body.model)
    model = state.engine.model
    if getattr(model, "classifier", None) is None:
        raise APIError(400, f"The model `{name}` is a causal LM, not a sequence classifier: /classify needs a "
                            "classifier checkpoint (its config's architectures end in ForSequenceClassification)",
                       "model")
    texts = [body.input] if isinstance(body.input, str) else body.input
    try:
        results = await run_in_threadpool(classify, model, state.tokenizer, texts, state.engine)
    except QwenrtError as e:
        raise from_engine(e, "input") from None
    tokens = sum(r.prompt_tokens for r in results)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
            "data": [{"index": i, "label": r.label, "probs": r.probs, "num_classes": len(r.probs)}
                     for i, r in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}
