"""OpenAI's Responses API (``POST /v1/responses``, as vLLM offers it) served as a chat completion.

Owns: the request schema (what a text model acts on, what is harmless, what is refused with a 400 naming the field),
its translation into a ``ChatCompletionRequest`` (``instructions`` -> a system message, ``input`` -> messages,
``text.format`` -> ``response_format``, ``max_output_tokens`` -> ``max_completion_tokens``), the ``response`` object
made from a chat completion's body, and the Responses streaming events made from a chat completion's chunks
(``ResponseEvents``). Function tools are the chat request's ``tools`` (``tools.py``): ``function_call`` input items
become an assistant turn's ``tool_calls``, ``function_call_output`` items ``tool`` messages, and the answer's calls
``function_call`` output items. Stateless: nothing is stored, so ``previous_response_id`` and ``conversation`` are
refused and ``store`` is harmless, as for chat. Does not own: generation (the chat path: ``ingress.py``), the chat
shapes (``openai_api.py``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from app.serving.openai_api import (STRICT, ChatCompletionRequest, JsonSchemaFormat, RequestLabels, unicode_text,
                                   unsupported, unsupported_part)
from app.serving.tools import FunctionDefinition, function_tool

# Request fields by what they do (the field walk test reads these)
ACTING = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text", "tools",
          "tool_choice", "parallel_tool_calls")
EXTENSIONS = ("priority",)  # vLLM's
HARMLESS = ("user", "metadata", "store", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
            "prompt_cache_options", "service_tier", "max_tool_calls", "stream_options")
REJECTED = ("previous_response_id", "conversation", "prompt", "reasoning", "truncation",
            "include", "background", "top_logprobs", "access_programs", "context_management", "image", "moderation")
# the chat request's field -> the Responses field an error about it names
PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
TEXT_PARTS = ("input_text", "output_text")


ITEM_TYPES = ("message", "reasoning", "function_call", "function_call_output")
# Fields the SDK's function call item carries beside the call (model_dump() names "async" async_; a streamed final
# response adds parsed_arguments, the arguments parsed): taken when they say nothing more than the call does.
SDK_CALL_FIELDS = {"async": lambda v: not v, "async_": lambda v: not v, "parsed_arguments": lambda v: True,
                   "caller": lambda v: v in (None, {"type": "direct"}), "namespace": lambda v: v is None}


class InputItem(BaseModel):
    """One ``input`` item: a message (``type`` "message" or left out) whose ``content`` is a string or a list of
    ``input_text`` / ``output_text`` parts, a ``reasoning`` item (its ``reasoning_text`` parts), an earlier
    ``function_call`` (``call_id``, ``name``, ``arguments``) or a call's result (``function_call_output``: ``call_id``,
    ``output`` text or ``input_text`` parts); an earlier output item comes back with its ``id``, ``status`` and
    ``phase``, which are kept as labels only."""

    model_config = STRICT

    type: Literal["message", "reasoning", "function_call", "function_call_output"] | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None
    encrypted_content: None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_types(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type", "message") not in ITEM_TYPES:
            raise unsupported(f"input item type {json.dumps(value['type'])[:100]}", "message, reasoning and function "
                              "call items only")
        if isinstance(value, dict) and value.get("type") == "function_call":  # what the SDK adds to a call item
            value = {k: v for k, v in value.items() if not (k in SDK_CALL_FIELDS and SDK_CALL_FIELDS[k](v))}
        return value

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "InputItem":
        calls = (self.call_id, self.name, self.arguments, self.output)
        if self.type in ("function_call", "function_call_output"):
            needed = ("call_id", "name", "arguments") if self.type == "function_call" else ("call_id", "output")
            if any(getattr(self, f) is None for f in needed) or self.role is not None or self.content is not None:
                raise ValueError(f"a {self.type} item has {', '.join(needed)} (and no role or content)")
            if self.type == "function_call" and self.output is not None:
                raise ValueError("a function_call item has no output (send it as a function_call_output item)")
        elif any(x is not None for x in calls):
            raise ValueError("call_id, name, arguments and output belong to function call items")
        elif self.type == "reasoning":
            if self.role is not None or not isinstance(self.content or [], list):
                raise ValueError("a reasoning item has no role, and its content is a list of reasoning_text parts")
        elif self.role is None or self.content is None or self.summary is not None:
            raise ValueError("a message item needs a role and content (and has no summary)")
        return self

    @field_validator("output")
    @classmethod
    def _output_text(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for i, part in enumerate(value if isinstance(value, list) else ()):
            if part.get("type") != "input_text" or not isinstance(part.get("text"), str) or set(part) - {"type",
                                                                                                        "text"}:
                raise unsupported(f"output part {i}", "a call's result is text: a string or input_text parts")
        return value

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: str | list[dict[str, Any]] | None, info) -> str | list[dict[str, Any]] | None:
        if value is None or isinstance(value, str):
            return value if value is None else unicode_text(value, "content")
        kinds = ("reasoning_text",) if info.data.get("type") == "reasoning" else TEXT_PARTS
        for i, part in enumerate(value):
            if part.get("type") not in kinds:
                raise unsupported_part(part.get("type"))
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text", "annotations", "logprobs"}:
                raise ValueError(f"content part {i} must be {{type, text}} (an output's annotations and logprobs are "
                                 "accepted)")
            unicode_text(part["text"], f"content part {i}")
        return value

    @property
    def text(self) -> str:
        """The item's text: its content (a function call result's output) string, or its parts joined."""
        value = self.output if self.type == "function_call_output" else self.content
        if isinstance(value, str):
            return value
        return "".join(part["text"] for part in value or [])


def chat_messages(items: list[InputItem]) -> list[dict]:
    """``input`` items as chat messages: a reasoning item's text (its ``content``; the ``summary`` is left out) becomes
    the ``reasoning`` of the assistant message after it (one of its own when none follows), as a chat request sends
    an earlier turn back; ``function_call`` items become the ``tool_calls`` of the assistant message they follow (of
    their own when they follow none), ``function_call_output`` items ``tool`` messages."""
    messages, reasoning = [], None
    for item in items:
        if item.type == "reasoning":  # its summary is not passed on; an item without text adds nothing
            if item.text:
                reasoning = item.text if reasoning is None else reasoning + item.text
            continue
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                         "arguments": item.arguments}}
            if reasoning is None and messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]}
                                | ({} if reasoning is None else {"reasoning": reasoning}))
                reasoning = None
            continue
        if reasoning is not None and item.role != "assistant":
            messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
            reasoning = None
        if item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            continue
        content = item.content if isinstance(item.content, str) else \
            [{"type": "text", "text": part["text"]} for part in item.content]
        messages.append({"role": item.role, "content": content} | ({} if reasoning is None else
                                                                    {"reasoning": reasoning}))
        reasoning = None
    if reasoning is not None:
        messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
    return messages


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``name`` and ``schema`` beside it."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict:
        """The chat request's ``response_format``.

        Raises: ValueError: a ``json_schema`` without its name and schema.
        """
        if self.type != "json_schema":
            return {"type": self.type}
        if self.name is None or self.schema_ is None:
            raise ValueError("a json_schema format needs a name and a schema")
        schema = JsonSchemaFormat(name=self.name, schema=self.schema_, description=self.description,
                                  strict=self.strict)
        return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True, exclude_none=True)}


class TextConfig(BaseModel):
    model_config = STRICT

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        if value is not None:
            raise unsupported("verbosity", "this model has no such option")
        return value


class FunctionTool(FunctionDefinition):
    """A ``tools`` entry: a function the model may call (the Responses API's flat form of chat's function tool: its
    ``FunctionDefinition`` with the type beside it)."""

    type: Literal["function"]
    output_schema: dict[str, Any] | None = Field(None, description="Harmless: describes what the client's function "
                                                 "returns, which the client writes.")
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    defer_loading: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return function_tool(value)

    @field_validator("allowed_callers")
    @classmethod
    def _direct(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["direct"]:
            raise unsupported("allowed_callers", "the model calls functions directly; only ['direct'] is accepted")
        return value

    @field_validator("defer_loading")
    @classmethod
    def _loaded(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("defer_loading", "this server has no tool search; every tool is shown to the model")
        return value

    def chat_tool(self) -> dict:
        """The tool as a chat request's ``tools`` entry."""
        return {"type": "function",
                "function": self.model_dump(include=set(FunctionDefinition.model_fields), exclude_none=True)}


