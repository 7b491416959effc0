"""Per-request timing of a streamed OpenAI completion: an incremental SSE decoder and a stream observer.

Owns: splitting a byte stream into SSE ``data:`` payloads as the bytes arrive (no line buffering beyond one
event), timing each event at the moment its bytes were read, and turning one request's events into a
``RequestRecord`` with the ``vllm bench serve`` definitions:

    ttft_ms   time from sending the request to the first chunk carrying output text
    itl_ms    gaps between successive chunks carrying output text (one chunk may carry several tokens: a
              speculative round commits its accepted block at once)
    e2el_ms   time from sending the request to the end of the stream
    tpot_ms   (e2el_ms - ttft_ms) / (output_tokens - 1)
    user_tok_s  the speed one user sees once text flows, (output_tokens - 1) / (e2el - ttft) = 1000 / tpot_ms

Output tokens come from the ``usage`` chunk (``stream_options.include_usage``); a server that sends none is
counted by its text chunks and the record says so (``usage_reported`` false). Does no I/O and imports no
HTTP client: the Locust user feeds it the raw chunks it reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field


class SSEDecoder:
    """Incremental Server-Sent-Events decoder: ``feed(bytes)`` returns the ``data`` of the events it completed.

    Lines end with ``\\n`` or ``\\r\\n``; a blank line ends an event; several ``data:`` lines of one event are
    joined with ``\\n``; comments (``:``) and the other fields (``event``, ``id``, ``retry``) are ignored.
    """

    def __init__(self) -> None:
        self._partial = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        events = []
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # the bytes after the last newline: an incomplete line
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[len("data:"):]
                self._data.append(value.removeprefix(" "))
        return events

    def close(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        tail = self.feed(b"\n\n") if self._partial or self._data else []
        self._partial = b""
        return tail


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it (times from ``time.time()``; durations in ms)."""

    user: int
    start: float  # request sent, unix seconds
    end: float  # stream ended (or failed), unix seconds
    ok: bool
    status: int | None = None
    error: str | None = None
    ttft_ms: float | None = None
    e2el_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache held
    usage_reported: bool = False
    finish_reason: str | None = None
    spec: dict | None = None  # the server's spec_stats: rounds, draft_tokens, accepted_tokens, ...
    turn: int = 0  # the request's user turn in its conversation (0: a first turn; ``--multi-turn`` sends later ones)

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.ttft_ms is None or self.output_tokens < 2:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def user_tok_s(self) -> float | None:
        tpot = self.tpot_ms
        return 1000.0 / tpot if tpot else None

    @property
    def accepted_length(self) -> float | None:
        """Committed tokens per verify round (accepted drafts + the bonus token), from the server."""
        rounds = (self.spec or {}).get("rounds") or 0
        return (self.spec["accepted_tokens"] + rounds) / rounds if rounds else None

    @property
    def verify_length(self) -> float | None:
        """Draft tokens verified per round, from the server."""
        rounds = (self.spec or {}).get("rounds") or 0
        return self.spec["draft_tokens"] / rounds if rounds else None

    def to_json(self) -> dict:
        """The stored fields plus the derived ones (for people reading the JSONL; ``from_json`` drops them)."""
        return {"kind": "request", **asdict(self), "tpot_ms": self.tpot_ms, "user_tok_s": self.user_tok_s,
                "accepted_length": self.accepted_length, "verify_length": self.verify_length}

    @classmethod
    def from_json(cls, row: dict) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in row.items() if k in names})


class StreamObserver:
    """Collects one streamed response's events (``on_event(t, data)``, ``t`` from ``time.perf_counter``); ``text``
    is the answer so far (the first choice's)."""

    def __init__(self, *, user: int, start_wall: float, start_perf: float, turn: int = 0) -> None:
        self.user, self.start_wall, self.start_perf, self.turn = user, start_wall, start_perf, turn
        self.text = ""
        self.first_text_t: float | None = None
        self.finish_t: float | None = None
        self.last_text_t: float | None = None
        self.itl_ms: list[float] = []
        self.text_chunks = 0
        self.usage: dict | None = None
        self.spec: dict | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error: str | None = None

    def on_event(self, t: float, data: str) -> None:
        if data == "[DONE]":
            self.done = True
            return
        body = json.loads(data)
        if "error" in body:
            self.error = str(body["error"].get("message", body["error"]))
            return
        if body.get("usage"):
            self.usage = body["usage"]
        if body.get("spec_stats"):
            self.spec = body["spec_stats"]
        for choice in body.get("choices") or ():
            text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                if choice.get("index", 0) == 0:
                    self.text += text
                if self.last_text_t is None:
                    self.first_text_t = t
                else:
                    self.itl_ms.append((t - self.last_text_t) * 1000)
                self.last_text_t = t
                self.text_chunks += 1
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.finish_t = t

    def record(self, *, end_perf: float, status: int | None, error: str | None = None) -> RequestRecord:
        """The request's record; it is ``ok`` when the stream finished (``finish_reason`` or ``[DONE]``)."""
        error = error or self.error
        if error is None and self.finish_reason is None and not self.done:
            error = "stream ended before a finish_reason"
        first = self.first_text_t if self.first_text_t is not None else self.finish_t

        def ms(t: float) -> float:
            return (t - self.start_perf) * 1000

        usage_tokens = (self.usage or {}).get("completion_tokens")
        return RequestRecord(
            user=self.user, start=self.start_wall, end=self.start_wall + (end_perf - self.start_perf),
            ok=error is None, status=status, error=error, ttft_ms=None if first is None else ms(first),
            e2el_ms=ms(end_perf), itl_ms=[round(x, 3) for x in self.itl_ms],
            output_tokens=usage_tokens if usage_tokens is not None else self.text_chunks,
            prompt_tokens=(self.usage or {}).get("prompt_tokens"),
            cached_tokens=((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
            usage_reported=usage_tokens is not None,
            finish_reason=self.finish_reason, spec=self.spec, turn=self.turn,
        )


def observe_stream(
    chunks: Iterable[bytes], observer: StreamObserver, clock: Callable[[], float] = time.perf_counter
) -> None:
    """Feed raw response chunks to ``observer``, timing each event when the bytes that completed it arrived.

    ``chunks`` must yield bytes as they are received (e.g. ``requests``' ``iter_content(chunk_size=None)``),
    not lines: a line iterator that waits to fill a buffer delays the timestamps.
    """
    decoder = SSEDecoder()
    for chunk in chunks:
        t = clock()
        for data in decoder.feed(chunk):
            observer.on_event(t, data)
    for data in decoder.close():
        observer.on_event(clock(), data)
