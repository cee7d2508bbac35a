class QwenrtError(Exception):
    """A user-facing error: one clear line naming the offending values. `field`: the request field at fault, where
    one is (a server names it as the error's param)."""

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFullError(QwenrtError):
    """The engine's waiting queue is full: try again later (HTTP 429)."""


class ContextLengthError(QwenrtError):
    """A prompt that does not fit the context limit (HTTP 400 `context_length_exceeded`). `prompt_tokens` is its
    length, or where counting stopped when `counted` is False (it has at least that many)."""

    def __init__(self, message: str, prompt_tokens: int, limit: int, counted: bool = True):
        super().__init__(message)
        self.prompt_tokens, self.limit, self.counted = prompt_tokens, limit, counted
