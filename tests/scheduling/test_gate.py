"""The draft gate: draft only when speculation, drafter step included, beats plain decoding."""

from __future__ import annotations

import pytest
import torch

from app.scheduling.policies import best_uniform_length, make_policy
from app.scheduling.scheduler import PROBE_EVERY, PROBE_MAX, DraftGate, VerifyScheduler, position_outcomes
from tests.scheduling.helpers import make_profile

# verify cost: 40 ms + 1 ms per token; drafter 10 ms per round
PROFILE = make_profile(lambda b, n: 40.0 + n, draft=10.0)


@pytest.mark.parametrize(
    ("acceptance", "batch", "draft_ms", "want_len"),
    [
        ([0.0] * 7, 1, None, 0),  # nothing accepted: never draft
        ([1.0] * 7, 1, None, 7),  # everything accepted, cheap tokens: verify the whole block
        ([0.2] * 7, 1, None, 0),  # (1 + 0.2) / 51 < 1 / 41: the drafter step does not pay
        ([0.9] * 7, 1, None, 7),
        ([0.9] * 7, 1, 200.0, 0),  # a slow drafter (e.g. a remote call) outweighs a good draft
        ([0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0], 1, None, 2),  # stop where acceptance collapses
    ],
)
def test_best_uniform_length(acceptance, batch, draft_ms, want_len):
    length, gain = best_uniform_length(torch.tensor(acceptance), batch=batch, profile=PROFILE, draft_ms=draft_ms)
    assert length == want_len
    assert gain == pytest.approx(1.0) if want_len == 0 else gain > 1.0


def test_best_uniform_length_matches_brute_force():
    acceptance = torch.tensor([0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    for batch in (1, 2, 4, 8):
        plain = batch / (40.0 + batch)
        theta = [plain] + [
            batch * (1 + float(torch.cumprod(acceptance, 0)[:l].sum())) / (40.0 + batch * (1 + l) + 10.0)
            for l in range(1, 8)
        ]
        length, gain = best_uniform_length(acceptance, batch=batch, profile=PROFILE)
        assert length == max(range(8), key=theta.__getitem__)
        assert gain == pytest.approx(max(theta) / plain)


@pytest.mark.parametrize("bad", [torch.tensor([1.5]), torch.tensor([[0.5]]), torch.tensor([-0.1])])
def test_best_uniform_length_rejects_bad_acceptance(bad):
    with pytest.raises(ValueError, match="acceptance"):
        best_uniform_length(bad, batch=1, profile=PROFILE)


def test_position_outcomes():
    # blocks: 3 drafts 1 accepted; 2 drafts 2 accepted; 0 drafts; 4 drafts 0 accepted
    accepted, tried = position_outcomes(torch.tensor([3, 2, 0, 4]), torch.tensor([1, 2, 0, 0]), 4)
    assert accepted.tolist() == [2, 1, 0, 0]
    assert tried.tolist() == [3, 2, 0, 0]  # draft 3 of the first block follows a rejection: not tried


def test_gate_closes_on_rejections_and_probes_less_and_less_often():
    gate = DraftGate(PROFILE, gamma=7)
    assert gate.should_draft(1)  # prior 0.5: (1 + 0.5 + ...) pays for a 10 ms draft at 41 ms a token
    for _ in range(30):
        gate.observe([7, 7], [0, 0])
    assert gate.acceptance[0] < 0.1
    decisions = [gate.should_draft(2) for _ in range(PROBE_EVERY * 15 + PROBE_MAX * 3)]
    probes = [i + 1 for i, d in enumerate(decisions) if d]
    waits = [b - a for a, b in zip([0] + probes, probes)]
    assert waits[:4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    assert max(waits) == PROBE_MAX == waits[-1]


def test_gate_reopens_when_drafts_are_accepted():
    gate = DraftGate(PROFILE, gamma=7)
    for _ in range(30):
        gate.observe([7], [0])
    assert not gate.should_draft(1)
    for _ in range(30):
        gate.observe([7], [7])
    assert gate.should_draft(1)
    assert gate.acceptance.min() > 0.9


def test_only_adaptive_policies_are_gated():
    for name, gated in [("dspark", True), ("dspark-async", True), ("fixed-5", False), ("mtp1", False)]:
        scheduler = VerifyScheduler(make_policy(name), PROFILE, max_batch=8, gamma=7)
        assert (scheduler.gate is not None) == gated
        for _ in range(30):
            scheduler.observe([7], [0])
        assert scheduler.should_draft(1) != gated  # a gated scheduler stops drafting for a useless drafter
    off = VerifyScheduler(make_policy("dspark"), PROFILE, max_batch=8, gamma=7, draft_gate=False)
    assert off.gate is None and off.should_draft(1)


def test_verify_scale_makes_a_measured_draft_cost_comparable():
    """A served round costs more than the profile's verify step; the same drafter call is then cheaper
    relative to it, and a draft that did not pay at profile speed can pay at served speed."""
    weak = torch.tensor([0.2] * 7)
    assert best_uniform_length(weak, batch=1, profile=PROFILE, draft_ms=10.0)[0] == 0
    length, gain = best_uniform_length(weak, batch=1, profile=PROFILE, draft_ms=10.0, verify_scale=4.0)
    assert length > 0 and gain > 1.0
    with pytest.raises(ValueError, match="verify_scale"):
        best_uniform_length(weak, batch=1, profile=PROFILE, verify_scale=0.0)
