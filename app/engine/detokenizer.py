"""Incremental detokenisation with stop-string detection and hold-back.

Owns: turning a request's generated token ids into text one token at a time, safe across multi-byte
characters split between tokens, and finding stop strings. Text that could still be the start of a stop
string is held back, so the streamed text never contains part of a stop string and its concatenation equals
the final text.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Per-request text state; ``add`` one generated token at a time.

    Decodes a sliding window of recent tokens (``prefix_offset`` .. end) rather than the whole output, so the
    cost per token stays constant.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all decoded text so far (final text once stopped)
        self._emitted = 0  # chars of ``text`` already released
        self.stopped = False

    def add(self, token_id: int, *, check_stop: bool = True) -> None:
        """Append a token; sets ``stopped`` and truncates ``text`` if it completes a stop string (only looked for
        when ``check_stop``: the engine does not before ``min_tokens``, so a stop string completed earlier is
        kept as text)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence or a special token: nothing new yet
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._stop and check_stop:
            start = max(0, before - self._holdback)
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True

    def release(self, *, final: bool) -> str:
        """Text not yet released; keeps back a possible stop-string prefix unless ``final``."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
