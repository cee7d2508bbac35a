"""LoRA adapters served side by side: a model loaded with adapters {name: directory} runs each sequence with the
adapter it asked for, or none, in one batched forward; the base weights are read once for every row and each row adds
its own adapter's product, scaling·B·(A·x), in fp32 before the output's rounding (as PEFT computes it).

Adapters are numbered by slot: 0 is the base alone, 1.. the adapters in the order given. A sequence's cache holds its
slot (`SequenceState.adapter`); a forward takes each row's slot from the cache it continues (the model's default
slot without one). A wrapped projection is a `ServedLinear`; the native decode plan binds its base and adapters
(`kernels.Projection.add_adapter`), so adapted models keep their native decode path on bf16, int8 and int4 bases.
Adapters on the routed MoE experts' banks (PEFT's target_parameters) wrap the experts in a `ServedExperts`, which
the modules compute (the native MoE block has no adapters: such a model decodes through its modules).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.adapters import read_adapter
from qwenrt.errors import QwenrtError
from qwenrt.lora import device_of, projections
from qwenrt.mlp import dispatch_experts
from qwenrt.ops.linear import decode_kernels, linear
from qwenrt.quant import QuantLinear

BANKS = ("gate_up_proj", "down_proj")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}")


class AdapterSet:
    """A model's adapters: names[s - 1] is slot s; marks[s] a number derived from that adapter's weights, which the
    prefix cache keys its prompts with (0 for the base); default: the slot of rows that name none; active: the slot of
    each row (batch entry) of the forward under way, None for `default` everywhere."""

    def __init__(self, names: list[str], marks: list[int], default: int = 0):
        self.names, self.marks, self.default = names, [0, *marks], default
        self.active: list[int] | None = None

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (None: the default)."""
        if name is None:
            return self.default
        try:
            return self.names.index(name) + 1
        except ValueError:
            raise QwenrtError(f"unknown adapter {name!r:.80} (this model has: {', '.join(self.names)})",
                              "adapter") from None

    def slots(self) -> list[int]:
        """The slot of each batch entry of the forward under way (one for all where it set none)."""
        return self.active if self.active is not None else [self.default]


class ServedLinear(nn.Module):
    """A projection (Linear or QuantLinear, N x K) and the adapters some slots put on it: adapters[s] = (A [r, K],
    Bt = Bᵀ [r, N] fp32, scaling), or None."""

    def __init__(self, base_layer: nn.Module, served: AdapterSet,
                 adapters: list[tuple[torch.Tensor, torch.Tensor, float] | None]):
        super().__init__()
        self.base_layer = base_layer
        self.adapters = adapters
        self._served = [served]  # in a list: not a submodule, not a parameter

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, K] (or [B·T, K], rows in batch order) -> [..., N]: each batch entry's rows through its slot's
        adapter, y + scaling·(x·Aᵀ)·Bᵀ in fp32, rounded once to y's dtype. At decode sizes on the CPU (bf16) the
        native kernel the decode plan uses (one row at a time), else torch per batch entry: a row's result does not
        depend on the batch it runs in."""
        y = self.base_layer(x)
        slots = self._served[0].slots()
        if all(self._adapter(s) is None for s in slots):
            return y
        N, K = y.shape[-1], x.shape[-1]
        out = y.reshape(-1, N).clone()  # [B·T, N]
        x2 = x.reshape(-1, K)
        per_entry = x2.shape[0] // len(slots)
        kernels = decode_kernels(x) if x.dtype == torch.bfloat16 else None
        if kernels is not None:
            x2 = x2.contiguous()
        for s in set(slots):
            if (adapter := self._adapter(s)) is None:
                continue
            rows = [b * per_entry + t for b, slot in enumerate(slots) if slot == s for t in range(per_entry)]
            A, Bt, scaling = adapter
            if kernels is not None:
                kernels.lora_add_rows(x2, out, A, Bt, scaling, torch.tensor(rows))
                continue
            for b in (b for b, slot in enumerate(slots) if slot == s):
                part = slice(b * per_entry, (b + 1) * per_entry)
                delta = (x2[part].float() @ A.t()) @ Bt * scaling  # [T, N] fp32
                out[part] = (out[part] + delta).to(y.dtype)
        return out.view(y.shape)

    def _adapter(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        return self.adapters[slot] if slot < len(self.adapters) else None

    @staticmethod
    def decode_many(kernels, x2: torch.Tensor, modules: list[ServedLinear], mode: str) -> None:
        """No native call here (ops.linear.project): each module runs alone, its base natively where it can; the
        decode plan binds adapters natively (qwenrt.native.bind)."""
        return None

    def extra_repr(self) -> str:
        return f"adapters in slots {[s for s, a in enumerate(self.adapters) if a is not None]}"


class ServedExperts(nn.Module):
    """The routed experts (Experts or QuantExperts) and the adapters some slots put on their banks: gate_up[s],
    down[s] = (A [E, r, K], Bᵀ [E, r, N] fp32, scaling), or None. Computed through the modules (the native MoE block
    has no adapters): each expert's rows as the base computes them, plus each row's adapter product in fp32 rounded
    once, per slot."""

    def __init__(self, base_layer: nn.Module, served: AdapterSet, gate_up: list, down: list):
        super().__init__()
        self.base_layer = base_layer
        self.gate_up, self.down = gate_up, down
        self._served = [served]
        self._rows: torch.Tensor | None = None  # per input row, its slot (during forward)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        slots = self._served[0].slots()
        self._rows = torch.tensor(slots).repeat_interleave(x.shape[0] // len(slots))  # [N]
        try:
            return dispatch_experts(self.expert, x, index, weight)
        finally:
            self._rows = None

    def expert(self, e: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        gate, up = self._bank("gate_up_proj", self.gate_up, e, x, rows).chunk(2, dim=-1)
        return self._bank("down_proj", self.down, e, F.silu(gate) * up, rows)

    def _bank(self, name: str, adapters: list, e: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Expert e's projection `name` of x [n, K] (input rows `rows`), each row with its slot's adapter."""
        bank = getattr(self.base_layer, name)
        y = bank(x, e) if isinstance(bank, QuantLinear) else linear(x, bank[e])
        slots = self._rows[rows]
        for s in slots.unique().tolist():
            if s < len(adapters) and adapters[s] is not None:
                A, Bt, scaling = adapters[s]
                mine = slots == s
                y[mine] = (y[mine] + (x[mine].float() @ A[e].t()) @ Bt[e] * scaling).to(y.dtype)
        return y


