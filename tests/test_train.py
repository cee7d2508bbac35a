"""Training: the loss mask, differentiability without native kernels, the shortened recipe (held-out loss falls),
seeded determinism and exact resumption, the `qwenrt train` command."""

import json
import random
import shutil
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as BackendTokenizer

import qwenrt
import qwenrt.kernels
from qwenrt.cli import main
from qwenrt.default_model import default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.mtp import load_mtp_head, mtp_hidden
from qwenrt.ops.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from qwenrt.tiny.recipe import Recipe, build
from qwenrt.tiny.tasks import TOOLS, conversations
from qwenrt.tokenizer import Tokenizer
from qwenrt.train import TrainConfig, train
from qwenrt.train.bpe import SPECIAL_TOKENS, build_tokenizer, train_bpe
from qwenrt.train.checkpoints import STATE_FILE, prune, save_checkpoint, step_dir
from qwenrt.train.data import check_conversation, encode_conversation, load_conversations
from qwenrt.train.trainer import (LOG_FILE, build_model, load_model_for_training, lr_at, sequence_losses,
                                  step_examples)
from tests.hostile import no_hang, one_line_error


@pytest.fixture(scope="session")
def quick(tmp_path_factory):
    """The shortened recipe, run once: (output directory, summary)."""
    out = tmp_path_factory.mktemp("quick")
    return out, build(out, Recipe.quick(), progress=False)


def test_quick_recipe_held_out_loss_falls(quick):
    out, summary = quick
    losses = [h["eval_loss"] for h in summary["history"]]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses  # before training, then every 4 steps
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    mtp_losses = [h["eval_mtp_loss"] for h in summary["history"]]
    assert mtp_losses[-1] < 0.8 * mtp_losses[0], mtp_losses
    log = [json.loads(line) for line in (out / "joint" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log[1:]] == list(range(Recipe.quick().steps + 1))


def test_quick_recipe_head_stage_fits_the_chained_drafts_alone(quick):
    """The recipe's second stage trains the MTP head alone on its chained drafts: their held-out losses fall, and
    the model's tensors in the final checkpoint are the joint stage's, bit for bit."""
    out, summary = quick
    history = summary["mtp_stage"]["history"]
    assert [h["step"] for h in history] == [0, 4, 8]
    for depth in ("", "2", "3"):
        losses = [h[f"eval_mtp{depth}_loss"] for h in history]
        assert losses[-1] < losses[0], (depth, losses)
    assert history[0]["eval_loss"] == history[-1]["eval_loss"]
    joint, final = load_file(out / "joint" / "model.safetensors"), load_file(out / "model.safetensors")
    assert joint.keys() == final.keys()
    for name, t in final.items():
        assert torch.equal(t, joint[name]) != name.startswith("mtp."), name


def test_quick_checkpoint_is_a_qwen35_checkpoint(quick):
    out, _ = quick
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["mtp_num_hidden_layers"] == 1
    modes = {(out / name).stat().st_mode & 0o777 for name in ("config.json", "model.safetensors", "tokenizer.json")}
    assert len(modes) == 1  # the weights as readable as the rest (safetensors alone would make them 0600)
    stored = load_file(out / "model.safetensors")
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in stored) and "lm_head.weight" not in stored
    model, tokenizer = qwenrt.load(out)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(tokenizer.vocab_size - 33,
                                                                          tokenizer.vocab_size))
    mtp = load_mtp_head(model)
    ids = torch.tensor([tokenizer.encode("What is 12 + 30?")])
    assert mtp_hidden(model, mtp, ids).shape == (1, ids.shape[1] - 1, model.config.text.hidden_size)


