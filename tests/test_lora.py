"""LoRA: adapters in PEFT's format both ways (transformers + PEFT as the reference), merge-lora, training only the
adapters (the base bit for bit unchanged), QLoRA on an int4 base, the decode path with adapters, bad adapters."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import qwenrt
from qwenrt.adapters import CONFIG_FILE, WEIGHTS_FILE, save_adapter
from qwenrt.cli import main
from qwenrt.decode_plan import DecodePlan
from qwenrt.lora import DEFAULT_TARGETS, LoraSpec, add_adapters, lora_modules
from qwenrt.merge import merge_lora
from qwenrt.served_adapters import ServedExperts, served_modules
from tests.hostile import one_line_error

peft = pytest.importorskip("peft")

IDS = torch.tensor([[5, 17, 300, 42, 9, 77, 128, 3, 256, 11, 500, 64]])
DENSE_KINDS = 12  # DeltaNet 5, attention 4, MLP 3


def _bound(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _peft_adapter(ref_model, out, targets=list(DEFAULT_TARGETS[:12]), seed=0, **options):
    """A PEFT adapter with random non-zero B on a copy of the transformers model: (the PeftModel, its directory)."""
    import copy

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **options)
    model = peft.get_peft_model(copy.deepcopy(ref_model), config).eval()
    model.save_pretrained(out)
    return model


def _randomize_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def test_peft_adapter_loads_into_qwenrt_with_peft_logits(dense_ckpt, tmp_path):
    path, ref = dense_ckpt
    peft_model = _peft_adapter(ref, tmp_path / "a")
    with torch.no_grad():
        expected = peft_model(IDS).logits
        base = ref(IDS).logits
    model, _ = qwenrt.load(path, dtype="float32", adapter=tmp_path / "a")
    assert len(served_modules(model)) == 8 * 3 + 2 * 4 + 6 * 5  # every projection of every layer
    with torch.no_grad():
        ours = model(IDS)
    assert _bound(ours, expected) <= 1e-4
    assert _bound(base, expected) > 1e-2  # the adapter changes the logits: the check can fail


def test_our_adapter_loads_into_peft_with_our_logits(dense_ckpt, tmp_path):
    path, ref = dense_ckpt
    model, _ = qwenrt.load(path, dtype="float32")
    spec = LoraSpec(4, 16)
    add_adapters(model, spec)
    _randomize_adapters(model)
    save_adapter(tmp_path / "ours", model, spec, str(path))
    config = json.loads((tmp_path / "ours" / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and len(config["target_modules"]) == DENSE_KINDS
    names = load_file(tmp_path / "ours" / WEIGHTS_FILE)
    assert "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight" in names
    with torch.no_grad():
        ours = model(IDS)
        import copy

        peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(ref), tmp_path / "ours").eval()
        expected = peft_model(IDS).logits
    assert _bound(ours, expected) <= 1e-4


def test_moe_shared_expert_adapter_round_trip(moe_ckpt, tmp_path):
    path, ref = moe_ckpt
    targets = ["linear_attn.in_proj_qkv", "self_attn.o_proj", "mlp.shared_expert.down_proj"]
    peft_model = _peft_adapter(ref, tmp_path / "a", targets)
    model, _ = qwenrt.load(path, dtype="float32", adapter=tmp_path / "a")
    with torch.no_grad():
        assert _bound(model(IDS), peft_model(IDS).logits) <= 1e-4


@pytest.mark.parametrize("banks", [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ["mlp.experts.down_proj"]])
def test_peft_routed_expert_adapters_load_and_merge_with_peft_logits(moe_ckpt, tmp_path, banks):
    """PEFT's target_parameters on the fused expert banks (both nested, or one): qwenrt's logits (the adapter loaded,
    and merged) are PEFT's."""
    path, ref = moe_ckpt
    peft_model = _peft_adapter(ref, tmp_path / "p", ["self_attn.q_proj"], target_parameters=banks)
    with torch.no_grad():
        expected = peft_model(IDS).logits
        model, _ = qwenrt.load(path, dtype="float32", adapter=tmp_path / "p")
        assert _bound(model(IDS), expected) <= 1e-4
        assert main(["merge-lora", str(path), str(tmp_path / "p"), str(tmp_path / "merged")]) == 0
        merged, _ = qwenrt.load(tmp_path / "merged", dtype="float32")
        assert _bound(merged(IDS), expected) <= 1e-4
        for m in model.modules():  # the experts' adapters off: the check sees them
            if isinstance(m, ServedExperts):
                m.gate_up = m.down = [None, None]
        assert _bound(model(IDS), expected) > 1e-3


