"""Qwen3-Next checkpoints (qwenrt/families/qwen3_next.py) against transformers 5.23 on tiny random checkpoints with
every weight randomised: a mix of dense and MoE layers, the router's top-A renormalised or not, Hv/Hk = 3 and
Dk != Dv so the per-key-head split of the fused projections is exercised; and on the paths Qwen3.5 takes (the native
decode plan, the engine, int8/int4)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import qwenrt
from qwenrt import shapes
from qwenrt.config import parse_config
from qwenrt.convert import quantize_checkpoint
from qwenrt.decode_plan import CyclePlan, DecodePlan, MTPPlan
from qwenrt.kernels import cpu_kernels
from qwenrt.moe import SparseMoeBlock, native_block
from qwenrt.ops.rope import rope_cos_sin
from tests.checkpoints import QWEN3_NEXT, add_mtp_head, build_qwen3_next_chat, randomize
from tests.hostile import one_line_error
from tests.numerics import rel_err, teacher_forced_logits
from tests.test_engine import check_staggered, greedy
from tests.test_mtp import PROMPTS as MTP_PROMPTS, check_lossless

VOCAB = 512
NEXT = dict(QWEN3_NEXT, vocab_size=VOCAB)
LAYERS = "LLFLLF"
DENSE_LAYERS = {1, 3}


def build(path, norm_topk_prob: bool, seed: int):
    """A tiny Qwen3-Next saved by transformers (fused in_proj_qkvz / in_proj_ba, per-expert tensors) and the
    reference in fp64 (its fp32 DeltaNet drifts ~1e-4 from fp64 on some random checkpoints)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    model = randomize(Qwen3NextForCausalLM(Qwen3NextConfig(**NEXT, norm_topk_prob=norm_topk_prob)).eval(), seed)
    model.save_pretrained(path)
    model.set_experts_implementation("eager")  # torch's grouped_mm takes no fp64
    return path, model.double()


@pytest.fixture(scope="module", params=[True, False], ids=["renormalised", "raw-top-k"])
def next_ckpt(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("next"), request.param, seed=11 + request.param)


@pytest.fixture(scope="module")
def next_path(tmp_path_factory):
    """The raw-top-k checkpoint alone (norm_topk_prob false: the case Qwen3.5 MoE never has)."""
    return build(tmp_path_factory.mktemp("next-raw"), False, seed=11)[0]


PROMPTS = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(0))  # > two DeltaNet chunks


def test_config_maps_to_qwen35_fields(next_ckpt):
    path, ref = next_ckpt
    c = qwenrt.config.load_config(path).text
    assert c.family == "Qwen3-Next" and c.is_moe and c.norm_topk_prob == ref.config.norm_topk_prob
    assert "".join("F" if t == "full_attention" else "L" for t in c.layer_types) == LAYERS
    assert {i for i in range(6) if not c.is_moe_layer(i)} == DENSE_LAYERS and c.intermediate_size == 96
    assert (c.rope_theta, c.rotary_dim) == (1e6, 8)


def test_hub_config_keys_parse_as_transformers_writes_them(next_ckpt):
    """The published configs' keys (full_attention_interval, flat rope_theta / partial_rotary_factor, rope_scaling
    null) give the config transformers 5.23 writes; absent keys take Qwen3NextConfig's defaults, not Qwen3.5's."""
    written = json.loads((next_ckpt[0] / "config.json").read_text())
    hub = {k: v for k, v in written.items() if k not in ("layer_types", "rope_parameters")}
    hub.update(full_attention_interval=3, rope_theta=1e6, partial_rotary_factor=0.25, rope_scaling=None)
    assert parse_config(hub).text == parse_config(written).text
    bare = {k: v for k, v in hub.items() if k not in ("rope_theta", "max_position_embeddings", "mlp_only_layers",
                                                      "decoder_sparse_step", "norm_topk_prob")}
    c = parse_config(bare).text
    assert (c.rope_theta, c.max_position_embeddings, c.norm_topk_prob) == (10_000.0, 32768, True)
    assert all(c.is_moe_layer(i) for i in range(6))


def test_logits_match_reference(next_ckpt):
    path, ref = next_ckpt
    model, _ = qwenrt.load(path, dtype="float32")
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "MLP" if i in DENSE_LAYERS else "SparseMoeBlock" for i in range(6)]
    with torch.no_grad():
        expected = ref(input_ids=PROMPTS).logits
    assert rel_err(model(PROMPTS), expected) <= 1e-4