def test_transformers_tokenizer_encodes_the_trained_tokenizer_as_written(quick):
    """The trainer's tokenizer_config names a class that makes transformers' AutoTokenizer use tokenizer.json as is
    (a Qwen tokenizer class rebuilds the Qwen3.5 pre-tokenizer over this vocabulary, not capitals-apart)."""
    from transformers import AutoTokenizer

    out, _ = quick
    tokenizer, hf = Tokenizer(out), AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is the capital of Velmoria? And 4821 * 37?"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, enable_thinking=False)
    assert hf.apply_chat_template(messages, tools=TOOLS, enable_thinking=False, add_generation_prompt=True,
                                  tokenize=True)["input_ids"] == tokenizer.encode(text)


def test_capitals_apart_gives_a_name_the_same_tokens_wherever_it_stands(quick, tmp_path):
    """The recipe's pre-tokenizer: a made-up name after a space (a question), a newline (a tool call's argument) or
    a '>' has the same tokens, so copying it is copying tokens; Qwen3.5's joins the space to the name."""
    out, _ = quick
    tokenizer = Tokenizer(out)
    name = tokenizer.encode("Velmoria")
    for before in (" ", "\n", ">"):
        assert tokenizer.encode(f"capital of{before}Velmoria?")[-len(name) - 1:-1] == name, before
    assert tokenizer.encode("127") == [tokenizer.token_to_id(d) for d in "127"]
    data = conversations(50, 3)
    build_tokenizer(tmp_path / "qwen", data, 512, "qwen3.5")
    for directory, pieces in ((out, ["Ġ", "V", "elmoria"]), (tmp_path / "qwen", ["ĠVelmoria"])):
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(" Velmoria")] == pieces
    with pytest.raises(QwenrtError, match="unknown pre-tokenizer 'gpt2'"):
        build_tokenizer(tmp_path / "bad", data, 512, "gpt2")


def test_min_count_drops_the_tokens_its_corpus_seldom_uses(tmp_path):
    """Without min_count BPE keeps intermediates the corpus's own encoding hardly uses (a held-out name would bring
    them out untrained); with it every merged token is used at least min_count times, and text still round-trips."""
    words = ["always", "always", "away", "Norway", "anyway", "the way"] * 3 + ["cat", "cats", "hat", "that"] * 20
    texts = [f"<|im_start|>user\nRepeat after me: {w}<|im_end|>" for w in words]
    pieces = [f"user\nRepeat after me: {w}" for w in words]  # what BPE sees: special tokens cut out
    counts = {}
    for min_count in (0, 10):
        tok = train_bpe(texts, 512, "capitals-apart", min_count)
        merged = {t for t in tok.get_vocab(with_added_tokens=False) if len(t) > 1}
        used = Counter(i for e in tok.encode_batch(pieces, add_special_tokens=False) for i in e.ids)
        counts[min_count] = {t: used[tok.token_to_id(t)] for t in merged}
        assert all(tok.decode(tok.encode(t).ids, skip_special_tokens=False) == t for t in texts + ["Nigeria anyway"])
        assert tok.token_to_id("<|im_end|>") == tok.get_vocab_size() - len(SPECIAL_TOKENS) + 2
    assert min(counts[0].values()) < 10 <= min(counts[10].values())
    assert counts[0]["way"] == 0 and "way" not in counts[10] and counts[10]["Ġcat"] == 20


class _NoKernels:
    def __getattr__(self, name):
        raise AssertionError(f"native kernel {name} called")


def test_training_never_calls_native_kernels(monkeypatch, quick):
    """With kernels 'available' (a stand-in that fails when used), a training step takes the torch ops, while the
    same forward without autograd reaches the kernels: the check can fail."""
    out, _ = quick
    model, mtp = build_model(json.loads((out / "config.json").read_text()), True, 0)
    monkeypatch.setattr(qwenrt.kernels, "cpu_kernels", lambda: _NoKernels())
    ids = torch.randint(0, 100, (2, 70))
    mask = torch.ones_like(ids, dtype=torch.bool)
    main_loss, extra, _, _ = sequence_losses(model, mtp, ids, mask)
    (main_loss + sum(extra)).backward()
    assert all(p.grad is not None for p in model.parameters()) and mtp.fc.weight.grad is not None
    with torch.no_grad(), pytest.raises(AssertionError, match="native kernel"):
        model(ids)