def _mark(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> int:
    """A negative 62-bit number from an adapter's weights: prompts run with different adapters never share cached
    states (image marks are negative too; a collision needs equal 62-bit digests)."""
    h = hashlib.sha256(repr(scaling).encode())
    for path in sorted(adapters):
        h.update(path.encode())
        for t in adapters[path]:
            h.update(t.contiguous().numpy().tobytes())
    return -1 - (int.from_bytes(h.digest()[:8], "little") >> 2)


def attach(model: nn.Module, adapters: dict[str, str | Path], default: str | None = None) -> AdapterSet:
    """Put the adapters {name: PEFT adapter directory} on `model` for serving side by side; requests that name none
    run with `default` (None: the base alone). Every adapter is read and checked before the model changes."""
    if getattr(model, "served_adapters", None) is not None:
        raise QwenrtError("this model already serves adapters; load it again to serve others")
    if not isinstance(adapters, dict) or not adapters:
        raise QwenrtError("adapters must be a dict {name: adapter directory} with at least one entry")
    for name in adapters:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise QwenrtError(f"adapter name {name!r:.80} must be 1-128 letters, digits or . _ / : - (starting with "
                              "a letter or digit)")
    read = {name: read_adapter(directory, model) for name, directory in adapters.items()}  # spec, {path: (A, B)}
    served = AdapterSet(list(read), [_mark(pairs, spec.scaling) for spec, pairs in read.values()])
    paths = {p for _, pairs in read.values() for p in pairs}
    found = projections(model)
    for path in (p for p in found if p in paths):
        base = found[path]
        setattr(model.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2],
                ServedLinear(base, served, _slots(read, path, device_of(base))))
    for path in sorted({p.rpartition(".")[0] for p in paths - found.keys()}):  # the routed experts' modules
        experts = model.get_submodule(path)
        device = device_of(experts)
        setattr(model.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2],
                ServedExperts(experts, served, *(_slots(read, f"{path}.{bank}", device) for bank in BANKS)))
    served.default = served.slot(default) if default is not None else 0
    model.served_adapters = served
    return served


def _slots(read: dict, path: str, device) -> list[tuple[torch.Tensor, torch.Tensor, float] | None]:
    """Per slot, the adapter on `path` as (A, Bᵀ, scaling) (a bank's: [E, r, K], [E, r, N]), None in slot 0 and
    where an adapter leaves it."""
    return [None] + [(pairs[path][0].to(device), pairs[path][1].transpose(-1, -2).contiguous().to(device),
                      spec.scaling) if path in pairs else None for spec, pairs in read.values()]


def served_modules(model: nn.Module) -> dict[str, ServedLinear]:
    """The model's adapted projections by path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, ServedLinear)}


def prefix_key(key: list[int], served: AdapterSet | None, slot: int) -> list[int]:
    """A prompt's prefix-cache key for a sequence run with adapter `slot`: its first entry replaced by one derived
    from the adapter's mark and that entry, so prompts of different adapters share no cached prefix."""
    if served is None or slot == 0 or not key:
        return key
    mixed = hashlib.sha256(f"{served.marks[slot]}:{key[0]}".encode()).digest()
    return [-1 - (int.from_bytes(mixed[:8], "little") >> 2), *key[1:]]
