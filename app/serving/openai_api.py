"""OpenAI-compatible request and response schemas for ``/v1/chat/completions`` and ``/v1/completions``.

Owns: validating a request body into one ``SamplingParams`` per choice (every out-of-range value is a 400 naming
the field), building response / chunk / logprobs / error JSON. Nothing is silently ignored: every field of OpenAI's
chat and completions requests is declared below and either acts as OpenAI documents (``ACTING``), is harmless by
nature (``HARMLESS``: it names, tags, stores or bills the request and cannot change its output), or answers a 400
naming it when set to anything but its neutral value (``REJECTED``); any other field is a 400 naming it too.
Extensions, with vLLM's names: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``allowed_token_ids``, ``ignore_eos``, ``prompt_logprobs``, ``return_token_ids``, ``add_special_tokens``,
``structured_outputs``, ``include_stop_str_in_output``, ``skip_special_tokens``; and ``spec_stats`` (the request's
speculative statistics).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, Any, Literal, Sequence

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator,
)

from app.engine.errors import InvalidRequestError
from app.engine.types import MAX_LOGPROBS, ChatTemplateOptions, GuidedDecoding, SamplingParams
from app.serving.protocol import ErrorItem, SpecStats, TokenLogprobText
from app.serving.tools import (NamedToolChoice, Tool, ToolChoice, ToolMode, ToolParserName, ToolReader, calls_grammar,
                               json_value, validate_tools)

DEFAULT_MAX_TOKENS = 256  # a chat request's without max_tokens or max_completion_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16  # a completions request's without max_tokens (OpenAI's legacy default, vLLM's)
MAX_CHOICES = 16  # most choices (n x prompts) one request may ask for
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' integer logprobs
MAX_JSON_DEPTH = 64  # deepest nesting of arrays and objects a request body may have (deeper: 400)

# Request fields by what they do (the field walk test reads these); the extensions are ACTING too.
ACTING_CHAT = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
               "stream_options", "stop", "seed", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
               "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls")
ACTING_COMPLETIONS = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                      "seed", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "echo", "best_of")
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "allowed_token_ids",
              "bad_words", "ignore_eos", "spec_stats", "return_token_ids", "prompt_logprobs", "add_special_tokens",
              "structured_outputs", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
              "priority", "return_tokens_as_token_ids", "add_generation_prompt", "continue_final_message",
              "chat_template_kwargs", "include_reasoning", "response_format")  # vLLM's; response_format on completions
HARMLESS_CHAT = ("user", "metadata", "store", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                 "prompt_cache_options", "service_tier", "prediction", "modalities")
HARMLESS_COMPLETIONS = ("user",)
REJECTED_CHAT = ("functions", "function_call", "audio", "reasoning_effort", "verbosity",
                 "web_search_options", "moderation")
REJECTED_COMPLETIONS = ("suffix",)


# Every request model: unknown fields are a 400, and so is a value of the wrong JSON type ("0.5" for a number, true for
# an integer, 1 for a boolean): nothing is coerced, as OpenAI's API does not; NaN and infinities are refused.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def unicode_text(value: str, what: str) -> str:
    """``value`` unless it cannot be UTF-8 (a lone UTF-16 surrogate such as a JSON "\\ud800" escape).

    Raises:
        ValueError: naming ``what``.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} is not valid Unicode text: {err.reason} at character {err.start}") from None
    return value


def json_too_deep(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON nests arrays / objects deeper than ``limit`` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def unsupported(name: str, why: str) -> ValueError:
    return ValueError(f"{name} is not supported by this server ({why})")


def unsupported_part(kind: Any) -> ValueError:
    """The error for a content part of type ``kind``, any JSON value (quoted as JSON, cut at 100 characters)."""
    return unsupported(f"content part type {json.dumps(kind)[:100]}", "text parts only")


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's ``content`` list."""

    model_config = STRICT

    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, value: str) -> str:
        return unicode_text(value, "text")


