"""The engine core: continuous batching with chunked prefill over one model (see core.py)."""

from qwenrt.engine.core import Engine, RequestHandle, RequestStream
from qwenrt.engine.request import Request, RequestOutput, TokenLogprob

__all__ = ["Engine", "Request", "RequestHandle", "RequestOutput", "RequestStream", "TokenLogprob"]
