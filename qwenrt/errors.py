class QwenrtError(Exception):
    """A user-facing error: one clear line naming the offending values."""


class QueueFullError(QwenrtError):
    """The engine's waiting queue is full: try again later (HTTP 429)."""
