"""The near-tie rule itself: identical outputs pass, a flipped token that the target clearly did not pick and a
length difference are reported as bugs. Uses the session-scoped ``engine`` fixture of ``tests/conftest.py``."""

from __future__ import annotations

import pytest

from app.loop import generate
from app.engine.near_tie import first_divergence
from app.engine.types import SamplingParams
from tests.engine.near_tie import check_greedy_path, check_same_or_near_tie


def test_divergences_are_judged_by_the_targets_logits(engine):
    prompt = engine.encode_chat([{"role": "user", "content": "Name three colours."}])
    (plain,), _ = generate(engine, [prompt], SamplingParams(max_tokens=12))
    ids = plain.token_ids
    assert first_divergence(engine, prompt, ids, list(ids)) is None
    flipped = ids[:5] + [0] + ids[6:]  # token 0 (a special token) is never a near-tie of the greedy choice
    divergence = first_divergence(engine, prompt, ids, flipped)
    assert divergence.index == 5 and not divergence.near_tie and divergence.gaps[0] > 1.0
    with pytest.raises(AssertionError, match="losslessness bug"):
        check_same_or_near_tie(engine, prompt, ids, flipped)
    shorter = first_divergence(engine, prompt, ids, ids[:-2])
    assert shorter.index == len(ids) - 2 and not shorter.near_tie and "stop bug" in shorter.describe()
    check_greedy_path(engine, prompt, ids)
    with pytest.raises(AssertionError, match=r"would not pick: \[\(5, 0, "):
        check_greedy_path(engine, prompt, flipped)
