"""`qwenrt qa`: each check passes on good models (the built-in one, a random checkpoint) and fails where its path is
broken; the JSON report's shape, the exit codes, skipped checks with their reasons, bad arguments in one line."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenrt import qa
from qwenrt.cli import main
from qwenrt.engine.runner import ModelRunner
from qwenrt.model import Qwen35ForCausalLM

FAST = dict(prompt_len=16, gen_len=8)


def statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def test_every_check_passes_on_the_built_in_model(capsys):
    assert main(["qa", "--kl", "int8,int4", "--prompt-len", "16", "--gen-len", "8", "--threads", "2", "--json",
                 "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"model", "machine", "checks", "passed"} and report["passed"] is True
    assert report["model"]["source"] == "qwenrt-tiny" and report["model"]["dtype"] == "bfloat16"
    assert report["machine"]["threads"] == 2 and report["machine"]["kernels"]
    assert statuses(report) == dict.fromkeys(qa.CHECKS, "pass")
    for c in report["checks"]:
        assert set(c) == {"name", "status", "reason", "figures", "seconds"} and c["reason"]
    assert check(report, "parity")["figures"]["max_rel_diff"] <= qa.PARITY_BOUND
    assert check(report, "speculative")["figures"]["draft_tokens"] > 0
    kl = check(report, "kl")["figures"]
    assert 0 <= kl["int8"]["mean_kl"] < kl["int4 g64"]["mean_kl"] <= kl["int4 g64"]["max_kl"]
    assert 0.5 < kl["int4 g64"]["top1_agreement"] <= kl["int8"]["top1_agreement"] <= 1
    speed = check(report, "speed")["figures"]
    assert speed["decode_tps"] > 0 and speed["prefill_tps"] > 0 and speed["gen_len"] == 8


def test_a_random_checkpoint_passes_without_a_tokenizer(dense_ckpt):
    report = qa.run_qa(str(dense_ckpt[0]), checks="contract,determinism,parity", **FAST)
    assert report["passed"] and report["model"]["dtype"] == "float32"
    assert statuses(report) == {"contract": "pass", "repeat": "pass", "batch": "pass", "speculative": "skipped",
                                "parity": "pass"}
    assert "no MTP head" in check(report, "speculative")["reason"]


def test_a_corrupted_weight_fails_the_contract_and_skips_the_rest(dense_ckpt, tmp_path, capsys):
    path = tmp_path / "nan"
    shutil.copytree(dense_ckpt[0], path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.mlp.down_proj.weight"][5, 7] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert main(["qa", str(path), "--checks", "contract,repeat,speed", "-q"]) == 1
    out = capsys.readouterr().out
    assert "model.layers.3.mlp.down_proj.weight' holds 1 NaN/Inf" in out and "FAIL: contract" in out
    report = qa.run_qa(str(path), checks="contract,repeat,speed", **FAST)
    assert statuses(report) == {"contract": "fail", "repeat": "skipped", "speed": "skipped"}
    assert check(report, "repeat")["reason"] == "the checkpoint fails its contract"


def test_nondeterministic_decoding_fails_repeat(monkeypatch):
    decode = ModelRunner.decode

    def shuffled(self, seqs):  # every step's logits rolled by a random amount
        logits, hidden = decode(self, seqs)
        return logits.roll(random.randrange(1, logits.shape[-1]), -1), hidden

    monkeypatch.setattr(ModelRunner, "decode", shuffled)
    report = qa.run_qa(None, checks="repeat", **FAST)
    assert statuses(report) == {"repeat": "fail"} and not report["passed"]
    assert "differs from run to run: prompt 1, token " in check(report, "repeat")["reason"]


def test_a_broken_batch_path_fails_batch(monkeypatch):
    decode = ModelRunner.decode

    def broken(self, seqs):  # the last row of a batch takes another token
        logits, hidden = decode(self, seqs)
        if len(seqs) > 1:
            logits = torch.cat([logits[:-1], logits[-1:].roll(1, -1)])
        return logits, hidden

    monkeypatch.setattr(ModelRunner, "decode", broken)
    report = qa.run_qa(None, checks="repeat,batch", **FAST)
    assert statuses(report) == {"repeat": "pass", "batch": "fail"}
    assert "a batch differs from its prompts alone: prompt 4, token " in check(report, "batch")["reason"]


def test_accepting_every_draft_fails_speculative(monkeypatch):
    import qwenrt.engine.core as core

    def accept_all(logits, drafts, *_args):  # wrong drafts kept too
        return [*drafts, int(logits[len(drafts)].argmax())], len(drafts)

    monkeypatch.setattr(ModelRunner, "cycle", lambda *_: None)  # the verify path, through `accept`
    monkeypatch.setattr(core, "accept", accept_all)
    report = qa.run_qa(None, checks="speculative", **FAST)
    assert statuses(report) == {"speculative": "fail"}
    assert "speculative decoding differs from plain" in check(report, "speculative")["reason"]


def test_logits_off_by_a_thousandth_fail_parity(monkeypatch):
    forward = Qwen35ForCausalLM.forward
    monkeypatch.setattr(Qwen35ForCausalLM, "forward", lambda self, *a, **k: forward(self, *a, **k) * 1.001)
    report = qa.run_qa(None, checks="parity", **FAST)
    assert statuses(report) == {"parity": "fail"}
    assert 5e-4 < check(report, "parity")["figures"]["max_rel_diff"] < 2e-3


def test_non_finite_quantized_logits_fail_kl(monkeypatch):
    import qwenrt.quant as quant

    quantize = quant.quantize_weight

    def poisoned(w, spec, *args):
        stored = quantize(w, spec, *args)
        return {**stored, "scales": stored["scales"] * float("nan")}

    monkeypatch.setattr(quant, "quantize_weight", poisoned)
    report = qa.run_qa(None, checks="kl", kl="int8", **FAST)
    assert statuses(report) == {"kl": "fail"} and check(report, "kl")["reason"] == "int8: non-finite logits"


def test_an_impossible_assert_tps_fails_the_exit_code(capsys):
    assert main(["qa", "--checks", "speed", "--assert-tps", "1e9", "--prompt-len", "8", "--gen-len", "4", "-q"]) == 1
    out = capsys.readouterr().out
    assert "decode below --assert-tps 1e+09" in out and out.rstrip().endswith("FAIL: speed")
    assert main(["qa", "--checks", "speed", "--assert-tps", "0.001", "--prompt-len", "8", "--gen-len", "4",
                 "-q"]) == 0


def test_parity_and_kl_say_why_they_are_skipped(dense_ckpt, tmp_path, monkeypatch):
    from qwenrt.convert import quantize_checkpoint
    from qwenrt.gguf.export import export_gguf

    gguf = export_gguf(dense_ckpt[0], tmp_path / "m.gguf", "f32")
    quantized = quantize_checkpoint(dense_ckpt[0], tmp_path / "q8", 8)
    for path, fragment in ((gguf, "a GGUF file"), (quantized, "stored quantized (int8)")):
        report = qa.run_qa(str(path), checks="parity,kl", kl="int8", **FAST)
        assert statuses(report) == {"parity": "skipped", "kl": "skipped"} and report["passed"], path
        assert fragment in check(report, "parity")["reason"]
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    report = qa.run_qa(str(dense_ckpt[0]), checks="parity", **FAST)
    assert check(report, "parity")["reason"].startswith("transformers is not installed")


@pytest.mark.parametrize("argv, fragment", [
    (["--checks", "contract,bogus"], "--checks: unknown check 'bogus' (known: contract, repeat"),
    (["--checks", ","], "--checks: no check named"),
    (["--kl", "int3"], "--kl: unknown quantization 'int3' (use int8 or int4)"),
    (["--kl", "int8", "--checks", "speed"], "--kl gives the formats of the kl check, which --checks leaves out"),
    (["--assert-tps", "0"], "--assert-tps must be a number of tokens/s > 0, got 0"),
    (["/nonexistent/model"], "/nonexistent/model: no such directory"),
])
def test_bad_arguments_are_refused_in_one_line(argv, fragment, capsys):
    assert main(["qa", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("qwenrt: error: ") and fragment in err and "\n" not in err, err


def test_a_missing_tensor_is_named_by_the_contract_and_by_the_checks_it_skips(dense_ckpt, tmp_path):
    path = tmp_path / "missing"
    shutil.copytree(dense_ckpt[0], path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    report = qa.run_qa(str(path), checks="contract,speed", **FAST)
    assert statuses(report) == {"contract": "fail", "speed": "skipped"}
    assert "missing 1 tensor(s): model.norm.weight" in check(report, "contract")["reason"]
    alone = qa.run_qa(str(path), checks="speed", **FAST)
    assert "the checkpoint fails its contract: " in check(alone, "speed")["reason"]
    assert "model.norm.weight" in check(alone, "speed")["reason"]