class FunctionChoice(BaseModel):
    """``tool_choice`` naming the function to call."""

    model_config = STRICT

    type: Literal["function"]
    name: str


class ResponsesRequest(RequestLabels):
    """``POST /v1/responses``: the fields of OpenAI's request (``ACTING``, ``HARMLESS``; the ``REJECTED`` ones are a
    400 unless null or empty)."""

    model_config = STRICT

    model: str
    input: list[InputItem] | str  # the list first: its errors name the item (input.0.content)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    text: TextConfig | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1, description=(
        "Extension (vLLM's): with the server's priority scheduling, queued requests are admitted lower values first; "
        "other than 0 without it, a 400."))
    # harmless by nature, beside RequestLabels
    user: str | None = None
    max_tool_calls: int | None = Field(None, description="Without tools there are no tool calls.")
    stream_options: dict[Literal["include_obfuscation"], bool] | None = Field(
        None, description="Harmless: this server never adds an obfuscation field.")
    tools: list[FunctionTool] | None = Field(None, description="Function tools (tools.py); hosted tools are a 400.")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    # rejected unless neutral
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    access_programs: Any = None
    context_management: Any = None
    image: Any = None
    moderation: Any = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: list[InputItem] | str) -> list[InputItem] | str:
        if isinstance(value, str):
            return unicode_text(value, "input")
        if not value:
            raise ValueError("at least one input item is needed")
        return value

    @field_validator("instructions")
    @classmethod
    def _instructions(cls, value: str | None) -> str | None:
        return value if value is None else unicode_text(value, "instructions")

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, value: Any, info) -> Any:
        if value is not None:
            raise unsupported(info.field_name, "this server keeps no responses or conversations: send the whole "
                               "conversation as input")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _flat_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and "function" in value:
            raise ValueError('the Responses API names a function as {"type": "function", "name": ...} (chat\'s form '
                             "nests it under function)")
        return value

    @field_validator("include")
    @classmethod
    def _empty(cls, value: list | None, info) -> list | None:
        if value:
            raise unsupported(info.field_name, "only an empty list is accepted")
        return value

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and any(v not in (None, "none") for v in value.values()):
            raise unsupported("reasoning", "this server does not set a reasoning effort or summary")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise unsupported("truncation", "an input over the context is a 400; only 'disabled' is accepted")
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("background", "responses are answered in the request")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise unsupported("top_logprobs", "logprobs are offered by /v1/chat/completions")
        return value

    @field_validator("prompt", "access_programs", "context_management", "image", "moderation")
    @classmethod
    def _not_offered(cls, value: Any, info) -> Any:
        if value is not None:
            raise unsupported(info.field_name, "this server has no such option")
        return value

    def chat(self) -> ChatCompletionRequest:
        """The chat completion this response is made from (streamed with usage when ``stream``).

        Raises:
            pydantic.ValidationError: what the chat request refuses (its field names: ``PARAMS`` maps them back);
            ValueError: a ``json_schema`` format without its name and schema.
        """
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else \
            chat_messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": system + items, "stream": bool(self.stream),
                                "priority": self.priority}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name, chat_name in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                                ("top_p", "top_p")):
            if getattr(self, name) is not None:
                body[chat_name] = getattr(self, name)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        if self.tools is not None:
            body["tools"] = [tool.chat_tool() for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.name}}
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return ChatCompletionRequest.model_validate(body)


