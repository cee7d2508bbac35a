"""Qwen3.5's multi-token-prediction (MTP) head, checkpoint prefix `mtp.` (shared/reference.md §5.7).

From the main model's final-normed hidden state h_t and the embedding of token t+1 it predicts token t+2 through
the main model's embedding and lm_head: e = norm_e(embed(x_{t+1})), z = fc([e ; norm_h(h_t)]), one full-attention
decoder layer at position t (its own KV cache, aligned with the model's positions), a final norm, lm_head.
`qwenrt.load` attaches it as `model.mtp` when the checkpoint has one (quantized with the rest of the model).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qwenrt.cache import HybridCache, SequenceState
from qwenrt.config import TextConfig
from qwenrt.errors import QwenrtError
from qwenrt.model import DecoderLayer, RMSNorm
from qwenrt.ops.linear import Linear
from qwenrt.quant import QuantLinear

PREFIX = "mtp."
DEFAULT_DRAFT_VOCAB = 32768  # draft logits over the first ids only (BPE ranks: the most frequent tokens)


class MTPHead(nn.Module):
    """One MTP layer; attribute names are the checkpoint's (after `mtp.`)."""

    def __init__(self, c: TextConfig):
        super().__init__()
        self.fc = Linear(2 * c.hidden_size, c.hidden_size)
        self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(c, 0, layer_type="full_attention")])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: HybridCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, D] (h_t, final-normed), next_embeds [B, T, D] (embeddings of x_{t+1}), cos, sin
        [B, T, R] of positions t -> the normed output [B, T, D]; lm_head of it predicts x_{t+2}. Causal over T (or
        as `mask` [T, T] says, without a cache); with `cache` (states from `new_state`) also over the cached
        entries, and the cache takes these T."""
        z = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        if cache is not None:
            cache.reserve(z.shape[1])
        x, delta = self.layers[0](z, None, cos, sin, cache, mask)
        if cache is not None:
            cache.advance(z.shape[1])
        return self.norm.add_forward(x, delta)[1]

    def new_state(self, config: TextConfig, dtype: torch.dtype, device, capacity: int,
                  limit: int | None, kv_dtype: torch.dtype | None = None) -> SequenceState:
        """An empty KV cache for this head's one attention layer, for one sequence (stores of kv_dtype, default
        dtype)."""
        single = dataclasses.replace(config, num_hidden_layers=1, layer_types=("full_attention",))
        return SequenceState(single, dtype, device, capacity, limit, kv_dtype)


def mtp_hidden(model, mtp: MTPHead, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The MTP head over whole sequences input_ids [B, T] -> [B, T-1, D]; lm_head of row t predicts
    input_ids[:, t+2]. `hidden`: the model's final-normed hidden states [B, T, D] when already computed."""
    if hidden is None:
        hidden = model.hidden_states(input_ids)
    B, T = input_ids.shape
    cos, sin = model.rotary(torch.arange(T - 1, device=hidden.device)[None].expand(B, T - 1), hidden.dtype)
    return mtp(hidden[:, :-1], model.model.embed_tokens(input_ids[:, 1:]), cos, sin)


def chained_hidden(model, mtp: MTPHead, input_ids: torch.Tensor, depths: int,
                   hidden: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head as the engine chains it for `depths` drafts, over whole sequences input_ids [B, T] -> per depth d
    (from 1) [B, T-1, D]: lm_head of row t predicts input_ids[:, t+d+1] (rows whose target lies past the end are
    padding). Depth 1 is mtp_hidden. Depth d > 1 at row t reads depth d-1's output at row t and token t+d, at
    position t+d-1; it attends to depth 1's rows up to t and to rows t of depths 2..d, the cache a draft sees
    (engine: the accepted rows' entries, then the earlier drafts'). Teacher-forced: the true tokens stand where
    the engine has drafts, which is what an accepted draft is."""
    if depths < 1:
        return []
    if hidden is None:
        hidden = model.hidden_states(input_ids)
    outs = [mtp_hidden(model, mtp, input_ids, hidden)]  # depth 1 exactly as the joint training has it
    if depths == 1:
        return outs
    B, T = input_ids.shape
    n = T - 1
    rows = torch.arange(n, device=hidden.device)
    embeds = model.model.embed_tokens(input_ids)  # [B, T, D]
    inputs = [hidden[:, :-1]]
    tokens = [embeds[:, 1:]]
    positions = [rows]
    for d in range(2, depths + 1):
        inputs.append(outs[-1])
        tokens.append(embeds[:, (rows + d).clamp(max=T - 1)])
        positions.append(rows + d - 1)
        depth = torch.arange(d, device=hidden.device).repeat_interleave(n)  # [d·n]: each column's depth - 1
        row = rows.repeat(d)
        first = depth[None, :] == 0
        mask = (first & (row[None, :] <= row[:, None])) | (~first & (row[None, :] == row[:, None])
                                                            & (depth[None, :] <= depth[:, None]))
        cos, sin = model.rotary(torch.cat(positions)[None].expand(B, -1), hidden.dtype)
        outs.append(mtp(torch.cat(inputs, 1), torch.cat(tokens, 1), cos, sin, mask=mask)[:, -n:])
    return outs


def mtp_state_dict(mtp: MTPHead) -> dict[str, torch.Tensor]:
    """The head's tensors under their checkpoint names (`mtp.fc.weight`, ...)."""
    return {PREFIX + name: t for name, t in mtp.state_dict().items()}


def load_mtp_head(model, dtype: torch.dtype | None = None) -> MTPHead:
    """The MTP head `qwenrt.load` attached to `model` (`model.mtp`), in `dtype` when given (norms stay fp32).
    Raises QwenrtError when the checkpoint had none."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        raise QwenrtError("the model has no MTP head (its checkpoint holds no mtp.* tensors)")
    if dtype is not None:
        for name, p in mtp.named_parameters():
            if p.is_floating_point() and not name.endswith("norm.weight"):
                p.data = p.data.to(dtype)
    return mtp


def draft_head(lm_head: nn.Module, vocab: int) -> nn.Module:
    """lm_head restricted to its first `vocab` rows (a view of the same weights): the draft reads a fraction of the
    head. The whole head where it is no larger or its layout cannot be sliced by rows (torch's packed int4)."""
    if vocab >= lm_head.out_features:
        return lm_head
    if type(lm_head) is Linear:
        with torch.device("meta"):  # no random initialisation of a weight that is replaced at once
            head = Linear(lm_head.in_features, vocab).requires_grad_(False)
        head.weight = nn.Parameter(lm_head.weight.data[:vocab], requires_grad=False)
        return head
    if isinstance(lm_head, QuantLinear) and not lm_head.torch_int4 and lm_head.qweight.dim() == 2:
        zeros = None if lm_head.zeros is None else lm_head.zeros[:vocab]
        return QuantLinear(lm_head.qweight[:vocab], lm_head.scales[:vocab], lm_head.spec, lm_head.in_features, zeros)
    return lm_head