def test_chunked_rule_gradients_match_recurrent():
    g = torch.Generator().manual_seed(3)
    B, T, H, D = 2, 75, 2, 8
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    grads = []
    for rule in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, decay, beta)]
        out, _ = rule(*inputs[:3], g=inputs[3], beta=inputs[4])
        (out * weight).sum().backward()
        grads.append([x.grad for x in inputs])
    for chunked, recurrent in zip(*grads):
        assert (chunked - recurrent).abs().max() <= 1e-10 * recurrent.abs().max()


def test_loss_mask_covers_exactly_what_the_model_generates(quick):
    out, _ = quick
    tokenizer = Tokenizer(out)
    tool_chat = next(c for c in conversations(200, 5) if "tools" in c and c["messages"][0]["role"] == "user"
                     and c["messages"][1].get("tool_calls") and c["messages"][1].get("reasoning_content"))
    example = encode_conversation(tokenizer, tool_chat)
    spans, current = [], []
    for token, on in zip(example.ids, example.loss_mask):
        if on:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    call, answer = tool_chat["messages"][1], tool_chat["messages"][3]
    assert spans[0].startswith(call["reasoning_content"] + "\n</think>\n\n<tool_call>\n<function=")
    assert spans[0].endswith("</tool_call><|im_end|>")
    assert spans[1] == answer["reasoning_content"] + "\n</think>\n\n" + answer["content"] + "<|im_end|>"
    assert len(spans) == 2
    direct = {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                           {"role": "assistant", "content": "2 + 2 = 4"}]}
    example = encode_conversation(tokenizer, direct)
    assert tokenizer.decode([t for t, on in zip(example.ids, example.loss_mask) if on]) == "2 + 2 = 4<|im_end|>"


def test_training_is_deterministic_and_resumable(quick, tmp_path):
    """Two runs with one seed give identical weights, and so does a run resumed from its step checkpoint (in the
    middle of a group of steps regrouped by length); another seed (another data order) does not."""
    out, _ = quick
    data = conversations(40, 11)
    cfg = TrainConfig(out=str(tmp_path / "a"), data=data, init=str(out), steps=4, batch_size=4, save_every=2,
                      warmup=1, length_groups=4, progress=False, threads=1)
    train(cfg)
    train(replace(cfg, out=str(tmp_path / "again")))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").unlink()
    train(replace(cfg, out=str(tmp_path / "b"), resume=True))
    train(replace(cfg, out=str(tmp_path / "other"), seed=1))
    weights = {name: load_file(tmp_path / name / "model.safetensors") for name in ("a", "again", "b", "other")}
    a = weights["a"]
    for name in ("again", "b"):
        assert a.keys() == weights[name].keys() and all(torch.equal(a[n], weights[name][n]) for n in a), name
    assert not all(torch.equal(a[n], weights["other"][n]) for n in a)


def test_in_order_takes_the_first_pass_as_given():
    """A curriculum (the built-in recipe's copying first) needs the data's own order in the first pass; later passes
    are shuffled as without it."""
    examples = list(range(12))

    def epoch(k, in_order):
        return [e for step in range(4 * k, 4 * k + 4) for e in step_examples(examples, step, 3, 0, in_order)]

    assert epoch(0, True) == examples != epoch(0, False)
    assert sorted(epoch(1, True)) == examples != epoch(1, True) and epoch(1, True) == epoch(1, False)


