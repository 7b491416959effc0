"""The test form of the near-tie rule (``app/engine/near_tie.py``): an assertion."""

from __future__ import annotations

from app.engine.near_tie import first_divergence


def check_same_or_near_tie(engine, prompt: list[int], expected: list[int], got: list[int], params=None) -> str | None:
    """None if ``got == expected``; a description if they differ at a near-tie (of the logits processed by
    ``params``' controls and grammar, ``first_divergence``); AssertionError otherwise."""
    divergence = first_divergence(engine, prompt, expected, got, params)
    if divergence is None:
        return None
    assert divergence.near_tie, divergence.describe()
    return divergence.describe()


def check_seeded_same_or_near_tie(engine, prompt: list[int], expected: list[int], got: list[int], params) -> str | None:
    """``check_same_or_near_tie`` for a seeded sampled request (coupled scores: ``first_divergence``)."""
    divergence = first_divergence(engine, prompt, expected, got, params)
    if divergence is None:
        return None
    assert divergence.near_tie, divergence.describe()
    return divergence.describe()
