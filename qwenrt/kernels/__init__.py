"""Optional native CPU kernels, compiled on first use for the CPU's instruction-set level and cached by torch.

Decode reads every weight once per token, so its speed is memory bandwidth; torch's matrix-vector products reach
about half of it on these CPUs (shared/baselines.md), these kernels most of it. One build per level, each under its
own extension name, so a cache shared between machines never loads code a CPU cannot run:

    avx512bf16  AVX-512 with BF16 and VNNI     avx2      AVX2 + FMA + F16C
    avx512      AVX-512F/BW/VL/DQ without them  portable  plain C++ the compiler vectorises (any CPU, ARM too)

QWENRT_ISA=<level> caps the level (a higher machine runs and tests the lower paths); QWENRT_KERNELS=0 turns the
kernels off, and then, or where no compiler works, `cpu_kernels()` returns None and callers use torch ops.
The kernels have no backward: callers ask `inference_kernels(...)`, which withholds them while autograd records.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from qwenrt.errors import QwenrtError

_DIR = Path(__file__).parent
SOURCES = [_DIR / n for n in ("bindings.cpp", "cpu_gemv.cpp", "cpu_gemm.cpp", "cpu_gdn.cpp", "cpu_norm.cpp",
                            "cpu_attention.cpp", "cpu_attention_prefill.cpp", "cpu_layer_stack.cpp", "cpu_moe.cpp",
                            "cpu_moe_gemm.cpp", "cpu_argmax.cpp", "cpu_greedy_cycle.cpp", "cpu_lora.cpp")]
HEADERS = [_DIR / n for n in ("simd.h", "gemv_common.h", "gemv_simd.h", "gemv_avx512bf16.h", "kernels.h",
                            "layer_stack.h", "parallel.h")]
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
# level -> (CPU flags it needs, compiler flags), highest first
LEVELS = {
    "avx512bf16": (_AVX512 | {"avx512_bf16", "avx512_vnni"}, [*_AVX512_FLAGS, "-mavx512bf16", "-mavx512vnni"]),
    "avx512": (_AVX512, _AVX512_FLAGS),
    "avx2": ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]),
    "portable": (set(), []),
}


def _cpu_flags() -> set[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def cpu_level() -> str:
    """The highest kernel level this CPU runs, capped by QWENRT_ISA."""
    cap = os.environ.get("QWENRT_ISA", "").strip().lower() or next(iter(LEVELS))
    if cap not in LEVELS:
        raise QwenrtError(f"QWENRT_ISA={cap!r} is not a kernel level (use one of {', '.join(LEVELS)})")
    flags = _cpu_flags()
    names = list(LEVELS)
    return next(n for n in names[names.index(cap):] if LEVELS[n][0] <= flags)


def native_bf16_matmul() -> bool:
    """Whether torch's bf16 matrix products run on bf16 hardware here; elsewhere they are emulated, far slower
    than converting the operands to fp32 (shared/baselines.md: 19 vs 113 tok/s of prefill on AVX2)."""
    return cpu_level() == "avx512bf16"


def _build(level: str):
    from torch.utils.cpp_extension import load

    # torch rebuilds when a source changes, not a header: the name carries a hash of every file. And of where the
    # sources and torch lie: two checkouts sharing the cache would rewrite one build file in turn, rebuilding each time
    where = f"{_DIR}|{torch.__file__}".encode()
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + where).hexdigest()[:10]
    # 70-90 s of CPU time (9 files at -O3, run in parallel by ninja): 40 s on 2 free cores, 2-3 min on busy ones
    notice = threading.Timer(3.0, lambda: print(f"qwenrt: compiling the native CPU kernels for {level} (once per "
                                                "qwenrt version: about a minute on 2 free cores, more if busy)...",
                                                file=sys.stderr, flush=True))
    notice.start()  # a cached build loads in well under a second and says nothing
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join(filter(None, [_ninja_dir(), path]))
    try:
        return load(f"qwenrt_cpu_kernels_{level}_{digest}", [str(s) for s in SOURCES], verbose=False,
                    extra_cflags=["-O3", *LEVELS[level][1], "-fopenmp"])
    finally:
        os.environ["PATH"] = path
        notice.cancel()


def _ninja_dir() -> str | None:
    """The folder of the ninja qwenrt depends on. Always that one: ninja versions keep their build logs in
    different formats, and one that reads another's log rebuilds everything (a venv used with and without
    activation would compile the kernels again at every switch)."""
    try:
        import ninja

        return ninja.BIN_DIR
    except (ImportError, AttributeError):
        return None


@functools.cache
def cpu_kernels():
    """The compiled kernel module for `cpu_level()`, or None when off or unavailable (the reason goes to stderr)."""
    if os.environ.get("QWENRT_KERNELS", "1") == "0":
        return None
    level = cpu_level()
    try:
        return _build(level)
    except Exception as e:  # compiler missing or failing: torch ops still give the same results, slower
        print(f"qwenrt: native CPU kernels unavailable ({str(e).splitlines()[0][:200]}); using torch ops",
              file=sys.stderr)
        return None


def kernel_path() -> str:
    """Which kernels run here, for load lines and benchmark tables: the level ('avx2'), or why torch ops do."""
    if os.environ.get("QWENRT_KERNELS", "1") == "0":
        return "torch ops (QWENRT_KERNELS=0)"
    return cpu_level() if cpu_kernels() is not None else "torch ops (the native kernels failed to build)"


def inference_kernels(*tensors: torch.Tensor):
    """`cpu_kernels()`, or None when autograd must see through the op (grad enabled and one of `tensors` requires
    grad): the native kernels have no backward, so training always takes the torch ops."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return cpu_kernels()
