"""Qwen3.5's multi-token-prediction (MTP) head, checkpoint prefix `mtp.` (shared/reference.md §5.7).

From the main model's final-normed hidden state h_t and the embedding of token t+1 it predicts token t+2 through
the main model's embedding and lm_head: e = norm_e(embed(x_{t+1})), z = fc([e ; norm_h(h_t)]), one full-attention
decoder layer at position t, a final norm, lm_head.
"""

from __future__ import annotations

import torch
from torch import nn

from qwenrt.checkpoint import open_checkpoint
from qwenrt.config import TextConfig
from qwenrt.errors import QwenrtError
from qwenrt.model import DecoderLayer, RMSNorm
from qwenrt.ops.linear import Linear

PREFIX = "mtp."


class MTPHead(nn.Module):
    """One MTP layer; attribute names are the checkpoint's (after `mtp.`)."""

    def __init__(self, c: TextConfig):
        super().__init__()
        self.fc = Linear(2 * c.hidden_size, c.hidden_size)
        self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(c, 0, layer_type="full_attention")])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D] (h_t, final-normed), next_embeds [B, T, D] (embeddings of x_{t+1}), cos, sin
        [B, T, R] of positions t -> the normed output [B, T, D]; lm_head of it predicts x_{t+2}. Causal over T."""
        z = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, delta = self.layers[0](z, None, cos, sin, None)
        return self.norm.add_forward(x, delta)[1]


def mtp_hidden(model, mtp: MTPHead, input_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The MTP head over whole sequences input_ids [B, T] -> [B, T-1, D]; lm_head of row t predicts
    input_ids[:, t+2]. `hidden`: the model's final-normed hidden states [B, T, D] when already computed."""
    if hidden is None:
        hidden = model.hidden_states(input_ids)
    B, T = input_ids.shape
    cos, sin = model.rotary(torch.arange(T - 1, device=hidden.device)[None].expand(B, T - 1), hidden.dtype)
    return mtp(hidden[:, :-1], model.model.embed_tokens(input_ids[:, 1:]), cos, sin)


def mtp_state_dict(mtp: MTPHead) -> dict[str, torch.Tensor]:
    """The head's tensors under their checkpoint names (`mtp.fc.weight`, ...)."""
    return {PREFIX + name: t for name, t in mtp.state_dict().items()}


def load_mtp_head(model, dtype: torch.dtype | None = None) -> MTPHead:
    """The MTP head stored beside a model loaded with `qwenrt.load` (its `mtp.*` tensors), in `dtype` (default: the
    model's; norms in fp32 as in the decoder). Raises QwenrtError when the checkpoint has none or it is incomplete."""
    from qwenrt.loader import check_tensors

    path = getattr(model, "checkpoint_path", None)
    if path is None:
        raise QwenrtError("the model was not loaded from a checkpoint directory: no MTP head to load")
    ckpt = open_checkpoint(path)
    names = ckpt.names(PREFIX)
    if not names:
        raise QwenrtError(f"{path}: the checkpoint has no MTP head (no mtp.* tensors)")
    with torch.device("meta"):
        mtp = MTPHead(model.config.text)
    expected = {PREFIX + n: tuple(p.shape) for n, p in mtp.named_parameters()}
    check_tensors(path, "MTP head does not match its config", expected, {n: ckpt.shapes[n] for n in names})
    dtype = dtype or model.dtype
    state = {n[len(PREFIX):]: ckpt.get(n).to(torch.float32 if "norm" in n else dtype) for n in names}
    mtp.load_state_dict(state, assign=True)
    return mtp.requires_grad_(False).eval()