def test_length_groups_deal_the_same_conversations_in_bands_of_like_length():
    examples = ["x" * n for n in random.Random(0).choices(range(1, 300), k=48)]

    def run(groups, seed=0):
        return [step_examples(examples, step, 4, seed, True, groups) for step in range(8)]

    plain, grouped = run(1), run(4)
    assert grouped == run(4) and grouped != run(4, seed=1)
    for first in (0, 4):  # each group of 4 steps: the same conversations, dealt out in bands of like length
        bands = grouped[first:first + 4]
        assert sorted(sum(bands, [])) == sorted(sum(plain[first:first + 4], []))
        assert all(len(b) == 4 for b in bands)
        by_length = sorted(bands, key=lambda b: len(b[0]))
        assert all(max(map(len, a)) <= min(map(len, b)) for a, b in zip(by_length, by_length[1:]))

    def padding(steps):
        return sum(max(map(len, b)) - len(e) for b in steps for e in b)

    assert padding(grouped) < 0.5 * padding(plain)


def test_learning_rate_warms_up_holds_then_decays():
    cfg = TrainConfig(out="unused", data=[], steps=100, lr=1.0, warmup=10, hold=20, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert all(lr_at(step, cfg) == 1.0 for step in range(10, 31))
    decay = [lr_at(step, cfg) for step in range(30, 101)]
    assert all(b < a for a, b in zip(decay, decay[1:])) and lr_at(100, cfg) == pytest.approx(0.1)


def test_the_default_warm_up_is_a_tenth_of_the_steps_at_most_50():
    assert [TrainConfig(out="unused", data=[], steps=steps).warmup for steps in (5, 200, 1000, 5000)] == [0, 20, 50, 50]
    short = TrainConfig(out="unused", data=[], steps=5, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, short) == 1.0 and lr_at(4, short) < 1.0  # a 5-step fine-tune starts at its learning rate
    assert TrainConfig(out="unused", data=[], steps=5, warmup=3).warmup == 3


def test_bad_training_settings_get_one_line_errors(capsys, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(4, 4)))
    for flags, message in ((["--batch-size", "0"], "batch_size must be at least 1, not 0"),
                           (["--steps", "-1"], "steps must be at least 1, not -1"),
                           (["--length-groups", "0"], "length_groups must be at least 1"),
                           (["--lr", "0"], "lr 0.0 is out of range"),
                           (["--save-dtype", "int8"], "save_dtype must be float32, bfloat16 or float16"),
                           (["--mtp-depths", "0"], "mtp_depths must be at least 1"),
                           (["--mtp-only", "--mtp-weight", "0"], "mtp_only trains the MTP head alone")):
        assert main(["train", str(tmp_path / "run"), "--data", str(data), *flags]) == 1, flags
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, (flags, err)
    assert not (tmp_path / "run").exists()


def test_train_command_on_jsonl(quick, tmp_path, capsys):
    out, _ = quick
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(12, 4)))
    assert main(["train", str(tmp_path / "run"), "--data", str(data), "--init", str(out), "--steps", "2",
                 "--batch-size", "4", "--mtp-weight", "0", "--save-dtype", "bfloat16"]) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    model, _ = qwenrt.load(tmp_path / "run")
    assert model.dtype == torch.bfloat16
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["train", str(tmp_path / "bad"), "--data", str(data), "--init", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no assistant message" in err


def test_training_into_a_model_needs_overwrite_or_resume(small_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    runs = []
    monkeypatch.setattr("qwenrt.train.train", lambda cfg: runs.append(cfg) or {"steps": cfg.steps, "seconds": 0.0,
                                                                                  "tokens": 0, "history": []})
    monkeypatch.setattr("qwenrt.tiny.recipe.build", lambda out, recipe, progress: runs.append(recipe) or {
        "steps": recipe.steps, "seconds": 0.0, "tokens": 0, "history": []})
    refusal = (f"qwenrt: error: {out} already holds a model (config.json); pass --overwrite to replace it, or --resume "
               "to continue its training\n")
    for args in (["--data", str(small_data), "--steps", "2"], ["--recipe", "tiny"]):
        assert main(["train", str(out), *args]) == 1
        assert capsys.readouterr().err == refusal and not runs
    for flag in ("--overwrite", "--resume"):
        assert main(["train", str(out), "--data", str(small_data), "--steps", "2", flag, "-q"]) == 0
    assert main(["train", str(out), "--recipe", "tiny", "--steps", "2", "--overwrite"]) == 0
    assert [run.steps for run in runs] == [2, 2, 2] and runs[1].resume
    assert [run.progress for run in runs[:2]] == [False, False]  # -q: no progress bar
    assert capsys.readouterr().err == ""


def test_recipe_steps_shorten_the_copying_phase_alike(monkeypatch, tmp_path, capsys):
    """`qwenrt train --recipe tiny --steps N`: the run still opens with the recipe's share of copying, then the
    mix (not N steps of copying alone)."""
    built = []

    def build(out, recipe, progress=True):
        built.append(recipe)
        return {"steps": recipe.steps, "seconds": 0.0, "tokens": 0, "history": []}

    monkeypatch.setattr("qwenrt.tiny.recipe.build", build)
    assert main(["train", str(tmp_path / "rebuilt"), "--recipe", "tiny", "--steps", "380"]) == 0
    full = Recipe()
    assert built[0].steps == 380 and built[0].copy_steps == full.copy_steps * 380 // full.steps > 0
    assert built[0].copy_steps < 380 and "trained 380 steps" in capsys.readouterr().out
    assert built[0].mtp_steps == full.mtp_steps * 380 // full.steps > 0


# ---- hostile inputs: the output directory, resume states, training data (issue 36) ----

BUILTIN = str(default_model_path())


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(4, 4)))
    return data


