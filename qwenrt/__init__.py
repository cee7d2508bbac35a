"""qwenrt: exact, fast inference for the Qwen3.5 model family."""

import importlib
import os
import sys
import types

# Where bf16 matrix products run on bf16 hardware (AVX-512 BF16, AMX), torch's prefill GEMMs go through oneDNN, which
# keeps a compiled primitive per shape in two caches (oneDNN's and ideep's), 1024 entries each by default. Prompt
# lengths differ per request, so a server's memory grew by ~300 KB per new length: 0.48 -> 1.03 GB over 120 prompts
# of qwenrt-tiny. 64 entries keep the shapes in use (a chunked prefill's full chunks) and bound the rest. Read when
# the first such product runs; a value the user set stands.
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, "64")
# OpenMP's threads (torch's and the native kernels') spin a short while at a barrier, then sleep. Spinning without
# end kept a core other work needed while waiting on a thread that work had taken off the other one (2 threads on a
# 2-core machine at load 3-4: the 0.8B 0.9-1.5 tok/s against 9.7-10.1 sleeping at once); sleeping at once costs a
# wake-up per kernel call, which an MoE step makes ~20 of per layer (the 35B-A3B in int4 on an idle 2-core EPYC:
# 5.7-6.5 tok/s sleeping at once, 13.0-13.6 with 30,000 spins). Read when torch loads OpenMP: import qwenrt first.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

__version__ = "0.1.0"

# The public API by the module that defines it, imported on first use: `import qwenrt` (and so the CLI's --help,
# --version and usage errors) does not import torch (~1-4 s).
_PUBLIC = {"QwenrtError": "qwenrt.errors", "QueueFullError": "qwenrt.errors", "Engine": "qwenrt.engine",
           "Request": "qwenrt.engine", "load": "qwenrt.loader", "generate": "qwenrt.generate",
           "stream_generate": "qwenrt.generate", "batch_generate": "qwenrt.generate", "complete": "qwenrt.generate",
           "SamplingParams": "qwenrt.sampling", "Completion": "qwenrt.generate",
           "GenerationResponse": "qwenrt.generate"}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'qwenrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps qwenrt.generate the function: importing the submodule qwenrt.generate would set the attribute to it."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, types.ModuleType):
            value = value.generate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
