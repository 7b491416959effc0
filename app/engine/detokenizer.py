"""Incremental detokenisation with stop-string detection and hold-back.

Owns: turning a request's generated token ids into text one token at a time, safe across multi-byte
characters split between tokens, and finding stop strings. Text that could still be the start of a stop
string is held back, so the streamed text never contains part of a stop string and its concatenation equals
the final text. Text is released at token boundaries only, with the characters each released token brings, so a
streamed chunk's text is its tokens' text and completions' ``text_offset`` indexes the text. Also each token's own
bytes (``TokenBytes``: OpenAI's logprobs ``bytes``).
"""

from __future__ import annotations

import abc
import bisect
import functools
import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.types import SamplingParams


class IncrementalDetokenizer:
    """Per-request text state; ``add`` one generated token at a time.

    Decodes a sliding window of recent tokens (``prefix_offset`` .. end) rather than the whole output, so the
    cost per token stays constant. Special tokens read as no text, unless ``skip_special_tokens`` is False (an echoed
    prompt's). The text ends before the first stop string, or after it with ``include_stop``.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._skip = skip_special_tokens
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all decoded text so far (final text once stopped)
        # per token whose text is out: len(text) once it was added (non-decreasing); the tokens after them (an
        # unfinished UTF-8 character, a special token) have none yet
        self._ends: list[int] = []
        self._emitted = 0  # chars of ``text`` already released
        self._released = 0  # tokens whose text is released
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once ``stopped``

    @classmethod
    def for_request(cls, tokenizer, params: SamplingParams) -> IncrementalDetokenizer:
        """A request's detokenizer: its stop strings and text options (``SamplingParams``)."""
        return cls(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                   include_stop=params.include_stop_str_in_output)

    def add_without_text(self, token_id: int) -> None:
        """Append the token that ends the request (EOS, a stop token id) without its text, as vLLM leaves it out
        (``release`` gives it no characters)."""
        self._ids.append(token_id)

    def add(self, token_id: int, *, check_stop: bool = True) -> None:
        """Append a token; sets ``stopped`` and ``stop_string`` and truncates ``text`` if it completes a stop string
        (only looked for when ``check_stop``: the engine does not before ``min_tokens``, so a stop string completed
        earlier is kept as text)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence or a special token: nothing new yet
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._ends.extend([before] * (len(self._ids) - len(self._ends) - 1))  # the tokens this one completes
        self._ends.append(len(self.text))
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._stop and check_stop:
            # each string where this token's text may complete it: one completed before (unchecked) stays text
            hits = [(at, order) for order, s in enumerate(self._stop)
                    if (at := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:  # the earliest; at one position, the first listed (vLLM's order)
                at, order = min(hits)
                self.stop_string = self._stop[order]
                self.text = self.text[: at + len(self.stop_string) if self._include_stop else at]
                self._ends = [min(end, len(self.text)) for end in self._ends]
                self.stopped = True

    def release(self, *, final: bool) -> tuple[str, list[int]]:
        """The text not yet released, up to the end of the last token whose text cannot be the start of a stop string
        (unless ``final`` or stopped: all of it), and, for each token it releases (the first not yet released
        onwards), the characters of that text the token brings: 0 for a token inside an unfinished UTF-8 character
        (the one that finishes it brings the character) or one with no text (a special token; at the end, an
        unfinished character), fewer than its own for the token a stop string cuts."""
        if final or self.stopped:
            count = len(self._ids)
        else:
            count = max(self._released, bisect.bisect_right(self._ends, len(self.text) - self._holdback))
        ends = self._ends[self._released : count] + [len(self.text)] * max(0, count - len(self._ends))
        lens, start = [], self._emitted
        for end in ends:
            lens.append(end - start)
            start = end
        out = self.text[self._emitted : start]
        self._emitted, self._released = start, count
        return out, lens


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, used by Llama 3, Qwen and SmolLM2 tokenizers) inverted: character -> byte.

    Each byte 0-255 is spelled by one printable character: the bytes of ``!``-``~``, ``¡``-``¬`` and ``®``-``ÿ`` by
    the character of the same code point, every other byte, in increasing order, by U+0100, U+0101, ... (a space,
    0x20, is ``Ġ``, U+0120).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


class _PerToken(abc.ABC):
    """A value per token id (``_value``), worked out once, on first use.

    Args:
        tokenizer: the engine's tokenizer (``decode`` at least).
    """

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, object] = {}

    def __call__(self, token_id: int):
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._value(token_id)
        return found

    @abc.abstractmethod
    def _value(self, token_id: int):
        """The value of ``token_id``, worked out."""


class TokenTexts(_PerToken):
    """A token decoded alone (``tokenizer.decode([id])``: the text logprobs give a token; one that ends inside a UTF-8
    character reads U+FFFD), worked out once per token id: a prompt scored with k alternatives needs k + 1 texts a
    token, on the serving replica's event loop."""

    def _value(self, token_id: int) -> str:
        return self._tok.decode([token_id])


class TokenBytes(_PerToken):
    """A token's own bytes as the tokenizer's vocabulary spells them (OpenAI's logprobs ``bytes``: a token that ends
    inside a UTF-8 character has the bytes it holds, which a client joins with its neighbours' to rebuild the text;
    the token decoded alone reads U+FFFD there).

    Read from a Hugging Face fast tokenizer's decoder: byte-level BPE (``byte_level_alphabet``), or SentencePiece-style
    pieces (``▁`` for a space, ``<0xAB>`` byte-fallback tokens, as Llama 2 and Mistral spell them). Added tokens
    (``<|im_end|>``) are their text in UTF-8. Any other tokenizer (no ``backend_tokenizer``, another decoder): the
    UTF-8 of the token decoded alone. Worked out once per token id, on first use.
    """

    def _value(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added
        if self._speller is not None:
            spelled = self._speller(self._tok.convert_ids_to_tokens(token_id))
            if spelled is not None:
                return spelled
        return self._tok.decode([token_id]).encode()

    @functools.cached_property
    def _added(self) -> dict[int, bytes]:
        """Added tokens (``<|im_end|>``) -> their text's UTF-8."""
        return {i: str(token).encode() for i, token in getattr(self._tok, "added_tokens_decoder", {}).items()}

    @functools.cached_property
    def _speller(self):
        """How this tokenizer's decoder spells a piece's bytes (a function piece -> bytes or None), or None."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return None
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {step.get("type") for step in steps}
        if "ByteLevel" in kinds:
            alphabet = byte_level_alphabet()

            def byte_level(piece: str) -> bytes | None:
                if all(c in alphabet for c in piece):
                    return bytes(alphabet[c] for c in piece)
                return None

            return byte_level
        replace = [(step["pattern"].get("String"), step["content"]) for step in steps
                   if step.get("type") == "Replace" and step.get("pattern", {}).get("String")]
        replace += [(step.get("replacement", "\u2581"), " ") for step in steps if step.get("type") == "Metaspace"]
        if not replace and "ByteFallback" not in kinds:
            return None

        def pieces(piece: str) -> bytes:
            byte = _BYTE_TOKEN.fullmatch(piece)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            for pattern, content in replace:
                piece = piece.replace(pattern, content)
            return piece.encode()

        return pieces
