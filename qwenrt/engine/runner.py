"""The runner runs what the scheduler picked: a prompt chunk of one sequence, or one decode step for a batch of
sequences (each continuing its own cache), and returns logits. It decides nothing."""

from __future__ import annotations

import torch

from qwenrt.cache import HybridCache, SequenceState
from qwenrt.decode_plan import DecodePlan
from qwenrt.engine.request import Sequence
from qwenrt.multimodal import vision_embeddings


def decode_step(model, input_ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
    """input_ids [B, 1] continuing the sequences of `cache` -> logits [B, 1, V] fp32: the native decode plan where
    there is one (the weight reads shared by the batch), else the modules."""
    plan = DecodePlan.for_model(model) if model.device.type == "cpu" else None
    return plan(input_ids, cache) if plan is not None else model(input_ids, cache=cache)


def _has_vision_tokens(model, ids: list[int]) -> bool:
    c = model.config
    return c.image_token_id in ids or c.video_token_id in ids


class ModelRunner:
    def __init__(self, model):
        self.model = model

    def allocate(self, seq: Sequence) -> SequenceState:
        """A fresh cache for an admitted sequence: KV room for its prompt (grown as it decodes, up to its limit)."""
        return self.model.new_sequence(capacity=min(seq.prompt_len + 64, seq.limit), limit=seq.limit)

    @torch.inference_mode()
    def prefill(self, seq: Sequence, n: int) -> torch.Tensor | None:
        """Run the next n prompt tokens of `seq` through its cache; logits [1, V] fp32 after its last prompt token,
        None while more of the prompt remains."""
        model, prompt = self.model, seq.prompt
        start, end = seq.computed, seq.computed + n
        last = end == seq.prompt_len
        cache = HybridCache([seq.state])
        ids = torch.tensor([prompt.ids[start:end]], device=model.device)  # [1, n]
        if prompt.vision is None:
            h = model.hidden_states(ids, cache, keep=1 if last else None)
        else:
            positions = prompt.vision.position_ids.to(model.device)[..., start:end]  # [3, 1, n]
            if seq.vision_embeds is None and _has_vision_tokens(model, prompt.ids[start:]):
                # the vision tower runs once, at the first chunk that needs it (a cached prefix may cover them all)
                seq.vision_embeds = vision_embeddings(model, torch.tensor([prompt.ids], device=model.device),
                                                      prompt.vision)  # [1, T, D]
            embeds = (seq.vision_embeds[:, start:end] if seq.vision_embeds is not None
                      else model.model.embed_tokens(ids))
            h = model.hidden_states(cache=cache, inputs_embeds=embeds, position_ids=positions,
                                    keep=1 if last else None)
            if last:
                seq.state.rope_delta = prompt.vision.rope_delta
                seq.vision_embeds = None
        seq.computed = end
        return model.lm_head(h[:, -1]).float() if last else None

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One new token for each sequence (its last sampled one) -> logits [B, V] fp32."""
        ids = torch.tensor([[s.last_token] for s in seqs], device=self.model.device)  # [B, 1]
        return decode_step(self.model, ids, HybridCache([s.state for s in seqs]))[:, -1]
