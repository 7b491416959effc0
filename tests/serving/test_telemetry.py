"""TPOT window and the target replica's autoscaling stats, on a fake clock (no Ray cluster)."""

from __future__ import annotations

import pytest

from app.serving.protocol import SpecStats
from app.serving.telemetry import TargetTelemetry, TpotWindow
from autoscale.config import SLOAutoscalingConfig


def test_tpot_of_finished_and_running_requests():
    w = TpotWindow(window_s=10)
    w.tokens("a", 1, now=0.0, finished=False)  # first token
    w.tokens("a", 4, now=0.2, finished=False)
    assert w.tokens("a", 5, now=0.9, finished=True) == pytest.approx(100.0)  # 0.9 s over 9 gaps
    w.tokens("b", 1, now=1.0, finished=False)
    assert w.samples(1.0) == pytest.approx([100.0])  # b has one token: no TPOT yet
    w.tokens("b", 2, now=1.1, finished=False)
    assert sorted(w.samples(1.1)) == pytest.approx([50.0, 100.0])
    assert w.tokens("c", 1, now=1.2, finished=True) is None  # one-token request leaves no sample
    w.forget("b")
    assert w.samples(1.2) == pytest.approx([100.0])


def test_window_drops_old_samples_and_percentiles():
    w = TpotWindow(window_s=5)
    for i, tpot_s in enumerate([0.01, 0.02, 0.03, 0.04, 0.10]):
        w.tokens(f"r{i}", 1, now=float(i), finished=False)
        w.tokens(f"r{i}", 1, now=i + tpot_s, finished=True)
    qs, n = w.percentiles(4.5)
    assert n == 5 and qs[50] == pytest.approx(30.0) and qs[99] == pytest.approx(97.6)
    qs, n = w.percentiles(7.0)  # finished at 0.01 and 1.02 (< 2.0) dropped
    assert n == 3 and qs[50] == pytest.approx(40.0)
    assert w.percentiles(100.0) == ({}, 0)
    with pytest.raises(ValueError, match="window_s"):
        TpotWindow(window_s=0)


def test_autoscaling_stats_report_percentiles_samples_and_load():
    now = [0.0]
    tel = TargetTelemetry(slo=SLOAutoscalingConfig(window_s=30), policy="dspark", replica="r0", gamma=4,
                          max_num_seqs=4, clock=lambda: now[0])
    assert tel.autoscaling_stats(active=0, queued=0) == {
        "tpot_p50_ms": 0.0, "tpot_p90_ms": 0.0, "tpot_p99_ms": 0.0, "tpot_samples": 0.0, "load": 0.0}
    tel.tokens("a", 1, finished=False, length=False, spec=SpecStats(), arrived_at=0.0)
    now[0] = 0.3
    tel.tokens("a", 4, finished=True, length=True, spec=SpecStats(rounds=1, draft_tokens=4, accepted_tokens=3),
               arrived_at=0.0)
    assert (tel.counters.requests_finished, tel.counters.requests_length) == (1, 1)
    stats = tel.autoscaling_stats(active=3, queued=3)
    assert stats["tpot_p90_ms"] == pytest.approx(75.0) and stats["tpot_samples"] == 1 and stats["load"] == 1.5
    tel.report(active=3, queued=3)  # gauges: Ray metrics record without a cluster too


@pytest.mark.parametrize("name, low, high", [("MS_BUCKETS", 1, 5000), ("TPOT_BUCKETS", 2, 2000)])
def test_time_buckets_resolve_quantiles_within_one_and_a_half_times(name, low, high):
    """Grafana reads round, verify, drafter-call and TPOT quantiles from these buckets by interpolating inside one:
    each bucket must be narrow (upper edge at most 1.5x the lower) from a GPU step to a slow CPU batch."""
    from app.serving import metrics

    edges = getattr(metrics, name)
    assert edges[0] <= low and edges[-1] >= high
    assert all(hi / lo <= 1.5 + 1e-9 for lo, hi in zip(edges, edges[1:])), edges


def test_request_histograms_measure_each_request_as_vllm_does():
    """Queue time, TTFT, inter-token latency (one gap per emission), end-to-end time and token counts per request,
    from its arrival at the replica, into ``SpecCounters``' buckets (``GET /metrics``: under vLLM's names)."""
    now = [10.0]
    tel = TargetTelemetry(slo=SLOAutoscalingConfig(), policy="dspark", replica="r0", gamma=4, max_num_seqs=4,
                          clock=lambda: now[0])
    tel.admitted(arrived_at=10.0, at=10.2)
    now[0] = 10.5
    tel.prefilled(12, 4, arrived_at=10.0)
    tel.tokens("a", 1, finished=False, length=False, spec=SpecStats(), arrived_at=10.0)
    for t, n, done in ((10.56, 3, False), (10.7, 2, True)):
        now[0] = t
        tel.tokens("a", n, finished=done, length=False, spec=SpecStats(rounds=2, draft_tokens=6, accepted_tokens=3),
                   arrived_at=10.0)
    c = tel.counters
    assert (c.queue_s.count, c.queue_s.total) == (1, pytest.approx(0.2))
    assert (c.ttft_s.count, c.ttft_s.total) == (1, pytest.approx(0.5))
    assert c.ttft_s.counts[c.ttft_s.bounds.index(0.5)] == 1  # 0.5 s is in the bucket le="0.5"
    assert (c.itl_s.count, c.itl_s.total) == (2, pytest.approx(0.2))  # 60 ms, then 140 ms
    assert c.itl_s.counts[c.itl_s.bounds.index(0.075)] == c.itl_s.counts[c.itl_s.bounds.index(0.15)] == 1
    assert (c.e2e_s.count, c.e2e_s.total) == (1, pytest.approx(0.7))
    assert (c.prompt_len.total, c.output_len.total) == (12, 6)
    tel.tokens("b", 1, finished=True, length=True, spec=SpecStats(), arrived_at=10.6)
    assert (c.itl_s.count, c.e2e_s.count, c.output_len.count) == (2, 2, 2)  # a one-token request has no gap
