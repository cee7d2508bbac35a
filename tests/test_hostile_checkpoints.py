"""Hostile checkpoints: files named outside the directory, FIFOs and devices, corrupt headers, wrong config types and
ranges, NaN/Inf weights. Each gets one line from `load` and `inspect` alike (or, where legitimate, a correct load)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qwenrt
from qwenrt.errors import QwenrtError
from qwenrt.inspect import inspect_checkpoint
from qwenrt.sampling import SamplingParams, sample
from qwenrt.tokenizer import Tokenizer
from tests.hostile import no_hang, one_line_error, read_safetensors, write_safetensors
from tests.tokenizer_fixture import qwen35_tokenizer_dir


@pytest.fixture
def ckpt(dense_ckpt, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(dense_ckpt[0], path)
    return path


def refused_by_both(path, *fragments):
    """`load` and `inspect` refuse the checkpoint with the same one-line error."""
    loaded = one_line_error(lambda: qwenrt.load(path), *fragments)
    inspected = one_line_error(lambda: inspect_checkpoint(path), *fragments)
    assert loaded == inspected
    return loaded


def split_into_index(path, shard_of):
    """Replace model.safetensors by an index whose weight_map sends every tensor to shard_of(name)."""
    names = list(load_file(path / "model.safetensors"))
    (path / "model.safetensors").rename(path / "real.safetensors")
    index = {"weight_map": {n: shard_of(n) for n in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


# ---- files named outside the checkpoint -------------------------------------------------------------------------

@pytest.mark.parametrize("name, fragment", [
    ("../../../../../../etc/passwd", "points outside the checkpoint"),
    ("/etc/passwd", "points outside the checkpoint"),
    ("~/model.safetensors", "points outside the checkpoint"),
    ("sub/../../other/model.safetensors", "points outside the checkpoint"),
    ("", "invalid shard name"),
    ("\ud800", "not valid Unicode"),  # was a UnicodeEncodeError
    ("x" * 300 + ".safetensors", "over 255 bytes"),  # was an OSError (file name too long)
])
def test_index_entries_cannot_escape(ckpt, name, fragment):
    split_into_index(ckpt, lambda n: name if n == "model.norm.weight" else "real.safetensors")
    message = refused_by_both(ckpt, fragment)
    assert "root:" not in message  # nothing of the named file is read


def test_index_entries_must_be_names(ckpt):
    split_into_index(ckpt, lambda n: 7 if n == "model.norm.weight" else "real.safetensors")
    refused_by_both(ckpt, "weight_map values must be file names")


def test_index_cannot_load_a_sibling_checkpoint(ckpt, dense_ckpt, tmp_path):
    shutil.copytree(dense_ckpt[0], tmp_path / "other")
    split_into_index(ckpt, lambda n: "../other/model.safetensors")
    refused_by_both(ckpt, "points outside the checkpoint")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_links_out_of_the_checkpoint_are_refused(ckpt, tmp_path, name):
    outside = tmp_path / f"outside-{name}"
    (ckpt / name).rename(outside)
    (ckpt / name).symlink_to(outside)
    refused_by_both(ckpt, "outside the checkpoint directory", name)


def test_links_inside_the_checkpoint_are_fine(ckpt):
    (ckpt / "weights").mkdir()
    (ckpt / "model.safetensors").rename(ckpt / "weights" / "w.safetensors")
    (ckpt / "model.safetensors").symlink_to("weights/w.safetensors")
    model, _ = qwenrt.load(ckpt)
    assert model.config.text.num_hidden_layers == 8


def test_hugging_face_cache_blobs_load(dense_ckpt, tmp_path):
    """The hub cache links every snapshot file into the repo's blob store: that is allowed, and nothing else."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in dense_ckpt[0].iterdir():
        shutil.copy(file, blobs / f"sha-{file.name}")
        (snapshot / file.name).symlink_to(f"../../blobs/sha-{file.name}")
    model, _ = qwenrt.load(snapshot)
    assert model.config.text.num_hidden_layers == 8
    assert inspect_checkpoint(snapshot)["verdict"].startswith("OK")
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(dense_ckpt[0] / "config.json")  # out of the blob store
    refused_by_both(snapshot, "outside the checkpoint directory")


