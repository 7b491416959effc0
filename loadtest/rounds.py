"""Where a served round's time goes over one load level, from the server's own counters on ``GET /metrics``.

A target replica counts its rounds, the requests in each (summed), the time in rounds, and of it the time in verify
steps and waiting for the drafter (``dspark_round_requests_total``, ``dspark_round_seconds_total``,
``dspark_verify_seconds_total``, ``dspark_drafter_wait_seconds_total``, and of the verify steps the time the engine
thread waited for a CPU, ``dspark_verify_cpu_wait_seconds_total``; docs/serving.md). Read before and after a level,
their differences give the level's mean batch and mean round, verify, drafter-wait and CPU-wait times: the served
round against the engine's own step, the overhead the serving shell adds. A server without these counters (vLLM,
any other OpenAI-compatible server) gives None for each figure.

Owns: reading the counters and the differences. Does not own: when the sweep reads them (``sweep.py``).
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {  # figure read -> sample name on /metrics
    "rounds": "dspark_rounds_total", "round_requests": "dspark_round_requests_total",
    "round_s": "dspark_round_seconds_total", "verify_s": "dspark_verify_seconds_total",
    "drafter_wait_s": "dspark_drafter_wait_seconds_total", "cpu_wait_s": "dspark_verify_cpu_wait_seconds_total",
}
FIGURES = ("server_mean_batch", "server_round_ms", "server_verify_ms", "server_drafter_wait_ms",
           "server_verify_cpu_wait_ms")


def read_counters(url: str, *, headers: dict | None = None, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The round counters on ``url``/metrics, summed over their labels; None where the server has no such page, not
    these counters, or a page that is not Prometheus text.

    Raises:
        httpx.HTTPError: the server could not be reached.
    """
    r = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=timeout_s)
    if r.status_code != 200:
        return None
    by_name = {name: 0.0 for name in COUNTERS.values()}
    found = set()
    try:
        samples = [s for family in text_string_to_metric_families(r.text) for s in family.samples]
    except ValueError:
        return None
    for sample in samples:
        if sample.name in by_name:
            by_name[sample.name] += sample.value
            found.add(sample.name)
    if found != set(by_name):
        return None
    return {key: by_name[name] for key, name in COUNTERS.items()}


def settled_counters(url: str, *, headers: dict | None = None, interval_s: float = 1.0,
                     timeout_s: float = 10.0) -> dict[str, float] | None:
    """``read_counters`` once two reads ``interval_s`` apart agree on the rounds (the server's /metrics lags its
    replicas by their report interval); the last read after ``timeout_s``.

    Raises:
        httpx.HTTPError: the server could not be reached.
    """
    last = read_counters(url, headers=headers)
    deadline = time.monotonic() + timeout_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(interval_s)
        now = read_counters(url, headers=headers)
        if now is None or now["rounds"] == last["rounds"]:
            return now
        last = now
    return last


def round_split(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """The ``FIGURES`` between two reads: mean requests per round, and mean round, verify-step, drafter-wait and
    CPU-wait times (ms); None each where either read is None or no round ran between them."""
    if before is None or after is None or (rounds := after["rounds"] - before["rounds"]) <= 0:
        return dict.fromkeys(FIGURES)

    def per_round(key: str, scale: float = 1.0) -> float:
        return round(scale * (after[key] - before[key]) / rounds, 2)

    return {"server_mean_batch": per_round("round_requests"), "server_round_ms": per_round("round_s", 1000),
            "server_verify_ms": per_round("verify_s", 1000),
            "server_drafter_wait_ms": per_round("drafter_wait_s", 1000),
            "server_verify_cpu_wait_ms": per_round("cpu_wait_s", 1000)}
