"""The draft gate: draft only when speculation, drafter step included, beats plain decoding."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from app.scheduling.gain import best_uniform_length
from app.scheduling.policies import make_policy
from app.scheduling.scheduler import (
    GATE_MIN_GAIN,
    GATE_PRIOR,
    PROBE_EVERY,
    PROBE_MAX,
    DraftGate,
    VerifyScheduler,
    position_outcomes,
    temperature_class,
)
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


def test_best_uniform_length_averages_per_request_survival():
    good, bad = torch.full((7,), 0.9), torch.full((7,), 0.1)
    survival = (torch.cumprod(good, 0) + torch.cumprod(bad, 0)) / 2
    theta = [2 / 42.0] + [2 * (1 + float(survival[:l].sum())) / (40.0 + 2 * (1 + l) + 10.0) for l in range(1, 8)]
    length, gain = best_uniform_length(torch.stack([good, bad]), batch=2, profile=PROFILE)
    assert length == max(range(8), key=theta.__getitem__) and gain == pytest.approx(max(theta) / theta[0])


@pytest.mark.parametrize("bad", [torch.tensor([1.5]), torch.zeros(1, 1, 1), torch.zeros(0, 7), torch.tensor([-0.1])])
def test_best_uniform_length_rejects_bad_acceptance(bad):
    with pytest.raises(ValueError, match="acceptance"):
        best_uniform_length(bad, batch=1, profile=PROFILE)


def test_position_outcomes():
    # blocks: 3 drafts 1 accepted; 2 drafts 2 accepted; 0 drafts; 4 drafts 0 accepted
    accepted, tried = position_outcomes(torch.tensor([3, 2, 0, 4]), torch.tensor([1, 2, 0, 0]), 4)
    assert accepted.shape == tried.shape == (4, 4)
    assert accepted.sum(0).tolist() == [2, 1, 0, 0]
    assert tried.sum(0).tolist() == [3, 2, 0, 0]  # draft 3 of the first block follows a rejection: not tried
    assert tried[0].tolist() == [1, 1, 0, 0] and tried[3].tolist() == [1, 0, 0, 0]


def run_gate(
    gate: DraftGate, rounds: int, *, accepted: int, draft_ms: float | None = None, request: str = "r"
) -> list[bool]:
    """Drive ``gate`` for ``rounds`` rounds of one request; each drafted round verifies 7 drafts and accepts
    ``accepted`` of them. Returns the per-round decisions."""
    decisions = []
    for _ in range(rounds):
        decisions.append(gate.should_draft([request], draft_ms=draft_ms))
        if decisions[-1]:
            gate.observe([request], [7], [accepted])
    return decisions


@pytest.mark.parametrize("draft_ms", [None, 60.0])  # 10 ms: the prior 0.5 pays; 60 ms: only good drafts pay
def test_a_closed_gate_probes_less_and_less_often(draft_ms):
    """Rejected drafts close the gate; faded counts alone do not reopen it, probes do, ever more rarely."""
    slow = best_uniform_length(torch.full((7,), 0.5), batch=1, profile=PROFILE, draft_ms=draft_ms)[1] < GATE_MIN_GAIN
    assert slow == (draft_ms is not None)
    gate = DraftGate(PROFILE, gamma=7)
    decisions = run_gate(gate, PROBE_EVERY * 15 + PROBE_MAX * 3, accepted=0, draft_ms=draft_ms)
    # trials: runs of drafted rounds, as (first, last) round; a closed gate's trial is a probe, plus at most one
    # round when the probe's outcome, weighed against counts that faded, still pays
    trials = [(-1, -1)] if slow else []
    for i, d in enumerate(decisions):
        if d and trials and trials[-1][1] == i - 1:
            trials[-1] = (trials[-1][0], i)
        elif d:
            trials.append((i, i))
    assert all(last - first <= 1 for first, last in trials[1:])
    waits = [nxt[0] - prev[1] for prev, nxt in pairwise(trials)]  # closed rounds + 1 before each trial
    assert waits[:4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    assert max(waits) == PROBE_MAX == waits[-1]
    assert sum(decisions) < 0.05 * len(decisions)  # each drafted round here wastes drafter + 7 tokens


def test_gate_reopens_at_the_first_good_probe_after_a_long_closed_stretch():
    """Within a request acceptance changes (prose, then code): the counts fade while the gate is closed, so
    after a long closed stretch the first probe whose drafts are accepted reopens it."""
    gate = DraftGate(PROFILE, gamma=7)
    run_gate(gate, 300, accepted=0, draft_ms=30.0)  # probes only: the prior barely pays at 30 ms
    decisions = run_gate(gate, 100, accepted=7, draft_ms=30.0)
    first = decisions.index(True)
    assert first <= PROBE_MAX
    assert all(decisions[first:])


def test_a_new_request_starts_from_the_prior_and_a_finished_one_is_forgotten():
    """One chat answer the drafter cannot predict must not close the gate for the requests after it."""
    gate = DraftGate(PROFILE, gamma=7)
    decisions = run_gate(gate, 300, accepted=0, request="chat")  # closed: one trial per PROBE_MAX rounds
    assert sum(decisions[-PROBE_MAX:]) <= 2
    assert gate.should_draft(["math"])  # at once: prior 0.5 pays for a 10 ms drafter at batch 1
    assert gate.acceptance("chat").tolist() == [0.5] * 7  # dropped when it left the batch
    for _ in range(30):
        gate.observe(["math", "chat"], [7, 7], [7, 0])
    assert gate.acceptance("math").min() > 0.9 and gate.acceptance("chat")[0] < 0.1
    assert gate.should_draft(["math", "chat"])  # the batch's mean expected tokens still pay


def test_a_request_joining_a_closed_gate_restarts_the_probe_back_off():
    gate = DraftGate(PROFILE, gamma=7)
    run_gate(gate, 300, accepted=0, request="a", draft_ms=60.0)
    decisions = [gate.should_draft(["a", "b"], draft_ms=60.0) for _ in range(PROBE_EVERY)]
    assert any(decisions)  # a probe within PROBE_EVERY rounds, not PROBE_MAX


def test_joins_of_a_known_temperature_class_keep_the_probe_back_off():
    """Under steady traffic a request joins every few rounds; one of a class whose requests accept nothing starts
    from that class's outcomes and must not bring a probe (a drafter catch-up) each time. A request of a class the
    gate has not seen yet still restarts the back-off."""
    gate = DraftGate(PROFILE, gamma=7)
    batch, next_id, decisions = ["r0", "r1"], 2, []
    for i in range(PROBE_EVERY * 15 + PROBE_MAX * 6):
        if i % 10 == 9:  # the oldest request finishes, a new one of the same class joins
            batch, next_id = batch[1:] + [f"r{next_id}"], next_id + 1
        decisions.append(gate.should_draft(batch, draft_ms=60.0, temperatures=[0.7] * len(batch)))
        if decisions[-1]:
            gate.observe(batch, [7] * len(batch), [0] * len(batch))
    assert sum(decisions[-PROBE_MAX * 4:]) <= 5  # probes PROBE_MAX rounds apart, not one per join
    greedy = [gate.should_draft(batch + ["g"], draft_ms=60.0, temperatures=[0.7] * len(batch) + [0.0])
              for _ in range(PROBE_EVERY)]
    assert any(greedy)  # no greedy outcome yet: a probe within PROBE_EVERY rounds


def test_gate_rejects_duplicate_ids_and_impossible_outcomes():
    gate = DraftGate(PROFILE, gamma=7)
    with pytest.raises(ValueError, match="distinct"):
        gate.should_draft(["a", "a"])
    with pytest.raises(ValueError, match="distinct"):
        gate.observe(["a", "a"], [7, 7], [1, 1])
    for num_draft, num_accepted in [([2], [5]), ([8], [0]), ([3], [-1])]:
        with pytest.raises(ValueError, match="num_accepted <= num_draft"):
            gate.observe(["a"], num_draft, num_accepted)
    with pytest.raises(ValueError, match="integers"):
        gate.observe(["a"], [2.9], [1.0])
    with pytest.raises(ValueError, match="gamma"):
        DraftGate(PROFILE, gamma=0)
    for kwargs in [{"draft_ms": -100.0}, {"draft_ms": float("nan")}, {"verify_scale": float("inf")}]:
        with pytest.raises(ValueError, match="finite"):
            gate.should_draft(["a"], **kwargs)


def test_outcomes_without_drafts_are_no_evidence():
    """A request that verified no drafts must neither age its counts nor count as a fresh probe outcome."""
    gate = DraftGate(PROFILE, gamma=7)
    run_gate(gate, 300, accepted=0, draft_ms=60.0)
    before = gate.acceptance("r").clone()
    decisions = []
    for _ in range(40):
        decisions.append(gate.should_draft(["r"], draft_ms=60.0))
        gate.observe(["r"], [0], [0])
    assert sum(decisions) <= 1  # probes PROBE_MAX rounds apart, as without the empty reports
    assert gate.acceptance("r")[0] <= before[0] + 0.1


def test_gate_rejects_mismatched_outcomes():
    with pytest.raises(ValueError, match="one outcome per request"):
        DraftGate(PROFILE, gamma=7).observe(["a", "b"], [7], [0])


@pytest.mark.parametrize("kwargs", [{"decay": 0.0}, {"idle_decay": 1.5}, {"probe_every": 0}, {"probe_every": 65}])
def test_gate_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="decay"):
        DraftGate(PROFILE, gamma=7, **kwargs)


def test_gate_reopens_when_drafts_are_accepted():
    gate = DraftGate(PROFILE, gamma=7)
    for _ in range(30):
        gate.observe(["r"], [7], [0])
    assert not gate.should_draft(["r"])
    for _ in range(30):
        gate.observe(["r"], [7], [7])
    assert gate.should_draft(["r"])
    assert gate.acceptance("r").min() > 0.9


def test_only_adaptive_policies_are_gated():
    for name, gated in [("dspark", True), ("dspark-async", True), ("fixed-5", False), ("mtp1", False)]:
        scheduler = VerifyScheduler(make_policy(name), PROFILE, max_batch=8, gamma=7)
        assert (scheduler.gate is not None) == gated
        for _ in range(30):
            scheduler.observe(["r"], [7], [0])
        assert scheduler.should_draft(["r"]) != gated  # a gated scheduler stops drafting for a useless drafter
    off = VerifyScheduler(make_policy("dspark"), PROFILE, max_batch=8, gamma=7, draft_gate=False)
    assert off.gate is None and off.should_draft(["r"])


def test_verify_scale_makes_a_measured_draft_cost_comparable():
    """A served round costs more than the profile's verify step; the same drafter call is then cheaper
    relative to it, and a draft that did not pay at profile speed can pay at served speed."""
    weak = torch.tensor([0.2] * 7)
    assert best_uniform_length(weak, batch=1, profile=PROFILE, draft_ms=10.0)[0] == 0
    length, gain = best_uniform_length(weak, batch=1, profile=PROFILE, draft_ms=10.0, verify_scale=4.0)
    assert length > 0 and gain > 1.0
    with pytest.raises(ValueError, match="verify_scale"):
        best_uniform_length(weak, batch=1, profile=PROFILE, verify_scale=0.0)


def test_a_new_request_starts_from_the_acceptance_of_its_temperature_class():
    """Sampled requests that accept nothing teach the T = 0.7 class; a new T = 0.7 request starts from that, a new
    greedy one from the prior (no greedy outcome yet), and a gate told no temperatures keeps the prior for all."""
    gate = DraftGate(PROFILE, gamma=7)
    for _ in range(5):
        gate.should_draft(["a", "b"], temperatures=[0.7, 0.7])
        gate.observe(["a", "b"], [7, 7], [0, 0])
    gate.should_draft(["a", "b", "c", "g"], temperatures=[0.7, 0.7, 0.7, 0.0])
    prior = GATE_PRIOR[0] / GATE_PRIOR[1]
    assert float(gate.acceptance("c")[0]) < 0.2 * prior  # (0 + 0.5) / (~9.6 decayed tries + 1)
    assert torch.allclose(gate.acceptance("g"), torch.full((7,), prior, dtype=torch.float64))
    plain = DraftGate(PROFILE, gamma=7)
    for _ in range(5):
        plain.should_draft(["a", "b"])
        plain.observe(["a", "b"], [7, 7], [0, 0])
    plain.should_draft(["a", "b", "c"])
    assert torch.allclose(plain.acceptance("c"), torch.full((7,), prior, dtype=torch.float64))
    with pytest.raises(ValueError, match="one temperature per request"):
        gate.should_draft(["a"], temperatures=[0.7, 1.0])


def test_temperature_classes():
    assert [temperature_class(t) for t in (0.0, 0.7, 0.71, 1.0)] == ["greedy", "T0.7", "T0.7", "T1.0"]


def test_sampled_requests_are_priced_from_the_sampled_table():
    """The same acceptance pays for a drafter call when the batch's rows are greedy and not when they sample on a
    profile whose sampled rows cost forty times as much; the flags must be one per request."""
    profile = make_profile(lambda b, n: 40.0 + n, sampled=lambda b, n: 40.0 * n, draft=10.0)
    for sampled, expected in (([False, False], True), ([True, True], False)):
        gate = DraftGate(profile, gamma=7)
        for _ in range(10):
            gate.observe(["a", "b"], [7, 7], [1, 1])
        assert gate.should_draft(["a", "b"], sampled=sampled) is expected
    with pytest.raises(ValueError, match="one sampled flag per request"):
        DraftGate(profile, gamma=7).should_draft(["a", "b"], sampled=[True])
