"""Tiny random Qwen3.5 checkpoints built with transformers (the test-only reference).

Every parameter is randomised, norms, A_log and dt_bias included: zero-initialised (1 + w) norms would hide
`w` vs `1 + w` mistakes. Hv > Hk so the repeat-interleave of DeltaNet heads is exercised.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 512
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                         mrope_interleaved=True),
)
DENSE = dict(TEXT, intermediate_size=96, tie_word_embeddings=True)
MOE = dict(TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
           tie_word_embeddings=False)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
# Matrices get gain/sqrt(fan_in). At gain 1 these random stacks are chaotic: fp32 rounding noise grows ~1000×
# over 140 tokens, so a 1e-4 parity bound would judge the noise. At 0.5 ours and transformers agree to ~1e-6 and a
# real bug (w vs 1 + w, a wrong position) still moves the logits by O(1).
WEIGHT_GAIN = 0.5


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, gain: float = WEIGHT_GAIN) -> torch.nn.Module:
    """Give every parameter a random value at a scale that keeps activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.0, 2.5, generator=g))
        elif name.endswith("dt_bias"):
            p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
        elif name.endswith("linear_attn.norm.weight"):  # plain-w gated norm
            p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
        elif "norm" in name:  # (1 + w) norms, and the vision LayerNorms' weight/bias
            p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=g))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        elif p.dim() == 1:  # biases (vision)
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        else:
            fan_in = math.prod(p.shape[1:]) if p.dim() > 1 else p.shape[0]
            scale = 3.0 if name.endswith("mlp.gate.weight") else 1.0  # router: spread the expert choice
            p.copy_(torch.randn(p.shape, generator=g) * scale * gain / math.sqrt(fan_in))
    return model


def build_dense(path: Path, seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = randomize(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**DENSE)).eval(), seed)
    model.save_pretrained(path)
    return model


