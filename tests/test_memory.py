"""Memory: load refuses a model larger than the memory available; quantize and load hold a few tensors, not all."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qwenrt
from qwenrt import loader, shapes
from qwenrt.convert import quantize_checkpoint
from qwenrt.quant import QuantEmbedding, QuantSpec
from tests.hostile import one_line_error

MIB = 1 << 20


def held_bytes(model) -> int:
    """Bytes of the distinct storages a loaded model's parameters, buffers and quantized lookup table hold."""
    embed = model.model.embed_tokens
    tensors = [*model.parameters(), *model.buffers(), *(embed.stored.values() if isinstance(embed, QuantEmbedding)
                                                         else ())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("options", [{}, {"dtype": "float32"}, {"quantize": "int8"}, {"quantize": QuantSpec(4, 32)},
                                     {"stored": QuantSpec(4, 32)}], ids=str)
def test_the_estimate_is_what_the_loaded_model_holds(options, published_ckpt, tmp_path, monkeypatch):
    """bf16 and fp32 as stored or cast, quantized while loading, stored quantized: fused experts, the MTP head and
    the fp32 norms / A_log / dt_bias included."""
    path, _ = published_ckpt
    if "stored" in options:
        spec = options.pop("stored")
        path = quantize_checkpoint(path, tmp_path / "q", spec.bits, spec.group_size)
    estimates = []
    monkeypatch.setattr(loader, "check_memory", lambda where, needed: estimates.append(needed))
    model, _ = qwenrt.load(path, **options)
    assert estimates == [held_bytes(model)]


class WeightRead(Exception):
    pass


def test_a_model_larger_than_the_available_memory_is_refused_before_reading(dense_ckpt, monkeypatch):
    path, _ = dense_ckpt
    needed = held_bytes(qwenrt.load(path)[0])

    def read_weights(*args):
        raise WeightRead

    monkeypatch.setattr(loader, "read_weights", read_weights)
    monkeypatch.setattr(loader, "meminfo", lambda field: needed + loader.MEMORY_MARGIN - 1)
    one_line_error(lambda: qwenrt.load(path), f"{path}: needs 0.5 GiB of memory to load (weights 0.0 GiB), 0.5 GiB "
                   "is available; free memory, use a smaller or quantized model, or set QWENRT_SKIP_MEMORY_CHECK=1 to "
                   "load it anyway")
    monkeypatch.setenv("QWENRT_SKIP_MEMORY_CHECK", "1")
    with pytest.raises(WeightRead):  # past the check
        qwenrt.load(path)


def test_a_model_that_fits_loads(dense_ckpt, monkeypatch):
    path, _ = dense_ckpt
    needed = held_bytes(qwenrt.load(path)[0])
    monkeypatch.setattr(loader, "meminfo", lambda field: needed + loader.MEMORY_MARGIN)
    model, _ = qwenrt.load(path)
    monkeypatch.setattr(loader, "meminfo", lambda field: None)  # no /proc/meminfo: not checked
    assert torch.equal(qwenrt.load(path)[0](torch.tensor([[1, 2]])), model(torch.tensor([[1, 2]])))


def test_the_cli_says_it_in_one_line(monkeypatch, capsys):
    from qwenrt.cli import main
    from qwenrt.default_model import default_model_path

    monkeypatch.setattr(loader, "meminfo", lambda field: 1 << 20)
    assert main(["run", str(default_model_path()), "hi"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"qwenrt: error: {default_model_path()}: needs 0.5 GiB of memory to load (weights 0.0 GiB), 0.0 GiB is "
        "available; free memory, use a smaller or quantized model, or set QWENRT_SKIP_MEMORY_CHECK=1 to load it anyway")


# A child process quantizes, or loads and generates, on one thread and reports its memory (bytes): its resident set
# after torch, qwenrt and the native kernels are loaded, its peak (VmHWM), and whether the kernels run.
CHILD = """
import json, sys
import torch
import qwenrt
from qwenrt.convert import quantize_checkpoint
from qwenrt.kernels import cpu_kernels

def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))

torch.set_num_threads(1)
cpu_kernels()  # loaded before the baseline, as torch and qwenrt
report = {"base": status("VmRSS"), "kernels": cpu_kernels() is not None}
if sys.argv[1] == "quantize":
    quantize_checkpoint(sys.argv[2], sys.argv[3], 4)
elif sys.argv[1] == "convert":
    from qwenrt.gguf.export import export_gguf
    export_gguf(sys.argv[2], sys.argv[3], "q4_0")
else:
    model, _ = qwenrt.load(sys.argv[2])
    report["loaded"] = status("VmHWM")
    report["tokens"] = qwenrt.complete(model, None, [1, 2, 3], max_tokens=4, ignore_eos=True).tokens
print(json.dumps(dict(report, peak=status("VmHWM"))))
"""


def _child(*args) -> dict:
    # a fixed mmap threshold: glibc's default one grows with each large free, after which freed tensors may stay in
    # the heap (resident) or not, by history: the peak would measure the allocator, not what the code holds
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), OMP_NUM_THREADS="1",
               MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_quantize_and_load_hold_a_few_tensors_not_the_checkpoint(tmp_path, monkeypatch):
    """A 376 MB bf16 checkpoint of 6 MoE layers and an MoE MTP layer (256 experts; its largest tensor, an expert
    bank, 33.5 MB) is quantized to int4 within 200 MiB over the child's baseline (the source's pages leave its RSS as
    it goes; the quantizer's fp32 slices take ~100 MiB; 492 MB when they stayed) and exported to GGUF Q4_0 within
    the same bound (103 MB; 430 when its pages stayed); its 109 MB int4 copy loads, memory-mapped, within 48 MiB
    (what load touches: norms, scales, the NaN scan; measured 28) and generates."""
    monkeypatch.setitem(shapes._TABLE, "many-experts", (6, 128, 0, 2, 1, 16, False, (256, 8, 256, 128)))
    monkeypatch.setitem(shapes._COMMON, "vocab_size", 16384)
    src = shapes.write_random_checkpoint("many-experts", tmp_path / "bf16")
    size = (src / "model.safetensors").stat().st_size
    assert size > 350 * MIB
    quantized = _child("quantize", str(src), str(tmp_path / "int4"))
    assert quantized["peak"] - quantized["base"] < 200 * MIB < size / 1.75, quantized
    exported = _child("convert", str(src), str(tmp_path / "q4_0.gguf"))
    assert exported["peak"] - exported["base"] < 200 * MIB, exported
    int4_size = (tmp_path / "int4" / "model.safetensors").stat().st_size
    loaded = _child("load", str(tmp_path / "int4"))
    assert len(loaded["tokens"]) == 4
    if loaded["kernels"]:  # without them int4 is repacked into torch's layout at load: a copy
        assert loaded["loaded"] - loaded["base"] < 48 * MIB < int4_size / 2, loaded
