"""qwenrt: exact, fast inference for the Qwen3.5 model family."""

from qwenrt.engine import Engine, Request
from qwenrt.errors import QueueFullError, QwenrtError
from qwenrt.generate import (Completion, GenerationResponse, batch_generate, complete, generate, stream_generate)
from qwenrt.loader import load
from qwenrt.sampling import SamplingParams

__all__ = ["QwenrtError", "QueueFullError", "Engine", "Request", "load", "generate", "stream_generate",
           "batch_generate", "complete", "SamplingParams", "Completion", "GenerationResponse"]
__version__ = "0.1.0"
