"""Model configuration from a checkpoint's config.json: HF field names, derived sizes, contract checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from qwenrt.errors import QwenrtError
from qwenrt.families import qwen3_next
from qwenrt.fields import Fields
from qwenrt.files import CheckpointDir

TEXT_MODEL_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True, qwen3_next.MODEL_TYPE: True,  # -> is MoE
                    "qwen3_vl_text": False, "qwen3_vl_moe_text": True}
QWEN3_5 = "Qwen3.5"
QWEN3_NEXT = "Qwen3-Next"
QWEN3_VL = "Qwen3-VL"  # Qwen3 layers: all full attention, no output gate, w·x norms (qwenrt.families.qwen3_vl)
FAMILIES = {"qwen3_5_text": QWEN3_5, "qwen3_5_moe_text": QWEN3_5, qwen3_next.MODEL_TYPE: QWEN3_NEXT,
            "qwen3_vl_text": QWEN3_VL, "qwen3_vl_moe_text": QWEN3_VL}
VLM_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",  # outer -> text sub-config type
                   "qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
LAYER_TYPES = ("linear_attention", "full_attention")
DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' default when config.json gives none
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
YARN_KEYS = {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"}


@dataclass(frozen=True)
class Yarn:
    """Static YaRN RoPE scaling (transformers' `_compute_yarn_parameters`): frequencies interpolated by `factor`
    below the wavelengths set by beta_fast/beta_slow rotations over the original context, and cos/sin scaled by
    attention_factor."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    @property
    def context_limit(self) -> int:
        return int(self.factor * self.original_max_position_embeddings)

    def rope_parameters(self) -> dict:
        """The rope_parameters keys that give this scaling (config.json)."""
        return {"rope_type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "truncate": self.truncate}

    def describe(self) -> str:
        return (f"YaRN x{self.factor:g} of {self.original_max_position_embeddings} tokens (attention factor "
                f"{self.attention_factor:.4f}, beta {self.beta_fast:g}/{self.beta_slow:g})")


@dataclass(frozen=True)
class TextConfig:
    """The text decoder's hyper-parameters (HF names) plus derived sizes."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = DEFAULT_MROPE_SECTION
    mrope_interleaved: bool = True
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    intermediate_size: int = 0  # dense MLP (0 for a MoE model without dense layers)
    num_experts: int = 0  # 0 for dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True  # the top-A router weights renormalised to sum to 1
    decoder_sparse_step: int = 1  # MoE models: layer i is MoE iff (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    yarn: Yarn | None = None  # rope_type "yarn"; None: plain RoPE

    @property
    def context_limit(self) -> int:
        """Tokens a sequence may hold: max_position_embeddings, or factor x the original context with YaRN."""
        return self.yarn.context_limit if self.yarn is not None else self.max_position_embeddings

    @property
    def attention_gate(self) -> bool:
        """Whether q_proj emits a sigmoid output gate beside each head's query (Qwen3-VL's does not)."""
        return self.family != QWEN3_VL

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> str:
        """The model family, by name: "Qwen3.5", "Qwen3-Next", "Qwen3-VL"."""
        return FAMILIES[self.model_type]

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has the sparse MoE block (else a dense MLP of intermediate_size)."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """C = 2·Hk·Dk + Hv·Dv: the DeltaNet q|k|v channels that go through the causal conv."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint's config: the text decoder plus what the VLM wrapper adds."""

    model_type: str
    text: TextConfig
    vision: dict | None = None  # raw vision_config; the vision tower parses it
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    eos_token_id: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_vlm(self) -> bool:
        return self.vision is not None


# Bounds well past every published Qwen3.5 shape: a config beyond them is refused before anything is built.
MAX_LAYERS = 1024
MAX_DIM = 1 << 16  # hidden size, intermediate sizes, head dims
MAX_HEADS = 1024
MAX_VOCAB = 1 << 22
MAX_EXPERTS = 4096
MAX_POSITIONS = 1 << 24


def _rope_fields(f: Fields, max_positions: int, vl: bool = False) -> dict:
    """rope_parameters (transformers 5) or the older flat rope_theta / partial_rotary_factor / rope_scaling keys.
    Qwen3-VL (vl): rotary over the whole head, sections (24, 20, 20) unless given, always interleaved."""
    flat = {k: f.d[k] for k in ("rope_theta", "partial_rotary_factor", "mrope_section") if k in f.d}
    params = Fields({**flat, **f.obj("rope_scaling", {}).d, **f.obj("rope_parameters", {}).d},
                    f"{f.where} rope_parameters")
    rope_type = params.d.get("rope_type", params.d.get("type", "default"))
    if rope_type not in ("default", "mrope", "yarn"):
        raise QwenrtError(f"{f.where}: rope_type {rope_type!r} is not supported (supported: default, yarn)")
    yarn = parse_yarn(params, max_positions) if rope_type == "yarn" else None
    if vl:
        return {"rope_theta": params.float("rope_theta", 500_000.0, lo=0.0, open_low=True),
                "partial_rotary_factor": 1.0, "mrope_interleaved": True, "yarn": yarn,
                "mrope_section": params.ints("mrope_section", (24, 20, 20), lo=0, hi=MAX_DIM, max_len=8)}
    return {
        "rope_theta": params.float("rope_theta", 10_000_000.0, lo=0.0, open_low=True),
        "partial_rotary_factor": params.float("partial_rotary_factor", 0.25, lo=0.0, hi=1.0, open_low=True),
        "mrope_section": params.ints("mrope_section", None, lo=0, hi=MAX_DIM, max_len=8),
        "mrope_interleaved": params.bool("mrope_interleaved", True),
        "yarn": yarn,
    }


def parse_yarn(params: Fields, max_position_embeddings) -> Yarn:
    """YaRN's fields as transformers 5.23 reads them: original_max_position_embeddings defaults to
    max_position_embeddings, a missing (or 0) beta to 32 / 1, attention_factor to 0.1·ln(factor) + 1 (or the mscale
    ratio when mscale and mscale_all_dim are both given). Unknown keys are refused (a misspelt one would be ignored)."""
    unknown = sorted(set(params.d) - ROPE_KEYS - YARN_KEYS)
    if unknown:
        raise QwenrtError(f"{params.where}: unknown YaRN key(s) {unknown} (known: {', '.join(sorted(YARN_KEYS))})")
    factor = params.float("factor", lo=1.0, hi=MAX_POSITIONS, open_low=True)
    original = params.int("original_max_position_embeddings", max_position_embeddings, hi=MAX_POSITIONS)
    if factor * original > MAX_POSITIONS:
        raise QwenrtError(f"{params.where}: YaRN factor x original_max_position_embeddings = {factor * original:g} "
                          f"exceeds {MAX_POSITIONS} positions")
    mscale, mscale_all_dim = (params.float(k, None, lo=0.0) for k in ("mscale", "mscale_all_dim"))
    attention_factor = params.float("attention_factor", None, lo=0.0, open_low=True)
    if attention_factor is None:
        attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                            else _mscale(factor))
    beta_fast = params.float("beta_fast", None, lo=0.0) or 32.0  # `or`: transformers takes 0 as the default too
    beta_slow = params.float("beta_slow", None, lo=0.0) or 1.0
    if beta_fast < beta_slow:
        raise QwenrtError(f"{params.where}: YaRN beta_fast ({beta_fast:g}) must be >= beta_slow ({beta_slow:g})")
    return Yarn(factor, original, attention_factor, beta_fast, beta_slow, params.bool("truncate", True))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def with_rope_scaling(config: ModelConfig, rope_scaling: dict | None) -> ModelConfig:
    """`config` with its rope scaling replaced by `rope_scaling` (a rope_parameters-style dict, as `--rope-scaling`
    or `load(rope_scaling=...)` give it: {"rope_type": "yarn", "factor": 4.0, ...}; {"rope_type": "default"}: none);
    None leaves it. The checkpoint's rope_theta and sections stay."""
    if rope_scaling is None:
        return config
    params = Fields(rope_scaling, "rope_scaling")
    rope_type = params.str("rope_type", None) or params.str("type", "default")
    if rope_type not in ("default", "yarn"):
        raise QwenrtError(f"rope_scaling: rope_type {rope_type!r} is not supported (supported: default, yarn)")
    extra = sorted(set(params.d) - {"rope_type", "type"})
    if rope_type == "default" and extra:
        raise QwenrtError(f"rope_scaling: rope_type 'default' takes no other keys, got {extra}")
    text = config.text
    if rope_type == "yarn":
        if set(params.d) & (ROPE_KEYS - {"rope_type", "type"}):
            raise QwenrtError(f"rope_scaling: give only YaRN's keys ({', '.join(sorted(YARN_KEYS))}); rope_theta "
                              "and the sections stay the checkpoint's")
        yarn = parse_yarn(params, text.max_position_embeddings)
    else:
        yarn = None
    return replace(config, text=replace(text, yarn=yarn))


