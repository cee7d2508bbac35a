"""LoRA adapters on a model's projections: y = base(x) + scaling·(x·Aᵀ)·Bᵀ, the base frozen (bf16, fp32, int8 or int4).

An adapter in training is held per projection as its own (A [r, K], B [N, r], scaling) tensors in fp32, never
merged into the base. A wrapped projection is a `LoraLinear`, which the native decode path has no format for
(`qwenrt.native.bind` refuses it); adapters loaded for inference are served side by side by
qwenrt.served_adapters instead. Targets are named as PEFT names them: a module path inside a layer matches a target
equal to it or ending in "." + target ("q_proj", "self_attn.q_proj"). The routed MoE experts' fused banks
(gate_up_proj [E, 2I, D], down_proj [E, D, I]) are targets named with their experts module
("mlp.experts.down_proj": PEFT's target_parameters), an adapter per expert: the banks' adapters are a `LoraBank`
each, in a `LoraExperts` around the experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qwenrt.errors import QwenrtError
from qwenrt.mlp import Experts, dispatch_experts
from qwenrt.ops.linear import Linear, linear
from qwenrt.quant import QuantExperts, QuantLinear

DELTANET = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
            "linear_attn.out_proj")
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED_EXPERT = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
EXPERT_BANKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the routed experts: PEFT's target_parameters
DEFAULT_TARGETS = DELTANET + ATTENTION + DENSE_MLP + SHARED_EXPERT + EXPERT_BANKS  # those a model has: all of them
BANK_NAMES = ("gate_up_proj", "down_proj")  # an experts module's banks, in the order PEFT wraps them (first innermost)
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


class LoraBank(nn.Module):
    """The adapters of one fused expert bank [E, N, K]: lora_A [E, r, K], lora_B [E, N, r] fp32, expert e's update
    scaling·B[e]·A[e] (PEFT stores the pair as [r·E, K] and [N, r·E]: qwenrt.adapters)."""

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, trainable: bool = False):
        super().__init__()
        self.lora_A = nn.Parameter(lora_A.float(), requires_grad=trainable)
        self.lora_B = nn.Parameter(lora_B.float(), requires_grad=trainable)
        self.scaling = scaling

    def extra_repr(self) -> str:
        return f"experts={self.lora_A.shape[0]}, rank={self.lora_A.shape[1]}, scaling={self.scaling:g}"


class LoraExperts(nn.Module):
    """The routed experts (Experts or QuantExperts, frozen) with adapters on some of their banks (`banks`, by bank
    name). Each expert runs on its tokens only (mlp.dispatch_experts), its adapters' update in fp32 added to the
    base's output before rounding to its dtype, as LoraLinear's."""

    def __init__(self, base_layer: nn.Module, banks: dict[str, LoraBank]):
        super().__init__()
        self.base_layer = base_layer
        self.banks = nn.ModuleDict(banks)
        self._factors: dict | None = None  # per bank, its experts' (A_e, B_e) (during forward)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # unbound once: indexing A[e] per expert would give each a backward writing a zero [E, r, K] gradient
        self._factors = {name: (bank.lora_A.unbind(0), bank.lora_B.unbind(0)) for name, bank in self.banks.items()}
        try:
            return dispatch_experts(self.expert, x, index, weight)
        finally:
            self._factors = None

    def expert(self, e: int, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Expert e on its tokens x [n, D] -> [n, D]."""
        gate, up = self._project("gate_up_proj", e, x).chunk(2, dim=-1)
        return self._project("down_proj", e, F.silu(gate) * up)

    def _project(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's bank `name` on x [n, K] -> [n, N], plus its adapter's update."""
        bank = getattr(self.base_layer, name)
        y = bank(x, e) if isinstance(bank, QuantLinear) else linear(x, bank[e])
        if name not in self._factors:
            return y
        A, B = self._factors[name]
        delta = F.linear(F.linear(x.float(), A[e]), B[e]) * self.banks[name].scaling  # [n, N] fp32
        return (y + delta).to(y.dtype)


def projections(model: nn.Module) -> dict[str, nn.Module]:
    """The projections an adapter may wrap: every Linear / QuantLinear of a decoder layer, by module path."""
    return {path: m for path, m in model.named_modules()
            if path.startswith(LAYERS) and type(m) in (Linear, QuantLinear) and _two_dimensional(m)}


def _two_dimensional(m: nn.Module) -> bool:
    return m.qweight.dim() == 2 if isinstance(m, QuantLinear) else True


def expert_banks(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """The routed experts' banks of the decoder layers an adapter may adapt, by path ("...mlp.experts.gate_up_proj")
    -> (E, N, K)."""
    banks = {}
    for path, m in model.named_modules():
        if path.startswith(LAYERS) and type(m) in (Experts, QuantExperts):
            for bank in BANK_NAMES:
                w = getattr(m, bank)
                E, N = (w.qweight.shape[0], w.out_features) if isinstance(w, QuantLinear) else w.shape[:2]
                K = w.in_features if isinstance(w, QuantLinear) else w.shape[2]
                banks[f"{path}.{bank}"] = (E, N, K)
    return banks


def matches(path: str, target: str) -> bool:
    """PEFT's rule: the module path is the target, or ends with "." + target."""
    return path == target or path.endswith("." + target)


def kind(path: str) -> str:
    """A layer's module path without its layer: "model.layers.3.self_attn.q_proj" -> "self_attn.q_proj"."""
    return path[len(LAYERS):].partition(".")[2]


def selects(path: str, target: str, banks: dict) -> bool:
    """Whether `target` names the projection or expert bank at `path`: a bank only by a target naming its experts
    module ("mlp.experts.down_proj"; "down_proj" names the dense and shared-expert projections, as in PEFT)."""
    return matches(path, target) and (path not in banks or "experts" in target.split("."))


def resolve_targets(model: nn.Module, targets: tuple[str, ...], defaults: bool = False) -> list[str]:
    """The paths of the projections and expert banks `targets` name, the projections first, each in model order. A
    target naming nothing is an error, unless `defaults` (the default list names every kind of projection; a model
    has some of them)."""
    banks = expert_banks(model)
    available = [*projections(model), *banks]
    for target in targets:
        if not defaults and not any(selects(path, target, banks) for path in available):
            kinds = sorted({kind(path) for path in available})
            raise QwenrtError(f"LoRA target {target!r} matches no projection of this model (it has: "
                              f"{', '.join(kinds)})")
    chosen = [path for path in available if any(selects(path, t, banks) for t in targets)]
    if not chosen:
        raise QwenrtError(f"LoRA targets {', '.join(targets)} match no projection of this model")
    return chosen


def wrap(model: nn.Module, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
         dropout: float = 0.0, trainable: bool = False) -> None:
    """Put an adapter on each path of `adapters`: a projection's -> (lora_A [r, K], lora_B [N, r]), an expert
    bank's -> ([E, r, K], [E, N, r]) (trainable: its tensors require gradients; the banks take no dropout)."""
    banks = expert_banks(model)
    experts: dict[str, dict[str, LoraBank]] = {}  # an experts module's path -> its adapted banks
    for path, (A, B) in adapters.items():
        parent_path, _, name = path.rpartition(".")
        if path in banks:
            experts.setdefault(parent_path, {})[name] = LoraBank(A, B, scaling, trainable)
            continue
        parent = model.get_submodule(parent_path)
        base = getattr(parent, name)
        if isinstance(base, LoraLinear):
            raise QwenrtError(f"{path} already has an adapter")
        setattr(parent, name, LoraLinear(base, A, B, scaling, dropout, trainable))
    for path, adapted in experts.items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, LoraExperts(getattr(parent, name), adapted))


