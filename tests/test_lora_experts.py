"""LoRA adapters trained on the routed MoE experts' banks (PEFT's target_parameters): their gradients are PEFT's, each
expert sees only its routed tokens; a trained adapter loads in transformers + PEFT with our logits, merges, serves
per request and wraps back for training; int8 / int4 bases train them; --plan counts them; dropout is refused."""

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import qwenrt
from qwenrt.adapters import CONFIG_FILE, read_adapter
from qwenrt.cli import main
from qwenrt.default_model import default_model_path
from qwenrt.lora import LoraBank, LoraExperts, LoraSpec, add_adapters, lora_modules, wrap
from qwenrt.served_adapters import ServedExperts
from tests.checkpoints import MOE, randomize
from tests.hostile import one_line_error
from tests.test_lora import IDS, _bound, _chat_data, _randomize_adapters
from tests.test_served_adapters import _each_alone_and_mixed

peft = pytest.importorskip("peft")

BANKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LAYERS = 4


@pytest.fixture(scope="module")
def moe_chat(tmp_path_factory):
    """(path, transformers reference) of a tiny random MoE checkpoint with the built-in model's tokenizer."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    path = tmp_path_factory.mktemp("moe-chat")
    config = Qwen3_5MoeTextConfig(**dict(MOE, vocab_size=576, num_hidden_layers=LAYERS))
    ref = randomize(Qwen3_5MoeForCausalLM(config).eval(), seed=1)
    ref.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_path() / name, path / name)
    return path, ref


@pytest.fixture(scope="module")
def trained(moe_chat, tmp_path_factory):
    """(path, reference, adapter directory): `qwenrt train --lora-rank 4` on the MoE, its default targets."""
    path, ref = moe_chat
    root = tmp_path_factory.mktemp("moe-run")
    out = root / "run"
    assert main(["train", str(out), "--init", str(path), "--data", str(_chat_data(root, 4)), "--steps", "2",
                 "--batch-size", "4", "--lr", "5e-2", "--lora-rank", "4", "--gradient-checkpointing", "-q"]) == 0
    return path, ref, out


def test_trained_expert_adapters_load_in_peft_with_our_logits(trained):
    path, ref, adapter = trained
    config = json.loads((adapter / CONFIG_FILE).read_text())
    assert config["target_parameters"] == BANKS and "mlp.shared_expert.down_proj" in config["target_modules"]
    with torch.no_grad():
        expected = peft.PeftModel.from_pretrained(copy.deepcopy(ref), adapter).eval()(IDS).logits
        model, _ = qwenrt.load(path, dtype="float32", adapter=adapter)
        assert _bound(model(IDS), expected) <= 1e-4
        assert _bound(ref(IDS).logits, expected) > 1e-2  # the adapter changes the logits
        for m in model.modules():  # the experts' adapters off: they trained, and the check sees them
            if isinstance(m, ServedExperts):
                m.gate_up = m.down = [None, None]
        assert _bound(model(IDS), expected) > 1e-3


def test_merged_trained_adapter_equals_it_loaded(trained, tmp_path):
    path, _, adapter = trained
    assert main(["merge-lora", str(path), str(adapter), str(tmp_path / "merged")]) == 0
    with torch.no_grad():
        loaded, _ = qwenrt.load(path, dtype="float32", adapter=adapter)
        merged, _ = qwenrt.load(tmp_path / "merged", dtype="float32")
        assert _bound(merged(IDS), loaded(IDS)) <= 1e-4


def test_trained_adapter_in_a_mixed_batch_equals_each_alone(trained):
    path, _, adapter = trained
    model, _ = qwenrt.load(path, dtype="bfloat16", adapters={"t": adapter})
    alone, mixed = _each_alone_and_mixed(model, [None, "t", None, "t"])
    assert mixed == alone
    assert _each_alone_and_mixed(model, [None] * 4)[1][1::2] != mixed[1::2]  # the adapter changes the tokens


def test_saved_expert_adapters_wrap_back_for_training(trained):
    """A resumed run's model (the saved adapter read back and wrapped, trainable) computes the served logits."""
    path, _, adapter = trained
    model, _ = qwenrt.load(path, dtype="float32")
    spec, adapters = read_adapter(adapter, model)
    wrap(model, adapters, spec.scaling, trainable=True)
    assert sum(isinstance(m, LoraBank) for m in lora_modules(model).values()) == 2 * LAYERS
    served, _ = qwenrt.load(path, dtype="float32", adapter=adapter)
    with torch.no_grad():
        assert _bound(model(IDS), served(IDS)) <= 1e-6


