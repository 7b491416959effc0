"""A target replica's telemetry: per-request token timing, the TPOT window the SLO autoscaler reads, metrics.

Owns: ``TpotWindow`` (time per output token of requests finished in the last ``window_s`` seconds plus the
requests still decoding, and its percentiles) and ``TargetTelemetry``, the one object ``TargetReplica``
calls from its hooks (tokens emitted, request dropped, round done, report tick, autoscaling stats poll).
TPOT of a request = (time of its last token - time of its first token) / (tokens - 1), measured where the
tokens are emitted on the replica (the client adds network time on top).

Does not own: the metric definitions (``metrics.py``) or the scaling decision (``autoscale/policy.py``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from app.engine.types import StepOutput
from app.serving.metrics import TargetMetrics
from app.serving.protocol import SpecCounters, SpecStats
from autoscale.config import REPORTED_PERCENTILES, SLOAutoscalingConfig
from autoscale.policy import STAT_LOAD, STAT_SAMPLES, tpot_stat


@dataclass
class _Timing:
    first_at: float
    last_at: float
    tokens: int

    @property
    def tpot_ms(self) -> float | None:
        return (self.last_at - self.first_at) * 1000 / (self.tokens - 1) if self.tokens > 1 else None


class TpotWindow:
    """TPOT samples (ms) of recent and running requests (module docstring). Times in seconds, any clock."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._done: collections.deque[tuple[float, float]] = collections.deque()  # (finished_at, tpot_ms)
        self._live: dict[str, _Timing] = {}

    def tokens(self, request_id: str, n: int, *, now: float, finished: bool) -> float | None:
        """Record ``n`` tokens of a request emitted at ``now``; returns its TPOT when ``finished`` (None if it
        produced fewer than two tokens)."""
        timing = self._live.get(request_id)
        if timing is None:
            timing = self._live[request_id] = _Timing(first_at=now, last_at=now, tokens=0)
        timing.tokens += n
        timing.last_at = now
        if not finished:
            return None
        del self._live[request_id]
        if timing.tpot_ms is not None:
            self._done.append((now, timing.tpot_ms))
        return timing.tpot_ms

    def live(self, request_id: str) -> _Timing | None:
        """A running request's timing so far: its first and last emission times and tokens (None before its first)."""
        return self._live.get(request_id)

    def forget(self, request_id: str) -> None:
        """A request that went away unfinished (cancelled, failed) leaves no sample."""
        self._live.pop(request_id, None)

    def samples(self, now: float) -> list[float]:
        """TPOT (ms) of requests finished within the window and of running requests with two tokens or more."""
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()
        live = [t.tpot_ms for t in self._live.values() if t.tpot_ms is not None]
        return [tpot for _, tpot in self._done] + live

    def percentiles(self, now: float, qs: Sequence[int] = REPORTED_PERCENTILES) -> tuple[dict[int, float], int]:
        """(percentile -> TPOT ms, sample count); an empty dict without samples."""
        samples = self.samples(now)
        if not samples:
            return {}, 0
        values = np.percentile(np.asarray(samples), list(qs))
        return {q: float(v) for q, v in zip(qs, values)}, len(samples)