def responses_param(param: str | None, req: ResponsesRequest) -> str | None:
    """The Responses field behind the chat request's field an error names: ``PARAMS``, ``messages.<i>...`` the input
    item it came from (after the system message ``instructions`` become), ``tools.<i>.function.<f>`` the flat
    ``tools.<i>.<f>``."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "tools" and ".function." in rest:  # the chat tool's function is the flat Responses tool itself
        return f"tools.{rest.replace('.function.', '.', 1)}"
    if head == "messages" and rest.split(".")[0].isdigit():
        index, _, tail = rest.partition(".")
        item = int(index) - (req.instructions is not None)
        if item < 0:
            return "instructions"
        return "input" if isinstance(req.input, str) else ".".join(["input", str(item)] + ([tail] if tail else []))
    return PARAMS.get(head, head) + (f".{rest}" if rest else "")


def _ids() -> tuple[str, str, str]:
    """New ids of a response, its message item and its reasoning item."""
    key = uuid.uuid4().hex
    return f"resp_{key}", f"msg_{key}", f"rs_{key}"


class ResponseShape:
    """The ``response`` objects of one request: ids and creation time fixed at the start, the request's settings
    echoed as OpenAI's response object does."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id, self.message_id, self.reasoning_id = _ids()
        self.created_at = int(time.time())

    def response(self, *, status: str, output: list[dict], usage: dict | None = None, length: bool = False,
                 error: dict | None = None) -> dict:
        """The ``response`` object (``status``: in_progress, completed, incomplete or failed; ``length``: ended at
        ``max_output_tokens``; ``error``: a failed one's ``{code, message}``)."""
        fmt = self.req.text.format if self.req.text is not None and self.req.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if length else None, "error": error,
            "model": self.model, "output": output, "usage": usage, "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens, "temperature": self.req.temperature,
            "top_p": self.req.top_p, "parallel_tool_calls": self.req.parallel_tool_calls is not False,
            "tool_choice": self._tool_choice(),
            "tools": [tool.model_dump(exclude_none=True) for tool in self.req.tools or ()],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "metadata": self.req.metadata or {}, "store": False, "truncation": "disabled",
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "user": self.req.user,
        }

    @property
    def named_call(self) -> bool:
        """Whether the answer is a named function's call, whose arguments are the whole output (``max_output_tokens``
        cuts them short; other calls are read only when complete)."""
        return isinstance(self.req.tool_choice, FunctionChoice)

    def _tool_choice(self) -> str | dict:
        """``tool_choice`` as the response echoes it: as sent, else ``auto`` with tools and ``none`` without."""
        choice = self.req.tool_choice
        if choice is None:
            return "auto" if self.req.tools else "none"
        return choice if isinstance(choice, str) else choice.model_dump()

    def message(self, text: str, *, done: bool, cut: bool = False) -> dict:
        """The assistant message item (its one ``output_text`` part); ``cut``: ended by ``max_output_tokens``."""
        content = [_output_text(text)] if done else []
        status = ("incomplete" if cut else "completed") if done else "in_progress"
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def reasoning(self, text: str, *, done: bool) -> dict:
        """The reasoning item (a reasoning parser's text: ``reasoning_parser``)."""
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if done else [],
                "status": "completed" if done else "in_progress"}


