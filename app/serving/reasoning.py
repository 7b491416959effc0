"""Reasoning output: a reasoning model's thinking apart from its answer (vLLM's ``reasoning`` field, its parser names).

Owns: splitting a chat completion's text at the ``<think>`` ... ``</think>`` tags that reasoning models (DeepSeek R1,
QwQ, Qwen3) write, whole (``ReasoningParser.split``) or as the text streams (``ReasoningStream``). Works on text only;
the tokens, logprobs and usage are the completion's as they are. Does not own: the response shapes (``openai_api.py``)
or the chat template (whether a model thinks is the template's matter: Qwen3's ``enable_thinking``).

An output that continues a message the client started (``continue_final_message``) starts where that message left
off: in the reasoning when it opened the start tag without the end tag, in the answer when it closed it or has no
tag. Otherwise the two parsers differ in what an output that does not open with the start tag is: ``deepseek_r1``
reads it as reasoning up to the end tag (R1's template opens ``<think>`` in the prompt), ``qwen3`` as an answer
without reasoning (Qwen3 with thinking off). Reasoning runs to the end tag, or to the end of an output cut short; the
text after the end tag is the answer. Unlike vLLM's ``qwen3`` parser, which gives a reasoning cut short (no end tag)
as the answer, the parts do not depend on whether the text was streamed: the streamed deltas join into the whole
text's parts. Structured output is all answer: the ingress applies no parser to it (its grammar constrains the whole
output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

START, END = "<think>", "</think>"
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


Part = Literal["head", "reasoning", "answer"]  # head: the start tag may still open the output


@dataclass(frozen=True)
class ReasoningParser:
    """One of vLLM's reasoning parsers by name, for an output that continues ``prefill`` (the message the client
    started, with ``continue_final_message``) or starts a new turn (None) (module docstring)."""

    name: ReasoningParserName
    prefill: str | None = None

    def reasons_unopened(self) -> bool:
        """Whether an output that does not open with the start tag reasons up to the end tag (``deepseek_r1``)."""
        return self.name == "deepseek_r1"

    def start(self) -> Part:
        """The part the output starts in."""
        if self.prefill is None:
            return "head"
        return "reasoning" if self.prefill.rfind(START) > self.prefill.rfind(END) else "answer"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, answer), None for a part that is absent or empty."""
        part = self.start()
        if part == "head":
            part = "reasoning" if text.startswith(START) or self.reasons_unopened() else "answer"
            text = text.removeprefix(START) if part == "reasoning" else text
        if part == "answer":
            return None, text or None
        reasoning, _, answer = text.partition(END)
        return reasoning or None, answer or None

    def stream(self) -> ReasoningStream:
        """An incremental ``split`` for a streamed output."""
        return ReasoningStream(self)


class ReasoningStream:
    """``ReasoningParser.split`` as the text streams: ``feed`` each text delta, ``finish`` at the end; the reasoning
    and answer deltas join into ``split``'s parts of the whole text. Text that could still become a tag waits (at
    most ``len(END) - 1`` characters)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._pending = ""  # text not given out yet
        self._part: Part = parser.start()

    def feed(self, delta: str) -> tuple[str, str]:
        """The (reasoning, answer) text ``delta`` releases ("" for none)."""
        self._pending += delta
        if self._part == "head":
            if START.startswith(self._pending) and self._pending != START:
                return "", ""
            opened = self._pending.startswith(START)
            self._pending = self._pending.removeprefix(START)
            self._part = "reasoning" if opened or self.parser.reasons_unopened() else "answer"
        if self._part == "answer":
            out, self._pending = self._pending, ""
            return "", out
        reasoning, found, answer = self._pending.partition(END)
        if found:
            self._part, self._pending = "answer", ""
            return reasoning, answer
        keep = tag_prefix(self._pending, END)
        out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The (reasoning, answer) text still held at the end of the output."""
        out, self._pending = self._pending, ""
        if self._part == "head":  # an output shorter than the start tag, and a start of it
            return (out, "") if self.parser.reasons_unopened() else ("", out)
        return (out, "") if self._part == "reasoning" else ("", out)


def tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (text a later delta may complete into it); a
    streamed parser holds that much back."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)
