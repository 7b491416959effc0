"""Exceptions the engine raises; the serving layer maps each to an HTTP status."""


class EngineError(Exception):
    """Base class of engine errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request or its draft block is malformed (HTTP 400); ``param`` names the request field at fault, when one
    is (an OpenAI error's ``param``)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt + max_tokens + draft room exceeds the engine's context limit (HTTP 400)."""


class UnknownRequestError(EngineError, KeyError):
    """A verify or release names a request the engine does not hold (never added, finished or released)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class CapacityError(EngineError, RuntimeError):
    """No free KV-cache slot for a new request (HTTP 503, retry later)."""
