"""Random checkpoints at the published shapes, and the streaming safetensors writer under them."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import qwenrt
from qwenrt import shapes
from qwenrt.checkpoint import INDEX_FILE
from qwenrt.convert import quantize_checkpoint
from qwenrt.errors import QwenrtError
from qwenrt.quant import QuantSpec
from qwenrt.writer import Entry, write_safetensors


def test_parameter_counts_match_the_published_sizes():
    # 0.8B: 752.4M (shared/baselines.md); 2B/4B/9B: the GGUF counts in llama.cpp#20455 (1.88B, 4.21B, 8.95B)
    assert shapes.parameter_count("0.8b") == 752_393_024
    assert round(shapes.parameter_count("2b") / 1e9, 2) == 1.88
    assert round(shapes.parameter_count("4b") / 1e9, 2) == 4.21
    assert round(shapes.parameter_count("9b") / 1e9, 2) == 8.95
    cfg = shapes.text_config("35b-a3b")
    assert cfg["num_experts"] == 256 and cfg["layer_types"][3] == "full_attention" and not cfg["tie_word_embeddings"]
    with pytest.raises(QwenrtError, match="unknown shape '1b'"):
        shapes.text_config("1b")
    # Qwen3-VL's decoders are Qwen3's: 1.7B, 4.0B and 8.2B (Qwen3's model cards, embeddings included)
    assert [round(shapes.parameter_count(f"qwen3-vl-{n}") / 1e9, 1) for n in ("2b", "4b", "8b")] == [1.7, 4.0, 8.2]


def test_random_qwen3_vl_checkpoint_loads_and_runs(tmp_path, monkeypatch):
    """A shrunken Qwen3-VL decoder: no MTP head, its w·x norms written near 1 (loaded as (1 + w) norms near 0)."""
    monkeypatch.setitem(shapes._QWEN3_VL_TABLE, "tiny-vl", (2, 64, 96, 4, 2, True))
    path = shapes.write_random_checkpoint("tiny-vl", tmp_path / "ckpt")
    model, _ = qwenrt.load(path)
    assert getattr(model, "mtp", None) is None and model.config.text.family == "Qwen3-VL"
    assert model.model.norm.weight.abs().max() < 0.2
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 151936) and torch.isfinite(logits).all()


def test_writer_shards_and_index(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(12, dtype=torch.int8)}
    entries = [Entry(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    write_safetensors(tmp_path, entries, lambda e: tensors[e.name].split(2), shard_bytes=40)  # row chunks
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"]["a"] != index["weight_map"]["b"] == index["weight_map"]["c"]  # 60 bytes; 14 + 12
    loaded = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(tmp_path / f).items()}
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_writer_refuses_misaligned_layouts(tmp_path):
    entries = [Entry("odd", (3,), torch.int8), Entry("f", (2,), torch.float32)]
    with pytest.raises(QwenrtError, match="misaligned"):  # `aligned_order` would put f first
        write_safetensors(tmp_path, entries, lambda e: torch.zeros(e.shape, dtype=e.dtype))


@pytest.mark.parametrize("table", [(4, 64, 96, 4, 2, 32, True, None), (4, 64, 0, 4, 2, 32, False, (8, 2, 32, 48))],
                         ids=["dense", "moe"])
def test_random_checkpoint_loads_and_runs(table, tmp_path, monkeypatch):
    """A shrunken table entry (the vocabulary and head sizes stay published): written in shards, loaded, run."""
    monkeypatch.setitem(shapes._TABLE, "tiny", table)
    path = shapes.write_random_checkpoint("tiny", tmp_path / "ckpt", shard_bytes=16 << 20)
    assert (path / INDEX_FILE).is_file() and not list(tmp_path.glob(".*partial*"))
    model, _ = qwenrt.load(path)
    assert model.dtype == torch.bfloat16
    decoder = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    assert decoder == shapes.parameter_count("tiny") and model.mtp is not None  # with an MTP head, as published
    a_log = model.model.layers[0].linear_attn.A_log
    assert (a_log.exp() >= 0.99).all() and (a_log.exp() <= 16.1).all()
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 248320) and torch.isfinite(logits).all()
    with pytest.raises(QwenrtError, match="already exists"):
        shapes.write_random_checkpoint("tiny", path)


@pytest.fixture
def small_shapes(monkeypatch):
    """Shrunken table entries and vocabulary, and small row chunks, so every tensor is written in several."""
    monkeypatch.setitem(shapes._TABLE, "tiny-moe", (4, 64, 0, 4, 2, 16, False, (8, 2, 32, 48)))
    monkeypatch.setitem(shapes._TABLE, "tiny-dense", (4, 64, 96, 4, 2, 16, True, None))
    monkeypatch.setitem(shapes._COMMON, "vocab_size", 512)
    monkeypatch.setattr(shapes, "ROWS_PER_CHUNK", 16)  # 16K values a chunk: the expert banks and head in two


def _tensors(path):
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("name, spec", [("tiny-moe", QuantSpec(4, 32)), ("tiny-moe", QuantSpec(8)),
                                        ("tiny-dense", QuantSpec(4, 64))], ids=str)
def test_random_checkpoint_written_quantized_is_the_quantized_bf16_one(name, spec, small_shapes, tmp_path):
    """Written directly in int8 / int4, tensor for tensor (MTP head, scales, zeros, kept modules) and config.json
    what `qwenrt quantize` makes of the bf16 checkpoint of the same seed, in the same file layout."""
    bf16 = shapes.write_random_checkpoint(name, tmp_path / "bf16", seed=3)
    expected = quantize_checkpoint(bf16, tmp_path / "via-bf16", spec.bits, spec.group_size)
    direct = shapes.write_random_checkpoint(name, tmp_path / "direct", seed=3, quantize=spec)
    assert json.loads((direct / "config.json").read_text()) == json.loads((expected / "config.json").read_text())
    want, got = _tensors(expected), _tensors(direct)
    assert want.keys() == got.keys() and any(n.startswith("mtp.") and n.endswith(".qweight") for n in got)
    assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items())
    assert (direct / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes()
    other_seed = shapes.write_random_checkpoint(name, tmp_path / "seed4", seed=4, quantize=spec)
    assert not torch.equal(_tensors(other_seed)["lm_head.qweight"], got["lm_head.qweight"])


def test_random_values_do_not_depend_on_the_write_order(small_shapes):
    """Each tensor has its own generator, and a weight's pieces are the same whichever is written first (the odd-sized
    ones go last in the file: held from the qweight's pass, or computed on a pass of their own)."""
    entries, weights, _ = shapes.planned_entries("tiny-moe", QuantSpec(8))
    forward, backward = shapes._producer(weights, 0), shapes._producer(weights, 0)
    joined = lambda out: torch.cat(list(out)) if not isinstance(out, torch.Tensor) else out  # noqa: E731
    later = {e.name: joined(backward(e)) for e in reversed(entries)}
    assert all(torch.equal(joined(forward(e)), later[e.name]) for e in entries)


