"""One load level's metrics from its per-request records, named as ``vllm bench serve`` names them.

Owns: reading a records file (``RequestRecord`` lines and the Locust markers), the measurement window,
SLO checks, and the aggregation:

    window            [spawning_complete + warmup, min(that + duration, test_stopping)]; the Locust run then
                      lets every request in flight finish (``--stop-timeout``), so no answer is cut short
    latency stats     over the requests *started* in the window: ttft_ms, tpot_ms, e2el_ms per request and
                      itl_ms over all their gaps; mean, median, std, p50, p90, p99
    output_throughput output tokens produced inside the window / window length; a request's tokens are
                      placed at its first-token time (one) and spread evenly up to its end (the rest), so
                      requests that straddle an edge count only their share
    request_throughput  requests that ended inside the window / window length
    request_goodput   of those, the ones meeting every SLO given (ttft, tpot, e2el) / window length
    user_tok_s        per request (output_tokens - 1) / (e2el - ttft); median and mean
    p50_ttft_ms_later_turns  the median TTFT of the requests that carry a conversation's later turn
                      (``--multi-turn``: the earlier turns and answers are a prefix the prefix cache may hold)
    mean_accepted_length, mean_verify_length   the server's spec_stats summed over the started requests:
                      (accepted + rounds) / rounds and draft_tokens / rounds

No I/O besides ``read_records``; pure functions over lists of records.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.stream import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives (None: not checked)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met(self, record: RequestRecord) -> bool:
        """Whether an ok request meets every objective (a one-token answer has no TPOT and meets that one)."""
        if not record.ok:
            return False
        checks = [(self.ttft_ms, record.ttft_ms), (self.tpot_ms, record.tpot_ms), (self.e2el_ms, record.e2el_ms)]
        return all(limit is None or value is None or value <= limit for limit, value in checks)

    def to_json(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}


@dataclass(frozen=True)
class Window:
    start: float  # unix seconds
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def __contains__(self, t: float) -> bool:
        return self.start <= t < self.end


def read_records(path: Path) -> tuple[list[RequestRecord], dict[str, dict]]:
    """The requests of a records file and its markers by kind (the last of each kind)."""
    records, markers = [], {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("kind") == "request":
            records.append(RequestRecord.from_json(row))
        else:
            markers[row["kind"]] = row
    return records, markers


def measurement_window(markers: dict[str, dict], *, warmup_s: float, duration_s: float) -> Window:
    """The window after ramp-up and warm-up, ending at ``duration_s`` or when Locust began stopping.

    Raises:
        ValueError: the run never finished spawning its users, or stopped before the warm-up ended.
    """
    if "spawning_complete" not in markers:
        raise ValueError("the Locust run has no spawning_complete marker (it never reached its user count)")
    start = markers["spawning_complete"]["t"] + warmup_s
    end = start + duration_s
    if "test_stopping" in markers:
        end = min(end, markers["test_stopping"]["t"])
    if end <= start:
        raise ValueError(f"the Locust run stopped {start - end:.1f} s before its warm-up ended")
    return Window(start, end)


def tokens_in_window(record: RequestRecord, window: Window) -> float:
    """Output tokens of ``record`` produced inside ``window`` (first token at TTFT, the rest spread evenly)."""
    if not record.ok or record.ttft_ms is None or record.output_tokens < 1:
        return 0.0
    first = record.start + record.ttft_ms / 1000
    tokens = 1.0 if first in window else 0.0
    rest = record.output_tokens - 1
    if rest == 0:
        return tokens
    if record.end <= first:
        return tokens + (rest if first in window else 0.0)
    overlap = max(0.0, min(record.end, window.end) - max(first, window.start))
    return tokens + rest * overlap / (record.end - first)


def distribution(values: list[float], name: str) -> dict[str, float | None]:
    """mean / median / std / p50 / p90 / p99 of ``values`` as ``{stat}_{name}`` (None when empty)."""
    keys = ["mean", "median", "std"] + [f"p{p}" for p in PERCENTILES]
    if not values:
        return {f"{k}_{name}": None for k in keys}
    a = np.asarray(values, dtype=np.float64)
    stats = [a.mean(), np.median(a), a.std()] + list(np.percentile(a, PERCENTILES))
    return {f"{k}_{name}": float(v) for k, v in zip(keys, stats)}


def spec_summary(records: list[RequestRecord]) -> dict:
    """The server's speculative statistics over ``records`` (requests that returned spec_stats)."""
    specs = [r.spec for r in records if r.ok and r.spec and r.spec.get("rounds")]
    rounds = sum(s["rounds"] for s in specs)
    accepted = sum(s["accepted_tokens"] for s in specs)
    drafted = sum(s["draft_tokens"] for s in specs)
    return {
        "spec_requests": len(specs),
        "spec_fallback_requests": sum(bool(s.get("fallback")) for s in specs),
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
        "mean_verify_length": drafted / rounds if rounds else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
    }


def prefix_hit_rate(records: list[RequestRecord]) -> float | None:
    """Prompt tokens the server's prefix cache held over prompt tokens sent, for the requests whose usage says
    (``prompt_tokens_details.cached_tokens``); None when none does."""
    told = [r for r in records if r.cached_tokens is not None and r.prompt_tokens]
    return sum(r.cached_tokens for r in told) / sum(r.prompt_tokens for r in told) if told else None


def summarize(records: list[RequestRecord], window: Window, slo: Slo) -> dict:
    """The level's metrics (see the module docstring for each definition)."""
    started = [r for r in records if r.start in window]
    ok = [r for r in started if r.ok]
    ended = [r for r in records if r.ok and r.end in window]
    duration = window.duration
    output_tokens = sum(tokens_in_window(r, window) for r in records)
    values = {
        "ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
        "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
        "itl": [gap for r in ok for gap in r.itl_ms],
        "e2el": [r.e2el_ms for r in ok],
    }
    speeds = [r.user_tok_s for r in ok if r.user_tok_s is not None]
    later = [r.ttft_ms for r in ok if r.turn > 0 and r.ttft_ms is not None]
    errors = Counter(r.error for r in started if not r.ok)
    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(started) - len(ok),
        "errors": dict(errors.most_common(3)),
        "total_input_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "prefix_cache_hit_rate": prefix_hit_rate(ok),
        "total_output_tokens": output_tokens,
        "output_tokens_from_usage": all(r.usage_reported for r in ok),
        "request_throughput": len(ended) / duration,
        "request_goodput": sum(slo.met(r) for r in ended) / duration if slo.active else None,
        "output_throughput": output_tokens / duration,
        "median_user_tok_s": float(np.median(speeds)) if speeds else None,
        "mean_user_tok_s": float(np.mean(speeds)) if speeds else None,
        "p50_ttft_ms_later_turns": float(np.median(later)) if later else None,
    }
    for name in LATENCIES:
        result.update(distribution(values[name], f"{name}_ms"))
    result.update(spec_summary(ok))
    return result