def _planted(tmp_path, layout: str):
    """(output directory, what must stay untouched) for one hostile or careless output layout."""
    out, victim = tmp_path / "run", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    if layout == "a file":
        out.write_text("not a directory")
    elif layout == "a dangling link":
        out.symlink_to(tmp_path / "missing")
    elif layout == "a link to a directory":
        out.symlink_to(victim)
    elif layout == "under /proc":
        out = Path("/proc/qwenrt-train-out")
    elif layout == "a 300-character name":
        out = tmp_path / ("x" * 300)
    elif layout == "a model.safetensors directory":
        (out / "model.safetensors").mkdir(parents=True)
    else:  # a link planted where training writes: a step directory, its old .tmp sibling, checkpoints/, the log
        (out / "checkpoints").mkdir(parents=True)
        (out / layout).symlink_to(victim if layout != LOG_FILE else victim / "keep.txt")
    return out, victim


OUTPUT_LAYOUTS = [("a file", "is not a directory"), ("a dangling link", "is a symlink"),
                  ("a link to a directory", "is a symlink"), ("under /proc", "cannot write to output directory"),
                  ("a 300-character name", "File name too long"), ("a model.safetensors directory", "is a directory"),
                  ("checkpoints/step-000002", "is a symlink"), ("checkpoints/step-000002.tmp", "is a symlink"),
                  (LOG_FILE, "is a symlink")]