def test_bench_builds_a_quantized_shape_without_its_bf16_checkpoint(small_shapes, tmp_path, monkeypatch, capsys):
    """`qwenrt bench --shape S --quantize int4,int8` writes each format directly (never the bf16 one, 70 GB for the
    35B-A3B), once; with too little disk it says how much it needs, where, and leaves nothing half-written."""
    from qwenrt import bench
    from qwenrt.cli import main

    monkeypatch.setattr(shapes, "SHAPES", (*shapes.SHAPES, "tiny-moe"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []

    def measure(job):
        measured.append(job["path"])
        raise QwenrtError("measured")

    monkeypatch.setattr(bench, "_run", measure)
    assert main(["bench", "--shape", "tiny-moe", "--quantize", "int4,int8", "--repeats", "1"]) == 1
    built = sorted(p.name for p in bench.cache_dir().iterdir())
    assert built == ["random-tiny-moe-mtp-seed0-int4g64", "random-tiny-moe-mtp-seed0-int8"]
    assert measured == [str(bench.cache_dir() / built[0])]
    capsys.readouterr()
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    assert main(["bench", "--shape", "tiny-moe", "--quantize", "none", "--repeats", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("qwenrt: error: not enough disk space for random Qwen3.5-tiny-moe: it needs 0.3 GiB in "
                          f"{bench.cache_dir()} (") and err.endswith("0.0 GiB is free")
    assert sorted(p.name for p in bench.cache_dir().iterdir()) == built
