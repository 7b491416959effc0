"""Reasoning output: a reasoning model's thinking apart from its answer (vLLM's ``reasoning`` field, its parser names).

Owns: splitting a chat completion's text at the ``<think>`` ... ``</think>`` tags that reasoning models (DeepSeek R1,
QwQ, Qwen3) write, whole (``ReasoningParser.split``) or as the text streams (``ReasoningStream``). Works on text only;
the tokens, logprobs and usage are the completion's as they are. Does not own: the response shapes (``openai_api.py``)
or the chat template (whether a model thinks is the template's matter: Qwen3's ``enable_thinking``).

The two parsers differ in what an output that does not open with the start tag is: ``deepseek_r1`` reads it as
reasoning up to the end tag (R1's template opens ``<think>`` in the prompt), ``qwen3`` as an answer without reasoning
(Qwen3 with thinking off). Reasoning runs to the end tag, or to the end of an output cut short; the text after the
end tag is the answer. Unlike vLLM's ``qwen3`` parser, which gives a reasoning cut short (no end tag) as the answer,
the parts do not depend on whether the text was streamed: the streamed deltas join into the whole text's parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

START, END = "<think>", "</think>"
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


@dataclass(frozen=True)
class ReasoningParser:
    """One of vLLM's reasoning parsers by name (module docstring)."""

    name: ReasoningParserName

    def reasons_unopened(self) -> bool:
        """Whether an output that does not open with the start tag reasons up to the end tag (``deepseek_r1``)."""
        return self.name == "deepseek_r1"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, answer), None for a part that is absent or empty."""
        opened = text.startswith(START)
        if not (opened or self.reasons_unopened()):
            return None, text or None
        reasoning, _, answer = text.removeprefix(START).partition(END)
        return reasoning or None, answer or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """``ReasoningParser.split`` as the text streams: ``feed`` each text delta, ``finish`` at the end; the reasoning
    and answer deltas join into ``split``'s parts of the whole text. Text that could still become a tag waits (at
    most ``len(END) - 1`` characters)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._pending = ""  # text not given out yet
        self._part: Literal["head", "reasoning", "answer"] = "head"  # head: the start tag may still open the output

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
        keep = _tag_prefix(self._pending)
        out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The (reasoning, answer) text still held at the end of the output."""
        out, self._pending = self._pending, ""
        if self._part == "head":  # an output shorter than the start tag, and a start of it
            return (out, "") if self.parser.reasons_unopened() else ("", out)
        return (out, "") if self._part == "reasoning" else ("", out)


def _tag_prefix(text: str) -> int:
    """The length of the longest end of ``text`` that begins ``END`` (text a later delta may complete into it)."""
    return next((n for n in range(min(len(END) - 1, len(text)), 0, -1) if END.startswith(text[-n:])), 0)