def add_adapters(model: nn.Module, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Fresh trainable adapters on the projections and expert banks `spec` targets (A as PEFT initialises it, B
    zero: the model's outputs are unchanged until B trains). Returns their paths."""
    paths = resolve_targets(model, spec.targets, defaults=spec.targets == DEFAULT_TARGETS)
    g = torch.Generator().manual_seed(seed)
    found, banks = projections(model), expert_banks(model)
    if spec.dropout and any(path in banks for path in paths):
        raise QwenrtError(f"LoRA dropout {spec.dropout:g} on the routed MoE experts (mlp.experts.*) is not "
                          "supported (PEFT's target_parameters refuse it): train them with dropout 0, or leave them "
                          "out of the targets")
    adapters = {}
    for path in paths:
        experts, N, K = ((banks[path][0],), *banks[path][1:]) if path in banks else \
            ((), found[path].out_features, found[path].in_features)
        device = device_of(model.get_submodule(path.rpartition(".")[0]) if path in banks else found[path])
        bound = 1 / math.sqrt(K)  # kaiming_uniform(a=sqrt(5)), PEFT's and nn.Linear's default
        A = torch.empty(*experts, spec.rank, K, device=device)
        if device.type != "meta":  # a plan's model (on meta) needs the shapes only
            A.copy_(torch.empty(A.shape).uniform_(-bound, bound, generator=g))
        adapters[path] = (A, torch.zeros(*experts, N, spec.rank, device=device))
    wrap(model, adapters, spec.scaling, spec.dropout, trainable=True)
    return paths


def device_of(module: nn.Module) -> torch.device:
    return next(t for t in (*module.parameters(), *module.buffers())).device


def lora_modules(model: nn.Module) -> dict[str, LoraLinear | LoraBank]:
    """The model's adapters by the path of the projection or expert bank they adapt."""
    found = {}
    for path, m in model.named_modules():
        if isinstance(m, LoraLinear):
            found[path] = m
        elif isinstance(m, LoraExperts):
            found.update({f"{path}.{name}": bank for name, bank in m.banks.items()})
    return found


def trainable_count(model: nn.Module) -> int:
    return sum(m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(model).values())