@pytest.mark.parametrize("blobs_to", ["root", "elsewhere"])
@pytest.mark.parametrize("name, target", [("model.safetensors", "outside"), ("config.json", "/etc/passwd")])
def test_a_linked_blob_store_admits_nothing(dense_ckpt, tmp_path, blobs_to, name, target):
    """A `blobs` that is itself a link (to / or anywhere) is no blob store: `blobs -> /` made any file a blob."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(dense_ckpt[0], snapshot)
    outside = tmp_path / "outside"
    shutil.copytree(dense_ckpt[0], outside)  # a whole checkpoint, loadable if it were reached
    target = outside / name if target == "outside" else Path(target)
    if blobs_to == "root":
        (repo / "blobs").symlink_to("/")
        link = "../../blobs" + str(target)
    else:
        (repo / "blobs").symlink_to(target.parent)
        link = f"../../blobs/{target.name}"
    (snapshot / name).unlink()
    (snapshot / name).symlink_to(link)
    message = refused_by_both(snapshot, "outside the checkpoint directory", name)
    assert "root:" not in message
    tok = tmp_path / "tok" / "snapshots" / "abc123"  # the tokenizer's files take the same road
    shutil.copytree(qwen35_tokenizer_dir(), tok)
    (tok.parent.parent / "blobs").symlink_to("/")
    (tok / "chat_template.jinja").unlink()
    (tok / "chat_template.jinja").symlink_to("../../blobs/etc/passwd")
    one_line_error(lambda: Tokenizer(tok), "chat_template.jinja", "outside the checkpoint directory")


def test_tokenizer_files_cannot_escape(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(qwen35_tokenizer_dir(), tok)
    outside = tmp_path / "elsewhere.jinja"
    (tok / "chat_template.jinja").rename(outside)
    (tok / "chat_template.jinja").symlink_to(outside)
    one_line_error(lambda: Tokenizer(tok), "chat_template.jinja", "outside the checkpoint directory")


# ---- FIFOs, devices, directories where files belong ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_fifo_is_refused_not_waited_on(ckpt, name):
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    refused_by_both(ckpt, "is a FIFO")


def test_directory_and_device_where_a_file_belongs(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    refused_by_both(ckpt, "is a directory")
    tok = tmp_path / "tok"
    shutil.copytree(qwen35_tokenizer_dir(), tok)
    (tok / "tokenizer.json").unlink()
    os.mkfifo(tok / "tokenizer.json")
    one_line_error(lambda: Tokenizer(tok), "is a FIFO")
    (tok / "tokenizer.json").unlink()
    (tok / "tokenizer.json").symlink_to("/dev/zero")  # outside; and a device besides
    one_line_error(lambda: Tokenizer(tok), "outside the checkpoint directory")


def test_unreadable_files_are_one_line(ckpt, monkeypatch):
    """Permission errors (simulated: the tests may run as root, which reads everything)."""
    real_open = os.open

    def denied(path, *args, **kwargs):
        if str(path).endswith(denied.name):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    for denied.name in ("config.json", "model.safetensors"):
        refused_by_both(ckpt, "Permission denied", denied.name)


# ---- corrupt safetensors headers: inspect and load agree ----------------------------------------------------------

def corrupt(path, edit=None, **write):
    file = path / "model.safetensors"
    header, data = read_safetensors(file)
    if edit is not None:
        edit(header)
    write_safetensors(file, header, data, **write)


def _overlap(h):
    h["model.norm.weight"]["data_offsets"] = h["model.layers.0.input_layernorm.weight"]["data_offsets"]


def _shift(name, by):
    def edit(h):
        h[name]["data_offsets"] = [o + by for o in h[name]["data_offsets"]]
    return edit


def _set(name, key, value):
    def edit(h):
        h[name][key] = value
    return edit


@pytest.mark.parametrize("edit, write, fragment", [
    (_overlap, {}, "overlaps"),
    (_set("model.norm.weight", "dtype", "F7"), {}, "unknown dtype 'F7'"),
    (_set("model.norm.weight", "dtype", ["F32"]), {}, "unknown dtype"),
    (_set("model.norm.weight", "shape", [65]), {}, "needs 260 bytes but its data_offsets span 256"),
    (_set("model.norm.weight", "shape", [-64]), {}, "invalid shape"),
    (_set("model.norm.weight", "shape", [64.0]), {}, "invalid shape"),
    (_set("model.norm.weight", "shape", "64"), {}, "invalid shape"),
    (_set("model.norm.weight", "data_offsets", [-4, 252]), {}, "invalid data_offsets"),
    (_set("model.norm.weight", "data_offsets", [10, 5]), {}, "invalid data_offsets"),
    (_set("model.norm.weight", "data_offsets", [0, 2 ** 70]), {}, "invalid data_offsets"),
    (_shift("model.norm.weight", 4), {}, "model.norm.weight"),
    (lambda h: h.update({"__metadata__": {"format": 1}}), {}, "__metadata__"),
    (lambda h: h.pop(min(h, key=lambda n: h[n]["data_offsets"] if n != "__metadata__" else [1 << 62])), {},
     "leaves a gap at byte 0"),
    (None, {"header_text": b'{"a": NaN}'}, "not JSON"),
    (None, {"header_text": b"[1, 2]"}, "not a JSON object"),
    (None, {"header_text": b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": {}}'},
     "duplicate key"),
    (None, {"length": 2 ** 63}, "corrupt or truncated safetensors header"),
    (None, {"header_text": b"\xff\xfe{}"}, "not JSON"),
])
def test_corrupt_headers(ckpt, edit, write, fragment):
    corrupt(ckpt, edit, **write)
    refused_by_both(ckpt, fragment)


def test_trailing_bytes(ckpt):
    with open(ckpt / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    refused_by_both(ckpt, "trailing bytes")


@pytest.mark.parametrize("dtype, fragment", [(torch.int64, "stored as I64; expected F32 or BF16 or F16"),
                                             (torch.float8_e4m3fn, "FP8 checkpoints are not supported")])
def test_non_float_weights_are_refused_not_cast(ckpt, dtype, fragment):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, ckpt / "model.safetensors")
    refused_by_both(ckpt, "model.norm.weight", fragment)


# ---- config.json: types and ranges, checked before anything is built ------------------------------------------------

def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, fragment", [
    ({"num_hidden_layers": 10_000_000, "layer_types": None}, "'num_hidden_layers' must be an integer in [1, 1024]"),
    ({"hidden_size": 2 ** 40}, "'hidden_size' must be an integer"),
    ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
    ({"hidden_size": 64.0}, "'hidden_size' must be an integer"),
    ({"vocab_size": True}, "'vocab_size' must be an integer"),
    ({"rms_norm_eps": -1e-6}, "'rms_norm_eps' must be a finite number in (0.0, 1.0]"),
    ({"rms_norm_eps": 0}, "'rms_norm_eps'"),
    ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps'"),
    ({"rope_parameters": {"rope_theta": 0, "partial_rotary_factor": 0.25}}, "'rope_theta'"),
    ({"rope_parameters": {"rope_theta": -5.0}}, "'rope_theta'"),
    ({"rope_parameters": {"rope_theta": "big"}}, "'rope_theta'"),
    ({"rope_parameters": [1, 2]}, "expected a JSON object"),
    ({"rope_parameters": {"rope_theta": 1e7, "mrope_section": "2,1,1"}}, "'mrope_section'"),
    ({"layer_types": "full_attention"}, "'layer_types' must be a list"),
    ({"layer_types": [1] * 8}, "layer_types must be a list of strings"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ({"model_type": ["qwen3_5_text"]}, "unsupported model_type"),
    ({"eos_token_id": "</s>"}, "'eos_token_id'"),
    ({"linear_conv_kernel_dim": 10 ** 6}, "'linear_conv_kernel_dim'"),
    ({"quantization_config": {"quant_method": "qwenrt", "bits": 8, "modules_not_converted": 5}},
     "modules_not_converted must be a list"),
    ({"quantization_config": {"quant_method": "qwenrt", "bits": 8.0}}, "bits must be 8 or 4"),
    ({"quantization_config": {"quant_method": "qwenrt", "bits": 4, "group_size": 64, "overrides": {"o": {"bits": 3}}}},
     "config.json: quantization_config.overrides['o']: quantization bits must be 8 or 4"),
    ({"quantization_config": {"quant_method": "qwenrt", "bits": 4, "group_size": 64, "overrides": [8]}},
     "quantization_config.overrides must map module path suffixes"),
])
def test_config_types_and_ranges(ckpt, changes, fragment):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    if changes.get("layer_types", 0) is None:
        del cfg["layer_types"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with no_hang(5):  # nothing is built before the config is checked
        refused_by_both(ckpt, fragment)


@pytest.mark.parametrize("text, fragment", [
    ('{"model_type": "qwen3_5_text", "rms_norm_eps": NaN}', "not valid JSON"),
    ('{"model_type": "qwen3_5_text", "rope_theta": Infinity}', "not valid JSON"),
    ("[" * 100000, "not valid JSON"),
    ('{"model_type": "qwen3_5", "text_config": [1]}', "text_config: expected a JSON object"),
    ('{"model_type": "qwen3_5", "text_config": {}, "vision_config": 3}', "text_config"),
])
def test_config_json_itself(ckpt, text, fragment):
    (ckpt / "config.json").write_text(text)
    refused_by_both(ckpt, fragment)


def test_vision_config_types(vlm_ckpt, tmp_path):
    path = tmp_path / "vlm"
    shutil.copytree(vlm_ckpt[0], path)
    cfg = json.loads((path / "config.json").read_text())
    for field, value in (("depth", "2"), ("hidden_size", -32), ("rope_parameters", 5), ("num_heads", 0)):
        (path / "config.json").write_text(json.dumps(dict(cfg, vision_config=dict(cfg["vision_config"], **{field: value}))))
        refused_by_both(path, field)


def test_vision_tensors_are_checked_at_load(vlm_ckpt, tmp_path):
    path = tmp_path / "vlm"
    shutil.copytree(vlm_ckpt[0], path)
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in tensors if n.startswith("model.visual.") and n.endswith("weight"))
    tensors[name] = tensors[name][:1].clone()
    save_file(tensors, path / "model.safetensors")
    refused_by_both(path, "1 tensor(s) with the wrong shape", name[len("model.visual."):])


# ---- NaN/Inf in the weights, and in the logits ------------------------------------------------------------------

@pytest.mark.parametrize("name, index, value", [
    ("model.norm.weight", 3, float("nan")),
    ("model.embed_tokens.weight", (7, 2), float("inf")),
    ("model.layers.2.linear_attn.A_log", 0, float("-inf")),
])
def test_non_finite_weights_are_refused(ckpt, name, index, value):
    tensors = load_file(ckpt / "model.safetensors")
    tensors[name][index] = value
    save_file(tensors, ckpt / "model.safetensors")
    one_line_error(lambda: qwenrt.load(ckpt), name, "1 NaN/Inf value(s)", "check_finite=False")
    model, _ = qwenrt.load(ckpt, check_finite=False)  # the scan can be skipped
    assert not torch.isfinite(dict(model.named_parameters())[name]).all()


def test_huge_but_finite_weights_load(ckpt):
    """Weights at the edge of fp32's range are finite: loaded."""
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][0, :8] = 3e38
    save_file(tensors, ckpt / "model.safetensors")
    model, _ = qwenrt.load(ckpt)
    assert model.model.layers[0].mlp.up_proj.weight[0, 0] == 3e38


