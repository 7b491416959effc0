"""Hand-made throughput profiles for scheduling tests."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from app.scheduling.profile import Provenance, ThroughputProfile


def provenance(**overrides: object) -> Provenance:
    fields = dict(
        engine="test", model="SmolLM2-135M-Instruct", dtype="bfloat16", torch_version="2.13.0",
        hardware="test-cpu", date=dt.date(2026, 1, 1), source="derived", context_tokens=200,
    )
    return Provenance(**{**fields, **overrides})


def make_profile(
    verify: Callable[[int, int], float],
    *,
    batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 8),
    tokens_per_request: tuple[int, ...] = tuple(range(1, 9)),
    draft: float = 0.0,
    verify_step: str = "ragged",
    sampled: Callable[[int, int], float] | None = None,
) -> ThroughputProfile:
    """Profile whose cell (B, t) costs verify(B, N = B * t) ms (all sampled: ``sampled(B, N)``, no sampled table
    without it); draft ms constant; ``verify_step`` as measured."""
    return ThroughputProfile(
        provenance=provenance(),
        batch_sizes=list(batch_sizes),
        tokens_per_request=list(tokens_per_request),
        verify_ms=[[verify(b, b * t) for t in tokens_per_request] for b in batch_sizes],
        sampled_verify_ms=None if sampled is None else [[sampled(b, b * t) for t in tokens_per_request]
                                                        for b in batch_sizes],
        draft_ms=[draft] * len(batch_sizes),
        draft_gamma=7,
        verify_step=verify_step,
    )
