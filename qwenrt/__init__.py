"""qwenrt: exact, fast inference for the Qwen3.5 model family."""

import os

# Where bf16 matrix products run on bf16 hardware (AVX-512 BF16, AMX), torch's prefill GEMMs go through oneDNN, which
# keeps a compiled primitive per shape in two caches (oneDNN's and ideep's), 1024 entries each by default. Prompt
# lengths differ per request, so a server's memory grew by ~300 KB per new length: 0.48 -> 1.03 GB over 120 prompts
# of qwenrt-tiny. 64 entries keep the shapes in use (a chunked prefill's full chunks) and bound the rest. Read when
# the first such product runs; a value the user set stands.
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, "64")
# OpenMP's threads (torch's and the native kernels') sleep at a barrier instead of spinning: spinning, they kept
# a core other work needed while waiting on a thread that work had taken off the other one. Two threads on a
# 2-core machine at load 3-4: qwenrt-tiny 121-206 tok/s to 2,720-3,389 (one thread: 2,577-3,374), the 0.8B
# 0.9-1.5 tok/s to 9.7-10.1 (one thread 9.6-11.5). The price, at load ~1.5: the 0.8B 14.3-15.1 against 17.5-20.0
# spinning (OMP_WAIT_POLICY=active on a machine of its own). Read when torch loads OpenMP: import qwenrt first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from qwenrt.engine import Engine, Request
from qwenrt.errors import QueueFullError, QwenrtError
from qwenrt.generate import (Completion, GenerationResponse, batch_generate, complete, generate, stream_generate)
from qwenrt.loader import load
from qwenrt.sampling import SamplingParams

__all__ = ["QwenrtError", "QueueFullError", "Engine", "Request", "load", "generate", "stream_generate",
           "batch_generate", "complete", "SamplingParams", "Completion", "GenerationResponse"]
__version__ = "0.1.0"
