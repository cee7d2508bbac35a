"""Optional native CPU kernels (AVX-512 BF16), compiled on first use and cached by torch.

Decode reads every weight once per token, so its speed is memory bandwidth; torch's bf16 matrix-vector product
reaches about half of it on these CPUs (shared/baselines.md), these kernels most of it. Where the CPU lacks the
instructions, no compiler is found, or QWENRT_KERNELS=0, `cpu_kernels()` returns None and callers use torch ops.
The kernels have no backward: callers ask `inference_kernels(...)`, which withholds them while autograd records.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(n) for n in ("bindings.cpp", "cpu_gemv.cpp", "cpu_gdn.cpp", "cpu_norm.cpp",
                                                 "cpu_attention.cpp")]
HEADERS = [Path(__file__).with_name("vec_math.h")]
ISA = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni"]
REQUIRED_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def cpu_kernels():
    """The compiled kernel module, or None when unavailable (the reason goes to stderr once)."""
    if os.environ.get("QWENRT_KERNELS", "1") == "0":
        return None
    missing = REQUIRED_FLAGS - _cpu_flags()
    if missing:
        return None
    try:
        from torch.utils.cpp_extension import load

        # torch rebuilds when a source changes, not a header: the name carries a hash of every file
        digest = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS)).hexdigest()[:10]
        notice = threading.Timer(3.0, lambda: print("qwenrt: compiling the native CPU kernels (once per qwenrt "
                                                    "version, about a minute)...", file=sys.stderr, flush=True))
        notice.start()  # a cached build loads in well under a second and says nothing
        try:
            return load(f"qwenrt_cpu_kernels_{digest}", [str(s) for s in SOURCES], verbose=False,
                        extra_cflags=["-O3", *ISA, "-fopenmp"])
        finally:
            notice.cancel()
    except Exception as e:  # compiler missing or failing: torch ops still give the same results, slower
        print(f"qwenrt: native CPU kernels unavailable ({str(e).splitlines()[0][:200]}); using torch ops",
              file=sys.stderr)
        return None


def inference_kernels(*tensors: torch.Tensor):
    """`cpu_kernels()`, or None when autograd must see through the op (grad enabled and one of `tensors` requires
    grad): the native kernels have no backward, so training always takes the torch ops."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return cpu_kernels()
