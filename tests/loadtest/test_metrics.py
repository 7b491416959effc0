"""Level aggregation on constructed records: window, token attribution, percentiles, SLO goodput, spec stats."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from loadtest.metrics import Slo, Window, distribution, measurement_window, read_records, summarize, tokens_in_window
from loadtest.stream import RequestRecord

T0 = 1_000.0


def rec(start: float, ttft_ms: float, e2el_ms: float, tokens: int, *, ok: bool = True, itl=(), spec=None,
        user: int = 0) -> RequestRecord:
    return RequestRecord(user=user, start=T0 + start, end=T0 + start + e2el_ms / 1000, ok=ok,
                         error=None if ok else "HTTP 503: overloaded", ttft_ms=ttft_ms if ok else None,
                         e2el_ms=e2el_ms, itl_ms=list(itl), output_tokens=tokens if ok else 0,
                         usage_reported=True, spec=spec)


def test_distribution_matches_numpy_and_handles_empty():
    values = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0]
    d = distribution(values, "ttft_ms")
    assert d["median_ttft_ms"] == 3.5 and d["mean_ttft_ms"] == pytest.approx(np.mean(values))
    assert d["p90_ttft_ms"] == pytest.approx(np.percentile(values, 90))
    assert d["p99_ttft_ms"] == pytest.approx(np.percentile(values, 99))
    assert d["p50_ttft_ms"] == d["median_ttft_ms"] and d["std_ttft_ms"] == pytest.approx(np.std(values))
    assert set(distribution([], "x").values()) == {None}


def test_window_from_markers():
    markers = {"spawning_complete": {"t": T0}, "test_stopping": {"t": T0 + 100}}
    assert measurement_window(markers, warmup_s=5, duration_s=20) == Window(T0 + 5, T0 + 25)
    early_stop = {"spawning_complete": {"t": T0}, "test_stopping": {"t": T0 + 15}}
    assert measurement_window(early_stop, warmup_s=5, duration_s=20) == Window(T0 + 5, T0 + 15)
    with pytest.raises(ValueError, match="spawning_complete"):
        measurement_window({}, warmup_s=0, duration_s=1)
    with pytest.raises(ValueError, match="warm-up"):
        measurement_window({"spawning_complete": {"t": T0}, "test_stopping": {"t": T0 + 1}}, warmup_s=5,
                           duration_s=20)


@pytest.mark.parametrize("start, expected", [
    (2.0, 11.0),    # wholly inside: all 11 tokens
    (-0.5, 11.0),   # first token at -0.5 + 0.5 = 0.0: inside, and the rest too
    (-1.0, 9.0),    # first token at -0.5: outside; the 10 others spread over [-0.5, 4.5]: 10 * 4.5 / 5 inside
    (8.0, 4.0),     # first token at 8.5: inside; 10 more over [8.5, 13.5]: 10 * 1.5 / 5 inside [0, 10)
    (12.0, 0.0),    # after the window
])
def test_tokens_in_window_spreads_tokens_over_the_decode(start, expected):
    window = Window(T0, T0 + 10)
    assert tokens_in_window(rec(start, 500, 5500, 11), window) == pytest.approx(expected)


def test_tokens_in_window_failed_and_single_token():
    window = Window(T0, T0 + 10)
    assert tokens_in_window(rec(1, 0, 100, 5, ok=False), window) == 0
    assert tokens_in_window(rec(1, 100, 100, 1), window) == 1


def test_summarize_throughput_goodput_latencies_and_spec():
    window = Window(T0, T0 + 10)
    spec = {"rounds": 5, "draft_tokens": 15, "accepted_tokens": 6, "fallback": False}
    records = [
        rec(-1.0, 500, 2000, 11, itl=[100, 200]),                     # started before the window: not in stats
        rec(1.0, 200, 1200, 11, itl=[50, 150], spec=spec),             # TPOT 100 ms
        rec(2.0, 400, 4400, 21, itl=[300], spec=spec),                 # TPOT 200 ms
        rec(3.0, 300, 0, 0, ok=False),                                 # failed
        rec(9.5, 100, 2100, 11, itl=[400], spec={**spec, "fallback": True}),  # ends after the window
    ]
    result = summarize(records, window, Slo(tpot_ms=150))
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["errors"] == {"HTTP 503: overloaded": 1}
    assert result["request_throughput"] == pytest.approx(3 / 10)  # three ok requests end in the window
    assert result["request_goodput"] == pytest.approx(2 / 10)     # the TPOT 200 ms one misses the SLO
    expected_tokens = sum(tokens_in_window(r, window) for r in records)
    assert result["output_throughput"] == pytest.approx(expected_tokens / 10)
    assert result["median_ttft_ms"] == 200 and result["p50_tpot_ms"] == pytest.approx(200)  # of 100, 200, 200
    assert result["median_itl_ms"] == pytest.approx(np.median([50, 150, 300, 400]))
    assert result["median_user_tok_s"] == pytest.approx(5)
    assert result["mean_accepted_length"] == pytest.approx((6 + 5) / 5)
    assert result["mean_verify_length"] == pytest.approx(3.0)
    assert result["draft_acceptance_rate"] == pytest.approx(6 / 15)
    assert result["spec_requests"] == 3 and result["spec_fallback_requests"] == 1
    assert result["duration"] == 10


def test_goodput_needs_an_slo_and_checks_every_objective():
    r = rec(1, 300, 1300, 11)
    assert summarize([r], Window(T0, T0 + 10), Slo())["request_goodput"] is None
    assert Slo(ttft_ms=400, tpot_ms=100).met(r) and not Slo(ttft_ms=200).met(r)
    assert not Slo(e2el_ms=1000).met(r) and not Slo(tpot_ms=1e9).met(rec(1, 0, 0, 0, ok=False))


def test_without_spec_stats_the_spec_fields_are_none():
    result = summarize([rec(1, 300, 1300, 11)], Window(T0, T0 + 10), Slo())
    assert result["mean_accepted_length"] is None and result["spec_requests"] == 0


def test_prefix_cache_hit_rate_counts_the_requests_whose_usage_tells():
    told = [replace(rec(1, 300, 1300, 11), prompt_tokens=p, cached_tokens=c) for p, c in ((100, 60), (50, 0))]
    untold = replace(rec(2, 300, 1300, 11), prompt_tokens=400)  # a server without prompt_tokens_details
    assert summarize(told + [untold], Window(T0, T0 + 10), Slo())["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert summarize([untold], Window(T0, T0 + 10), Slo())["prefix_cache_hit_rate"] is None


def test_later_turns_ttft_is_the_median_over_the_requests_past_a_first_turn():
    records = [rec(1, 900, 1300, 11), replace(rec(2, 200, 1300, 11), turn=1), replace(rec(3, 400, 1300, 11), turn=2),
               replace(rec(4, 300, 1300, 11, ok=False), turn=1)]
    assert summarize(records, Window(T0, T0 + 10), Slo())["p50_ttft_ms_later_turns"] == pytest.approx(300)
    assert summarize(records[:1], Window(T0, T0 + 10), Slo())["p50_ttft_ms_later_turns"] is None


def test_read_records_splits_markers_and_requests(tmp_path):
    path = tmp_path / "r.jsonl"
    rows = [{"kind": "test_start", "t": T0}, {"kind": "spawning_complete", "t": T0 + 1, "user_count": 2},
            rec(2, 100, 500, 5).to_json(), {"kind": "test_stopping", "t": T0 + 30}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records, markers = read_records(path)
    assert records == [rec(2, 100, 500, 5)] and markers["spawning_complete"]["user_count"] == 2
