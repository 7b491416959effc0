"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` on chat completions, with vLLM's tool parser names.

Owns: the request's tool fields (validated), the grammar that writes the calls when the
request names a function or requires calls, and reading the calls out of a chat answer's text, whole
(``ToolReader.split``) or as it streams (``ToolStream``). Works on text only, after any reasoning was split off
(``reasoning.py``); the tokens, logprobs and usage are the completion's as they are. Does not own: showing the tools
to the model (the chat template's matter: ``deployments/templates/chatml_tools.jinja`` for ChatML models) or the
request's messages and response shapes, earlier turns' tool calls among them (``openai_api.py``).

How the calls come about, by ``tool_choice``:
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that function's arguments,
  a JSON object its ``parameters`` schema constrains (guided decoding); one call.
- ``required``: the output is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, one per call, each a
  listed function with its own schema (one call at most with ``parallel_tool_calls: false``), as vLLM does it.
- ``auto`` (the default with tools; the server needs ``enable_auto_tool_choice`` and ``tool_call_parser``): the model
  writes calls in its own format or answers in text. ``hermes`` reads ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks anywhere in the text; ``llama3_json`` an answer that is JSON objects ``{"name": ...,
  "parameters": {...}}`` (after an optional ``<|python_tag|>``), separated by ``;``. A call must name a listed
  function; text that is not a well-formed call stays content, and whitespace before and after calls is dropped;
  with ``parallel_tool_calls: false`` only the first call is taken and later ones are dropped (vLLM's rule).
- ``none``: no calls; the tools are still shown to the template (vLLM's default).

A reading does not depend on how the text was cut into deltas: the streamed content and the streamed calls (each
sent whole, or for a named function its arguments as they come) join into the whole text's ``split``. An output cut
short (``length``) keeps its unfinished call's text as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.engine.errors import InvalidRequestError
from app.engine.types import GuidedDecoding
from app.serving.reasoning import tag_prefix

ToolParserName = Literal["hermes", "llama3_json"]
ToolMode = Literal["none", "auto", "named", "required"]
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's opening of a tool call (a special token: in the text when not skipped)
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FunctionDefinition(BaseModel):
    """A function the model may call: OpenAI's ``tools[i].function``."""

    model_config = _STRICT

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object; None: none.")
    strict: bool | None = Field(None, description="Named and required calls always follow the schema (their grammar); "
                                "an auto call's arguments are the model's text, as in vLLM.")

    def arguments_schema(self) -> dict[str, Any]:
        """The JSON schema the call's arguments object follows (an empty object without ``parameters``)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


def function_tool(value: Any) -> Any:
    """``value`` unless it is a tool of another type than ``function`` (a request's raw ``tools`` entry).

    Raises:
        ValueError: naming the type.
    """
    if isinstance(value, dict) and "type" in value and value["type"] != "function":
        raise ValueError(f"tool type {value.get('type')!r} is not supported by this server (function tools only; it "
                         "hosts no tools)")
    return value


class Tool(BaseModel):
    """One entry of a request's ``tools``: a function (the one kind a text model can call here)."""

    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return function_tool(value)


class FunctionName(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function to call."""

    model_config = _STRICT

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def json_value(text: str) -> Any:
    """The JSON value ``text`` is, or None when it is not strict JSON (NaN and infinities refused) or is too large or
    deep for Python's parser."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # JSONDecodeError; an integer over Python's digit limit; deep nesting
        return None


def _raw_decode(text: str) -> tuple[Any, int] | None:
    """The JSON value that opens ``text`` and where it ends, or None (incomplete, not JSON, or too large or deep)."""
    try:
        return _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def tool_call_id() -> str:
    """A new call's id (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """A call read from the output: the function's name, its arguments as JSON text, its id."""

    name: str
    arguments: str
    id: str

    def body(self) -> dict:
        """The call as a response's ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def calls_grammar(tools: list[Tool], choice: ToolChoice | None, *, parallel: bool) -> GuidedDecoding | None:
    """The structured output that writes the calls: for a named function its arguments' schema, for ``required`` an
    array of ``{"name", "parameters"}`` objects (at most one without ``parallel``; the tools' ``$defs`` moved to the
    root, as vLLM does); None for ``auto`` and ``none``.

    Raises:
        InvalidRequestError: (``tools``) two tools define one ``$defs`` name differently.
    """
    if isinstance(choice, NamedToolChoice):
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        return GuidedDecoding("json_schema", json.dumps(function.arguments_schema()))
    if choice != "required":
        return None
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    calls = []
    for tool in tools:
        parameters = dict(tool.function.arguments_schema())
        for key in ("$defs", "definitions"):  # "#/$defs/..." references resolve from the root: move them there
            if not isinstance(parameters.get(key), dict):  # absent, or not definitions: the grammar library judges
                continue
            for name, definition in parameters.pop(key).items():
                if schema.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise InvalidRequestError(f"two tools define {key} {name!r} differently; tool_choice 'required' "
                                              "puts their schemas in one", param="tools")
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema["items"] = {"type": "object", "anyOf": calls}
    if not parallel:
        schema["maxItems"] = 1
    return GuidedDecoding("json_schema", json.dumps(schema))


@dataclass(frozen=True)
class ToolReader:
    """How calls are read from one choice's answer text (module docstring): ``mode`` from the request, ``parser``
    the server's (for ``auto``), ``function`` the named one, ``names`` the listed functions (an ``auto`` call must
    name one), ``parallel`` from ``parallel_tool_calls``.

    Raises:
        ValueError: ``auto`` without a parser.
    """

    mode: Literal["auto", "named", "required"]
    parser: ToolParserName | None = None
    function: str | None = None
    names: tuple[str, ...] = ()
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode == "auto" and self.parser is None:
            raise ValueError("calls the model chooses are read by a tool_call_parser; none is set")

    def stream(self) -> ToolStream:
        """An incremental ``split`` for a streamed answer."""
        return ToolStream(self)

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer as (content, calls): None for content that is absent or empty."""
        stream = self.stream()
        content = stream.feed(text)[0] + stream.finish()[0]
        return content or None, list(stream.calls)

    def finish_reason(self, reason: str, calls: bool) -> str:
        """A choice's ``finish_reason``: ``tool_calls`` for an answer that stopped on calls the model chose or was
        required to make (OpenAI's; a named function's call keeps ``stop``), else the engine's."""
        return "tool_calls" if calls and reason == "stop" and self.mode != "named" else reason


class ToolStream:
    """``ToolReader.split`` as the text streams: ``feed`` each text delta, ``finish`` at the end; each gives (content
    text, ``delta.tool_calls`` entries: a call whole, or for a named function the arguments as they come). ``calls``
    holds the calls read so far. Text that could still become part of a call waits."""

    def __init__(self, reader: ToolReader) -> None:
        self.reader = reader
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not given out yet
        self._space = ""  # whitespace after the last content, held: given out only if more content follows
        self._in_call = False  # hermes: inside a <tool_call> block
        self._json: bool | None = None  # llama3_json: the answer is calls (None: not known yet)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """The (content, call deltas) that ``delta`` releases."""
        self._pending += delta
        if "}" not in delta and (self.reader.mode == "required" or self._json):
            return "", []  # a JSON call closes with "}": nothing new to read (no quadratic re-reading)
        return self._read(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """The (content, call deltas) still held at the end of the answer."""
        content, deltas = self._read(final=True)
        return content + self._content(self._take(), final=True), deltas

    def _read(self, *, final: bool) -> tuple[str, list[dict]]:
        if self.reader.mode == "named":
            return "", self._named(final=final)
        if self.reader.mode == "required":
            return "", self._scan_array(final=final)
        if self.reader.parser == "hermes":
            return self._hermes(final=final)
        return self._llama(final=final)

    def _take(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _content(self, text: str, *, final: bool = False) -> str:
        """Content to give out, whitespace after the last content held back; at the end, held whitespace is dropped
        when the answer made calls (whitespace before and after calls)."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if final:
            body, self._space = body + ("" if self.calls else self._space), ""
        return body

    def _named(self, *, final: bool) -> list[dict]:
        """A named function's call: its arguments are the whole output, sent as they come."""
        text = self._take()
        if not self.calls:
            if not (text or final):
                return []
            self.calls.append(ToolCall(name=self.reader.function or "", arguments=text, id=tool_call_id()))
            return [{"index": 0, **self.calls[0].body()}]
        if not text:
            return []
        first = self.calls[0]
        self.calls[0] = ToolCall(first.name, first.arguments + text, first.id)
        return [{"index": 0, "function": {"arguments": text}}]

    def _call(self, value: Any, keys: tuple[str, ...], *, optional: bool) -> dict | None | Literal[False]:
        """The call a parsed JSON value is: an object of a string ``name`` and an object of arguments under one of
        ``keys`` (absent when ``optional``: no arguments); None when it is not one (for ``auto``, a name that is not
        among the tools' is not); False for a call past the first without ``parallel`` (vLLM drops those). Other
        keys are ignored, as vLLM's parsers do."""
        if not isinstance(value, dict) or not isinstance(name := value.get("name"), str):
            return None
        key = next((k for k in keys if k in value), None)
        if key is None and not optional:
            return None
        arguments = value[key] if key is not None else {}
        if not isinstance(arguments, dict) or self.reader.mode == "auto" and name not in self.reader.names:
            return None
        try:  # strict JSON (1e400 parses to inf), and text a response can carry (no lone surrogate escape)
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
            text.encode("utf-8")
        except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError; the encoder nests deeper
            return None
        if self.calls and not self.reader.parallel:
            return False
        self.calls.append(ToolCall(name=name, arguments=text, id=tool_call_id()))
        return {"index": len(self.calls) - 1, **self.calls[-1].body()}

    def _scan_array(self, *, final: bool) -> list[dict]:
        """``required``: the calls of the grammar's JSON array, each as soon as its object closes."""
        deltas = []
        while True:
            text = self._pending.lstrip()
            if (not self.calls and not text.startswith("[")) or (self.calls and not text.startswith(",")):
                break
            decoded = _raw_decode(body := text[1:].lstrip())
            call = None if decoded is None else self._call(decoded[0], ("parameters",), optional=False)
            if not call:
                break
            deltas.append(call)
            self._pending = body[decoded[1]:]
        if final and self.calls and self._pending.strip() == "]":
            self._pending = ""
        return deltas

    def _hermes(self, *, final: bool) -> tuple[str, list[dict]]:
        """``hermes``: ``<tool_call>`` JSON ``</tool_call>`` blocks; text outside them is content."""
        content, deltas = "", []
        while True:
            if not self._in_call:
                before, found, after = self._pending.partition(HERMES_START)
                if not found:
                    keep = 0 if final else tag_prefix(self._pending, HERMES_START)
                    cut = len(self._pending) - keep
                    content += self._content(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return content, deltas
                content += self._content(before)
                self._pending, self._in_call = after, True
            body, found, after = self._pending.partition(HERMES_END)
            if not found:
                if final:  # an unfinished block: content
                    self._pending, self._in_call = HERMES_START + self._pending, False
                return content, deltas
            self._pending, self._in_call = after, False
            call = self._call(json_value(body), ("arguments", "parameters"), optional=True)
            if call is None:
                content += self._content(HERMES_START + body + HERMES_END)
            elif call:
                deltas.append(call)

    def _llama(self, *, final: bool) -> tuple[str, list[dict]]:
        """``llama3_json``: an answer that opens with a JSON object (or ``<|python_tag|>``) is ``;``-separated calls;
        any other answer is content."""
        if self._json is None:
            head = self._pending.lstrip()
            if not final and (not head or PYTHON_TAG.startswith(head)):
                return "", []
            self._json = head.startswith(("{", PYTHON_TAG))
            if self._json:
                self._pending = head.removeprefix(PYTHON_TAG)
        if not self._json:
            return self._content(self._take()), []
        deltas = []
        while True:
            text = self._pending.lstrip()
            text = text[1:].lstrip() if self.calls and text.startswith(";") else text
            decoded = _raw_decode(text) if text.startswith("{") else None
            call = None if decoded is None else self._call(decoded[0], ("parameters", "arguments"), optional=False)
            if call is None:
                break
            if call:
                deltas.append(call)
            self._pending = text[decoded[1]:]
        return "", deltas


def validate_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """The request's tool fields agree: function names are unique; a ``tool_choice`` other than none comes with tools,
    and a named one is among them.

    Raises:
        InvalidRequestError: naming the field (``tools`` or ``tool_choice``) and the value.
    """
    names = [t.function.name for t in tools or ()]
    if len(set(names)) < len(names):
        raise InvalidRequestError(f"function names must be unique, got {names}", param="tools")
    if choice not in (None, "none") and not names:
        shown = choice if isinstance(choice, str) else choice.model_dump()
        raise InvalidRequestError(f"tool_choice {shown!r} needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                  f"tools ({names})", param="tool_choice")
