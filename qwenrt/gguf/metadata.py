"""A `qwen35` / `qwen35moe` GGUF file's metadata (or a related family's: `qwen3vl`, `qwen3vlmoe`, `qwen3next`) as
qwenrt reads it: the model's config (as a Hugging Face config
dict, checked by qwenrt.config) and its tokenizer (tokens, merges, token types, special ids, chat template, sampling
defaults), each key checked for its type. The keys are those llama.cpp's converter writes (shared/peers.md §1.3).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, ReaderField

from qwenrt.config import FAMILIES, QWEN3_NEXT, QWEN3_VL, TEXT_MODEL_TYPES
from qwenrt.errors import QwenrtError
from qwenrt.families import qwen3_next, qwen3_vl
from qwenrt.tokenizer import QWEN2_SPLIT, QWEN35_SPLIT, TokenizerParts

# general.architecture -> model_type
ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", **qwen3_vl.GGUF_ARCHITECTURES,
                 qwen3_next.GGUF_ARCHITECTURE: qwen3_next.MODEL_TYPE}
# tokenizer.ggml.pre -> (the split regex, whether a word in the vocabulary is taken whole before any merge)
PRE_TOKENIZERS = {"qwen35": (QWEN35_SPLIT, True), "qwen2": (QWEN2_SPLIT, False)}
INTEGER_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                 GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
# llama.cpp's token types
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 3, 4, 5, 6
SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
            "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p"}


class Metadata:
    """Typed access to a GGUF file's key-value metadata; a missing or mistyped key is a one-line QwenrtError."""

    def __init__(self, fields: dict[str, ReaderField], where: Path):
        self.fields, self.where = fields, where

    def has(self, key: str) -> bool:
        return key in self.fields

    def _field(self, key: str, kinds: set, what: str, array: bool) -> ReaderField:
        field = self.fields.get(key)
        if field is None:
            raise QwenrtError(f"{self.where}: GGUF metadata key '{key}' is missing")
        types = field.types
        ok = (len(types) == 2 and types[0] == GGUFValueType.ARRAY and types[1] in kinds) if array else \
            (len(types) == 1 and types[0] in kinds)
        if not ok:
            got = "/".join(t.name for t in types) or "an empty array"
            raise QwenrtError(f"{self.where}: GGUF metadata key '{key}' must be {what}, got {got}")
        return field

    def int(self, key: str, default: int | None = None) -> int:
        if default is not None and key not in self.fields:
            return default
        return int(self._field(key, INTEGER_TYPES, "an integer", False).contents())

    def float(self, key: str, default: float | None = None) -> float:
        if default is not None and key not in self.fields:
            return default
        value = self._field(key, FLOAT_TYPES | INTEGER_TYPES, "a number", False).contents()
        return float(str(np.float32(value)))  # a float32's shortest decimal: 1e-06, not 9.99999997e-07

    def str(self, key: str, default: str | None = None) -> str | None:
        if key not in self.fields:
            return default
        return self._field(key, {GGUFValueType.STRING}, "a string", False).contents()

    def flag(self, key: str, default: bool | None = None) -> bool:
        if default is not None and key not in self.fields:
            return default
        return bool(self._field(key, {GGUFValueType.BOOL}, "a boolean", False).contents())

    def _counted(self, field: ReaderField, key: str, count: int | None) -> ReaderField:
        """`field`, an array of exactly `count` values where a count is given (checked before it is read)."""
        found = int(field.parts[4][0])  # after the key's length, the key, the value type and the item type
        if count is not None and found != count:
            raise QwenrtError(f"{self.where}: GGUF metadata key '{key}' must hold {count} values, got {found}")
        return field

    def floats(self, key: str, count: int | None = None) -> list[float]:
        field = self._field(key, FLOAT_TYPES | INTEGER_TYPES, "an array of numbers", True)
        return [float(str(np.float32(v))) for v in self._counted(field, key, count).contents()]

    def ints(self, key: str, count: int | None = None) -> list[int]:
        field = self._field(key, INTEGER_TYPES | {GGUFValueType.BOOL}, "an array of integers", True)
        return [int(v) for v in self._counted(field, key, count).contents()]

    def strings(self, key: str) -> list[str]:
        return self._field(key, {GGUFValueType.STRING}, "an array of strings", True).contents()


