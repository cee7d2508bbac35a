"""Decoding state of a Qwen3.5 decoder: one `SequenceState` per sequence, a `HybridCache` batch of them per call.

Full-attention layers keep keys/values [1, Hkv, capacity, Dh] per sequence (grown by a quarter, up to the
sequence's limit), in the model's dtype or 8-bit: int8 rows [1, Hkv, capacity, Dh + 4], each token's Dh values per
head then their fp32 scale in the last 4 bytes (qwenrt/kernels/kv_int8.h reads and writes the same). DeltaNet layers
keep the last K-1 conv inputs [1, C, K-1] and the recurrent state [1, Hv, Dk, Dv], both fp32, fixed size whatever
the context length. Each sequence owns its tensors, so sequences of different lengths join and leave a batch without
copying anyone else's state.
"""

from __future__ import annotations

import torch

from qwenrt.config import TextConfig
from qwenrt.errors import QwenrtError


SCALE_BYTES = 4  # an 8-bit row's fp32 scale
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8}  # --kv-cache-dtype: auto = the model's dtype


def kv_row_size(config: TextConfig, dtype: torch.dtype) -> int:
    """Elements of one token's row per KV head in a store of `dtype`: Dh, or Dh + 4 for 8-bit rows."""
    return config.head_dim + (SCALE_BYTES if dtype == torch.int8 else 0)


def kv_bytes_per_token(config: TextConfig, dtype: torch.dtype) -> int:
    """Bytes of keys + values one token adds to a sequence (full-attention layers only)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * len(config.full_attention_layers) * config.num_key_value_heads * kv_row_size(config, dtype) * itemsize


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., Dh] -> 8-bit rows int8 [..., Dh + 4]: scale = max|x| / 127 per row (fp32, in the last 4 bytes),
    values round(x / scale), half to even; a zero row has scale 0."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127  # [..., 1]
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize_kv(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """8-bit rows int8 [..., Dh + 4] -> [..., Dh] of dtype (values × scale in fp32, then rounded to dtype)."""
    scale = q[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return (q[..., :-SCALE_BYTES].float() * scale).to(dtype)


def parse_kv_cache_dtype(name: str | None) -> torch.dtype | None:
    """--kv-cache-dtype's value -> the store dtype (None: the model's)."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise QwenrtError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def deltanet_state_bytes(config: TextConfig) -> int:
    """Bytes of one sequence's DeltaNet conv + recurrent state (fp32), whatever its length."""
    c = config
    per_layer = c.conv_dim * (c.linear_conv_kernel_dim - 1) + (
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)
    return 4 * per_layer * len(c.linear_attention_layers)


