"""OpenAI-compatible request and response schemas for ``/v1/chat/completions`` and ``/v1/completions``.

Owns: validating a request body into ``SamplingParams`` (every out-of-range value is a 400 naming the field),
building response / chunk / error JSON. Unknown request fields that do not change the output are ignored, as
OpenAI-compatible servers do; fields this server cannot honour (``n`` > 1, ``logprobs``, ``best_of`` > 1) are
rejected. Extension: ``spec_stats: true`` adds the request's speculative statistics to the response.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.engine.types import SamplingParams
from app.serving.protocol import ErrorItem, SpecStats

DEFAULT_MAX_TOKENS = 256  # when the client sends neither max_tokens nor max_completion_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="Only n = 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="A signed 64-bit integer.")
    ignore_eos: bool = False
    spec_stats: bool = Field(False, description="Extension: add speculative statistics to the response.")
    return_token_ids: bool = Field(False, description="Extension: add the completion's token ids (non-streamed).")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS, temperature=self.temperature, top_p=self.top_p,
            seed=self.seed, stop=self.stop_strings(), ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Not supported: must be false.")

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        if self.logprobs:
            raise ValueError("logprobs is not supported")
        return self

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_completion_tokens or self.max_tokens)


class CompletionRequest(_Common):
    prompt: str | list[str]
    logprobs: int | None = Field(None, description="Not supported: must be null.")
    best_of: int = Field(1, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt is supported")
        if (value if isinstance(value, str) else value[0]) == "":
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported")
        return self

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens)


def validation_error(err: ValidationError) -> ErrorItem:
    """The first pydantic error as a 400 naming the field."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    msg = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for errors raised by validators
    return ErrorItem(status=400, message=f"{param}: {msg}" if param else msg, param=param)


def error_body(err: ErrorItem) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    *, chat: bool, request_id: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
    completion_tokens: int, spec: SpecStats | None, token_ids: list[int] | None = None,
) -> dict:
    """A non-streamed response (``chat.completion`` or ``text_completion``)."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    body = {
        "id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens),
    }
    if spec is not None:
        body["spec_stats"] = spec.to_json()
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def chunk_body(
    *, chat: bool, request_id: str, model: str, text: str | None, finish_reason: str | None = None,
    role: bool = False,
) -> dict:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``)."""
    if chat:
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    return {
        "id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()), "model": model, "choices": [choice],
    }