@pytest.mark.parametrize("layout, message", OUTPUT_LAYOUTS, ids=[layout for layout, _ in OUTPUT_LAYOUTS])
def test_unusable_output_directory_is_refused_before_any_training_work(layout, message, small_data, tmp_path,
                                                                        monkeypatch, capsys):
    out, victim = _planted(tmp_path, layout)

    def started(*_):
        raise AssertionError("training work started")

    monkeypatch.setattr("qwenrt.train.trainer.load_model_for_training", started)
    assert main(["train", str(out), "--data", str(small_data), "--init", BUILTIN, "--steps", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"] and (victim / "keep.txt").read_text() == "mine"


def test_a_bad_model_config_gets_one_line_error(small_data, tmp_path, capsys):
    config = tmp_path / "config.json"
    for text, message in (("[" * 100_000, "not valid JSON"), ('{"n": ' + "9" * 5000 + "}", "not valid JSON"),
                          ("[]", "expected a JSON object")):
        config.write_text(text)
        assert main(["train", str(tmp_path / "run"), "--data", str(small_data), "--config", str(config),
                     "--tokenizer", BUILTIN]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err


def test_recipe_checks_its_output_before_building(tmp_path, capsys):
    (tmp_path / "rebuilt").write_text("a file")
    assert main(["train", str(tmp_path / "rebuilt"), "--recipe", "tiny"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a directory" in err, err


def test_a_file_beside_the_output_named_like_its_old_tmp_folder_is_left_alone(small_data, tmp_path):
    """Checkpoints are written into a fresh private folder inside their directory: a file `OUT.tmp` (where the
    final checkpoint used to be staged, failing at the end of the run) is neither in the way nor touched."""
    out = tmp_path / "run"
    (tmp_path / "run.tmp").write_text("mine")
    train(TrainConfig(out=str(out), data=str(small_data), init=BUILTIN, steps=2, batch_size=2, save_every=1,
                      mtp_weight=0, progress=False, threads=1))
    assert (tmp_path / "run.tmp").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("tokenizer")) == [
        "chat_template.jinja", "checkpoints", "config.json", "generation_config.json", "model.safetensors",
        LOG_FILE]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]


@pytest.fixture(scope="module")
def builtin_model():
    return load_model_for_training(BUILTIN, False, 0)[0]


def test_checkpoint_is_never_written_through_a_link(builtin_model, tmp_path):
    """A link that appears where a step directory goes after the start is refused at the save, not followed."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-000002").symlink_to(victim)
    one_line_error(lambda: save_checkpoint(step_dir(tmp_path, 2), builtin_model, None, {}, Path(BUILTIN),
                                           state={"step": 2, "optimizer": {}}), "step-000002 is a symlink")
    assert list(victim.iterdir()) == []
    (tmp_path / "checkpoints").rename(tmp_path / "moved")
    (tmp_path / "checkpoints").symlink_to(victim)
    one_line_error(lambda: step_dir(tmp_path, 2), "checkpoints is a symlink")
    assert list(victim.iterdir()) == []


def test_prune_removes_only_real_step_directories(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    checkpoints = tmp_path / "checkpoints"
    for step in (1, 3, 4):
        (checkpoints / f"step-{step:06d}").mkdir(parents=True)
        (checkpoints / f"step-{step:06d}" / "model.safetensors").write_text("weights")
    (checkpoints / "step-000002").symlink_to(victim)
    (checkpoints / "step-000000.tmp").symlink_to(victim)
    (checkpoints / "step-000003" / "inner").symlink_to(victim)
    prune(tmp_path, 1)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000.tmp", "step-000002", "step-000004"]
    assert [p.name for p in victim.iterdir()] == ["keep.txt"]


@pytest.fixture(scope="module")
def resumable(small_data, tmp_path_factory):
    """A 2-step run of the built-in model with a step checkpoint after step 1: (output directory, its config)."""
    out = tmp_path_factory.mktemp("resumable")
    cfg = TrainConfig(out=str(out), data=str(small_data), init=BUILTIN, steps=2, batch_size=2, save_every=1,
                      mtp_weight=0, progress=False, threads=1)
    train(cfg)
    return out, cfg


def _wrong_shape(state):
    moments = state["optimizer"]["state"][0]
    moments["exp_avg"] = moments["exp_avg"][:1]


def _nan(state):
    state["optimizer"]["state"][0]["exp_avg_sq"][...] = float("nan")


def _group_short(state):
    state["optimizer"]["param_groups"][0]["params"].pop()


BAD_STATES = [
    ("no optimizer", lambda s: s.pop("optimizer"), "has no optimizer state"),
    ("no step", lambda s: s.pop("step"), "step must be an integer >= 0, not None"),
    ("negative step", lambda s: s.update(step=-1), "step must be an integer >= 0, not -1"),
    ("float step", lambda s: s.update(step=1.5), "not 1.5"),
    ("string step", lambda s: s.update(step="1"), "not '1'"),
    ("bool step", lambda s: s.update(step=True), "not True"),
    ("step past the run", lambda s: s.update(step=5), "at step 5, past steps 2"),
    ("moments of another shape", _wrong_shape, "'exp_avg' must be finite floats of shape"),
    ("NaN moments", _nan, "'exp_avg_sq' must be finite floats"),
    ("a parameter short", _group_short, "the optimizer state does not fit this model"),
    ("moments missing", lambda s: s["optimizer"]["state"][0].pop("exp_avg"), "optimizer state has"),
    ("not a dict", lambda s: s.clear(), "has no optimizer state"),
    ("code", lambda s: s.update(hook=shutil.rmtree), "not a training state (damaged, or holding more than"),
]


@pytest.mark.parametrize("fault, damage, message", BAD_STATES, ids=[fault for fault, _, _ in BAD_STATES])
def test_bad_resume_state_gets_one_line_error(fault, damage, message, resumable, tmp_path):
    out, cfg = resumable
    shutil.copytree(out, tmp_path / "run")
    state_file = tmp_path / "run" / "checkpoints" / "step-000001" / STATE_FILE
    state = torch.load(state_file, weights_only=True)
    damage(state)
    torch.save(state, state_file)
    one_line_error(lambda: train(replace(cfg, out=str(tmp_path / "run"), resume=True)), STATE_FILE, message)


DATA_FAULTS = [
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff"}]}', "not UTF-8 text"),
    ("100k-deep JSON", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("5000-digit integer", b'{"messages": [], "n": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
    ("NaN", b'{"messages": [{"role": "user", "content": NaN}]}', "NaN is not valid JSON"),
    ("non-string reasoning", json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "reasoning_content": 5}]}).encode(),
     "message 1: 'reasoning_content' must be a string, not int"),
    ("tool_calls a number", json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "tool_calls": 7}]}).encode(),
     "message 1: 'tool_calls' must be a list, not int"),
    ("content an object", json.dumps({"messages": [
        {"role": "user", "content": {"a": 1}}, {"role": "assistant", "content": "a"}]}).encode(),
     "message 0: 'content' must be a string or a list of text parts"),
    ("deep tool arguments", json.dumps({"messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]}]}
                                       ).encode(), "tool call arguments are not valid JSON (nested too deeply)"),
]


@pytest.mark.parametrize("fault, line, message", DATA_FAULTS, ids=[fault for fault, _, _ in DATA_FAULTS])
def test_training_data_faults_get_one_line_errors_naming_the_line(fault, line, message, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_bytes(json.dumps(conversations(1, 4)[0]).encode() + b"\n" + line + b"\n")
    one_line_error(lambda: load_conversations(str(data)), f"{data}:2: ", message)


@pytest.fixture(scope="module")
def tokenizers():
    """The built-in model's tokenizer and the real Qwen3.5 one (its pre-tokenizer joins spaces and newlines)."""
    from tests.tokenizer_fixture import qwen35_tokenizer_dir

    return [Tokenizer(BUILTIN), Tokenizer(qwen35_tokenizer_dir())]


def _encode_by_prefixes(tokenizer, conversation: dict) -> tuple[list[int], list[bool]]:
    """The encoding before issue 36, as the reference: every assistant turn's prompt rendered and tokenized on its
    own (quadratic in turns)."""
    messages, tools = conversation["messages"], conversation.get("tools")
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools))
    mask = [False] * len(ids)
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = messages[:i]
        thinking = bool((turn.get("reasoning_content") or "").strip())
        prompts = [tokenizer.apply_chat_template(before, add_generation_prompt=True, enable_thinking=thinking,
                                                 tools=tools),
                   tokenizer.apply_chat_template(before, add_generation_prompt=False, tools=tools)
                   + "<|im_start|>assistant\n"]
        prefixes = [tokenizer.encode(p) for p in prompts if any(m["role"] == "user" for m in before)]
        start = next((len(p) for p in prefixes if ids[:len(p)] == p), None)
        if start is None:
            raise QwenrtError("not a prefix")
        end = ids.index(tokenizer.token_to_id("<|im_end|>"), start) + 1
        mask[start:end] = [True] * (end - start)
    return ids, mask


def _multi_turn_chats() -> list[dict]:
    """Conversations with several user turns, tool calls, reasoning, and text the template or the pre-tokenizer
    treat specially (a think block in the content, leading newlines and spaces)."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    user, system = {"role": "user", "content": "Add 1 and 2."}, {"role": "system", "content": "Be brief."}
    return [
        {"messages": [system, user, {"role": "assistant", "content": "3", "reasoning_content": "1 + 2"},
                      {"role": "user", "content": "Now with the tool."},
                      {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [call]},
                      {"role": "tool", "content": "3"}, {"role": "tool", "content": "again 3"},
                      {"role": "assistant", "content": "It is 3.", "reasoning_content": "the tool said 3"}],
         "tools": tools},
        {"messages": [user, {"role": "assistant", "content": "\n\n3"}, {"role": "user", "content": " and again?"},
                      {"role": "assistant", "content": "", "tool_calls": [call, call]},
                      {"role": "tool", "content": "3"}, {"role": "assistant", "content": " 3 "}],
         "tools": tools},
        {"messages": [user, {"role": "assistant", "content": "<think>\nhm\n</think>\n\n3"},
                      {"role": "user", "content": "\nsure?"},
                      {"role": "assistant", "content": "\nyes", "reasoning_content": "\n  "}]},
        {"messages": [user, {"role": "assistant", "content": "3", "reasoning_content": "\nfirst a newline"}]},
    ]


def test_encoding_renders_once_and_masks_as_rendering_every_prompt_did(tokenizers):
    """Each assistant turn's start is found in the one rendering (its header token, then the generation prompt's
    tokens), not by rendering and tokenizing every prompt before it: the ids and loss masks are those of the
    per-prompt encoding, for the recipe's conversations and multi-turn ones with tools and thinking."""
    chats = [c for c in conversations(60, 9)] + _multi_turn_chats()
    for tokenizer in tokenizers:
        for chat in chats:
            example = encode_conversation(tokenizer, check_conversation(chat, "chat"))
            assert (example.ids, example.loss_mask) == _encode_by_prefixes(tokenizer, chat), chat
    no_user_first = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}
    one_line_error(lambda: encode_conversation(tokenizers[0], no_user_first), "must follow a user message")


