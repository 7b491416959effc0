"""``loadtest.rounds``: the server's round counters read from ``GET /metrics`` as the server writes them, and a
level's mean batch and round / verify / drafter-wait times from two reads."""

from __future__ import annotations

import httpx
import pytest

from app.serving.metrics import prometheus_text
from app.serving.protocol import SpecCounters
from loadtest import rounds


def serve_pages(monkeypatch, pages: list[httpx.Response]) -> None:
    """``httpx.get`` in ``loadtest.rounds`` answers ``pages`` in turn (the last one again once they run out)."""
    def get(url, **kwargs):
        assert url == "http://server/metrics"
        return pages.pop(0) if len(pages) > 1 else pages[0]

    monkeypatch.setattr(rounds.httpx, "get", get)


def page(counters: SpecCounters) -> httpx.Response:
    return httpx.Response(200, text=prometheus_text(counters, model_name="m", positions=4, running=0, waiting=0))


def test_a_level_splits_into_mean_batch_round_verify_and_drafter_wait(monkeypatch):
    counters = SpecCounters()
    counters.add_round([3, 0], [1, 0], round_ms=40.0, verify_ms=30.0, drafter_wait_ms=6.0, verify_cpu_wait_ms=2.0)
    serve_pages(monkeypatch, [page(counters)])
    before = rounds.read_counters("http://server/")
    assert before == pytest.approx({"rounds": 1, "round_requests": 2, "round_s": 0.04, "verify_s": 0.03,
                                    "drafter_wait_s": 0.006, "cpu_wait_s": 0.002})
    for _ in range(3):
        counters.add_round([1, 2, 0, 4], [1, 2, 0, 0], round_ms=60.0, verify_ms=50.0, drafter_wait_ms=4.0,
                           verify_cpu_wait_ms=5.0)
    serve_pages(monkeypatch, [page(counters)])
    split = rounds.round_split(before, rounds.read_counters("http://server"))
    assert split == {"server_mean_batch": 4.0, "server_round_ms": 60.0, "server_verify_ms": 50.0,
                     "server_drafter_wait_ms": 4.0, "server_verify_cpu_wait_ms": 5.0}
    assert rounds.round_split(before, before) == dict.fromkeys(rounds.FIGURES)  # no round between the reads
    assert rounds.round_split(None, before) == dict.fromkeys(rounds.FIGURES)


@pytest.mark.parametrize("response", [
    httpx.Response(404, json={"error": "not found"}),
    httpx.Response(200, text="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"),
    httpx.Response(200, text="<html>not prometheus</html>"),
], ids=["no page", "other counters", "not prometheus text"])
def test_a_server_without_the_counters_gives_none(monkeypatch, response):
    serve_pages(monkeypatch, [response])
    assert rounds.read_counters("http://server") is None
    assert rounds.settled_counters("http://server", interval_s=0) is None


def test_settled_counters_wait_until_the_rounds_stop_moving(monkeypatch):
    counters, pages = SpecCounters(), []
    for _ in range(3):  # the server's reports lag: the rounds still move over the first three reads
        counters.add_round([1], [0], round_ms=10.0, verify_ms=8.0)
        pages.append(page(counters))
    serve_pages(monkeypatch, pages + [page(counters)])
    assert rounds.settled_counters("http://server", interval_s=0)["rounds"] == 3