def function_call(call: dict, *, done: bool, cut: bool = False) -> dict:
    """A ``function_call`` output item of a chat tool call (``ToolCall.body``): the call's id is its ``call_id``,
    the item's id ``fc_`` and the same key; ``cut``: its arguments were cut short (``incomplete``)."""
    return {"type": "function_call", "id": "fc_" + call["id"].rpartition("-")[2], "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"] if done else "",
            "status": ("incomplete" if cut else "completed") if done else "in_progress"}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(chat_usage: dict) -> dict:
    """A chat completion's ``usage`` as a response's. Reasoning tokens are not counted apart (0)."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_body(shape: ResponseShape, chat: dict) -> dict:
    """The ``response`` object of a finished chat completion body (``completion_body``, one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = [] if message.get("reasoning") is None else [shape.reasoning(message["reasoning"], done=True)]
    length = choice["finish_reason"] == "length"
    calls = message.get("tool_calls") or []
    if message["content"] is not None or not calls:  # an answer of calls alone has no message item
        output.append(shape.message(message["content"] or "", done=True, cut=length))
    output += [function_call(call, done=True, cut=length and shape.named_call) for call in calls]
    return shape.response(status="incomplete" if length else "completed", output=output, usage=usage(chat["usage"]),
                          length=length)


class ResponseEvents:
    """The Responses streaming events of one request, made from its chat completion's chunks (``chunk_body``
    dicts): ``start``, then ``chunk`` for each, ``error`` for a failure. Each event is a dict with its ``type`` and
    ``sequence_number``; the reasoning item (with a reasoning parser) comes before the message item, and the
    ``function_call`` items (one per tool call, its arguments streamed as they come) after it; text after a call
    opens a message item of its own (a non-streamed response holds all the text in its one message item)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self._seq = 0
        self._open: Literal["reasoning", "message", "call"] | None = None
        self._call: dict = {}  # the open function_call item
        self._texts = {"reasoning": "", "message": ""}
        self._output: list[dict] = []  # the items done
        self._finished: str | None = None

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict]:
        """The events that open the stream: ``response.created`` and ``response.in_progress``."""
        in_progress = self.shape.response(status="in_progress", output=[])
        return [self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress)]

    def chunk(self, chunk: dict) -> list[dict]:
        """The events of one chat chunk: deltas, and at the end (the usage chunk) the items' ends and
        ``response.completed`` (``response.incomplete`` at ``max_output_tokens``)."""
        events = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning"):
                events += self._delta("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._delta("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call_delta(call)
            if choice["finish_reason"] is not None:
                self._finished = choice["finish_reason"]
        if not chunk["choices"] and chunk.get("usage") is not None:  # the usage chunk that ends the chat stream
            events += self._close()
            if not any(item["type"] in ("message", "function_call") for item in self._output):  # nothing but reasoning
                events += self._open_item("message") + self._close()
            length = self._finished == "length"
            events.append(self._event(
                "response.incomplete" if length else "response.completed", response=self.shape.response(
                    status="incomplete" if length else "completed", output=self._output,
                    usage=usage(chunk["usage"]), length=length)))
        return events

    def error(self, body: dict) -> list[dict]:
        """The events of a failure mid-stream (``error_body``'s ``error`` fields): ``error``, then
        ``response.failed`` with the items done so far."""
        err = body["error"]
        failed = self.shape.response(status="failed", output=self._output,
                                     error={"code": err.get("code") or "server_error", "message": err["message"]})
        return [self._event("error", code=err.get("code"), message=err["message"], param=err.get("param")),
                self._event("response.failed", response=failed)]

    def _delta(self, kind: Literal["reasoning", "message"], text: str) -> list[dict]:
        events = []
        if self._open != kind:
            events += self._close() + self._open_item(kind)
        self._texts[kind] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, **self._where(kind), delta=text, **extra))
        return events

    def _call_delta(self, call: dict) -> list[dict]:
        """A ``delta.tool_calls`` entry: a new call (with its ``id``) opens a ``function_call`` item; its arguments
        are an arguments delta."""
        events = []
        if "id" in call:
            events += self._close()
            self._open, self._call = "call", function_call(call, done=False)
            events.append(self._event("response.output_item.added", output_index=len(self._output),
                                      item=dict(self._call)))
        if arguments := call["function"].get("arguments"):
            self._call["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=self._call["id"],
                                      output_index=len(self._output), delta=arguments))
        return events

    def _where(self, kind: str) -> dict:
        item_id = self.shape.reasoning_id if kind == "reasoning" else self.shape.message_id
        return {"item_id": item_id, "output_index": len(self._output), "content_index": 0}

    def _open_item(self, kind: Literal["reasoning", "message"]) -> list[dict]:
        self._open = kind
        if kind == "message" and any(item["type"] == "message" for item in self._output):  # text after a call
            self.shape.message_id, self._texts["message"] = f"msg_{uuid.uuid4().hex}", ""
        item = self.shape.reasoning("", done=False) if kind == "reasoning" else self.shape.message("", done=False)
        events = [self._event("response.output_item.added", output_index=len(self._output), item=item)]
        if kind == "message":
            events.append(self._event("response.content_part.added", **self._where(kind), part=_output_text("")))
        return events

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        if self._open == "call":
            cut = self._finished == "length" and self.shape.named_call
            item = {**self._call, "status": "incomplete" if cut else "completed"}
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=len(self._output), arguments=item["arguments"]),
                      self._event("response.output_item.done", output_index=len(self._output), item=item)]
            self._output.append(item)
            self._open = None
            return events
        kind, text, where = self._open, self._texts[self._open], self._where(self._open)
        if kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, text=text)]
            item = self.shape.reasoning(text, done=True)
        else:
            events = [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                      self._event("response.content_part.done", **where, part=_output_text(text))]
            item = self.shape.message(text, done=True, cut=self._finished == "length")
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self._output.append(item)
        self._open = None
        return events
