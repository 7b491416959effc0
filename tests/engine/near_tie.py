"""The test form of the near-tie rule (``app/engine/near_tie.py``): an assertion."""

from __future__ import annotations

from app.engine.near_tie import first_divergence, first_divergence_seeded


def check_same_or_near_tie(engine, prompt: list[int], expected: list[int], got: list[int]) -> str | None:
    """None if ``got == expected``; a description if they differ at a near-tie; AssertionError otherwise."""
    divergence = first_divergence(engine, prompt, expected, got)
    if divergence is None:
        return None
    assert divergence.near_tie, divergence.describe()
    return divergence.describe()


def check_seeded_same_or_near_tie(engine, prompt: list[int], expected: list[int], got: list[int], params) -> str | None:
    """``check_same_or_near_tie`` for a seeded sampled request (``first_divergence_seeded``)."""
    divergence = first_divergence_seeded(engine, prompt, expected, got, params)
    if divergence is None:
        return None
    assert divergence.near_tie, divergence.describe()
    return divergence.describe()
