"""The near-tie rule itself: identical outputs pass, a flipped token that the target clearly did not pick and a
length difference are reported as bugs. Uses the session-scoped ``engine`` fixture of ``tests/conftest.py``."""

from __future__ import annotations

import math

import pytest
import torch

import app.engine.near_tie as near_tie
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


def test_seeded_divergences_are_judged_by_coupled_scores_within_the_nucleus(engine, monkeypatch):
    """Seeded sampling: gaps on logits / T + noise. An edge token of the top_p nucleus (in it by less than NUCLEUS_EPS
    of mass) is no rival of the other run's token, however high its score (that run may have left it out), and one run
    may pick it if it beats what every run keeps; a token in the nucleus well below the best, or one outside it, is a
    bug. Four-token vocabulary, top_p 0.9: probabilities 0.6, 0.295, 0.1 (the edge token), 0.005."""
    logits = torch.tensor([0.6, 0.295, 0.1, 0.005]).log()
    noise = torch.tensor([0.0, math.log(0.6 / 0.295) - 0.1, 3.0, 0.0])  # scores: a, a - 0.1, a + 1.21, low
    monkeypatch.setattr(near_tie, "processed_logits", lambda *args: logits)
    monkeypatch.setattr(near_tie, "gumbel_noise", lambda seed, positions, vocab: noise[None])
    params = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=1)
    tie = first_divergence(engine, [1, 2], [0], [1], params)
    assert tie.near_tie and tie.gaps[1] == pytest.approx(0.1, abs=1e-5)
    edge = first_divergence(engine, [1, 2], [2], [0], params)  # one run kept the edge token and picked it
    assert edge.near_tie and edge.gaps == {2: 0.0, 0: 0.0}
    noise[2] = -1.0  # the edge token now 1.79 + 1 below the first: no run picks it
    assert not first_divergence(engine, [1, 2], [2], [0], params).near_tie
    noise[1] -= 1.0  # the second token now 1.1 below the first
    assert not first_divergence(engine, [1, 2], [0], [1], params).near_tie
    outside = first_divergence(engine, [1, 2], [0], [3], params)  # token 3 is outside any nucleus near 0.9
    assert not outside.near_tie and outside.gaps[3] == math.inf


def test_without_a_top_p_cut_every_token_is_a_rival_and_a_nucleus_keeps_tokens_in_order(engine, monkeypatch):
    """top_p 1 keeps every token: one in the last percent of mass that has the best score is what both runs must pick.
    Two edge tokens of a top_p 0.995 nucleus: a run that kept the less probable one kept the more probable one too."""
    logits = torch.tensor([0.6, 0.29, 0.103, 0.005, 0.002]).log()
    noise = torch.tensor([0.0, 0.0, 0.0, 7.0, 8.0])  # scores: token 4 best (a + 2.30), token 3 next (a + 2.21)
    monkeypatch.setattr(near_tie, "processed_logits", lambda *args: logits)
    monkeypatch.setattr(near_tie, "gumbel_noise", lambda seed, positions, vocab: noise[None])
    whole = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    assert not first_divergence(engine, [1, 2], [4], [0], whole).near_tie
    cut = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.995, seed=1)  # tokens 3 and 4 at its edge
    assert first_divergence(engine, [1, 2], [4], [3], cut).near_tie  # the run that picked 3 may have left 4 out
    noise[3] = 10.0  # token 3 now best: a run that kept 4 kept 3 and must have picked it
    assert not first_divergence(engine, [1, 2], [3], [4], cut).near_tie
    tiny = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.005, seed=1)  # narrowed by less than NUCLEUS_EPS
    assert not first_divergence(engine, [1, 2], [0], [1], tiny).near_tie
