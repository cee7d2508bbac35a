"""The runner runs what the scheduler picked: a prompt chunk of one sequence, one decode step for a batch of
sequences (each continuing its own cache), a speculative verification of several tokens per sequence, and the MTP
head's drafts. It returns logits and hidden states and decides nothing."""

from __future__ import annotations

import torch

from collections.abc import Iterator
from dataclasses import dataclass

from qwenrt.cache import HybridCache, SequenceState
from qwenrt.decode_plan import NO_ROWS, CyclePlan, DecodePlan, MTPPlan
from qwenrt.engine.request import Sequence
from qwenrt.mtp import draft_head
from qwenrt.multimodal import vision_embeddings
from qwenrt.sampling import greedy

LOGIT_ROWS = 64  # prompt positions whose logits are held at once (prompt logprobs)


def decode_step(model, input_ids: torch.Tensor, cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, 1] continuing the sequences of `cache` -> (logits [B, V] fp32, final-normed hidden [B, D]): the
    native decode plan where there is one (the weight reads shared by the batch), else the modules."""
    plan = DecodePlan.for_model(model) if model.device.type == "cpu" else None
    if plan is not None:
        return plan(input_ids, cache)
    h = model.hidden_states(input_ids, cache)[:, -1]
    return model.lm_head(h).float(), h


def _has_vision_tokens(model, ids: list[int]) -> bool:
    c = model.config
    return c.image_token_id in ids or c.video_token_id in ids


@dataclass
class Verified:
    """One sequence's part of a verification: T = 1 + its drafts."""

    logits: torch.Tensor  # [T, V] fp32: row t predicts the token after input t
    hidden: torch.Tensor  # [T, D] final-normed hidden states (what the MTP head reads)
    saved: list[dict]  # saved[t]: {DeltaNet layer: (conv, recurrent)} after input t, for t < T - 1


@dataclass
class Cycle:
    """One sequence's part of a greedy cycle: picks[t] is the model's token after input t; the first accepted + 1
    are its output; drafts: for its next cycle (none where it asked for none: then its rows wait for the head)."""

    picks: list[int]
    accepted: int
    drafts: list[int]
    logits: torch.Tensor  # [T, V] fp32, a row per input
    hidden: torch.Tensor  # [T, D] final-normed hidden states
    saved: list[torch.Tensor]  # per DeltaNet layer in order: conv [T-1, ...], recurrent [T-1, ...] after each input