def architecture(meta: Metadata) -> str:
    arch = meta.str("general.architecture")
    if arch == "clip":
        raise QwenrtError(f"{meta.where}: a vision projector (mmproj) file, not a model: give it beside the model "
                          "file (--mmproj FILE, mmproj=FILE)")
    if arch not in ARCHITECTURES:
        raise QwenrtError(f"{meta.where}: GGUF architecture {arch!r} is not supported (supported: "
                          f"{', '.join(ARCHITECTURES)}: Qwen3.5, Qwen3-VL and Qwen3-Next, dense and MoE)")
    return arch


def config_dict(meta: Metadata, vocab_rows: int, tied: bool) -> dict:
    """The Hugging Face config dict of the model a GGUF holds. vocab_rows: token_embd's rows; tied: the file has no
    output.weight."""
    arch = architecture(meta)

    def key(name: str) -> str:
        return f"{arch}.{name}"

    blocks, mtp = meta.int(key("block_count")), meta.int(key("nextn_predict_layers"), 0)
    n_layers = blocks - mtp
    if n_layers < 1 or mtp < 0:
        raise QwenrtError(f"{meta.where}: {key('block_count')} {blocks} leaves no layers beside "
                          f"{key('nextn_predict_layers')} {mtp}")
    head_dim = meta.int(key("attention.key_length"))
    model_type = ARCHITECTURES[arch]
    family = FAMILIES[model_type]
    rotary = meta.int(key("rope.dimension_count"), head_dim if family == QWEN3_VL else head_dim // 4)
    rope = {"rope_type": "default", "rope_theta": meta.float(key("rope.freq_base")),
            "partial_rotary_factor": rotary / head_dim if head_dim else 0.0, **_rope_scaling(meta, key)}
    if meta.has(key("rope.dimension_sections")):  # Qwen3.5's and Qwen3-VL's M-RoPE (Qwen3-Next's rotary is 1-D)
        rope.update(mrope_section=meta.ints(key("rope.dimension_sections"))[:3], mrope_interleaved=True)
    config = {
        "model_type": model_type,
        "vocab_size": vocab_rows,
        "hidden_size": meta.int(key("embedding_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": meta.int(key("attention.head_count")),
        "num_key_value_heads": meta.int(key("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": meta.float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": meta.int(key("context_length")),
        "rope_parameters": rope,
        "tie_word_embeddings": tied,
    }
    if family != QWEN3_VL:  # the DeltaNet layers
        config.update(_deltanet_keys(meta, key, n_layers))
    if mtp:
        config["mtp_num_hidden_layers"] = mtp
    if not TEXT_MODEL_TYPES[model_type]:  # dense
        config["intermediate_size"] = meta.int(key("feed_forward_length"))
    else:
        config.update(num_experts=meta.int(key("expert_count")), num_experts_per_tok=meta.int(key("expert_used_count")),
                      moe_intermediate_size=meta.int(key("expert_feed_forward_length")))
        if family != QWEN3_VL:  # Qwen3-VL-MoE has no shared expert
            config["shared_expert_intermediate_size"] = meta.int(key("expert_shared_feed_forward_length"))
    if family == QWEN3_NEXT:
        config.update(intermediate_size=meta.int(key("feed_forward_length")),
                      norm_topk_prob=meta.flag(key("expert_weights_norm"), True))
    if meta.has("tokenizer.ggml.eos_token_id"):
        config["eos_token_id"] = meta.int("tokenizer.ggml.eos_token_id")
    return config


def _deltanet_keys(meta: Metadata, key, n_layers: int) -> dict:
    """The config keys of the DeltaNet layers and which layers they are."""
    hv = meta.int(key("ssm.time_step_rank"))
    if meta.has(key("attention.recurrent_layers")):
        recurrent = meta.ints(key("attention.recurrent_layers"))[:n_layers]
        layer_types = ["linear_attention" if r else "full_attention" for r in recurrent]
    else:
        interval = meta.int(key("full_attention_interval"), 4)
        layer_types = ["linear_attention" if (i + 1) % max(interval, 1) else "full_attention" for i in range(n_layers)]
    return {
        "layer_types": layer_types,
        "linear_conv_kernel_dim": meta.int(key("ssm.conv_kernel")),
        "linear_key_head_dim": meta.int(key("ssm.state_size")),
        "linear_num_key_heads": meta.int(key("ssm.group_count")),
        "linear_num_value_heads": hv,
        "linear_value_head_dim": meta.int(key("ssm.inner_size")) // max(hv, 1),
    }


def tokenizer_parts(meta: Metadata) -> TokenizerParts | None:
    """The tokenizer a GGUF file describes (a byte-level BPE with Qwen3.5's pre-tokenizer, or Qwen2's for Qwen3-VL
    and Qwen3-Next), or None when it has none. Token types: control tokens are special added tokens, user-defined
    ones added but not special, unused
    ones (the `[PAD{i}]` rows padding the list to the embedding) left out."""
    if not meta.has("tokenizer.ggml.tokens"):
        return None
    model, pre = meta.str("tokenizer.ggml.model"), meta.str("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise QwenrtError(f"{meta.where}: tokenizer {model!r} with pre-tokenizer {pre!r} is not supported (Qwen3.5 "
                          "files have gpt2 / qwen35, Qwen3-VL and Qwen3-Next gpt2 / qwen2)")
    split, whole_words = PRE_TOKENIZERS[pre]
    tokens, types = meta.strings("tokenizer.ggml.tokens"), meta.ints("tokenizer.ggml.token_type")
    if len(types) != len(tokens):
        raise QwenrtError(f"{meta.where}: {len(tokens)} tokens but {len(types)} token types")
    vocab, added = {}, []
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            added.append({"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == TOKEN_CONTROL})
        elif kind != TOKEN_UNUSED:
            vocab[token] = i
    merges = meta.strings("tokenizer.ggml.merges")  # "a b" each, a form tokenizers reads as it is
    backend = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": whole_words,
                  "vocab": vocab, "merges": merges},
    }
    generation = {name: meta.float(key) for key, name in SAMPLING.items() if meta.has(key)}
    if "top_k" in generation:
        generation["top_k"] = int(generation["top_k"])
    if meta.has("tokenizer.ggml.eos_token_id"):
        generation["eos_token_id"] = meta.int("tokenizer.ggml.eos_token_id")
    if meta.has("tokenizer.ggml.padding_token_id"):
        generation["pad_token_id"] = meta.int("tokenizer.ggml.padding_token_id")
    where = meta.where
    return TokenizerParts(json.dumps(backend, ensure_ascii=False), where, {}, where, generation, where,
                          meta.str("tokenizer.chat_template"), where)


def _rope_scaling(meta, key) -> dict:
    """llama.cpp's rope.scaling.* as rope_parameters: YaRN's factor, original context, betas and attention factor,
    which its converter copies from transformers' rope_parameters; its other YaRN keys have no transformers meaning."""
    kind = meta.str(key("rope.scaling.type"), "none")
    if kind == "none":
        return {}
    others = [k for k in ("rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor",
                          "rope.scaling.yarn_log_multiplier") if meta.has(key(k))]
    if kind != "yarn" or others:
        raise QwenrtError(f"{meta.where}: rope scaling {kind!r}{' with ' + ', '.join(others) if others else ''} is not "
                          "supported (YaRN is, as transformers computes it)")
    params = {"rope_type": "yarn", "factor": meta.float(key("rope.scaling.factor")),
              "original_max_position_embeddings": meta.int(key("rope.scaling.original_context_length"),
                                                           meta.int(key("context_length")))}
    for name, field in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                        ("attention_factor", "yarn_attn_factor")):
        if meta.has(key(f"rope.scaling.{field}")):
            params[name] = meta.float(key(f"rope.scaling.{field}"))
    return params