def parse_text_config(d: dict, tie_word_embeddings: bool | None = None, where: str = "config.json") -> TextConfig:
    """Build and validate a TextConfig from a text config dict (flat or a VLM's text_config)."""
    model_type = d.get("model_type")
    if model_type not in TEXT_MODEL_TYPES:
        raise QwenrtError(f"{where}: unsupported text model_type {model_type!r} (supported: {', '.join(TEXT_MODEL_TYPES)})")
    is_moe, vl = TEXT_MODEL_TYPES[model_type], FAMILIES[model_type] == QWEN3_VL
    if model_type == qwen3_next.MODEL_TYPE:
        d = qwen3_next.with_defaults(d)
    f = Fields(d, where)
    if d.get("hidden_act", "silu") != "silu":
        raise QwenrtError(f"{where}: hidden_act must be 'silu', got {d['hidden_act']!r}")
    family = FAMILIES[model_type]
    if family != QWEN3_5 and f.bool("attention_bias", False):
        raise QwenrtError(f"{where}: attention_bias true is not supported ({family}'s projections have no bias)")
    n_layers = f.int("num_hidden_layers", hi=MAX_LAYERS)
    fields = {
        "model_type": model_type,
        "vocab_size": f.int("vocab_size", hi=MAX_VOCAB),
        "hidden_size": f.int("hidden_size", hi=MAX_DIM),
        "num_hidden_layers": n_layers,
        "num_attention_heads": f.int("num_attention_heads", hi=MAX_HEADS),
        "num_key_value_heads": f.int("num_key_value_heads", hi=MAX_HEADS),
        "head_dim": f.int("head_dim", 128 if vl else 256, hi=MAX_DIM),
        # eps is added to a mean of squares: outside (0, 1) the norm is meaningless or divides by ~0
        "rms_norm_eps": f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, open_low=True),
        "max_position_embeddings": f.int("max_position_embeddings", 128000 if vl else 262144, hi=MAX_POSITIONS),
        "tie_word_embeddings": f.bool("tie_word_embeddings", False) if tie_word_embeddings is None else tie_word_embeddings,
    }
    for key, default in (("linear_key_head_dim", 128), ("linear_value_head_dim", 128)):
        fields[key] = f.int(key, default, hi=MAX_DIM)
    for key, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32)):
        fields[key] = f.int(key, default, hi=MAX_HEADS)
    fields["linear_conv_kernel_dim"] = f.int("linear_conv_kernel_dim", 4, hi=64)
    if is_moe:
        # Qwen3-VL-MoE: 5.23 writes num_local_experts where the published configs say num_experts; no shared expert
        fields["num_experts"] = f.int("num_local_experts" if vl and "num_experts" not in d else "num_experts",
                                      hi=MAX_EXPERTS)
        fields["num_experts_per_tok"] = f.int("num_experts_per_tok", hi=MAX_EXPERTS)
        for key in ("moe_intermediate_size",) if vl else ("moe_intermediate_size", "shared_expert_intermediate_size"):
            fields[key] = f.int(key, hi=MAX_DIM)
    if is_moe and family != QWEN3_5:  # transformers' layer rule; Qwen3.5 MoE has no dense layers
        fields["mlp_only_layers"] = f.ints("mlp_only_layers", (), lo=0, hi=n_layers - 1, max_len=MAX_LAYERS)
        fields["decoder_sparse_step"] = f.int("decoder_sparse_step", 1, hi=MAX_LAYERS)
    dense_layers = fields.get("mlp_only_layers") or fields.get("decoder_sparse_step", 1) > 1
    if not is_moe or model_type == qwen3_next.MODEL_TYPE or dense_layers:
        fields["intermediate_size"] = f.int("intermediate_size", hi=MAX_DIM)
    if model_type == qwen3_next.MODEL_TYPE:
        fields.update(qwen3_next.config_fields(f))

    layer_types = f.list("layer_types", None, max_len=MAX_LAYERS)
    if vl:  # Qwen3 layers are all softmax attention (a layer_types key, where written, says so too)
        layer_types = ["full_attention"] * n_layers
    elif layer_types is None:
        interval = f.int("full_attention_interval", 4, hi=MAX_LAYERS)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if not all(isinstance(t, str) for t in layer_types):
        raise QwenrtError(f"{where}: layer_types must be a list of strings")
    rope = _rope_fields(f, fields["max_position_embeddings"], vl)
    fields["layer_types"] = tuple(layer_types)
    fields.update({k: v for k, v in rope.items() if v is not None})
    cfg = TextConfig(**fields)
    _check_contracts(cfg, rope["mrope_section"] is not None, where)
    return cfg