class SequenceState:
    """The cache of one sequence: `length` tokens seen, M-RoPE offset `rope_delta`, per-layer stores.

    `limit` caps the KV capacity (the most tokens this sequence may hold); None grows without bound. `kv_dtype`:
    the stores' dtype, `dtype` (the model's) by default, or torch.int8 for 8-bit rows.
    """

    def __init__(self, config: TextConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 capacity: int = 256, limit: int | None = None, kv_dtype: torch.dtype | None = None):
        self.config, self.limit, self.dtype, self.kv_dtype = config, limit, dtype, kv_dtype or dtype
        self.length = 0  # tokens held
        self.rope_delta = 0  # decode position = length + rope_delta (non-zero after vision tokens)
        self.adapter = 0  # the slot of the LoRA adapter its tokens run with (qwenrt.served_adapters; 0: none)
        c = config
        n = c.num_hidden_layers
        self.keys: list[torch.Tensor | None] = [None] * n
        self.values: list[torch.Tensor | None] = [None] * n
        self.conv: list[torch.Tensor | None] = [None] * n
        self.recurrent: list[torch.Tensor | None] = [None] * n
        capacity = max(1, min(capacity, limit) if limit else capacity)
        for i in c.full_attention_layers:
            shape = (1, c.num_key_value_heads, capacity, kv_row_size(c, self.kv_dtype))
            self.keys[i] = torch.zeros(shape, dtype=self.kv_dtype, device=device)
            self.values[i] = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        for i in c.linear_attention_layers:
            # conv inputs are rounded to the compute dtype already; fp32 storage lets the fused kernel update in place
            self.conv[i] = torch.zeros(1, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=torch.float32, device=device)
            self.recurrent[i] = torch.zeros(1, c.linear_num_value_heads, c.linear_key_head_dim,
                                            c.linear_value_head_dim, dtype=torch.float32, device=device)
        self._length_tensor = torch.zeros(1, dtype=torch.int64, device=device)
        self._length_filled = 0  # the value in _length_tensor

    @property
    def capacity(self) -> int:
        first = self.config.full_attention_layers
        return self.keys[first[0]].shape[2] if first else 1 << 62

    @property
    def nbytes(self) -> int:
        """Bytes held now (KV at its current capacity + DeltaNet state)."""
        return sum(t.numel() * t.element_size() for s in self._stores() for t in s if t is not None)

    def reserve(self, length: int) -> None:
        """Make room for `length` tokens, at most `limit`: the capacity grows by a quarter (to `length` if more; 256
        at least), amortised O(1) copies per token, so it stays under 1.25 × length and the peak while growing
        (the new stores + the one old store being copied) under that + one layer's store. Doubling held up to twice
        the KV (a 262K-token sequence of the 0.8B: 6 GiB for its 3 GiB of keys and values)."""
        if length <= self.capacity:
            return
        if self.limit is not None and length > self.limit:
            raise ValueError(f"sequence limit of {self.limit} tokens exceeded ({length})")  # an engine bug, not input
        new = max(length, self.capacity + self.capacity // 4, 256)
        if self.limit is not None:
            new = min(new, self.limit)
        for i in self.config.full_attention_layers:
            for store in (self.keys, self.values):
                old = store[i]
                grown = old.new_zeros(1, old.shape[1], new, old.shape[3])
                grown[:, :, : self.length] = old[:, :, : self.length]
                store[i] = grown

    @property
    def quantized_kv(self) -> bool:
        """The KV stores hold 8-bit rows."""
        return self.kv_dtype == torch.int8

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [1, Hkv, T, Dh] after this sequence's tokens (quantized in an 8-bit store); the caller has
        reserved room and advances `length` after the forward."""
        end = self.length + k.shape[2]
        if self.quantized_kv:
            k, v = quantize_kv(k), quantize_kv(v)
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v

    def kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [0, end) in the model's dtype, [1, Hkv, end, Dh]: views of the stores, or
        dequantized copies of 8-bit ones."""
        k, v = self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        if self.quantized_kv:
            return dequantize_kv(k, self.dtype), dequantize_kv(v, self.dtype)
        return k, v

    def length_tensor(self) -> torch.Tensor:
        """`length` as an int64 tensor [1] for the native attention step (one reused tensor)."""
        if self._length_filled != self.length:
            self._length_tensor.fill_(self.length)
            self._length_filled = self.length
        return self._length_tensor

    def _stores(self):
        return (self.keys, self.values, self.conv, self.recurrent)


class HybridCache:
    """The B sequences one forward call continues, row b = sequences[b]."""

    def __init__(self, sequences: list[SequenceState]):
        self.sequences = sequences

    @property
    def batch_size(self) -> int:
        return len(self.sequences)

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.sequences]

    def positions(self, T: int, device) -> torch.Tensor:
        """[B, T] text positions continuing each sequence (plus its M-RoPE offset after vision tokens)."""
        starts = torch.tensor([s.length + s.rope_delta for s in self.sequences], device=device)
        return starts[:, None] + torch.arange(T, device=device)

    def reserve(self, T: int) -> None:
        """Room for T more tokens in every sequence."""
        for s in self.sequences:
            s.reserve(s.length + T)

    def advance(self, T: int) -> None:
        for s in self.sequences:
            s.length += T

    def deltanet_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, C, K-1], recurrent [B, Hv, Dk, Dv]) of a DeltaNet layer: the sequence's own tensors when B = 1
        (updated in place by the native step), stacked copies otherwise (see set_deltanet_state)."""
        if len(self.sequences) == 1:
            s = self.sequences[0]
            return s.conv[layer], s.recurrent[layer]
        return (torch.cat([s.conv[layer] for s in self.sequences]),
                torch.cat([s.recurrent[layer] for s in self.sequences]))

    def set_deltanet_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep a layer's new state (conv [B, C, K-1], recurrent [B, Hv, Dk, Dv])."""
        if len(self.sequences) == 1:
            s = self.sequences[0]
            s.conv[layer], s.recurrent[layer] = conv, recurrent
            return
        for b, s in enumerate(self.sequences):
            s.conv[layer].copy_(conv[b:b + 1])
            s.recurrent[layer].copy_(recurrent[b:b + 1])
