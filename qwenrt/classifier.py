"""Sequence classification on the Qwen3.5 decoder, as transformers' Qwen3_5ForSequenceClassification computes it
(GenericForSequenceClassification): `score`, a Linear(hidden, num_labels) without bias, over the final-normed hidden
state of each text's last token that is not the pad token.

A classifier checkpoint is one whose config's `architectures` end in ForSequenceClassification: its labels are
config.id2label (num_labels), its pad token config.pad_token_id (the text_config's in a vision-language config, as
transformers reads it). Loaded, the model has `score` and `classifier` (a ClassifierSpec) and no LM head: it scores
texts, it does not generate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenrt.errors import QwenrtError
from qwenrt.ops.linear import Linear

SUFFIX = "ForSequenceClassification"
TEXT_ARCHITECTURE = "Qwen3_5TextForSequenceClassification"  # transformers' class for a text-only config
MAX_LABELS = 1 << 16
WINDOW = 64  # texts queued at once by `classify`
HEAD_STD = 0.02  # transformers' initializer_range: a fresh score head is N(0, 0.02²)


@dataclass(frozen=True)
class ClassifierSpec:
    """The labels by class id, and the pad token whose trailing run the pooling skips (None: the last token)."""

    labels: tuple[str, ...]
    pad_token_id: int | None

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def classifier_spec(raw: dict, where: str = "config.json") -> ClassifierSpec | None:
    """The classifier a config.json dict describes, or None for a causal LM; one QwenrtError for a bad label map."""
    architectures = raw.get("architectures")
    if not (isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
            and architectures[0].endswith(SUFFIX)):
        return None
    id2label = raw.get("id2label")
    if id2label is None:  # transformers' default: num_labels (2) classes named LABEL_i
        count = raw.get("num_labels", 2)
        if type(count) is not int or not 1 <= count <= MAX_LABELS:
            raise QwenrtError(f"{where}: num_labels must be an integer in [1, {MAX_LABELS}], not {count!r:.40}")
        id2label = {str(i): f"LABEL_{i}" for i in range(count)}
    if not (isinstance(id2label, dict) and 1 <= len(id2label) <= MAX_LABELS
            and set(id2label) == {str(i) for i in range(len(id2label))}
            and all(isinstance(v, str) for v in id2label.values())):
        raise QwenrtError(f"{where}: id2label must map the class ids \"0\".. \"N-1\" to label names")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    pad = text.get("pad_token_id")
    if pad is not None and (type(pad) is not int or pad < 0):
        raise QwenrtError(f"{where}: pad_token_id must be a token id, not {pad!r:.40}")
    return ClassifierSpec(tuple(id2label[str(i)] for i in range(len(id2label))), pad)


def attach_head(model, num_labels: int) -> None:
    """Give `model` (a Qwen35ForCausalLM, on any device) a `score` head in place of its LM head."""
    model.score = Linear(model.config.text.hidden_size, num_labels)
    model.lm_head = None


@torch.no_grad()
def init_head(model, seed: int) -> None:
    """A fresh trainable fp32 score head, N(0, HEAD_STD²) as transformers initialises it."""
    g = torch.Generator().manual_seed(seed)
    weight = model.score.weight
    model.score.weight = torch.nn.Parameter(torch.randn(weight.shape, generator=g) * HEAD_STD)


def spec_of(model) -> ClassifierSpec:
    """The model's classifier, or one QwenrtError for a causal LM."""
    spec = getattr(model, "classifier", None)
    if spec is None:
        raise QwenrtError("this model is a causal LM, not a sequence classifier (a classifier checkpoint's config has "
                          f"architectures ...{SUFFIX}, as `qwenrt finetune --task classify` writes)")
    return spec


def pooled_ids(ids: list[int], pad_token_id: int | None) -> list[int]:
    """The tokens up to the one the head reads: transformers pools at the rightmost token that is not the pad token
    (the first when all are), so trailing pad tokens are dropped; causal layers make the rest irrelevant."""
    end = len(ids)
    if pad_token_id is not None:
        while end > 1 and ids[end - 1] == pad_token_id:
            end -= 1
    return ids[:end]


def last_token_logits(model, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """ids [B, T] right-padded, lengths [B] -> the head's logits [B, num_labels] fp32 at each row's last token."""
    hidden = model.hidden_states(ids)  # [B, T, D]
    pooled = hidden[torch.arange(len(ids)), lengths - 1]  # [B, D]
    return model.score(pooled.to(model.score.weight.dtype)).float()  # a trained head is fp32 on any base


@dataclass
class Classification:
    """One text's result: the most probable label, every class's logit and probability (by class id), the tokens
    the head read up to."""

    label: str
    logits: list[float]
    probs: list[float]
    prompt_tokens: int


def classify(model, tokenizer, texts: list[str | list[int]], engine=None) -> list[Classification]:
    """Classify `texts` (strings, or token ids) through the engine (the model's default one unless given): each is a
    request that only prefills and hands back its last token's final-normed hidden state, which the head scores
    here, all texts at once."""
    from qwenrt.engine import Engine, Request

    spec = spec_of(model)
    engine = engine or Engine.for_model(model, tokenizer)
    prompts = [pooled_ids(_ids(tokenizer, text, i), spec.pad_token_id) for i, text in enumerate(texts)]
    hidden = []  # [D] each
    for start in range(0, len(prompts), WINDOW):  # a window at a time: any number of texts, within the queue
        streams = [engine.submit(Request(ids, hidden_only=True)) for ids in prompts[start:start + WINDOW]]
        hidden += [_hidden(stream) for stream in streams]
    with torch.inference_mode():  # row by row: a text's logits do not depend on the others (a GEMM's sums would)
        logits = torch.cat([model.score(h[None]).float() for h in hidden])  # [n, num_labels]
    probs = logits.softmax(-1)
    return [Classification(spec.labels[int(p.argmax())], z.tolist(), p.tolist(), len(ids))
            for z, p, ids in zip(logits, probs, prompts)]


def _ids(tokenizer, text, i: int) -> list[int]:
    if isinstance(text, list) and text and all(type(t) is int for t in text):
        return text
    if not isinstance(text, str):
        raise QwenrtError(f"input {i}: expected a string or token ids, got {type(text).__name__}")
    if tokenizer is None:
        raise QwenrtError("classifying text needs the checkpoint's tokenizer (or pass token ids)")
    ids = tokenizer.encode(text)
    if not ids:
        raise QwenrtError(f"input {i}: the text is empty")
    return ids


def _hidden(stream) -> torch.Tensor:
    """The hidden state [D] a hidden_only request's stream ends with."""
    for out in stream:
        if out.finish_reason == "error":
            raise QwenrtError(out.error)
        if out.finished and out.hidden is not None:
            return out.hidden
    raise QwenrtError(f"the classification ended ({out.finish_reason}) without a result")
