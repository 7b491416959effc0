"""SSE decoding and per-request timing: events split anywhere, TTFT / ITL / TPOT / per-user speed math."""

from __future__ import annotations

import json

import pytest

from loadtest.stream import RequestRecord, SSEDecoder, StreamObserver, observe_stream


def sse(body) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


FINAL = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
         "spec_stats": {"rounds": 4, "draft_tokens": 12, "accepted_tokens": 5, "mean_accepted_length": 2.25,
                        "fallback": False}}
USAGE = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21}}


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_decoder_same_events_for_any_split(size):
    stream = sse(text_chunk("héllo")) + b": a comment\n\n" + sse(USAGE) + sse("[DONE]")
    decoder = SSEDecoder()
    events = [e for i in range(0, len(stream), size) for e in decoder.feed(stream[i:i + size])]
    assert events == [json.dumps(text_chunk("héllo")), json.dumps(USAGE), "[DONE]"]
    assert decoder.close() == []


def test_decoder_crlf_multiline_fields_and_unterminated_tail():
    decoder = SSEDecoder()
    assert decoder.feed(b"event: x\r\nid: 3\r\ndata: {\"a\":\r\ndata:1}\r\n\r\ndata: tail") == ['{"a":\n1}']
    assert decoder.close() == ["tail"]


def observed(events: list[tuple[float, bytes]], start: float = 100.0) -> StreamObserver:
    """Feed (arrival time, bytes) pairs through ``observe_stream`` with a fake clock."""
    obs = StreamObserver(user=3, start_wall=1_000.0, start_perf=start)
    times = iter([t for t, _ in events] + [events[-1][0]])
    observe_stream((chunk for _, chunk in events), obs, clock=lambda: next(times))
    return obs


def test_timing_from_arrival_times():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    obs = observed([
        (100.05, sse(role)),                      # no text: not the first token
        (100.30, sse(text_chunk("a"))),           # first token: TTFT 300 ms
        (100.50, sse(text_chunk("bcd"))),         # a block of 3 tokens: one gap of 200 ms
        (100.60, sse(text_chunk("e")) + sse(text_chunk("f"))),  # two events in one read: a 0 ms gap
        (101.20, sse(text_chunk("ghij")) + sse(FINAL) + sse(USAGE) + sse("[DONE]")),
    ])
    rec = obs.record(end_perf=101.30, status=200)
    assert rec.ok and rec.finish_reason == "length" and rec.usage_reported
    assert rec.ttft_ms == pytest.approx(300)
    assert rec.itl_ms == pytest.approx([200, 100, 0, 600])
    assert rec.e2el_ms == pytest.approx(1300)
    assert rec.output_tokens == 10 and rec.prompt_tokens == 11
    assert rec.tpot_ms == pytest.approx((1300 - 300) / 9)
    assert rec.user_tok_s == pytest.approx(9 / 1.0)
    assert rec.accepted_length == pytest.approx((5 + 4) / 4) and rec.verify_length == pytest.approx(3.0)
    assert rec.start == 1_000.0 and rec.end == pytest.approx(1_001.3)


def test_without_usage_counts_text_chunks_and_says_so():
    obs = observed([(100.1, sse(text_chunk("a"))), (100.2, sse(text_chunk("b")) + sse(FINAL) + sse("[DONE]"))])
    rec = obs.record(end_perf=100.2, status=200)
    assert rec.ok and not rec.usage_reported and rec.output_tokens == 2


def test_single_token_answer_has_no_tpot():
    obs = observed([(100.1, sse(text_chunk("a")) + sse(FINAL) + sse("[DONE]"))])
    rec = obs.record(end_perf=100.1, status=200)
    assert rec.output_tokens == 1 and rec.tpot_ms is None and rec.user_tok_s is None and rec.ttft_ms > 0


def test_errors_and_cut_streams_are_not_ok():
    err = observed([(100.1, sse({"error": {"message": "boom"}}))]).record(end_perf=100.2, status=200)
    assert not err.ok and err.error == "boom" and err.tpot_ms is None
    cut = observed([(100.1, sse(text_chunk("a")))]).record(end_perf=100.2, status=200)
    assert not cut.ok and "before a finish_reason" in cut.error
    http = StreamObserver(user=0, start_wall=0.0, start_perf=0.0).record(end_perf=0.1, status=503,
                                                                         error="HTTP 503: overloaded")
    assert not http.ok and http.ttft_ms is None and http.status == 503


def test_completions_text_field_counts_as_output():
    chunk = {"choices": [{"index": 0, "text": "xy", "finish_reason": None}]}
    rec = observed([(100.2, sse(chunk) + sse(FINAL) + sse("[DONE]"))]).record(end_perf=100.2, status=200)
    assert rec.ttft_ms == pytest.approx(200)


def test_record_json_round_trip_keeps_stored_fields():
    obs = observed([(100.3, sse(text_chunk("a"))), (100.5, sse(text_chunk("b")) + sse(FINAL) + sse(USAGE))])
    rec = obs.record(end_perf=100.6, status=200)
    row = json.loads(json.dumps(rec.to_json()))
    assert row["kind"] == "request" and row["tpot_ms"] == pytest.approx(rec.tpot_ms)
    assert RequestRecord.from_json(row) == rec