def test_overflow_to_float16_is_refused(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6  # finite in fp32, Inf in float16
    save_file(tensors, ckpt / "model.safetensors")
    qwenrt.load(ckpt)
    one_line_error(lambda: qwenrt.load(ckpt, dtype="float16"), "model.layers.0.mlp.up_proj.weight", "NaN/Inf")


def test_non_finite_weights_in_quantized_and_stacked_tensors(moe_ckpt, tmp_path):
    path = tmp_path / "moe"
    shutil.copytree(moe_ckpt[0], path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.5.up_proj.weight"][2, 3] = float("nan")
    save_file(tensors, path / "model.safetensors")
    one_line_error(lambda: qwenrt.load(path), "model.layers.1.mlp.experts", "NaN/Inf")
    one_line_error(lambda: qwenrt.load(path, quantize="int8"), "model.layers.1.mlp.experts", "NaN/Inf")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_are_an_error_not_a_sample(bad):
    logits = torch.randn(2, 50)
    logits[1, 7] = bad
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=0)):
        one_line_error(lambda: sample(logits, params), "NaN/Inf logits", "rows [1]")
    huge = torch.full((1, 50), 3e38)  # finite at the edge of the range
    huge[0, 9] = 3.3e38
    assert sample(huge, SamplingParams()).tolist() == [9]


