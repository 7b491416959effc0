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
    """Prompt + max_tokens exceeds the engine's context limit (HTTP 400); ``param`` is ``max_tokens``
    when a smaller max_tokens would fit, else ``prompt`` (the serving layer names the request's own field:
    ``max_completion_tokens`` where a chat request set that, a chat's ``messages``)."""

    @classmethod
    def check(cls, *, prompt_tokens: int, max_tokens: int, limit: int) -> None:
        """Raise the error if ``prompt_tokens + max_tokens`` exceeds ``limit`` (tokens; vLLM's rule for
        ``max_model_len``: draft blocks do not count, the engine's cache holds their room past the limit).

        Raises:
            ContextLengthError: it does (the message gives each term and the limit).
        """
        if prompt_tokens + max_tokens > limit:
            err = cls(cls._message(prompt_tokens, max_tokens, limit, "max_tokens"),
                      param="max_tokens" if prompt_tokens < limit else "prompt")
            err.terms = (prompt_tokens, max_tokens, limit)
            raise err

    def describe(self, max_tokens_field: str, *, max_tokens_default: bool = False) -> str:
        """The message with the request's own name for max_tokens (``max_completion_tokens`` where it set that);
        ``max_tokens_default``: the request set none (a default the serving layer lowers to what the context leaves,
        so only a prompt that fills the context fails): the message names the prompt alone."""
        prompt_tokens, _, limit = self.terms
        if max_tokens_default:
            return (f"prompt of {prompt_tokens} tokens leaves no room for a generated token within the context limit "
                    f"of {limit} tokens")
        return self._message(*self.terms, max_tokens_field)

    @staticmethod
    def _message(prompt_tokens: int, max_tokens: int, limit: int, max_tokens_field: str) -> str:
        return (f"prompt of {prompt_tokens} tokens + {max_tokens_field} {max_tokens} = {prompt_tokens + max_tokens} "
                f"exceeds the context limit of {limit} tokens")


class UnknownRequestError(EngineError, KeyError):
    """A verify or release names a request the engine does not hold (never added, finished or released)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class CapacityError(EngineError, RuntimeError):
    """No free KV-cache slot for a new request (HTTP 503, retry later)."""