def test_encoding_is_linear_in_turns(tokenizers):
    """2,000 turns (a 60 KB line) encode in about half a second; rendering every prompt took 3.4 / 12.4 / 51 s
    for 100 / 200 / 400 turns and more than 150 s for these. Too long for max_len is said before any turn."""
    messages = [m for i in range(1000) for m in ({"role": "user", "content": f"What is {i} + {i}?"},
                                                 {"role": "assistant", "content": f"{i} + {i} = {2 * i}"})]
    chat = check_conversation({"messages": messages}, "chat")
    with no_hang(60):
        began = time.perf_counter()
        example = encode_conversation(tokenizers[0], chat)
        assert time.perf_counter() - began < 5
    assert sum(example.loss_mask) > 1000 * 5
    one_line_error(lambda: encode_conversation(tokenizers[0], chat, "chats.jsonl:7", max_len=1024),
                   "chats.jsonl:7: ", "tokens, over max_len 1024")


@pytest.mark.parametrize("options, fragment", [
    (dict(out="", data=[]), "output directory is empty"),  # was: trained into the current directory
    (dict(out="o\0", data=[]), "NUL"),
    (dict(out="o", data=123), "data (a JSONL file, or a list of conversations) must be a str"),  # was a TypeError
    (dict(out="o", data=[], eval_data=b"x.jsonl"), "eval_data"),
])
def test_training_paths_that_are_no_paths_are_one_line(options, fragment):
    one_line_error(lambda: TrainConfig(**options), fragment)


def test_data_that_is_no_path_is_one_line():
    one_line_error(lambda: load_conversations(123), "data (a JSONL file, or a list of conversations) must be a str")