def test_merged_checkpoint_gives_the_adapted_logits_here_and_in_transformers(dense_ckpt, tmp_path, capsys):
    from transformers import Qwen3_5ForCausalLM

    path, ref = dense_ckpt
    peft_model = _peft_adapter(ref, tmp_path / "a")
    assert main(["merge-lora", str(path), str(tmp_path / "a"), str(tmp_path / "merged")]) == 0
    assert "merged 62 adapted weights" in capsys.readouterr().out
    with torch.no_grad():
        expected = peft_model(IDS).logits
        merged, _ = qwenrt.load(tmp_path / "merged", dtype="float32")
        assert _bound(merged(IDS), expected) <= 1e-4
        theirs = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert _bound(theirs(IDS).logits, expected) <= 1e-4


def test_adapter_model_keeps_the_native_decode_plan_and_decodes_as_its_prefill(dense_ckpt, tmp_path):
    """bf16: the adapted model decodes through the native plan (adapters bound in it); its stepped logits follow the
    whole prompt's, which the adapter moves."""
    path, ref = dense_ckpt
    _peft_adapter(ref, tmp_path / "a")
    base, _ = qwenrt.load(path, dtype="bfloat16")
    adapted, _ = qwenrt.load(path, dtype="bfloat16", adapter=tmp_path / "a")
    assert qwenrt.kernels.cpu_kernels() is None or DecodePlan.for_model(adapted) is not None
    cache = adapted.new_cache()
    with torch.no_grad():
        stepped = torch.cat([adapted(IDS[:, :6], cache)[:, -1:]] +
                            [adapted(IDS[:, t:t + 1], cache) for t in range(6, IDS.shape[1])], dim=1)
        whole = adapted(IDS)[:, 5:]
        assert _bound(base(IDS)[:, 5:], whole) > 1e-1
    assert _bound(stepped, whole) <= 3e-2  # bf16 rounding between the chunked and the stepped paths


def test_int4_base_trains_adapters_through_the_quantized_weights(dense_ckpt):
    """QLoRA: on an int4 base the loss's gradient reaches the first layer's adapter (through every frozen int4
    projection above it: the native kernels have no backward of their own), and nothing else gets one."""
    path, _ = dense_ckpt
    model, _ = qwenrt.load(path, dtype="float32", quantize="int4")
    add_adapters(model, LoraSpec(4, 8, ("in_proj_qkv", "q_proj")))
    _randomize_adapters(model)
    model.train()
    loss = model(IDS).logsumexp(-1).mean()
    loss.backward()
    first = lora_modules(model)["model.layers.0.linear_attn.in_proj_qkv"]
    assert first.lora_A.grad is not None and float(first.lora_A.grad.abs().max()) > 0
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def _chat_data(tmp_path, n=8):
    from qwenrt.tiny.tasks import conversations

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(n, 4)))
    return data


def test_lora_training_changes_only_the_adapters_and_lowers_the_loss(tmp_path, capsys, monkeypatch):
    """The trained model as the run leaves it: every base tensor bit for bit the stored one, every adapter's B moved
    off zero; the held-out loss falls; OUT holds the adapter (which loads), not a checkpoint."""
    import qwenrt.train.trainer as trainer
    from qwenrt.default_model import default_model_path

    trained = {}
    save = trainer.save_adapter
    monkeypatch.setattr(trainer, "save_adapter", lambda d, model, *a: (trained.update(model.state_dict()),
                                                                       save(d, model, *a)))
    builtin = default_model_path()
    data = _chat_data(tmp_path, 16)
    out = tmp_path / "run"
    assert main(["train", str(out), "--data", str(data), "--eval-data", str(data), "--steps", "6",
                 "--batch-size", "8", "--lr", "1e-2", "--lora-rank", "4", "--gradient-checkpointing", "-q"]) == 0
    assert "adapter in" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE, "train_log.jsonl"]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in log if "eval_loss" in r]
    assert evals[-1] < evals[0], evals
    stored = load_file(builtin / "model.safetensors")
    base = {n: t for n, t in trained.items() if "lora_" not in n and n != "lm_head.weight"}  # the head is tied
    assert len(base) == len(stored)
    for name, t in base.items():  # fp32 copies of the stored bf16 / fp32 tensors: exact
        assert torch.equal(t, stored[name.replace(".base_layer", "")].float()), name
    assert all(float(t.abs().max()) > 0 for n, t in trained.items() if n.endswith("lora_B"))
    model, _ = qwenrt.load(builtin, adapter=out)
    assert len(served_modules(model)) == 6 * 3 + 2 * 4 + 4 * 5


