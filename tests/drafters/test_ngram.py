"""Prompt-lookup n-gram drafter: suffix matching rules and the Proposer hooks (no model)."""

from __future__ import annotations

import random

import pytest
import torch

from app.drafters.ngram import NGRAM_CONFIDENCE, NgramProposer, lookup
from app.engine.types import StepOutput


@pytest.mark.parametrize(
    ("history", "kwargs", "expected"),
    [
        ([1, 2, 3, 9, 1, 2, 3], dict(max_ngram=3, gamma=4), ([9, 1, 2, 3], 3)),
        ([5, 6, 7], dict(max_ngram=3, gamma=4), ([], 0)),
        ([4, 8, 4], dict(max_ngram=2, gamma=2), ([8, 4], 1)),
        ([4, 8, 4], dict(max_ngram=4, min_ngram=2, gamma=2), ([], 0)),  # unigram matches are off below min 2
        # the longest suffix wins over a more recent shorter one: "2 3" recurs at 5, "1 2 3" only at 0
        ([1, 2, 3, 7, 8, 2, 3, 6, 1, 2, 3], dict(max_ngram=4, min_ngram=2, gamma=3), ([7, 8, 2], 3)),
        # among equal lengths the most recent earlier occurrence wins
        ([1, 2, 5, 1, 2, 6, 1, 2], dict(max_ngram=2, min_ngram=2, gamma=1), ([6], 2)),
        # fewer than gamma tokens follow the match: propose what there is, or continue the period
        ([3, 4, 3, 4], dict(max_ngram=2, min_ngram=2, gamma=5), ([3, 4], 2)),
        ([3, 4, 3, 4], dict(max_ngram=2, min_ngram=2, gamma=5, periodic=True), ([3, 4, 3, 4, 3], 2)),
        ([7, 7], dict(max_ngram=3, gamma=3, periodic=True), ([7, 7, 7], 1)),
    ],
)
def test_lookup(history, kwargs, expected):
    assert lookup(history, **kwargs) == expected


def brute_force_lookup(history, *, max_ngram, gamma, min_ngram):
    """The definition, slice by slice: longest suffix n first, then its latest earlier occurrence."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == history[-n:]:
                return history[start + n : start + n + gamma], n
    return [], 0


def test_lookup_matches_its_definition_on_random_histories():
    rng = random.Random(0)
    for _ in range(3000):
        history = [rng.randrange(3) for _ in range(rng.randrange(0, 25))]
        hi = rng.randrange(1, 6)
        kwargs = {"max_ngram": hi, "min_ngram": rng.randrange(1, hi + 1), "gamma": rng.randrange(1, 8)}
        assert lookup(history, **kwargs) == brute_force_lookup(history, **kwargs), (history, kwargs)


def test_bad_ngram_bounds_are_rejected():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(gamma=4, max_ngram=2, min_ngram=3)


def test_proposer_tracks_history_and_reports_confidences():
    p = NgramProposer(gamma=3, max_ngram=4, min_ngram=2)
    p.start("a", [10, 11, 12, 13, 10], StepOutput("a", [11]))  # history ... 10 11 -> 12 13 10
    p.start("b", [1, 2, 3], StepOutput("b", [4]))  # no repeat
    blocks = p.propose(["a", "b"])
    assert blocks[0].tokens.tolist() == [12, 13, 10] and blocks[0].probs is None
    assert blocks[1].tokens.numel() == 0
    conf = p.last_proposal.confidences
    assert conf.shape == (2, 3)
    assert torch.allclose(conf[0], torch.full((3,), NGRAM_CONFIDENCE ** 0.5)) and (conf[1] == 0).all()
    p.update([StepOutput("b", [1, 2])])  # history 1 2 3 4 1 2 -> "1 2" matched, followed by 3 4 1
    assert p.propose(["b"])[0].tokens.tolist() == [3, 4, 1]
    p.finish("a")
    with pytest.raises(KeyError):
        p.propose(["a"])
