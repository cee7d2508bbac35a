"""Bad checkpoints and configs: one clear QwenrtError each, and `qwenrt inspect` exits non-zero with one line."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import qwenrt
from qwenrt.cli import main
from qwenrt.errors import QwenrtError
from qwenrt.files import CheckpointDir
from qwenrt.inspect import inspect_checkpoint
from qwenrt.loader import load_model
from qwenrt.tokenizer import Tokenizer, load_tokenizer
from tests.hostile import one_line_error


@pytest.fixture
def ckpt(dense_ckpt, tmp_path):
    """A fresh, writable copy of the dense checkpoint."""
    path = tmp_path / "ckpt"
    shutil.copytree(dense_ckpt[0], path)
    return path


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, fn):
    file = path / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)


def expect_error(path, *fragments):
    with pytest.raises(QwenrtError) as info:
        qwenrt.load(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    expect_error(ckpt, "missing 1 tensor", "model.layers.2.linear_attn.A_log")


def test_unexpected_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": t["model.norm.weight"].clone()}))
    expect_error(ckpt, "unexpected 1 tensor", "model.layers.0.mlp.extra.weight")


def test_wrong_shape(ckpt):
    def cut(t):
        t["model.layers.3.self_attn.q_proj.weight"] = t["model.layers.3.self_attn.q_proj.weight"][:-1].clone()
    edit_tensors(ckpt, cut)
    expect_error(ckpt, "wrong shape", "model.layers.3.self_attn.q_proj.weight is [255, 64], expected [256, 64]")


def test_truncated_file(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    expect_error(ckpt, "truncated")


def test_corrupt_header(ckpt):
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"not json!!!!"
    file.write_bytes(bytes(data))
    expect_error(ckpt, "corrupt safetensors header")


def test_missing_shard(ckpt):
    names = list(load_file(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").rename(ckpt / "model-00002-of-00002.safetensors")
    index = {"weight_map": {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(ckpt, "shard file(s) missing", "model-00001-of-00002.safetensors")


def test_single_file_wins_over_an_index(ckpt):
    """As transformers: model.safetensors beside an index is what loads (the index may be stale)."""
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = qwenrt.load(ckpt)
    assert model.model.norm.weight.shape == (64,)


def test_no_weights_and_no_config(tmp_path, ckpt):
    (ckpt / "model.safetensors").unlink()
    expect_error(ckpt, "no *.safetensors")
    expect_error(tmp_path / "nowhere", "no such directory")
    (tmp_path / "empty").mkdir()
    expect_error(tmp_path / "empty", "no config.json")


def test_a_gguf_file_is_no_checkpoint_directory(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(28))
    with pytest.raises(QwenrtError, match="model.gguf: a GGUF file, not a checkpoint directory"):
        CheckpointDir(gguf)  # where a directory is opened without resolving a source first (tests/test_gguf_errors.py)


@pytest.mark.parametrize("changes, fragments", [
    ({"linear_num_value_heads": 3}, ["linear_num_value_heads (3) must be divisible by linear_num_key_heads (2)"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads (4) must be divisible by num_key_value_heads (3)"]),
    ({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [2, 2, 2]}},
     ["mrope_section [2, 2, 2]", "rotary_dim/2 = 4"]),
    ({"layer_types": ["linear_attention"] * 7 + ["sliding_attention"]}, ["unknown layer type(s) ['sliding_attention']"]),
    ({"layer_types": ["linear_attention"] * 3}, ["layer_types has 3 entries but num_hidden_layers is 8"]),
    ({"model_type": "llama"}, ["unsupported", "'llama'"]),
    ({"hidden_size": None}, ["missing required field 'hidden_size'"]),
    ({"num_hidden_layers": 0}, ["'num_hidden_layers' must be an integer in [1, 1024]"]),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e7}}, ["rope_type 'longrope' is not supported"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7}},
     ["rope_parameters: missing required field 'factor'"]),
])
def test_config_contracts(ckpt, changes, fragments):
    edit_config(ckpt, **changes)
    expect_error(ckpt, *fragments)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{ not json")
    expect_error(ckpt, "config.json is not valid JSON")


def test_layer_types_derived_from_interval(ckpt):
    edit_config(ckpt, layer_types=None, full_attention_interval=4)
    model, _ = qwenrt.load(ckpt)
    assert model.config.text.full_attention_layers == (3, 7)


def test_inspect_cli_reports_and_refuses(dense_ckpt, published_ckpt, ckpt, capsys):
    assert main(["inspect", str(published_ckpt[0])]) == 0
    out = capsys.readouterr().out
    assert "MoE VLM" in out and "MTP head: yes" in out and "BF16" in out and "OK" in out
    assert main(["inspect", "--json", str(dense_ckpt[0])]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == 8 and report["attention_layers"] == 2 and report["tied_embeddings"] is True
    assert report["params_decoder"] == sum(p.numel() for p in dense_ckpt[1].parameters())

    edit_config(ckpt, linear_num_value_heads=3)
    assert main(["inspect", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qwenrt: error:") and err.count("\n") == 1


def test_inspect_entry_point_exit_code(tmp_path):
    run = subprocess.run([sys.executable, "-m", "qwenrt", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0
    assert "no config.json" in run.stderr


class BytesPath:
    def __fspath__(self):
        return b"/tmp"


@pytest.mark.parametrize("bad, kind", [(123, "int"), (b"qwenrt/tiny/model", "bytes"), (1.5, "float"),
                                       (["x"], "list"), (BytesPath(), "BytesPath")])
def test_paths_of_the_wrong_type_are_one_line(bad, kind):
    """What the API takes: a str or an os.PathLike of one (load: or None, the built-in model)."""
    for fn in (qwenrt.load, inspect_checkpoint, load_model, Tokenizer, load_tokenizer):
        one_line_error(lambda: fn(bad), "must be a str or an os.PathLike", f"got {kind}")


def test_empty_path_and_bad_revision():
    one_line_error(lambda: qwenrt.load(""), "is empty")  # was: the current directory
    one_line_error(lambda: qwenrt.load("bad\0path"), "NUL")  # was a ValueError
    one_line_error(lambda: qwenrt.load("\ud800/x"), "not valid Unicode")  # was a UnicodeEncodeError
    one_line_error(lambda: qwenrt.load("~no-such-user-qwenrt/x"), "~no-such-user-qwenrt")  # was a RuntimeError
    one_line_error(lambda: qwenrt.load(None, progress="yes"), "progress must be True or False")  # was accepted
    for threads in (0, True, 1.5, "2"):
        one_line_error(lambda: qwenrt.load(None, threads=threads), f"threads must be an integer >= 1, got {threads!r}")
    one_line_error(lambda: qwenrt.load("Qwen/Qwen3.5-0.8B", revision=5), "revision must be a string")