def test_plan_prints_adapters_parameters_and_memory_without_training(tmp_path, capsys):
    assert main(["train", str(tmp_path / "run"), "--data", str(tmp_path / "none.jsonl"), "--lora-rank", "8",
                 "--plan"]) == 0
    out = capsys.readouterr().out
    assert "linear_attn.in_proj_qkv" in out and "trainable" in out and "GiB" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("options, fragment", [
    (["--lora-targets", "q_proj,nope_proj"], "'nope_proj' matches no projection"),
    (["--lora-targets", "mlp.experts.down_proj"], "'mlp.experts.down_proj' matches no projection"),
    (["--lora-dropout", "1.5"], "dropout"),
])
def test_bad_lora_options_get_one_line_errors(options, fragment, tmp_path, capsys):
    data = _chat_data(tmp_path, 2)
    assert main(["train", str(tmp_path / "run"), "--data", str(data), "--lora-rank", "4", "--plan", *options]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and fragment in err, err


def _break(adapter, fault):
    weights = load_file(adapter / WEIGHTS_FILE)
    config = json.loads((adapter / CONFIG_FILE).read_text())
    name = "base_model.model.model.layers.0.linear_attn.in_proj_z"
    if fault == "no config":
        (adapter / CONFIG_FILE).unlink()
    elif fault == "no weights":
        (adapter / WEIGHTS_FILE).unlink()
    elif fault == "rank":
        config["r"] = 8
        (adapter / CONFIG_FILE).write_text(json.dumps(config))
    elif fault == "shape":
        weights[name + ".lora_A.weight"] = torch.zeros(4, 65)
    elif fault == "unknown module":
        weights["base_model.model.model.layers.0.linear_attn.conv1d.lora_A.weight"] = torch.zeros(4, 64)
    elif fault == "half a pair":
        del weights[name + ".lora_B.weight"]
    elif fault == "bad pattern":
        config["rank_pattern"] = {"in_proj_(z": 2}
        (adapter / CONFIG_FILE).write_text(json.dumps(config))
    elif fault == "redos pattern":
        config["alpha_pattern"] = {"(.*a+)+$": 3}
        (adapter / CONFIG_FILE).write_text(json.dumps(config))
    elif fault == "pattern rank":
        config["rank_pattern"] = {"linear_attn.in_proj_z": 2}  # the tensors hold rank 4
        (adapter / CONFIG_FILE).write_text(json.dumps(config))
    elif fault == "not lora":
        config["peft_type"] = "IA3"
        (adapter / CONFIG_FILE).write_text(json.dumps(config))
    elif fault == "damaged":
        (adapter / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    if fault in ("shape", "unknown module", "half a pair"):
        save_file(weights, adapter / WEIGHTS_FILE)


@pytest.mark.parametrize("fault, fragment", [
    ("no config", "no adapter_config.json"), ("no weights", "no adapter_model.safetensors"),
    ("rank", "r = 8"), ("shape", "do not fit the base"), ("unknown module", "no projection of this model"),
    ("half a pair", "has no lora_B.weight"), ("not lora", "not a LoRA adapter"),
    ("bad pattern", "rank_pattern key 'in_proj_(z' is not a regular expression"), ("pattern rank", "r = 2 for it"),
    ("redos pattern", "repeats a repeated group"),
    ("damaged", "cannot read the adapter weights"),
])
def test_bad_adapters_get_one_line_errors_naming_the_file(fault, fragment, dense_ckpt, tmp_path):
    path, ref = dense_ckpt
    adapter = tmp_path / "a"
    _peft_adapter(ref, adapter)
    _break(adapter, fault)
    message = one_line_error(lambda: qwenrt.load(path, adapter=adapter), fragment)
    assert str(adapter) in message
    one_line_error(lambda: merge_lora(path, adapter, tmp_path / "merged"), fragment)
    assert not (tmp_path / "merged").exists()
