"""HybridCache: the per-sequence decoding state of a Qwen3.5 decoder.

Full-attention layers keep keys/values [B, Hkv, S, Dh] (S grows by doubling); DeltaNet layers keep the last K-1
conv inputs [B, C, K-1] and the recurrent state [B, Hv, Dk, Dv], both fp32, fixed size whatever the context length.
Sequences in a batch may hold different lengths (`lengths`, kept on the host so no step needs a device sync).
"""

from __future__ import annotations

import torch

from qwenrt.config import TextConfig


class HybridCache:
    def __init__(self, config: TextConfig, batch_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 capacity: int = 256):
        self.config = config
        self.batch_size = batch_size
        self.lengths = [0] * batch_size  # tokens held per sequence
        self.rope_deltas = [0] * batch_size  # M-RoPE position offset after vision tokens
        c = config
        n = c.num_hidden_layers
        self.keys: list[torch.Tensor | None] = [None] * n
        self.values: list[torch.Tensor | None] = [None] * n
        self.conv: list[torch.Tensor | None] = [None] * n
        self.recurrent: list[torch.Tensor | None] = [None] * n
        for i in c.full_attention_layers:
            shape = (batch_size, c.num_key_value_heads, capacity, c.head_dim)
            self.keys[i] = torch.zeros(shape, dtype=dtype, device=device)
            self.values[i] = torch.zeros(shape, dtype=dtype, device=device)
        for i in c.linear_attention_layers:
            # conv inputs are rounded to the compute dtype already; fp32 storage lets the fused kernel update in place
            self.conv[i] = torch.zeros(batch_size, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=torch.float32,
                                       device=device)
            self.recurrent[i] = torch.zeros(batch_size, c.linear_num_value_heads, c.linear_key_head_dim,
                                            c.linear_value_head_dim, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        first = self.config.full_attention_layers
        return self.keys[first[0]].shape[2] if first else 1 << 62

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def reserve(self, length: int) -> None:
        """Make room for `length` tokens per sequence (doubling, so growth costs amortised O(1) per token)."""
        if length <= self.capacity:
            return
        new = self.capacity
        while new < length:
            new *= 2
        for i in self.config.full_attention_layers:
            for store in (self.keys, self.values):
                old = store[i]
                grown = old.new_zeros(old.shape[0], old.shape[1], new, old.shape[3])
                grown[:, :, : old.shape[2]] = old
                store[i] = grown

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v [B, Hkv, T, Dh] after each sequence's tokens; return the stores' used prefix [B, Hkv, S, Dh].

        The caller has already called `reserve` for this step and advances `lengths` after the forward.
        """
        T = k.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            keys[:, :, start:start + T] = k
            values[:, :, start:start + T] = v
        else:
            for b, start in enumerate(self.lengths):  # ragged batch: one slice per sequence
                keys[b, :, start:start + T] = k[b]
                values[b, :, start:start + T] = v[b]
        end = self.max_length + T
        return keys[:, :, :end], values[:, :, :end]

    def lengths_tensor(self, device) -> torch.Tensor:
        """`lengths` as an int64 tensor [B] on `device`, rebuilt only when they change (once per step)."""
        key = (tuple(self.lengths), str(device))
        if getattr(self, "_lengths_key", None) != key:
            self._lengths_tensor = torch.tensor(self.lengths, dtype=torch.int64, device=device)
            self._lengths_key = key
        return self._lengths_tensor

    def attention_mask(self, T: int, device) -> torch.Tensor | None:
        """Boolean [B, 1, T, S] (True = attend) for T new tokens per sequence, or None when no mask is needed."""
        S = self.max_length + T
        if len(set(self.lengths)) == 1 and T == 1:
            return None
        starts = torch.tensor(self.lengths, device=device)[:, None, None]  # [B, 1, 1]
        query = torch.arange(T, device=device)[None, :, None]  # [1, T, 1]
        key = torch.arange(S, device=device)[None, None, :]  # [1, 1, S]
        # a sequence's own new tokens sit at [start, start+T); anything past them in a ragged batch is stale
        return (key <= starts + query)[:, None]

    def advance(self, T: int) -> None:
        self.lengths = [n + T for n in self.lengths]

    def _stores(self):
        return (self.keys, self.values, self.conv, self.recurrent)

    def set_row(self, b: int, other: HybridCache) -> None:
        """Copy the single sequence held by `other` (batch 1, e.g. prefilled alone) into row b."""
        n = other.lengths[0]
        self.reserve(n)
        for mine, theirs in zip(self._stores(), other._stores()):
            for i, t in enumerate(theirs):
                if t is None:
                    continue
                if mine is self.keys or mine is self.values:  # KV: only the filled prefix
                    mine[i][b, :, :n] = t[0, :, :n]
                else:
                    mine[i][b] = t[0]
        self.lengths[b] = n
        self.rope_deltas[b] = other.rope_deltas[0]

    def select_rows(self, rows: list[int]) -> None:
        """Keep only the sequences in `rows` (in that order), e.g. to drop finished ones from a batch."""
        index = torch.tensor(rows, device=next(t for s in self._stores() for t in s if t is not None).device)
        for store in self._stores():
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, index)
        self.lengths = [self.lengths[r] for r in rows]
        self.rope_deltas = [self.rope_deltas[r] for r in rows]
        self.batch_size = len(rows)