class TargetTelemetry:
    """The target replica's hooks into metrics and the SLO window (one instance per replica)."""

    def __init__(self, *, slo: SLOAutoscalingConfig, policy: str, replica: str, gamma: int, max_num_seqs: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slo = slo
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self.window = TpotWindow(slo.window_s)
        self.metrics = TargetMetrics(policy=policy, replica=replica, gamma=gamma)
        self.counters = SpecCounters()  # what the load reports carry to the Router (``GET /metrics``)

    def tokens(self, request_id: str, n: int, *, finished: bool, length: bool, spec: SpecStats,
               arrived_at: float) -> None:
        """A request emitted ``n`` tokens (prefill or round); ``spec`` is its running speculative stats; ``length``:
        it finished at its max_tokens; ``arrived_at``: when it reached the replica (``clock``)."""
        now = self.clock()
        self.metrics.tokens(n)
        self.counters.output_tokens += n
        self.counters.requests_finished += int(finished)
        self.counters.requests_length += int(finished and length)
        before = self.window.live(request_id)
        if before is not None:
            self.counters.itl_s.observe(now - before.last_at)
        generated = n + (before.tokens if before is not None else 0)
        tpot = self.window.tokens(request_id, n, now=now, finished=finished)
        if finished:
            self.counters.e2e_s.observe(now - arrived_at)
            self.counters.output_len.observe(generated)
            self.metrics.finished(accepted_length=spec.mean_accepted_length if spec.draft_tokens else None,
                                  tpot_ms=tpot)

    def admitted(self, *, arrived_at: float, at: float) -> None:
        """A request that arrived at ``arrived_at`` got its KV slot at ``at`` (``clock``; its prefill started then; a
        request sent back to the queue for want of KV blocks is not admitted)."""
        self.counters.queue_s.observe(at - arrived_at)

    def prefilled(self, prompt_tokens: int, cached_tokens: int, *, arrived_at: float) -> None:
        """A request was admitted: ``prompt_tokens`` looked up in the prefix cache, ``cached_tokens`` of them found;
        ``arrived_at``: when it reached the replica (``clock``), its first token being now."""
        ttft_s = self.clock() - arrived_at
        self.metrics.prefilled(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, ttft_ms=ttft_s * 1000)
        self.counters.prefix_cache_queries += prompt_tokens
        self.counters.prefix_cache_hits += cached_tokens
        self.counters.ttft_s.observe(ttft_s)
        self.counters.prompt_len.observe(prompt_tokens)

    def dropped(self, request_id: str) -> None:
        self.window.forget(request_id)

    def cancelled(self) -> None:
        """A request's client went away before it finished (counted once per request)."""
        self.metrics.requests_cancelled.inc()
        self.counters.requests_cancelled += 1

    def round(self, *, round_ms: float, verify_ms: float, drafter_wait_ms: float, drafter_called: bool, drafted: int,
              lookup: int, outputs: Sequence[StepOutput], verify_cpu: tuple[float, float] | None,
              guarded: bool) -> None:
        """A round of ``round_ms`` (its verify step ``verify_ms``, its wait for the drafter ``drafter_wait_ms``):
        ``drafted`` draft tokens offered for verification (drafter or prompt lookup), ``lookup`` requests verifying a
        prompt-lookup draft, ``verify_cpu`` the engine thread's (ms on a CPU, ms waiting for one) during the verify
        step (None: not measured), ``guarded`` whether the speculation guard ran it plain."""
        num_draft, num_accepted = [o.num_draft for o in outputs], [o.num_accepted for o in outputs]
        self.counters.add_round(num_draft, num_accepted, round_ms=round_ms, verify_ms=verify_ms,
                                drafter_wait_ms=drafter_wait_ms,
                                verify_cpu_wait_ms=verify_cpu[1] if verify_cpu is not None else 0.0)
        self.counters.guard_plain_rounds += int(guarded)
        self.metrics.round(round_ms=round_ms, verify_ms=verify_ms, drafter_called=drafter_called, drafted=drafted,
                           lookup=lookup, num_draft=num_draft, num_accepted=num_accepted,
                           committed=sum(len(o.new_token_ids) for o in outputs), verify_cpu=verify_cpu,
                           guarded=guarded)

    def report(self, *, active: int, queued: int) -> None:
        """Report tick: load gauges and the SLO gauges from the current window."""
        self.metrics.load(active=active, queued=queued)
        quantiles, _ = self.window.percentiles(self.clock())
        met = quantiles[self.slo.tpot_percentile] <= self.slo.tpot_limit_ms if quantiles else None
        self.metrics.slo(limit_ms=self.slo.tpot_limit_ms, quantiles=quantiles or None, met=met)

    def autoscaling_stats(self, *, active: int, queued: int) -> dict[str, float]:
        """``record_autoscaling_stats`` entries the SLO policy reads (``autoscale/policy.py``)."""
        quantiles, n = self.window.percentiles(self.clock())
        stats = {tpot_stat(q): quantiles.get(q, 0.0) for q in REPORTED_PERCENTILES}
        return {**stats, STAT_SAMPLES: float(n), STAT_LOAD: (active + queued) / self.max_num_seqs}
