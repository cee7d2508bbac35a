class QwenrtError(Exception):
    """A user-facing error: one clear line naming the offending values. `field`: the request field at fault, where
    one is (a server names it as the error's param)."""

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFullError(QwenrtError):
    """The engine's waiting queue is full: try again later (HTTP 429)."""