def _check_contracts(c: TextConfig, section_given: bool, where: str) -> None:
    if c.num_attention_heads % c.num_key_value_heads:
        raise QwenrtError(f"{where}: num_attention_heads ({c.num_attention_heads}) must be divisible by "
                          f"num_key_value_heads ({c.num_key_value_heads})")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise QwenrtError(f"{where}: linear_num_value_heads ({c.linear_num_value_heads}) must be divisible by "
                          f"linear_num_key_heads ({c.linear_num_key_heads})")
    if len(c.layer_types) != c.num_hidden_layers:
        raise QwenrtError(f"{where}: layer_types has {len(c.layer_types)} entries but num_hidden_layers is "
                          f"{c.num_hidden_layers}")
    unknown = sorted({t for t in c.layer_types if t not in LAYER_TYPES})
    if unknown:
        raise QwenrtError(f"{where}: unknown layer type(s) {unknown} in layer_types (known: {', '.join(LAYER_TYPES)})")
    if c.rotary_dim % 2 or c.rotary_dim == 0:
        raise QwenrtError(f"{where}: rotary dim head_dim·partial_rotary_factor = {c.head_dim}·{c.partial_rotary_factor} "
                          f"must be a positive even integer")
    # transformers' default section only matters for vision positions; an explicit one must fit the rotary dim
    if section_given and (len(c.mrope_section) != 3 or sum(c.mrope_section) != c.rotary_dim // 2):
        raise QwenrtError(f"{where}: mrope_section {list(c.mrope_section)} must have 3 entries summing to "
                          f"rotary_dim/2 = {c.rotary_dim // 2}")
    if c.is_moe and c.num_experts_per_tok > c.num_experts:
        raise QwenrtError(f"{where}: num_experts_per_tok ({c.num_experts_per_tok}) exceeds num_experts ({c.num_experts})")


def parse_config(d: dict, where: str = "config.json") -> ModelConfig:
    """A checkpoint's config dict -> ModelConfig. VLM configs nest the decoder in text_config."""
    f = Fields(d, where)
    model_type = d.get("model_type")
    supported = ", ".join([*VLM_MODEL_TYPES, *TEXT_MODEL_TYPES])
    if not isinstance(model_type, str) or model_type not in {**VLM_MODEL_TYPES, **TEXT_MODEL_TYPES}:
        raise QwenrtError(f"{where}: unsupported model_type {model_type!r} (supported: {supported})")
    if model_type in TEXT_MODEL_TYPES:
        text_cfg = parse_text_config(d, where=where)
        return ModelConfig(model_type, text_cfg, eos_token_id=_token_ids(f, "eos_token_id"), raw=d)
    text = dict(f.obj("text_config").d)
    text.setdefault("model_type", VLM_MODEL_TYPES[model_type])
    # transformers ties the VLM's lm_head by the outer flag
    tie = f.bool("tie_word_embeddings", Fields(text, where).bool("tie_word_embeddings", False))
    text_cfg = parse_text_config(text, tie_word_embeddings=tie, where=f"{where} text_config")
    ids = {k: f.int(k, lo=0) for k in ("image_token_id", "video_token_id",
                                                                     "vision_start_token_id", "vision_end_token_id")
           if k in d}
    vision = f.obj("vision_config", None)
    if vision is not None:
        vision = _deepstack(vision, text_cfg, where)
        from qwenrt.vision.config import VisionConfig  # here: the vision package imports torch (`qwenrt list` need not)

        VisionConfig.from_dict(vision.d)  # refused now, not at the first image
    eos = Fields(text, where) if "eos_token_id" in text else f
    return ModelConfig(model_type, text_cfg, vision=vision and vision.d, eos_token_id=_token_ids(eos, "eos_token_id"),
                       raw=d, **ids)


def _deepstack(vision: Fields, text: TextConfig, where: str) -> Fields:
    """vision_config with its DeepStack blocks made explicit: Qwen3-VL's default (8, 16, 24) where unnamed (as
    transformers reads it); Qwen3.5 has none (transformers drops the key), so naming some is refused."""
    named = vision.d.get("deepstack_visual_indexes")
    if text.family != QWEN3_VL:
        if named:
            raise QwenrtError(f"{where}: vision_config deepstack_visual_indexes {named!r:.80} is not supported for "
                              f"{text.model_type} (Qwen3.5 has no DeepStack)")
        return vision
    if named is None:
        vision = Fields({**vision.d, "deepstack_visual_indexes": [8, 16, 24]}, vision.where)
    if isinstance(named, list) and len(named) > text.num_hidden_layers:
        raise QwenrtError(f"{where}: {len(named)} deepstack_visual_indexes but only {text.num_hidden_layers} "
                          "decoder layers to add them to")
    return vision


def _token_ids(f: Fields, key: str) -> tuple[int, ...]:
    return f.ints(key, (), lo=0)


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate `config.json` in a checkpoint directory."""
    where = CheckpointDir(path)
    if not where.exists("config.json"):
        raise QwenrtError(f"{path}: no config.json (not a checkpoint directory)")
    file = where.file("config.json")
    return parse_config(where.read_json("config.json"), where=str(file))
