"""The test form of the near-tie rule (``app/engine/near_tie.py``): an assertion."""

from __future__ import annotations

from app.engine.near_tie import NEAR_TIE_EPS, first_divergence, teacher_forced_logits


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


def check_greedy_path(engine, prompt: list[int], got: list[int]) -> None:
    """AssertionError unless every token of ``got`` is a greedy choice of the target after ``prompt`` and the tokens
    of ``got`` before it, up to a near-tie: its logit within NEAR_TIE_EPS of the best in one teacher-forced forward
    over ``prompt + got``. Judges a whole greedy output on its own, past a first divergence from a reference, so a
    path that leaves the target's choices anywhere fails however many near-ties it met."""
    if not got:
        return
    logits = teacher_forced_logits(engine, prompt + got)[len(prompt) - 1:-1]  # [len(got), V]: row i predicts got[i]
    gaps = logits.max(dim=-1).values - logits[range(len(got)), got]
    bad = [(i, got[i], round(float(g), 3)) for i, g in enumerate(gaps) if g >= NEAR_TIE_EPS]
    assert not bad, f"tokens (index, id, gap to the best logit) that greedy decoding would not pick: {bad}"


def check_greedy_output(engine, prompt: list[int], expected: list[int], got: list[int]) -> str | None:
    """``check_same_or_near_tie`` for a greedy output without controls, and past a near-tie divergence
    ``check_greedy_path`` over the whole of ``got``: None if identical, the divergence's description otherwise."""
    note = check_same_or_near_tie(engine, prompt, expected, got)
    if note is not None:
        check_greedy_path(engine, prompt, got)
    return note
