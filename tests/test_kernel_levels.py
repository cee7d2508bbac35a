"""Kernel levels: which one a CPU gets, the QWENRT_ISA cap, and every level below this machine's tested against the
torch reference, each in a fresh process (the kernel module is built and cached once per process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qwenrt.kernels
import qwenrt.ops.linear
from qwenrt.errors import QwenrtError
from qwenrt.kernels import LEVELS, cpu_level
from qwenrt.quant import QuantLinear, QuantSpec, dequantize_weight, quantize_weight
from tests.numerics import int8_groups, rel_err

ROOT = Path(__file__).resolve().parent.parent
AVX512BF16_CPU = LEVELS["avx512bf16"][0] | LEVELS["avx2"][0] | {"sse4_2", "bmi2"}


def level_for(monkeypatch, flags: set[str], cap: str | None) -> str:
    monkeypatch.setattr(qwenrt.kernels, "_cpu_flags", lambda: flags)
    if cap is None:
        monkeypatch.delenv("QWENRT_ISA", raising=False)
    else:
        monkeypatch.setenv("QWENRT_ISA", cap)
    cpu_level.cache_clear()
    try:
        return cpu_level()
    finally:
        cpu_level.cache_clear()


def test_each_cpu_gets_the_highest_level_it_runs_capped_by_qwenrt_isa(monkeypatch):
    assert level_for(monkeypatch, AVX512BF16_CPU, None) == "avx512bf16"
    assert level_for(monkeypatch, AVX512BF16_CPU - {"avx512_bf16"}, None) == "avx512"
    assert level_for(monkeypatch, {"avx2", "fma", "f16c", "avx512f"}, None) == "avx2"  # AVX-512F alone is not enough
    assert level_for(monkeypatch, {"avx2", "fma"}, None) == "portable"  # no F16C: not the avx2 level
    assert level_for(monkeypatch, set(), None) == "portable"  # ARM, or no /proc/cpuinfo
    assert level_for(monkeypatch, AVX512BF16_CPU, "avx2") == "avx2"
    assert level_for(monkeypatch, AVX512BF16_CPU, " AVX512 ") == "avx512"
    assert level_for(monkeypatch, {"avx2", "fma", "f16c"}, "avx512bf16") == "avx2"  # a cap, not a demand
    with pytest.raises(QwenrtError, match="QWENRT_ISA='sse9' is not a kernel level"):
        level_for(monkeypatch, AVX512BF16_CPU, "sse9")


def test_bf16_products_go_through_fp32_where_the_cpu_emulates_them(monkeypatch):
    """Prefill-sized bf16 GEMMs: torch's bf16 GEMM with bf16 hardware; otherwise the native fp32 GEMM, or without it
    fp32 slices of the weight through torch's; the same sums rounded once each way. Quantized weights likewise,
    dequantized exactly to fp32 slice by slice, except int4 on the native GEMM, which takes x in 8 bits per group:
    exact to that x."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(700, 256, generator=g).bfloat16()
    x = torch.randn(2, 40, 256, generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    native_gemm = qwenrt.ops.linear.NATIVE_GEMM_LEVELS
    # bf16 hardware; the native GEMM; 3 slices of the weight, the last partial; 1 slice
    for native, levels, slice_rows in ((True, native_gemm, 300), (False, native_gemm, 300), (False, (), 300),
                                       (False, (), 700)):
        monkeypatch.setattr(qwenrt.ops.linear, "SLICE", 256 * slice_rows)
        monkeypatch.setattr(qwenrt.ops.linear, "NATIVE_GEMM_LEVELS", levels)
        monkeypatch.setattr(qwenrt.ops.linear, "native_bf16_matmul", lambda: native)
        assert qwenrt.ops.linear.emulated_bf16(x) is not native
        y = qwenrt.ops.linear.gemm(x, w)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 40, 700)
        assert rel_err(y, ref) < 4e-3  # one bf16 rounding of each output
        for spec in (QuantSpec(8), QuantSpec(4, 64)):
            stored = quantize_weight(w.float(), spec)
            layer = QuantLinear.from_stored(stored, spec, torch.bfloat16)
            x_in = x.double()
            if spec.bits == 4 and not native and qwenrt.kernels.cpu_kernels() is not None:
                x_in = int8_groups(x.view(-1, 256), 64)[0].view_as(x_in)
            exact = x_in @ dequantize_weight(stored, spec).double().t()
            assert rel_err(layer(x), exact) < 8e-3  # int4 without fp32 (bf16 dequantization) rounds twice


def lower_levels() -> list[str]:
    names = list(LEVELS)
    return names[names.index(cpu_level()) + 1:]


@pytest.mark.parametrize("level", lower_levels())
def test_lower_level_kernels_match_the_torch_reference(level):
    """tests/test_kernels.py's, tests/test_moe_native.py's, tests/test_tiled_attention.py's and tests/test_kv_int8.py's
    kernel tests again with the level capped (a build of its own, a minute or so to compile): each GEMV, the
    DeltaNet, attention (decode step and tiled prefill, over plain and 8-bit stores) and norm kernels and the MoE
    block against torch or their bounds, on the code a CPU of that level runs (not the MoE block's 1e-2 check against
    the torch path, which the int4 GEMVs' 8-bit x exceed below avx512bf16). (Whole-model decodes and prefills run the
    same kernels: they stay at this machine's level.)"""
    env = dict(os.environ, QWENRT_ISA=level)
    env.pop("QWENRT_KERNELS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", "tests/test_kernels.py",
                           "tests/test_moe_native.py", "tests/test_tiled_attention.py", "tests/test_kv_int8.py",
                           "-k", "not native_decode and not decode_plan and not copies and not inference_mode and not "
                           "matches_the_torch_path and not model_prefill and not int8_kv and not int8_bytes and not "
                           "bad_kv"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout, done.stdout[-500:]