def _text_part(part: dict[str, Any]) -> dict[str, Any]:
    """A message's ``content`` part, which must be a ``TextPart`` (its errors located at the part's index).

    Raises:
        ValueError: another part type.
        ValidationError: not a ``TextPart`` (a field missing, unknown or of the wrong type; text not valid Unicode).
    """
    if part.get("type", "text") != "text":  # a part without a type is TextPart's "type: Field required"
        raise unsupported_part(part["type"])
    TextPart.model_validate(part)
    return part


class FunctionCallParam(BaseModel):
    model_config = STRICT

    name: str
    arguments: str = Field(description="The arguments as JSON text, as a response gave them.")


class ToolCallParam(BaseModel):
    """A tool call of an earlier assistant turn, as a response gave it (``message.tool_calls[i]``)."""

    model_config = STRICT

    id: str
    type: Literal["function"]
    function: FunctionCallParam

    def template_dict(self) -> dict[str, Any]:
        """The call as chat templates take it: the arguments as an object when they are a JSON object (templates
        write them with ``tojson``; vLLM passes them so), else, or nested deeper than a request body may be
        (``MAX_JSON_DEPTH``: the renderer walks objects recursively), as sent."""
        arguments = json_value(self.function.arguments)
        if json_too_deep(arguments):
            arguments = None
        return {"id": self.id, "type": "function", "function": {
            "name": self.function.name,
            "arguments": arguments if isinstance(arguments, dict) else self.function.arguments}}


class ChatMessage(BaseModel):
    """A message; ``content`` is a string or a list of text parts (joined with a newline, as vLLM does); an earlier
    assistant turn may come back as a response gave it: ``content`` null, its ``reasoning`` (vLLM's field, or its
    older name ``reasoning_content``), which the chat template receives as ``reasoning_content``, its
    ``tool_calls``; a ``tool`` message is a call's result, named by ``tool_call_id``."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    # optional in an assistant turn, as OpenAI's
    content: str | list[Annotated[dict[str, Any], AfterValidator(_text_part)]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    # what an SDK sends back with an earlier assistant turn; only their empty values are accepted
    refusal: str | None = None
    annotations: list | None = None
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _assistant_fields(self) -> "ChatMessage":
        if self.role != "assistant" and self.content is None:
            raise ValueError("content is needed (it may be null or left out in assistant messages only)")
        if self.role != "assistant" and (self.reasoning is not None or self.reasoning_content is not None):
            raise ValueError("reasoning is for assistant messages only")
        if self.role != "assistant" and self.tool_calls is not None:
            raise ValueError("tool_calls are for assistant messages only")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id goes with role 'tool' only, and that role needs it (the call answered)")
        return self

    @field_validator("reasoning", "reasoning_content")
    @classmethod
    def _reasoning_text(cls, value: str | None, info) -> str | None:
        return value if value is None else unicode_text(value, info.field_name)

    @field_validator("content")
    @classmethod
    def _unicode(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        return unicode_text(value, "content") if isinstance(value, str) else value

    @field_validator("refusal", "annotations", "audio", "function_call")
    @classmethod
    def _empty(cls, value: Any, info) -> Any:
        if value:
            raise unsupported(info.field_name, "a text model's turn has none; only an empty value is accepted")
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p["text"] for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it: role, text, and any reasoning, tool calls, tool call id."""
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if reasoning is not None:
            out["reasoning"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (``ChatMessage.template_dict``)."""
    return [m.template_dict() for m in messages]


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description=(
        "Extension (vLLM's): with include_usage, every chunk of a choice also carries that choice's usage so far "
        "(its prompt's tokens, its completion tokens)."))
    include_obfuscation: bool = Field(True, description="Harmless: this server never adds an obfuscation field.")

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> "StreamOptions":
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage: true")
        return self


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(**STRICT, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema`` (guided decoding)."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema' only, and that type needs it")
        return self

    def guided(self) -> GuidedDecoding | None:
        if self.type == "text":
            return None
        schema = None if self.json_schema is None else json.dumps(self.json_schema.schema_)
        return GuidedDecoding(kind=self.type, spec=schema)


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (one constraint): ``json`` (a JSON schema, as an object or its JSON text),
    ``json_object``, ``regex``, ``choice`` (the output is exactly one of the strings) or ``grammar`` (a context-free
    grammar in llguidance's Lark syntax, or GBNF: ``root ::= ...``)."""

    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, "json_" if name == "json" else name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice, grammar (got {given or 'none'})")
        return self

    def guided(self) -> GuidedDecoding:
        """Raises: InvalidRequestError (``GuidedDecoding``: an empty choice)."""
        if self.json_object:
            return GuidedDecoding("json_object")
        if self.json_ is not None:
            return GuidedDecoding("json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))
        if self.choice is not None:
            return GuidedDecoding("choice", json.dumps(self.choice))
        if self.regex is not None:
            return GuidedDecoding("regex", self.regex)
        return GuidedDecoding("grammar", self.grammar)


class RequestLabels(BaseModel):
    """OpenAI's fields that label, store, cache or bill a request, never change its tokens: harmless here (nothing is
    stored or billed), and ``parallel_tool_calls``, harmless where a request has no tools (a chat request with tools
    acts on it: ``tools.py``)."""

    model_config = STRICT

    metadata: dict[str, str] | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    parallel_tool_calls: bool | None = None


class _TemplateFields(BaseModel):
    """vLLM's fields that say how the model's chat template renders the messages (chat requests, ``/tokenize``)."""

    model_config = STRICT

    add_generation_prompt: bool | None = Field(None, description=(
        "End with the header that opens the assistant's turn; None: true, unless continue_final_message."))
    continue_final_message: bool = Field(False, description=(
        "Leave the final message open, without its end-of-turn tokens, so the model continues it (a reply the "
        "client started)."))
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "More variables for the chat template (Qwen3's enable_thinking, for one)."))
    tools: list[Tool] | None = Field(None, description=(
        "Functions the model may call (OpenAI's), shown to the model by the chat template; a template that does not "
        "show tools answers 400."))

    @model_validator(mode="after")
    def _template(self) -> "_TemplateFields":
        self.template_options()
        validate_tools(self.tools, None)
        return self

    def template_options(self) -> ChatTemplateOptions:
        """Raises: InvalidRequestError (``ChatTemplateOptions``: both add_generation_prompt and
        continue_final_message)."""
        generation = self.add_generation_prompt
        return ChatTemplateOptions(add_generation_prompt=not self.continue_final_message if generation is None
                                   else generation, continue_final_message=self.continue_final_message,
                                   template_kwargs=dict(self.chat_template_kwargs or {}),
                                   tools=None if self.tools is None else tuple(t.model_dump(exclude_none=True)
                                                                               for t in self.tools))