def _adapted(path, targets=("q_proj", *BANKS), dtype="float32", **options):
    """The checkpoint with random non-zero adapters on `targets`, in training mode."""
    model, _ = qwenrt.load(path, dtype=dtype, **options)
    add_adapters(model, LoraSpec(4, 8, targets))
    _randomize_adapters(model)
    return model.train()


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0, :-1], IDS[0, 1:])


def _peft_grads(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapter's gradients (lora_A, lora_B), a bank's in PEFT's layout."""
    from qwenrt.adapters import _peft_pair

    return {p: _peft_pair(LoraBank(m.lora_A.grad, m.lora_B.grad, 1.0)) if isinstance(m, LoraBank) else
            (m.lora_A.grad.clone(), m.lora_B.grad.clone()) for p, m in lora_modules(model).items()}


def test_expert_gradients_are_peft_s_and_each_expert_sees_its_tokens_only(moe_ckpt, tmp_path, monkeypatch):
    """fp32: every adapter's gradient (the banks' in PEFT's layout) is PEFT's training gradient, with and without
    gradient checkpointing; a forward runs each expert on the rows routed to it only."""
    from qwenrt.adapters import _peft_path, save_adapter

    path, ref = moe_ckpt
    model = _adapted(path)
    save_adapter(tmp_path / "a", model, LoraSpec(4, 8), str(path))
    rows = []
    expert = LoraExperts.expert
    monkeypatch.setattr(LoraExperts, "expert", lambda self, e, x, r=None: rows.append(len(x)) or expert(self, e, x))
    grads = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad()
        _loss(model(IDS)).backward()
        grads.append(_peft_grads(model))
        if not checkpointing:
            assert sum(rows) == IDS.numel() * MOE["num_experts_per_tok"] * MOE["num_hidden_layers"]
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(ref), tmp_path / "a", is_trainable=True).train()
    _loss(theirs(IDS).logits).backward()
    expected = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    banks = {p: m for p, m in lora_modules(model).items() if isinstance(m, LoraBank)}
    assert len(banks) == 2 * MOE["num_hidden_layers"] and len(expected) == 2 * len(grads[0])
    for p, pair in grads[0].items():
        for ours, piece in zip(pair, ("lora_A", "lora_B")):
            assert _bound(ours, expected[f"base_model.model.{_peft_path(p, banks)}.{piece}.default.weight"]) <= 1e-5
        assert all(torch.equal(a, b) for a, b in zip(pair, grads[1][p]))  # checkpointed: the same sums


@pytest.mark.parametrize("base", [dict(dtype="bfloat16"), dict(quantize="int8"), dict(quantize="int4")])
def test_bf16_and_quantized_bases_train_expert_adapters(moe_ckpt, base):
    """bf16, and QLoRA on int8 / int4 experts: the loss's gradient reaches every bank's adapters (the first layer's
    through every frozen expert above it) and nothing else gets one; bf16's and int8's first-layer gradient is within
    10% of fp32's (int4's random weights move the routing and the logits too far for a bound)."""
    path, _ = moe_ckpt
    model = _adapted(path, BANKS, **base)
    _loss(model(IDS).float()).backward()
    assert all(float(m.lora_A.grad.abs().max()) > 0 for m in lora_modules(model).values())
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    if base.get("quantize") != "int4":
        exact = _adapted(path, BANKS)
        _loss(exact(IDS)).backward()
        first = "model.layers.0.mlp.experts.gate_up_proj"
        assert _bound(lora_modules(model)[first].lora_A.grad, lora_modules(exact)[first].lora_A.grad) <= 1e-1


def test_plan_counts_the_expert_adapters(moe_chat, tmp_path, capsys):
    path, _ = moe_chat
    assert main(["train", str(tmp_path / "run"), "--init", str(path), "--data", str(tmp_path / "none.jsonl"),
                 "--lora-rank", "8", "--plan"]) == 0
    out = capsys.readouterr().out
    E, D, I = MOE["num_experts"], MOE["hidden_size"], MOE["moe_intermediate_size"]
    assert f"mlp.experts.gate_up_proj            {LAYERS} x  {LAYERS * E * 8 * (D + 2 * I):>12,} parameters" in out
    assert f"mlp.experts.down_proj               {LAYERS} x  {LAYERS * E * 8 * (I + D):>12,} parameters" in out
    assert not (tmp_path / "run").exists()


def test_dropout_on_the_experts_is_refused_in_one_line(moe_ckpt):
    path, _ = moe_ckpt
    model, _ = qwenrt.load(path, dtype="float32")
    one_line_error(lambda: add_adapters(model, LoraSpec(2, 2, dropout=0.1)), "routed MoE experts", "dropout")
    add_adapters(model, LoraSpec(2, 2, ("q_proj", "mlp.shared_expert.down_proj", "down_proj"), dropout=0.1))
    assert not any(isinstance(m, LoraExperts) for m in model.modules())  # "down_proj" names no expert bank