def test_device_and_dtype_are_checked_before_loading(ckpt):
    one_line_error(lambda: qwenrt.load(ckpt, device="banana"), "unknown device 'banana'")
    if not torch.cuda.is_available():
        one_line_error(lambda: qwenrt.load(ckpt, device="cuda"), "no CUDA support")
    one_line_error(lambda: qwenrt.load(ckpt, dtype="int8"), "unsupported dtype 'int8'")


def test_quantize_refuses_a_bad_checkpoint_like_load(ckpt, tmp_path):
    from qwenrt.convert import quantize_checkpoint

    corrupt(ckpt, _overlap)
    one_line_error(lambda: quantize_checkpoint(ckpt, tmp_path / "q", 8), "overlaps")
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.partial-*"))


def test_errors_are_qwenrt_errors_at_the_api(ckpt):
    """One exception type for everything above: QwenrtError (a plain Exception subclass)."""
    corrupt(ckpt, _set("model.norm.weight", "dtype", "F7"))
    with pytest.raises(QwenrtError):
        qwenrt.load(ckpt)


# ---- inspect runs load's checks: the tokenizer's files, NaN/Inf weights and scales --------------------------------

def add_tokenizer(path):
    """A tiny byte-level tokenizer with its config and template files beside the weights."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    backend = Backend(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")


def make_fifo(file, _):
    os.mkfifo(file)


def make_directory(file, _):
    file.mkdir()


def make_link_out(file, outside):
    outside.write_text("{}")
    file.symlink_to(outside)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
@pytest.mark.parametrize("make, fragment", [(make_fifo, "is a FIFO"), (make_directory, "is a directory"),
                                            (make_link_out, "outside the checkpoint directory")])
def test_inspect_refuses_bad_tokenizer_files_as_load_does(ckpt, tmp_path, name, make, fragment):
    """`inspect` said "contract OK" where `load` refused."""
    add_tokenizer(ckpt)
    (ckpt / name).unlink()
    make(ckpt / name, tmp_path / "outside")
    refused_by_both(ckpt, name, fragment)


def test_inspect_checks_the_tokenizer_like_load(ckpt):
    add_tokenizer(ckpt)
    report = inspect_checkpoint(ckpt)
    assert report["tokenizer_tokens"] == 256 and "tokenizer files valid" in report["verdict"]
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}")
    refused_by_both(ckpt, "chat_template.jinja", "syntax error")


def test_inspect_scans_for_non_finite_weights_unless_told_not_to(ckpt, capsys):
    from qwenrt.cli import main

    assert inspect_checkpoint(ckpt)["weights_scanned"] is True
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.3.mlp.down_proj.weight"][1, 2] = float("inf")
    save_file(tensors, ckpt / "model.safetensors")
    refused_by_both(ckpt, "model.layers.3.mlp.down_proj.weight", "1 NaN/Inf value(s)")
    report = inspect_checkpoint(ckpt, check_finite=False)
    assert report["weights_scanned"] is False and report["verdict"].endswith("weights not scanned for NaN/Inf")
    assert main(["inspect", "--no-finite-check", str(ckpt)]) == 0
    assert "weights not scanned for NaN/Inf" in capsys.readouterr().out
    assert main(["inspect", str(ckpt)]) == 1
    assert "NaN/Inf" in capsys.readouterr().err


def test_inspect_scans_the_scales_of_a_quantized_checkpoint(ckpt, tmp_path):
    from qwenrt.convert import quantize_checkpoint

    quantized = quantize_checkpoint(ckpt, tmp_path / "int8", 8)
    tensors = load_file(quantized / "model.safetensors")
    scales = next(n for n in tensors if n.endswith(".scales"))
    tensors[scales][0] = float("nan")
    save_file(tensors, quantized / "model.safetensors")
    refused_by_both(quantized, scales, "NaN/Inf")