def test_rope_is_qwen35_mrope_at_text_positions(next_path):
    """Qwen3-Next's 1-D partial rotary is what qwenrt computes for text: the interleaved M-RoPE tables with all three
    axes at the position, and transformers' own tables."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    model, _ = qwenrt.load(next_path, dtype="float32")
    positions = torch.arange(300)[None]
    cos, sin = model.rotary(positions, torch.float32)
    mrope = rope_cos_sin(positions[None].expand(3, 1, 300), model.inv_frequencies("cpu"), (2, 1, 1), True)
    assert torch.equal(cos, mrope[0]) and torch.equal(sin, mrope[1])
    ref_cos, ref_sin = Qwen3NextRotaryEmbedding(Qwen3NextConfig(**NEXT))(torch.zeros(1, dtype=torch.float32),
                                                                         positions)
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)


def test_greedy_decode_matches_reference_generate(next_ckpt):
    path, ref = next_ckpt
    model, _ = qwenrt.load(path, dtype="float32")
    prompt = PROMPTS[:1, :37]
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                pad_token_id=0)[0, 37:].tolist()
    cache = model.new_cache(1)
    logits = model(prompt, cache=cache, logits_to_keep=1)
    tokens = []
    for _ in range(24):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token.item())
        logits = model(token, cache=cache)
    assert tokens == expected


@pytest.mark.skipif(cpu_kernels() is None, reason="no native kernels")
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_bf16_decodes_on_the_native_plan(next_path, quantize):
    """bf16 (and int8/int4) decode takes the native plan, MoE blocks as one kernels.MoE each (the raw top-k weights
    too): its steps equal the modules' step for step."""
    model, _ = qwenrt.load(next_path, dtype="bfloat16", quantize=quantize)
    assert DecodePlan.for_model(model) is not None
    assert all(native_block(layer.mlp) is not None for layer in model.model.layers
               if isinstance(layer.mlp, SparseMoeBlock))
    assert torch.equal(teacher_forced_logits(model, PROMPTS[:, :16], 8),
                       teacher_forced_logits(model, PROMPTS[:, :16], 8, modules=True))


@pytest.mark.skipif(cpu_kernels() is None, reason="no native kernels")
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_native_moe_honours_norm_topk_prob(norm_topk_prob):
    """The native MoE block gives its modules' output bit for bit with the top-A weights renormalised or not, and
    the two differ (the flag reaches the kernel)."""
    c = parse_config(dict(NEXT, model_type="qwen3_next", norm_topk_prob=norm_topk_prob)).text
    g = torch.Generator().manual_seed(3)
    block = SparseMoeBlock(c)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    block = block.bfloat16().requires_grad_(False)
    h = torch.randn(5, 64, generator=g).bfloat16()
    assert torch.equal(native_block(block)(h), block.dispatched(h))
    block.norm_topk_prob = not norm_topk_prob
    assert not torch.equal(block.dispatched(h), native_block(block)(h))


def test_batched_equals_each_alone(next_path):
    model, _ = qwenrt.load(next_path, dtype="bfloat16")
    g = torch.Generator().manual_seed(4)
    requests = [greedy(torch.randint(0, VOCAB, (n,), generator=g).tolist(), 10, ignore_eos=True)
                for n in (5, 40, 17, 3)]
    check_staggered(model, None, requests, max_running=3, max_batched_tokens=12)


def test_quantized_copy_loads_as_quantized_at_load(next_path, tmp_path):
    """`qwenrt quantize` writes the split projections under the qwen3_next config; the copy loads and decodes as the
    checkpoint quantized at load does."""
    dst = quantize_checkpoint(next_path, tmp_path / "q", 8)
    stored, _ = qwenrt.load(dst, dtype="bfloat16")
    at_load, _ = qwenrt.load(next_path, dtype="bfloat16", quantize="int8")
    assert stored.config.text.family == "Qwen3-Next"
    assert torch.equal(stored(PROMPTS[:, :20]), at_load(PROMPTS[:, :20]))


@pytest.fixture(scope="module")
def next_chat(tmp_path_factory):
    path = tmp_path_factory.mktemp("next-chat")
    build_qwen3_next_chat(path)
    return path