class ModelRunner:
    def __init__(self, model, draft_vocab: int, kv_dtype: torch.dtype | None = None):
        """kv_dtype: the KV stores' dtype (None: the model's)."""
        self.model, self.kv_dtype = model, kv_dtype
        self.mtp = getattr(model, "mtp", None)
        self.draft_vocab = draft_vocab
        self._draft_head = None

    def allocate(self, seq: Sequence) -> SequenceState:
        """A fresh cache for an admitted sequence: KV room for its prompt, so that a long prompt's prefill never
        copies its cache (a 262K-token prompt's KV is 3 GiB on the 0.8B), grown by a quarter as it decodes, up to its
        limit (room for every token it may hold up front would commit a full context's KV for each request without
        max_tokens); with speculation, the MTP head's own cache too."""
        capacity = min(seq.prompt_len + 64, seq.limit)
        if seq.max_drafts and self.mtp is not None:
            model = self.model
            # room for the drafts' entries and the padding of a batched catch-up, both rolled back each round
            seq.draft_state = self.mtp.new_state(model.config.text, model.dtype, model.device, capacity,
                                                 seq.limit + 2 * seq.max_drafts + 2, self.kv_dtype)
        state = self.model.new_sequence(capacity=capacity, limit=seq.limit, kv_dtype=self.kv_dtype)
        state.adapter = seq.adapter
        return state

    @torch.inference_mode()
    def prefill(self, seq: Sequence, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the next n prompt tokens of `seq` through its cache -> (logits [1, V] fp32 after its last prompt token,
        None while more of the prompt remains; where the request asked for prompt logprobs, the final-normed hidden
        states [n, D] of every position of the chunk, for `logits_rows`; for a hidden_only request, the last prompt
        token's [1, D] after the last chunk (and no logits); else None)."""
        model, prompt = self.model, seq.prompt
        start, end = seq.computed, seq.computed + n
        last = end == seq.prompt_len
        cache = HybridCache([seq.state])
        ids = torch.tensor([prompt.ids[start:end]], device=model.device)  # [1, n]
        every = seq.draft_state is not None or seq.request.prompt_logprobs is not None  # the MTP head reads them all
        keep = 0 if every else 1 if last else None
        positions = embeds = None
        if prompt.vision is None:
            h = model.hidden_states(ids, cache, keep=keep)
        else:
            positions = prompt.vision.position_ids.to(model.device)[..., start:end]  # [3, 1, n]
            if seq.vision_embeds is None and _has_vision_tokens(model, prompt.ids[start:]):
                # the vision tower runs once, at the first chunk that needs it (a cached prefix may cover them all)
                seq.vision_embeds = vision_embeddings(model, torch.tensor([prompt.ids], device=model.device),
                                                      prompt.vision)  # embeddings [1, T, D], DeepStack
            embeds, deepstack = (seq.vision_embeds.chunk(slice(start, end)) if seq.vision_embeds is not None
                                 else (model.model.embed_tokens(ids), None))
            h = model.hidden_states(cache=cache, inputs_embeds=embeds, position_ids=positions, keep=keep,
                                    deepstack=deepstack)
            if last:
                seq.state.rope_delta = prompt.vision.rope_delta
        if seq.draft_state is not None:
            self._mtp_prefill(seq, start, h, positions)
        if last:
            seq.vision_embeds = None
        seq.computed = end
        if seq.request.hidden_only:
            return None, h[:, -1] if last else None
        return (model.lm_head(h[:, -1]).float() if last else None,
                h[0] if seq.request.prompt_logprobs is not None else None)

    @torch.inference_mode()
    def logits_rows(self, h: torch.Tensor) -> Iterator[torch.Tensor]:
        """The LM head over hidden states h [n, D], LOGIT_ROWS rows at a time -> logits [<= LOGIT_ROWS, V] fp32 each:
        a long chunk never holds its whole [n, V] (V floats a token, ~1 MB at a 248K vocabulary)."""
        for i in range(0, len(h), LOGIT_ROWS):
            yield self.model.lm_head(h[i:i + LOGIT_ROWS]).float()

    def _mtp_prefill(self, seq: Sequence, start: int, h: torch.Tensor, positions: torch.Tensor | None) -> None:
        """The MTP head over a prompt chunk's positions whose next token is in the prompt (h [1, n, D]); the
        prompt's last position waits for the first sampled token (`seq.mtp_pending`)."""
        model, prompt = self.model, seq.prompt
        n = h.shape[1]
        pairs = min(n, seq.prompt_len - 1 - start)
        if seq.mtp_index is None:
            seq.mtp_index = start
        if pairs > 0:
            nxt = slice(start + 1, start + 1 + pairs)
            embeds = (seq.vision_embeds.embeds[:, nxt] if seq.vision_embeds is not None
                      else model.model.embed_tokens(torch.tensor([prompt.ids[nxt]], device=model.device)))
            if positions is None:
                positions = torch.arange(start, start + pairs, device=model.device)[None]
            cos, sin = model.rotary(positions[..., :pairs], h.dtype)
            self.mtp(h[:, :pairs], embeds, cos, sin, HybridCache([seq.draft_state]))
            seq.mtp_index, seq.mtp_entries = start + pairs, seq.draft_state.length
        rows = h[0, pairs:]  # [n - pairs, D]: at most the prompt's last position
        seq.mtp_pending, seq.mtp_count = [rows], len(rows)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token for each sequence (its last sampled one) -> (logits [B, V] fp32, hidden [B, D])."""
        ids = torch.tensor([[s.last_token] for s in seqs], device=self.model.device)  # [B, 1]
        return decode_step(self.model, ids, HybridCache([s.state for s in seqs]))

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> list[Verified]:
        """Each sequence's last sampled token and its drafts through the model in one forward: the weights are read
        once for all of them. Caches advance over every input; `commit` then keeps the accepted ones."""
        model = self.model
        inputs = [[s.last_token] + d for s, d in zip(seqs, drafts)]
        counts = [len(t) for t in inputs]
        states = [s.state for s in seqs]
        for state, n in zip(states, counts):
            state.reserve(state.length + n)
        saved = [[] for _ in seqs]
        plan = DecodePlan.for_model(model) if model.device.type == "cpu" else None
        if plan is not None:
            ids = torch.tensor([t for row in inputs for t in row], device=model.device)  # [N]
            h = plan.hidden(ids, states, counts, saved)  # [N, D]
            logits = plan.logits(h)
            for state, n in zip(states, counts):
                state.length += n
        else:
            h, logits = self._verify_stepwise(inputs, states, saved)
        out, start = [], 0
        for b, n in enumerate(counts):
            out.append(Verified(logits[start:start + n], h[start:start + n], saved[b]))
            start += n
        return out

    def _verify_stepwise(self, inputs: list[list[int]], states: list[SequenceState], saved: list[list]):
        """Verification token by token through the modules (no native decode plan: other dtypes and devices): the
        same computation as plain decoding. Returns (hidden [N, D], logits [N, V]) in sequence order."""
        model = self.model
        layers = model.config.text.linear_attention_layers
        rows: list[list[torch.Tensor]] = [[] for _ in inputs]
        for t in range(max(len(i) for i in inputs)):
            active = [b for b, i in enumerate(inputs) if len(i) > t]
            ids = torch.tensor([[inputs[b][t]] for b in active], device=model.device)  # [B_t, 1]
            h = model.hidden_states(ids, HybridCache([states[b] for b in active]))  # [B_t, 1, D]
            for j, b in enumerate(active):
                rows[b].append(h[j, 0])
                if t < len(inputs[b]) - 1:
                    s = states[b]
                    saved[b].append({i: (s.conv[i].clone(), s.recurrent[i].clone()) for i in layers})
        h = torch.stack([r for row in rows for r in row])
        return h, model.lm_head(h).float()

    @staticmethod
    @torch.inference_mode()
    def commit(seq: Sequence, verified: Verified, taken: int) -> None:
        """Keep the first `taken` inputs of a verification in seq's cache: length back to them and, when some were
        rejected, the DeltaNet state saved after the last kept one, copied into the state's own tensors (the saved
        ones are views of the verification's buffers of every position; the rejected KV is overwritten later)."""
        state, n = seq.state, verified.logits.shape[0]
        state.length -= n - taken
        if taken < n:
            for i, (conv, recurrent) in verified.saved[taken - 1].items():
                state.conv[i].copy_(conv)
                state.recurrent[i].copy_(recurrent)

    @torch.inference_mode()
    def cycle(self, seqs: list[Sequence], drafts: list[list[int]], ks: list[int]) -> list[Cycle] | None:
        """verify, the greedy picks, commit and draft in one native call (CyclePlan): the head of a sequence that
        drafts reads its pending pairs first. None where the call does not apply (the caller goes the separate way).
        Caches keep the inputs up to the last accepted one (`keep` moves them back further)."""
        plan = CyclePlan.for_model(self.model, self.draft_vocab) if self.model.device.type == "cpu" else None
        if plan is None or any(s.draft_state is None for s in seqs):
            return None
        inputs = [[s.last_token] + d for s, d in zip(seqs, drafts)]
        pending = []
        for s, row, k in zip(seqs, inputs, ks):
            c = s.mtp_count if k else 0
            pending.append((torch.cat(s.mtp_pending), (s.prompt.ids + s.tokens)[s.mtp_index + 1:s.mtp_index + 1 + c])
                           if c else (NO_ROWS, []))
            s.state.reserve(s.state.length + len(row))
            s.draft_state.reserve(s.mtp_entries + c + len(row) + max(ks) - 1)
        logits, picks, hidden, accepted, made, saved = plan(inputs, [s.state for s in seqs], ks, pending,
                                                            [s.draft_state for s in seqs],
                                                            [s.mtp_entries for s in seqs])
        picks = picks.tolist()
        out, start = [], 0
        for s, row, a, d, kept, (_, nxt) in zip(seqs, inputs, accepted, made, saved, pending):
            n = len(row)
            s.state.length += a + 1
            if d:  # the head read the pending and the accepted rows, then wrote a row per further draft
                s.mtp_pending, s.mtp_count = [], 0
                s.mtp_index = s.state.length  # the newest input's pair waits for the next cycle's pick
                s.mtp_entries += len(nxt) + a + 1
                s.draft_state.length = s.mtp_entries + max(ks) - 1
            out.append(Cycle(picks[start:start + n], a, d, logits[start:start + n], hidden[start:start + n], kept))
            start += n
        return out

    @torch.inference_mode()
    def keep(self, seq: Sequence, cycle: Cycle, taken: int) -> None:
        """Keep only the first `taken` inputs of a cycle (fewer than it accepted: the sequence ended among them)."""
        dropped = cycle.accepted + 1 - taken
        if dropped <= 0:
            return
        seq.state.length -= dropped
        for j, i in enumerate(self.model.config.text.linear_attention_layers):
            seq.state.conv[i].copy_(cycle.saved[2 * j][taken - 1:taken])
            seq.state.recurrent[i].copy_(cycle.saved[2 * j + 1][taken - 1:taken])

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[b] draft tokens per sequence from the MTP head: one forward over each sequence's pending
        (hidden, next token) pairs (its cache first rewound past earlier drafts' entries) gives the first; each
        further one reuses the head on its own output. A sequence without pending pairs gets none."""
        ready = [b for b, s in enumerate(seqs) if ks[b] > 0 and s.mtp_count]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not ready:
            return drafts
        plan = MTPPlan.for_model(self.model, self.draft_vocab)  # None off the CPU
        picked, counts = [seqs[b] for b in ready], [ks[b] for b in ready]
        rows = self._draft_native(picked, counts, plan) if plan is not None else self._draft_modules(picked, counts)
        for b, row in zip(ready, rows):
            drafts[b] = row
        return drafts

    @staticmethod
    def _chain(last: torch.Tensor, ks: list[int], logits, step) -> list[list[int]]:
        """Greedy drafts from the head's outputs last [R, D], ks[j] for row j: logits(h) -> [R, V'], and
        step(h, tokens, i) -> the head's next outputs, its own output standing for the hidden state at the drafted
        position."""
        drafts: list[list[int]] = [[] for _ in ks]
        for i in range(max(ks)):
            token = greedy(logits(last).float())  # [R]
            for j, k in enumerate(ks):
                if i < k:
                    drafts[j].append(int(token[j]))
            if i + 1 < max(ks):
                last = step(last, token, i)
        return drafts

    @staticmethod
    def _catch_up(s: Sequence) -> tuple[list[int], int]:
        """A sequence's pending pairs: (their next tokens, the position of the first); its head cache is rewound past
        earlier drafts' entries and marked as holding the pairs."""
        m = s.mtp_count
        tokens = (s.prompt.ids + s.tokens)[s.mtp_index + 1:s.mtp_index + 1 + m]
        first = s.mtp_index + s.state.rope_delta
        s.draft_state.length = s.mtp_entries
        s.mtp_index += m
        s.mtp_entries += m
        return tokens, first

    def _draft_native(self, seqs: list[Sequence], ks: list[int], plan: MTPPlan) -> list[list[int]]:
        """The MTP plan over every sequence's pending pairs (no padding: each its own count), then one row per
        sequence per further draft."""
        dev = seqs[0].mtp_pending[0].device
        counts = [s.mtp_count for s in seqs]
        caught = [self._catch_up(s) for s in seqs]
        states = [s.draft_state for s in seqs]
        for state, n in zip(states, counts):
            state.reserve(state.length + n + max(ks) - 1)
        ids = torch.tensor([t for tokens, _ in caught for t in tokens], device=dev)  # [N]
        out = plan.hidden(torch.cat([r for s in seqs for r in s.mtp_pending]), ids, states, counts,
                          [first for _, first in caught])  # [N, D]
        for state, n in zip(states, counts):
            state.length += n
        last = out[torch.tensor(counts).cumsum(0) - 1]  # [R, D]: each sequence's newest pair
        where = [first + n for (_, first), n in zip(caught, counts)]
        for s in seqs:
            s.mtp_pending, s.mtp_count = [], 0

        def step(h, tokens, i):
            out = plan.hidden(h, tokens, states, [1] * len(seqs), [w + i for w in where])
            for state in states:
                state.length += 1
            return out

        return self._chain(last, ks, plan.logits, step)

    def _draft_modules(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """The same through the head's modules (other dtypes and devices): the pending pairs padded to one width by
        repeating each sequence's last (the padding is rolled back)."""
        model, mtp = self.model, self.mtp
        width = max(s.mtp_count for s in seqs)
        hidden, nxt, pos, counts = [], [], [], []
        for s in seqs:
            m = s.mtp_count
            pad = [m - 1] * (width - m)
            hidden.append(torch.cat(s.mtp_pending)[list(range(m)) + pad])
            tokens, first = self._catch_up(s)
            nxt.append(tokens + [tokens[-1]] * (width - m))
            pos.append(list(range(first, first + m)) + [first + m - 1] * (width - m))
            counts.append(m)
        dev = model.device
        cache = HybridCache([s.draft_state for s in seqs])
        cos, sin = model.rotary(torch.tensor(pos, device=dev), model.dtype)
        out = mtp(torch.stack(hidden), model.model.embed_tokens(torch.tensor(nxt, device=dev)), cos, sin, cache)
        last = torch.stack([out[j, m - 1] for j, m in enumerate(counts)])  # [R, D]
        where = [p[m - 1] + 1 for p, m in zip(pos, counts)]
        for s in seqs:
            s.draft_state.length = s.mtp_entries
            s.mtp_pending, s.mtp_count = [], 0

        def step(h, tokens, i):
            cos, sin = model.rotary(torch.tensor(where, device=dev)[:, None] + i, model.dtype)
            return mtp(h[:, None], model.model.embed_tokens(tokens[:, None]), cos, sin, cache)[:, 0]

        return self._chain(last, ks, self.draft_logits, step)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """MTP outputs h [R, D] -> logits [R, draft_vocab] over the first token ids only."""
        if self._draft_head is None:
            self._draft_head = draft_head(self.model.lm_head, self.draft_vocab)
        return self._draft_head(h)