def build_moe(path: Path, seed: int = 1):
    """MoE text model; transformers 5.23 writes the experts per index (mlp.experts.{e}.*)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    model = randomize(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE)).eval(), seed)
    model.save_pretrained(path)
    return model


def build_vlm(path: Path, seed: int = 2):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(text_config=dict(DENSE, model_type="qwen3_5_text"), vision_config=VISION,
                           tie_word_embeddings=True)
    model = randomize(Qwen3_5ForConditionalGeneration(config).eval(), seed)
    model.save_pretrained(path)
    return model


def build_published_moe(path: Path, seed: int = 3):
    """The published layout: a MoE VLM with `model.language_model.` names, fused experts, an MTP head, bf16, two shards.

    Returns the transformers reference with its weights rounded to bf16 (computing in fp32).
    """
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig(text_config=dict(MOE, model_type="qwen3_5_moe_text"), vision_config=VISION)
    model = randomize(Qwen3_5MoeForConditionalGeneration(config).eval(), seed)
    tensors = {}
    for name, p in model.state_dict().items():
        tensors[name] = p.to(torch.bfloat16).contiguous()
    path.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    from qwenrt.config import load_config
    from qwenrt.mtp import MTPHead, mtp_state_dict

    head = randomize(MTPHead(load_config(path).text), seed)
    tensors.update({n: t.to(torch.bfloat16).contiguous() for n, t in mtp_state_dict(head).items()})
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def build_chat_model(path: Path, seed: int = 4):
    """A tiny dense model over the real 248,320-token vocabulary, with the Qwen3.5 tokenizer and chat template.

    Gain 1: its next-token distributions are broad enough for sampling tests (its tests compare tokens, not 1e-4).
    """
    import shutil

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.tokenizer_fixture import qwen35_tokenizer_dir

    config = Qwen3_5TextConfig(**dict(DENSE, vocab_size=248320, num_hidden_layers=4, eos_token_id=[248046, 248044],
                                      pad_token_id=248044))
    model = randomize(Qwen3_5ForCausalLM(config).eval(), seed, gain=1.0)
    model.save_pretrained(path)
    for file in qwen35_tokenizer_dir().iterdir():
        shutil.copy(file, path / file.name)
    return model


PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
                "do_rescale": True, "do_normalize": True, "do_resize": True, "do_convert_rgb": True, "resample": 3}
VIDEO_PREPROCESSOR = dict(PREPROCESSOR, video_processor_type="Qwen3VLVideoProcessor", fps=2, min_frames=4,
                          max_frames=768, size={"shortest_edge": 32 * 32, "longest_edge": 4 * 128 * 128})


def build_chat_vlm(path: Path, moe: bool = False, seed: int = 5):
    """A tiny VLM (dense or MoE) over the real vocabulary, with tokenizer, chat template and small-image
    preprocessor configs."""
    import shutil

    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    from tests.tokenizer_fixture import qwen35_tokenizer_dir

    text = dict(MOE if moe else DENSE, vocab_size=248320, num_hidden_layers=4, eos_token_id=[248046, 248044],
                pad_token_id=248044, model_type="qwen3_5_moe_text" if moe else "qwen3_5_text")
    config_cls, model_cls = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                             else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    config = config_cls(text_config=text, vision_config=VISION, tie_word_embeddings=not moe)
    model = randomize(model_cls(config).eval(), seed)
    model.save_pretrained(path)
    for file in qwen35_tokenizer_dir().iterdir():
        shutil.copy(file, path / file.name)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR))
    return model


def add_mtp_head(src: Path, dst: Path, seed: int = 7) -> Path:
    """A copy of checkpoint `src` with a random MTP head (mtp.* tensors: per-expert names for a MoE, as published
    per-expert checkpoints store them) added to its single safetensors file."""
    import shutil

    from safetensors.torch import load_file

    from qwenrt.config import load_config
    from qwenrt.mtp import MTPHead, mtp_state_dict

    shutil.copytree(src, dst)
    head = randomize(MTPHead(load_config(dst).text), seed)
    tensors = load_file(dst / "model.safetensors")
    dtype = next(iter(tensors.values())).dtype
    for name, t in mtp_state_dict(head).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = name.rsplit(".", 1)[0]
            for e, w in enumerate(t):
                if name.endswith("gate_up_proj"):
                    gate, up = w.chunk(2)
                    tensors[f"{prefix}.{e}.gate_proj.weight"] = gate.to(dtype).contiguous()
                    tensors[f"{prefix}.{e}.up_proj.weight"] = up.to(dtype).contiguous()
                else:
                    tensors[f"{prefix}.{e}.down_proj.weight"] = w.to(dtype).contiguous()
        else:
            tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# Qwen3-VL: the Qwen3 decoder (all attention, no gate, full rotary: sections sum to head_dim/2) under a ViT whose
# DeepStack blocks are named out of order (the features still join the decoder in block order)
QWEN3_VL_TEXT = dict(vocab_size=248320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, intermediate_size=96, rms_norm_eps=1e-6,
                     max_position_embeddings=4096, eos_token_id=[248046, 248044], pad_token_id=248044,
                     rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[6, 5, 5],
                                          mrope_interleaved=True))
QWEN3_VL_MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1])
QWEN3_VL_VISION = dict(VISION, depth=3, deepstack_visual_indexes=[2, 0, 1])
QWEN3_5_VISION_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                          vision_end_token_id=248054)  # the Qwen3.5 tokenizer's, which the tests use


def build_qwen3_vl(path: Path, moe: bool = False, published: bool = False, seed: int = 11):
    """A tiny Qwen3-VL (or Qwen3-VL-MoE) with the real vocabulary, tokenizer and small-image preprocessor configs,
    as transformers 5.23 writes it; `published`: the MoE experts as the hub's files hold them ([E, D, 2I] /
    [E, I, D], `num_experts`)."""
    import shutil

    from safetensors.torch import load_file
    from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                              Qwen3VLMoeForConditionalGeneration)

    from tests.tokenizer_fixture import qwen35_tokenizer_dir

    config_cls, model_cls = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                             else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    text = dict(QWEN3_VL_TEXT, **(QWEN3_VL_MOE if moe else {}))
    config = config_cls(text_config=text, vision_config=QWEN3_VL_VISION, tie_word_embeddings=not moe,
                        **QWEN3_5_VISION_IDS)
    model = randomize(model_cls(config).eval(), seed)
    model.save_pretrained(path)
    if published:
        tensors = load_file(path / "model.safetensors")
        for name in tensors:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        cfg["text_config"]["num_experts"] = cfg["text_config"].pop("num_local_experts")
        (path / "config.json").write_text(json.dumps(cfg))
    for file in qwen35_tokenizer_dir().iterdir():
        shutil.copy(file, path / file.name)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR))
    return model


# Qwen3-Next: Hv/Hk = 3 and Dk != Dv (the per-key-head split of the fused projections), layers 1 and 3 dense
QWEN3_NEXT = dict(
    hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, full_attention_interval=3,
    intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=3, mlp_only_layers=[1, 3], decoder_sparse_step=1,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25),
)


def build_qwen3_next_chat(path: Path, seed: int = 5):
    """A tiny Qwen3-Next over the 151,936-token vocabulary with a Qwen3 tokenizer and chat template; gain 1 (broad
    next-token distributions: its checks compare tokens)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from tests.tokenizer_fixture import build_qwen3_tokenizer

    config = Qwen3NextConfig(**dict(QWEN3_NEXT, vocab_size=151936, num_hidden_layers=3, mlp_only_layers=[1],
                                    eos_token_id=151645, pad_token_id=151643))
    model = randomize(Qwen3NextForCausalLM(config).eval(), seed, gain=1.0)
    model.save_pretrained(path)
    build_qwen3_tokenizer(Path(path))
    return model