def test_inspect_and_run_on_the_qwen3_vocabulary(next_chat):
    inspect = subprocess.run([sys.executable, "-m", "qwenrt", "inspect", str(next_chat)], capture_output=True,
                             text=True, timeout=300)
    assert inspect.returncode == 0, inspect.stderr
    assert "qwen3_next  (Qwen3-Next MoE text" in inspect.stdout and "151669 tokens" in inspect.stdout
    assert "experts 8 (top-3) + shared in 2 of 3 layers (the others dense)" in inspect.stdout
    run = subprocess.run([sys.executable, "-m", "qwenrt", "run", str(next_chat), "Hello", "--max-tokens", "8",
                          "--temperature", "0", "--no-thinking"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    model, tok = qwenrt.load(next_chat)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], enable_thinking=False)
    assert tok.encode(prompt)[:3] == [151644, 872, 198]  # <|im_start|>user\n
    assert run.stdout == qwenrt.generate(model, tok, [{"role": "user", "content": "Hello"}], max_tokens=8,
                                         enable_thinking=False) + "\n"
    assert "generated 8 tokens" in run.stderr and "loaded 3-layer Qwen3-Next MoE model" in run.stderr


@pytest.fixture(scope="module")
def next_mtp(next_path, tmp_path_factory):
    """The raw-top-k checkpoint with a random MTP head under Qwen3-Next's published names (mtp.fc,
    mtp.pre_fc_norm_*, mtp.norm, mtp.layers.0.* with per-expert tensors: layer 0's MoE block)."""
    return add_mtp_head(next_path, tmp_path_factory.mktemp("next-mtp") / "m")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_with_mtp_drafts_equals_plain(next_mtp, dtype):
    model, _ = qwenrt.load(next_mtp, dtype=dtype)
    assert type(model.mtp.layers[0].mlp).__name__ == "SparseMoeBlock"
    if dtype == "bfloat16" and cpu_kernels() is not None:  # the draft step and the whole cycle natively
        assert MTPPlan.for_model(model, 256) is not None and CyclePlan.for_model(model, 256) is not None
    check_lossless(model, None, MTP_PROMPTS)


def _rewrite(src, dst, change):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_contracts(next_path, tmp_path):
    fused = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    short = _rewrite(next_path, tmp_path / "short", lambda t: t.update({fused: t[fused][:-8]}))
    one_line_error(lambda: qwenrt.load(short), f"tensor '{fused}' has shape [152, 64]; Qwen3-Next's fused "
                                                "in_proj_qkvz needs [160, 64] (2 key-head groups)")
    ba = "model.layers.3.linear_attn.in_proj_ba.weight"
    one_line_error(lambda: qwenrt.load(_rewrite(next_path, tmp_path / "ba", lambda t: t.pop(ba))),
                   "missing 2 tensor(s): model.layers.3.linear_attn.in_proj_a.weight, "
                   "model.layers.3.linear_attn.in_proj_b.weight")
    both = _rewrite(next_path, tmp_path / "both", lambda t: t.update(
        {"model.layers.0.linear_attn.in_proj_z.weight": torch.zeros(48, 64)}))
    one_line_error(lambda: qwenrt.load(both), "'model.layers.0.linear_attn.in_proj_z.weight' is stored both split "
                                              f"and fused in '{fused}'")
    dense = "model.layers.1.mlp.gate_proj.weight"
    one_line_error(lambda: qwenrt.load(_rewrite(next_path, tmp_path / "dense", lambda t: t.pop(dense))),
                   f"missing 1 tensor(s): {dense}")


