"""Modules as the native kernels' bound objects: projections sharing an input as one `kernels.Projection`, an expert
bank's projection as a `kernels.ExpertBank`, kept per owner until its weights may have changed.

A bound object holds the weights' tensors (views, no copies). It is rebuilt after any module, parameter or buffer is
registered anywhere in the process (quantization swaps modules in, load_state_dict(assign=True) replaces
parameters) or the owner's dtype changes.
"""

from __future__ import annotations

import weakref
from itertools import groupby

import torch
from torch import nn

from qwenrt.kernels import cpu_kernels
from qwenrt.ops.linear import Linear
from qwenrt.quant import QuantLinear
from qwenrt.served_adapters import ServedLinear

_generation = [0]  # bumped by every module / parameter / buffer registration
_bound = weakref.WeakKeyDictionary()  # owner -> {what: ((generation, dtype), object)}; not in the owner: it pickles


def _registered(*_args) -> None:
    _generation[0] += 1


for _hook in (nn.modules.module.register_module_module_registration_hook,
              nn.modules.module.register_module_parameter_registration_hook,
              nn.modules.module.register_module_buffer_registration_hook):
    _hook(_registered)


def cached(owner: nn.Module, what, dtype: torch.dtype, build):
    """build(kernels) for `owner`, kept per `what` until a registration or a change of `dtype` (the owner's); None
    without the native kernels."""
    kernels = cpu_kernels()
    if kernels is None:
        return None
    key = (_generation[0], dtype)
    bound = _bound.setdefault(owner, {})
    entry = bound.get(what)
    if entry is None or entry[0] != key:
        entry = bound[what] = (key, build(kernels))
    return entry[1]


def gemv_format(module: nn.Module, experts: bool = False) -> tuple | None:
    """What a GEMV call takes `module` as: ("bf16", None), ("q8" | "q4" | "q8g" | "q4g" | "q4k", its QuantSpec);
    None where none does. experts: a QuantLinear over E experts (a 3-D weight)."""
    if type(module) is Linear and module.weight.dtype == torch.bfloat16:
        return "bf16", None
    if type(module) is QuantLinear and module.qweight.dim() == 2 + experts and not module.torch_int4:
        return module.spec.kernel_format, module.spec
    return None


def _bind_run(kernels, fmt: tuple, modules: list[nn.Module]):
    """Modules of one format (`gemv_format`) as one `kernels.Projection`."""
    kind, spec = fmt
    if kind == "bf16":
        return kernels.Projection("bf16", [m.weight for m in modules], [], [], 0)
    qs, scales = [m.qweight for m in modules], [m.scales for m in modules]
    zeros = [m.zeros for m in modules if m.zeros is not None]
    return kernels.Projection(kind, qs, scales, zeros, spec.group_size or 0)


def bind(kernels, modules: list[nn.Module], one_format: bool = False, adapters: bool = False):
    """The projections as one native call, a `kernels.Projection`: (x [B, K], mode) -> [B, N_i] per module, a GEMV
    per run of one format (int4 keeps the projections its layout cannot hold in bf16); None where one has none, or
    where they are of several formats and `one_format` (the SwiGLU GEMV takes gate and up in one format).
    adapters: a served adapter's projection (qwenrt.served_adapters.ServedLinear) binds as its base with its
    adapters (the caller passes each row's slot); otherwise it has no native call."""
    bases = [m.base_layer if adapters and isinstance(m, ServedLinear) else m for m in modules]
    formats = [gemv_format(m) for m in bases]
    if None in formats:
        return None
    runs = [(fmt, [m for _, m in run]) for fmt, run in groupby(zip(formats, bases), key=lambda pair: pair[0])]
    if len(runs) > 1 and one_format:
        return None
    parts = [_bind_run(kernels, fmt, run) for fmt, run in runs]
    projection = parts[0] if len(parts) == 1 else kernels.Projection(parts)
    for output, m in enumerate(modules):
        if m is not bases[output]:
            for slot, adapter in enumerate(m.adapters):
                if adapter is not None:
                    projection.add_adapter(output, slot, *adapter)
    return projection


def expert_bank(kernels, weight: nn.Module | torch.Tensor):
    """One projection of an expert bank as a `kernels.ExpertBank`: a bf16 weight [E, N, K] or a QuantLinear over E
    experts; None where the kernels have no format for it."""
    if isinstance(weight, torch.Tensor):
        return kernels.ExpertBank("bf16", weight, None, None, 0) if weight.dtype == torch.bfloat16 else None
    fmt = gemv_format(weight, experts=True)
    if fmt is None:
        return None
    return kernels.ExpertBank(fmt[0], weight.qweight, weight.scales, weight.zeros, fmt[1].group_size or 0)
