"""LoRA adapters on a model's projections: y = base(x) + scaling·(x·Aᵀ)·Bᵀ, the base frozen (bf16, fp32, int8 or int4).

An adapter in training is held per projection as its own (A [r, K], B [N, r], scaling) tensors in fp32, never
merged into the base. A wrapped projection is a `LoraLinear`, which the native decode path has no format for
(`qwenrt.native.bind` refuses it); adapters loaded for inference are served side by side by
qwenrt.served_adapters instead. Targets are named as PEFT names them: a module path inside a layer matches a target
equal to it or ending in "." + target ("q_proj", "self_attn.q_proj").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.errors import QwenrtError
from qwenrt.ops.linear import Linear
from qwenrt.quant import QuantLinear

DELTANET = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
            "linear_attn.out_proj")
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED_EXPERT = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
DEFAULT_TARGETS = DELTANET + ATTENTION + DENSE_MLP + SHARED_EXPERT  # those a model has: every projection
LAYERS = "model.layers."


@dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha (scaling alpha / r, or alpha / sqrt(r) with rslora), the target names, dropout in training."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise QwenrtError(f"LoRA rank must be an integer >= 1, got {self.rank!r:.40}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise QwenrtError(f"LoRA alpha must be a number > 0, got {self.alpha!r:.40}")
        if not 0 <= self.dropout < 1:
            raise QwenrtError(f"LoRA dropout must be in [0, 1), got {self.dropout!r:.40}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise QwenrtError(f"LoRA targets must be module names, got {self.targets!r:.80}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoraLinear(nn.Module):
    """A frozen projection (Linear or QuantLinear, N x K) plus a low-rank update: lora_A [r, K], lora_B [N, r] fp32.
    The update runs in fp32 and is added to the base's output before rounding to its dtype (as PEFT does)."""

    def __init__(self, base_layer: nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                 dropout: float = 0.0, trainable: bool = False):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Parameter(lora_A.float(), requires_grad=trainable)
        self.lora_B = nn.Parameter(lora_B.float(), requires_grad=trainable)
        self.scaling = scaling
        self.dropout = dropout

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        delta = F.linear(F.linear(h.float(), self.lora_A), self.lora_B) * self.scaling  # [..., N] fp32
        return (y + delta).to(y.dtype)

    @staticmethod
    def decode_many(kernels, x2: torch.Tensor, modules: list[LoraLinear], mode: str) -> None:
        """No native call (ops.linear.project): each module runs alone, its base natively where it can."""
        return None

    def delta_weight(self) -> torch.Tensor:
        """scaling·B·A [N, K] fp32: what merging adds to the base weight."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def projections(model: nn.Module) -> dict[str, nn.Module]:
    """The projections an adapter may wrap: every Linear / QuantLinear of a decoder layer, by module path."""
    return {path: m for path, m in model.named_modules()
            if path.startswith(LAYERS) and type(m) in (Linear, QuantLinear) and _two_dimensional(m)}


def _two_dimensional(m: nn.Module) -> bool:
    return m.qweight.dim() == 2 if isinstance(m, QuantLinear) else True


def matches(path: str, target: str) -> bool:
    """PEFT's rule: the module path is the target, or ends with "." + target."""
    return path == target or path.endswith("." + target)


def kind(path: str) -> str:
    """A layer's module path without its layer: "model.layers.3.self_attn.q_proj" -> "self_attn.q_proj"."""
    return path[len(LAYERS):].partition(".")[2]


def resolve_targets(model: nn.Module, targets: tuple[str, ...], defaults: bool = False) -> list[str]:
    """The paths of the projections `targets` name, in model order. A target naming nothing is an error, unless
    `defaults` (the default list names every kind of projection; a model has some of them). Routed MoE experts are
    refused: training their adapters (PEFT's target_parameters) is not supported yet."""
    available = projections(model)
    for target in targets:
        if "experts" in target.split("."):
            raise QwenrtError(f"LoRA target {target!r}: training adapters on the routed MoE experts (mlp.experts.*) "
                              "is not supported yet (PEFT's, on target_parameters, load, serve and merge); the shared "
                              "expert (mlp.shared_expert.*) and every other projection train")
        if not defaults and not any(matches(path, target) for path in available):
            kinds = sorted({kind(path) for path in available})
            raise QwenrtError(f"LoRA target {target!r} matches no projection of this model (it has: "
                              f"{', '.join(kinds)})")
    chosen = [path for path in available if any(matches(path, t) for t in targets)]
    if not chosen:
        raise QwenrtError(f"LoRA targets {', '.join(targets)} match no projection of this model")
    return chosen


def wrap(model: nn.Module, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
         dropout: float = 0.0, trainable: bool = False) -> None:
    """Put an adapter on each projection path -> (lora_A [r, K], lora_B [N, r]) of `adapters` (trainable: its
    tensors require gradients)."""
    for path, (A, B) in adapters.items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        base = getattr(parent, name)
        if isinstance(base, LoraLinear):
            raise QwenrtError(f"{path} already has an adapter")
        setattr(parent, name, LoraLinear(base, A, B, scaling, dropout, trainable))


def add_adapters(model: nn.Module, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Fresh trainable adapters on the projections `spec` targets (A as PEFT initialises it, B zero: the model's
    outputs are unchanged until B trains). Returns their paths."""
    paths = resolve_targets(model, spec.targets, defaults=spec.targets == DEFAULT_TARGETS)
    g = torch.Generator().manual_seed(seed)
    found = projections(model)
    adapters = {}
    for path in paths:
        base = found[path]
        bound = 1 / math.sqrt(base.in_features)  # kaiming_uniform(a=sqrt(5)), PEFT's and nn.Linear's default
        A = torch.empty(spec.rank, base.in_features).uniform_(-bound, bound, generator=g)
        adapters[path] = (A.to(device_of(base)), torch.zeros(base.out_features, spec.rank, device=device_of(base)))
    wrap(model, adapters, spec.scaling, spec.dropout, trainable=True)
    return paths


def device_of(module: nn.Module) -> torch.device:
    return next(t for t in (*module.parameters(), *module.buffers())).device


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """The model's adapters by the path of the projection they wrap."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoraLinear)}


def trainable_count(model: nn.Module) -> int:
    return sum(m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(model).values())