def test_gguf_export_is_refused(next_path, tmp_path):
    from qwenrt.gguf.export import export_gguf

    one_line_error(lambda: export_gguf(next_path, tmp_path / "x.gguf"),
                   "a Qwen3-Next model is not written as GGUF (qwenrt writes the Qwen3.5 architectures")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("change,fragment", [
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be an integer in [1, "),
    ({"mlp_only_layers": [6]}, "'mlp_only_layers' must be an integer or a list of integers in [0, 5]"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be true or false"),
    ({"attention_bias": True}, "attention_bias true is not supported"),
])
def test_config_contracts(change, fragment):
    one_line_error(lambda: parse_config(dict(NEXT, model_type="qwen3_next", **change)), fragment)


def test_published_shape_and_a_random_slice_of_it(tmp_path, monkeypatch):
    """next-80b-a3b is Qwen3-Next-80B-A3B's decoder (79.67B parameters without the MTP head, 3.25B active per token
    besides the embeddings); a shrunken slice of it is written in its layout under its config, loads as Qwen3-Next
    and decodes on the native plan."""
    assert shapes.parameter_count("next-80b-a3b") == 79_674_391_296
    c = shapes.meta_model("next-80b-a3b").config.text
    routed = 48 * (512 - 10) * 3 * 2048 * 512
    assert round((79_674_391_296 - routed - 2 * 151936 * 2048) / 1e9, 2) == 3.25
    assert (c.family, c.num_hidden_layers, c.full_attention_layers[:2], c.rope_theta) == ("Qwen3-Next", 48, (3, 7),
                                                                                          1e7)
    monkeypatch.setitem(shapes._NEXT, "next-tiny", 4)
    monkeypatch.setattr(shapes, "_NEXT_COMMON", dict(shapes._NEXT_COMMON, vocab_size=512, hidden_size=64,
                                                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48, head_dim=32,
                                                     linear_key_head_dim=16, linear_value_head_dim=16,
                                                     linear_num_key_heads=2, linear_num_value_heads=4))
    path = shapes.write_random_checkpoint("next-tiny", tmp_path / "slice", quantize=qwenrt.quant.QuantSpec(4, 32))
    model, _ = qwenrt.load(path)
    assert model.config.text.family == "Qwen3-Next" and model.mtp is not None
    assert cpu_kernels() is None or DecodePlan.for_model(model) is not None
    assert torch.isfinite(model(PROMPTS[:1, :8])).all()


def _peft_on_reference(path, out, seed=0):
    """A PEFT adapter with random B on transformers' Qwen3-Next (fp32): the fused in_proj_qkvz / in_proj_ba as PEFT
    sees them, the DeltaNet output, attention; one module with its own rank and alpha."""
    import peft
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, rank_pattern={"in_proj_ba": 2},
                             alpha_pattern={"layers.0.linear_attn.in_proj_qkvz": 3},
                             target_modules=["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "o_proj"])
    model = peft.get_peft_model(Qwen3NextForCausalLM.from_pretrained(path).eval(), config).eval()
    model.save_pretrained(out)
    return model


LORA_IDS = PROMPTS[:1, :24]


def test_peft_adapters_on_the_fused_projections_load(next_path, tmp_path):
    """PEFT trains Qwen3-Next's fused in_proj_qkvz / in_proj_ba: qwenrt splits each pair by rows (and folds the
    per-module rank / alpha into B); its logits are PEFT's, loaded and merged."""
    from qwenrt.merge import merge_lora

    reference = _peft_on_reference(next_path, tmp_path / "a")
    with torch.no_grad(), reference.disable_adapter():
        base = reference(LORA_IDS).logits
    with torch.no_grad():
        expected = reference(LORA_IDS).logits
    model, _ = qwenrt.load(next_path, dtype="float32", adapter=tmp_path / "a")
    assert rel_err(model(LORA_IDS), expected) <= 1e-4 and rel_err(base, expected) > 1e-2
    merge_lora(next_path, tmp_path / "a", tmp_path / "merged")
    merged, _ = qwenrt.load(tmp_path / "merged", dtype="float32")
    assert rel_err(merged(LORA_IDS), expected) <= 1e-4


def test_our_adapters_are_written_on_the_fused_projections(next_path, tmp_path):
    """Adapters qwenrt trains on the split projections are written as one pair per fused module (rank 2r, alpha
    kept to the same scaling): PEFT on transformers' Qwen3-Next gives qwenrt's logits, and qwenrt reads them back."""
    import peft
    from transformers import Qwen3NextForCausalLM

    from qwenrt.adapters import CONFIG_FILE, save_adapter
    from qwenrt.lora import LoraSpec, add_adapters, lora_modules

    model, _ = qwenrt.load(next_path, dtype="float32")
    spec = LoraSpec(4, 8, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj"))
    add_adapters(model, spec)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)
        ours = model(LORA_IDS)
    save_adapter(tmp_path / "ours", model, spec, str(next_path))
    config = json.loads((tmp_path / "ours" / CONFIG_FILE).read_text())
    assert config["target_modules"] == ["linear_attn.in_proj_ba", "linear_attn.in_proj_qkvz", "self_attn.q_proj"]
    assert set(config["rank_pattern"].values()) == {8} and set(config["alpha_pattern"].values()) == {16}
    reference = peft.PeftModel.from_pretrained(Qwen3NextForCausalLM.from_pretrained(next_path).eval(),
                                               tmp_path / "ours").eval()
    with torch.no_grad():
        assert rel_err(ours, reference(LORA_IDS).logits) <= 1e-4
    again, _ = qwenrt.load(next_path, dtype="float32", adapter=tmp_path / "ours")
    with torch.no_grad():
        assert rel_err(again(LORA_IDS), ours) <= 1e-5