class _Common(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="None: 1.0, OpenAI's default.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="Choices; each is its own request on the engine.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="A signed 64-bit integer.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = Field(None, description=(
        "Guided decoding to JSON (``json_object``, ``json_schema``) or none (``text``); on completions as vLLM "
        "offers it."))
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = Field(None, description="Keep the k most likely tokens; 0 or -1 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = Field(None, description=(
        "The only token ids that may be generated (vLLM's): one or more, each in the vocabulary. EOS is not added: "
        "without it the output ends at max_tokens, a stop string or a stop_token_ids token."))
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(False, description="The text ends after the stop string that ended it.")
    skip_special_tokens: bool = Field(True, description="False: special tokens show as their text.")
    spec_stats: bool = Field(False, description="Extension: add speculative statistics to the response.")
    return_token_ids: bool = Field(False, description="Extension: add the completion's token ids (non-streamed).")
    return_tokens_as_token_ids: bool = Field(False, description=(
        "Extension (vLLM's): name each logprobs token \"token_id:<id>\" instead of its text."))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "Extension: vLLM's structured output (json, json_object, regex, choice or grammar)."))
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1, description=(
        "Extension (vLLM's): with the server's priority scheduling, queued requests are admitted lower values first; "
        "other than 0 without it, a 400."))
    bad_words: list[str] | None = Field(None, description=(
        "Extension (vLLM's): words that may not be generated (each tokenized alone and after a space; a word's last "
        "token is masked where the output ends with its other tokens)."))
    truncate_prompt_tokens: int | None = Field(None, description=(
        "Extension (vLLM's): keep only the prompt's last k tokens (after the chat template and special tokens); -1: "
        "as many as the context holds. An echoed prompt is then the kept tokens' text."))
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "Extension: add each prompt token's logprob, rank and this many most likely alternatives (vLLM's "
        "``prompt_logprobs`` field, non-streamed)."))

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < -1:
            raise ValueError(f"must be a number of tokens >= 1, or 0 or -1 for off (vLLM's), got {value}")
        return 0 if value == -1 else value  # vLLM's "off"

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError(f"must be a number of tokens >= 1, or -1 for the context length (vLLM's), got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if len(key) > 18:  # no vocabulary is that large; Python refuses int() of over 4300 digits
                raise ValueError(f"keys must be token ids (decimal strings of 0-9), got one of {len(key)} characters")
            if not (key.isascii() and key.isdigit()):  # str.isdigit alone takes any script's digits
                raise ValueError(f"keys must be token ids (decimal strings of 0-9), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias!r} for token {key}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _streamed_only(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @model_validator(mode="after")
    def _one_structure(self) -> "_Common":
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise InvalidRequestError(f"a response_format of type {self.response_format.type!r} is a second "
                                      "constraint: send one of the two", param="structured_outputs")
        return self

    @field_validator("return_token_ids", "prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: bool | int | None, info: ValidationInfo) -> bool | int | None:
        if value is not None and value is not False and info.data.get("stream"):  # prompt_logprobs 0 counts
            raise ValueError(f"{info.field_name} is for non-streamed responses (stream: false) only")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def guided_param(self) -> str:
        """The field that sets the engine's structured output, which errors about it name."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats``: every chunk of a choice carries its usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def max_tokens_param(self) -> str:
        """The field that sets the engine's max_tokens, which errors about it name."""
        return "max_tokens"

    @property
    def max_tokens_default(self) -> bool:
        """Whether the request sets no max_tokens (the default then gives way to the context, as in vLLM)."""
        return self.max_tokens is None

    def guided(self) -> GuidedDecoding | None:
        """The structured output ``structured_outputs`` or ``response_format`` sets (at most one does), or None.

        Raises:
            InvalidRequestError: an empty ``choice`` (``GuidedDecoding``).
        """
        if self.structured_outputs is not None:
            return self.structured_outputs.guided()
        return self.response_format.guided() if self.response_format is not None else None

    def _params(self, max_tokens: int, *, logprobs: int | None, choice: int,
                prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's settings for choice ``choice`` (``seed + choice`` with a seed, so choices differ).

        Raises:
            ValueError: a combination ``SamplingParams`` refuses (``min_tokens`` over ``max_tokens``, ...).
        """
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = None if self.seed is None else (self.seed + choice + 2**63) % 2**64 - 2**63
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, seed=seed, stop=stops, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, min_tokens=self.min_tokens or 0,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()),
            logprobs=logprobs, guided=self.guided(), prompt_logprobs=prompt_logprobs,
        )


class ChatCompletionRequest(_Common, _TemplateFields, RequestLabels):
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = Field(False, description=(
        "Extension (vLLM's): also add the tokenizer's special tokens (a Llama tokenizer's BOS) to the chat "
        "template's text, which usually writes them itself."))
    max_completion_tokens: int | None = Field(None, ge=1)
    include_reasoning: bool = Field(True, description=(
        "Extension (vLLM's): with a reasoning parser, false leaves the reasoning out of the response."))
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # harmless by nature, beside RequestLabels
    prediction: dict[str, Any] | None = Field(None, description="Predicted output: a latency hint only.")
    modalities: list[Literal["text"]] | None = None
    tool_choice: ToolChoice | None = Field(None, description=(
        "none, auto (the default with tools: the model chooses; needs the server's enable_auto_tool_choice), "
        "required (one or more calls), or a named function (its call); app/serving/tools.py."))
    # rejected unless neutral
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _named_form(cls, value: Any) -> Any:
        named = isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
        if not (value is None or isinstance(value, str) or named and isinstance(value["function"].get("name"), str)):
            raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}; the others are '
                             f'"none", "auto" and "required" (got {json.dumps(value)[:200]})')
        return value

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list | None) -> list | None:
        if value:
            raise unsupported("functions", "OpenAI's deprecated form of tools; send tools instead")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise unsupported("function_call", "OpenAI's deprecated form of tool_choice; send tool_choice instead")
        return value

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        validate_tools(self.tools, self.tool_choice)
        if self.tool_mode in ("named", "required") and super().guided() is not None:
            raise InvalidRequestError(f"tool_choice {self.tool_mode!r} writes the calls with a grammar: it cannot "
                                      f"be combined with {super().guided_param}", param="tool_choice")
        return self

    @property
    def tool_mode(self) -> ToolMode:
        """How the answer may call the tools (``tools.py``): none without tools or with ``tool_choice`` none."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def tool_reader(self, parser: ToolParserName | None) -> ToolReader | None:
        """How the answer's calls are read (``parser``: the server's, for ``auto``); None when it makes none.

        Raises:
            ValueError: ``auto`` without a parser (the ingress refuses such requests first).
        """
        if self.tool_mode == "none":
            return None
        function = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return ToolReader(self.tool_mode, parser=parser, function=function,
                          names=tuple(t.function.name for t in self.tools or ()),
                          parallel=self.parallel_tool_calls is not False)

    @property
    def guided_param(self) -> str:
        """A grammar error names the schema behind it: the named function's ``parameters``, ``tools`` for a required
        choice's (all of them), else ``_Common.guided_param``."""
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_mode == "named":
            index = next(i for i, t in enumerate(self.tools or ()) if t.function.name == self.tool_choice.function.name)
            return f"tools.{index}.function.parameters"
        return "tools" if self.tool_mode == "required" else super().guided_param

    def guided(self) -> GuidedDecoding | None:
        """The grammar that writes the calls of a named or required ``tool_choice``, else ``_Common.guided``."""
        grammar = calls_grammar(self.tools or [], self.tool_choice, parallel=self.parallel_tool_calls is not False)
        return grammar if grammar is not None and self.tool_mode != "none" else super().guided()

    @field_validator("audio", "verbosity", "web_search_options", "moderation")
    @classmethod
    def _not_offered(cls, value: Any, info) -> Any:
        if value is not None:
            raise unsupported(info.field_name, "this model has no such option")
        return value

    @field_validator("reasoning_effort")
    @classmethod
    def _no_reasoning(cls, value: Any, info) -> Any:
        if value not in (None, "none"):  # OpenAI's "none": no reasoning, what this server does
            raise unsupported(info.field_name, "this model does not reason; only 'none' is accepted")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_tokens_default(self) -> bool:
        return self.max_tokens is None and self.max_completion_tokens is None

    def params(self, choice: int = 0) -> SamplingParams:
        """Raises: ValueError (``SamplingParams``)."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS
        return self._params(max_tokens, logprobs=logprobs, choice=choice,
                            prompt_logprobs=self.prompt_logprobs if choice == 0 else None)  # one prompt, scored once

    def chat_messages(self) -> list[dict[str, str]]:
        return chat_dicts(self.messages)


Prompt = str | list[int]  # a completion prompt: text, or token ids


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="0 (with echo): the prompt alone, scored with logprobs.")
    add_special_tokens: bool = Field(True, description=(
        "Extension (vLLM's): add the tokenizer's special tokens (a Llama tokenizer's BOS) to a text prompt; "
        "token-id prompts are taken as sent."))
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_kinds(cls, value: Any) -> Any:
        """One of OpenAI's four prompt shapes, token ids as JSON integers >= 0 (their range is the model's to check:
        the target replica's)."""
        def token_ids(p: Any) -> bool:
            return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if not isinstance(value, list) or all(isinstance(p, str) for p in value):
            return value
        if not (token_ids(value) or all(token_ids(p) for p in value)):
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                             "token ids")
        if any(t < 0 for t in (value if token_ids(value) else [t for p in value for t in p])):
            raise ValueError("prompt token ids must be integers >= 0")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        prompts = cls.prompt_list(value)
        if not prompts:
            raise ValueError("at least one prompt is needed")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must not be empty")
        for p in prompts:
            if isinstance(p, str):
                unicode_text(p, "prompt")
        return value

    @staticmethod
    def prompt_list(value: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
        """The prompts of a ``prompt`` value: one string, strings, one list of token ids, or lists of them."""
        if isinstance(value, str) or value and all(isinstance(t, int) for t in value):
            return [value]
        return list(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise unsupported("suffix", "the model has no fill-in-the-middle mode")
        return value

    @model_validator(mode="after")
    def _checks(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.num_choices:
            raise InvalidRequestError("best_of must equal n (choosing the best of several is not supported)",
                                      param="best_of")
        if self.prompt_only and not self.echo:
            raise InvalidRequestError("0 generates nothing; it needs echo: true (the prompt alone, scored with "
                                      "logprobs)", param="max_tokens")
        if self.prompt_only and self.min_tokens:
            raise InvalidRequestError(f"{self.min_tokens} is more than max_tokens (0)", param="min_tokens")
        if len(self.prompts) * self.num_choices > MAX_CHOICES:
            raise InvalidRequestError(f"prompts x n must be at most {MAX_CHOICES}",
                                      param="n" if self.num_choices > 1 else "prompt")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        return self.prompt_list(self.prompt)

    @property
    def max_tokens_default(self) -> bool:
        """Whether the engine's max_tokens is not one the request set: none set, or 0 (``prompt_only``: a context
        error then names the prompt alone, not the 1 token the engine samples)."""
        return self.max_tokens is None or self.prompt_only

    @property
    def prompt_only(self) -> bool:
        """``max_tokens: 0`` (with ``echo``): the response is the prompt alone (OpenAI's legacy way to score a text,
        vLLM's too). The engine prefills and samples one token, which the response leaves out."""
        return self.max_tokens == 0

    def params(self, choice: int = 0) -> SamplingParams:
        """With ``prompt_logprobs``, or ``echo`` and ``logprobs``, the prompt's tokens are scored too
        (``SamplingParams.prompt_logprobs``: the more alternatives of the two; each view keeps its own number).

        Raises: ValueError (``SamplingParams``)."""
        max_tokens = 1 if self.prompt_only else self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        scored = [k for k in (self.prompt_logprobs, self.echoed_logprobs) if k is not None]
        return self._params(max_tokens, logprobs=self.logprobs, choice=choice,
                            prompt_logprobs=max(scored, default=None))

    @property
    def echoed_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token in ``logprobs`` (``echo`` with ``logprobs``), or None."""
        return self.logprobs if self.echo else None


class TokenizeRequest(_TemplateFields):
    """vLLM's ``POST /tokenize`` body: a text ``prompt`` or chat ``messages`` (one of them), tokenized as
    ``/v1/completions`` or ``/v1/chat/completions`` tokenizes it."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description=(
        "The tokenizer's own special tokens (a Llama tokenizer's BOS); None: the endpoint's default, true for a "
        "prompt, false for messages (their template writes them)."))
    return_token_strs: bool = Field(False, description="Also each token's vocabulary string.")

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: str | None) -> str | None:
        return value if value is None else unicode_text(value, "prompt")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send either prompt (a text) or messages (a chat)",
                                      param="messages" if self.messages is not None else "prompt")
        if self.prompt is not None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"):
                if name in self.model_fields_set:
                    raise InvalidRequestError(f"{name} applies to messages only", param=name)
        return self

    def chat_messages(self) -> list[dict[str, str]] | None:
        return None if self.messages is None else chat_dicts(self.messages)


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize`` body: token ids to text."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int] = Field(description="Token ids >= 0 (their range is the model's to check).")

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be integers >= 0")
        return value


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _union_member(part) -> bool:
    """Whether a pydantic error location part names a member type of a union ("str", "list[str]"), not a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in _UNION_TAGS)


def validation_error(err: ValidationError) -> ErrorItem:
    """The first pydantic error as a 400 naming the field (for a whole-request validator's error, which pydantic
    locates nowhere, the ``param`` of the ``InvalidRequestError`` it raised). Of a union's members the error the value
    went furthest into is told (``[5]`` for a string or a list of strings: its item 0); a value that is none of the
    union's types gets one message naming each ("a valid string or a valid list")."""
    errors = err.errors()
    first = errors[0]
    tag = next((i for i, part in enumerate(first["loc"]) if _union_member(part)), None)
    if tag is not None:  # of a union's members the one the value went furthest into ("stop": [5] -> stop.0)
        first = max((e for e in errors if len(e["loc"]) > tag and e["loc"][:tag] == first["loc"][:tag]
                     and _union_member(e["loc"][tag])), key=lambda e: len(e["loc"]))
    # pydantic adds the member type of a union to the location ("content.str"): a client's field path has none
    param = ".".join(str(p) for p in first["loc"] if not _union_member(p)) or None
    param = param or getattr(first.get("ctx", {}).get("error"), "param", None)
    msg = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for errors raised by validators
    if first["type"] == "extra_forbidden":
        msg = "unknown field (not an OpenAI request field this server knows)"
    elif first["loc"] and _union_member(first["loc"][-1]):
        members = [e["msg"] for e in errors if len(e["loc"]) == len(first["loc"])
                   and e["loc"][:-1] == first["loc"][:-1] and _union_member(e["loc"][-1])]
        if len(members) > 1 and all(m.startswith("Input should be ") for m in members):
            msg = "Input should be " + " or ".join(dict.fromkeys(m.removeprefix("Input should be ") for m in members))
    return ErrorItem(status=400, message=f"{param}: {msg}" if param else msg, param=param)


def error_body(err: ErrorItem) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage`` object; ``cached_tokens``: prompt tokens reused from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def tokens_as_ids(entries: Sequence[TokenLogprobText]) -> list[TokenLogprobText]:
    """vLLM's ``return_tokens_as_token_ids``: each token and alternative named ``"token_id:<id>"`` instead of its text
    (its bytes those of that name); ``text_len`` stays the characters the token brings to the text."""
    return [dataclasses.replace(e, token=f"token_id:{e.token_id}", token_bytes=None, top_bytes=None,
                                top=tuple((f"token_id:{t}", lp) for t, (_, lp) in zip(e.top_ids, e.top, strict=True)))
            for e in entries]


def chat_logprobs(entries: Sequence[TokenLogprobText], *, token_ids: bool = False) -> dict:
    """OpenAI's chat ``logprobs`` object: per token its text, logprob, UTF-8 bytes and top alternatives
    (``token_ids``: tokens named by id, ``tokens_as_ids``)."""
    entries = tokens_as_ids(entries) if token_ids else entries

    def item(token: str, logprob: float, raw: bytes | None) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode() if raw is None else raw)}

    def top(e: TokenLogprobText) -> list[dict]:
        raws = e.top_bytes if e.top_bytes is not None else [None] * len(e.top)
        return [item(t, lp, raw) for (t, lp), raw in zip(e.top, raws, strict=True)]

    return {"content": [{**item(e.token, e.logprob, e.token_bytes), "top_logprobs": top(e)} for e in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprobText], offset: int,
                        prompt: Sequence[TokenLogprobText] = (), *, token_ids: bool = False) -> dict:
    """OpenAI's completions ``logprobs`` object; ``offset`` is the text offset of the first token (characters), and
    ``text_offset`` indexes the response text (a token inside a UTF-8 character starts where the character does).
    ``top_logprobs`` maps the k alternatives and the chosen token to their logprobs (up to k + 1 entries).

    ``prompt``: with ``echo``, the echoed prompt's tokens (``TextChunk.prompt_logprobs``), listed first from text
    offset 0, the first one's logprob and alternatives null (as OpenAI and vLLM give them). ``token_ids``: tokens
    named by id (``tokens_as_ids``)."""
    def offsets(tokens: Sequence[TokenLogprobText], at: int) -> list[int]:
        out = []
        for e in tokens:
            out.append(at)
            at += len(e.token) if e.text_len is None else e.text_len
        return out

    text_offset = offsets(prompt, 0) + offsets(entries, offset)
    every = tokens_as_ids([*prompt, *entries]) if token_ids else [*prompt, *entries]
    return {
        "tokens": [e.token for e in every], "token_logprobs": [e.logprob for e in every],
        "top_logprobs": [None if e.logprob is None else {**dict(e.top), e.token: e.logprob} for e in every],
        "text_offset": text_offset,
    }


def echoed_prompt(entries: Sequence[TokenLogprobText] | None, k: int | None) -> list[TokenLogprobText]:
    """The scored prompt's tokens (``TextChunk.prompt_logprobs``) as ``completion_logprobs`` lists them for ``echo``
    with ``logprobs`` k (None: not echoed, none), each with its k most likely alternatives (the engine scored those
    of the larger of k and ``prompt_logprobs``)."""
    if k is None or not entries:
        return []
    return [e if len(e.top) <= k else dataclasses.replace(
        e, top=e.top[:k], top_ids=e.top_ids[:k], top_bytes=None if e.top_bytes is None else e.top_bytes[:k])
        for e in entries]


def vllm_prompt_logprobs(entries: Sequence[TokenLogprobText], k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` response field, one item per prompt token: None for the first (nothing predicts
    it), else {token id: {"logprob", "rank", "decoded_token"}}, the prompt token first, then its k most likely
    alternatives (ranks 1..k; a prompt token among them is listed once)."""
    def item(token_id: int, logprob: float, rank: int | None, text: str) -> tuple[str, dict]:
        return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": text}

    out: list[dict | None] = [None]
    for e in entries[1:]:
        alternatives = [item(t, v, r, text) for r, (t, (text, v)) in enumerate(zip(e.top_ids, e.top[:k]), start=1)]
        out.append(dict([item(e.token_id, e.logprob, e.rank, e.token)] +
                        [a for a in alternatives if a[0] != str(e.token_id)]))
    return out


def completion_body(
    *, chat: bool, request_id: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
    spec: SpecStats | None, token_ids: list[int] | None = None, cached_tokens: int = 0,
) -> dict:
    """A non-streamed response (``chat.completion`` or ``text_completion``); ``choices`` from ``choice_body``."""
    body = {
        "id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }
    if spec is not None:
        body["spec_stats"] = spec.to_json()
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def choice_body(*, chat: bool, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                stop_reason: str | int | None = None, reasoning: str | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """One choice of a non-streamed response; ``stop_reason`` is vLLM's: the stop string or stop token id that ended
    the choice (None for EOS or ``length``); a chat message's ``reasoning`` is vLLM's (``app/serving/reasoning.py``:
    None without a reasoning parser), its ``tool_calls`` OpenAI's (``app/serving/tools.py``: present when made)."""
    if chat:
        message = {"role": "assistant", "content": text, "reasoning": reasoning}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chunk_body(
    *, chat: bool, request_id: str, created: int, model: str, text: str | None, index: int = 0,
    finish_reason: str | None = None, role: bool = False, logprobs: dict | None = None,
    stop_reason: str | int | None = None, reasoning: str | None = None, tool_calls: list[dict] | None = None,
) -> dict:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``) of choice ``index``; ``created`` (Unix
    seconds) is the stream's, the same in every chunk; ``stop_reason`` as in ``choice_body`` (on the last chunk); a
    chat delta has ``reasoning`` (vLLM's) and ``tool_calls`` (OpenAI's delta entries) when given."""
    if chat:
        delta: dict = {"role": "assistant"} if role else {}
        if reasoning is not None:
            delta["reasoning"] = reasoning
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    choice["stop_reason"] = stop_reason
    return {
        "id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created, "model": model, "choices": [choice],
    }
