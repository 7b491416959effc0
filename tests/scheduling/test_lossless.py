"""Losslessness of the early stop under sampling: a seeded Monte Carlo test on a two-token toy.

Construction (ours, in the spirit of DSpark Appendix A, whose exact numbers are not reproduced here).
Vocabulary {A, B}, one request, gamma 2, speculative sampling (accept draft x with min(1, p/q), else sample
the residual norm(max(p - q, 0)); a bonus token from p after a fully accepted prefix):

    position 1:  target p1 = (0.5, 0.5)   draft q1 = (0.8, 0.2)   acceptance 0.7, so c1 = 0.7
    position 2:  after A: p2 = (0.6, 0.4), q2 = (0.7, 0.3)  acceptance 0.9, so c2(A) = 0.9
                 after B: p2 = (0.9, 0.1), q2 = (0.0, 1.0)  acceptance 0.1, so c2(B) = 0.1

c2 is calibrated and depends on the *unverified* draft token x1 of the current round. On the step-shaped
profile T(1 token) = 1 ms, T(2) = T(3) = 1 / 0.55 ms (decreasing marginal cost):
    Theta(l=0) = 1,  Theta(l=1) = 1.7 * 0.55 = 0.935,  Theta(l=2) = (1.7 + 0.7 c2) * 0.55
which is 1.28 after x1 = A and 0.97 after x1 = B. The greedy with early stop stops at the first slot
(Theta falls) and always verifies l = 0. A policy that continues past that point and takes the argmax of
Theta over all cut points verifies both tokens only when x1 = A, i.e. decides whether to verify x1 from x1
itself: P(y1 = A) becomes 0.8 * 0.625 + 0.2 * 0.5 = 0.6 instead of 0.5.

A second, convex profile T = (1, 1, 1.1) makes the ``dspark`` lengths depend on x1 legitimately (l = 2
after A, 1 after B: slot 2 is decided from the already-verified prefix), and its output stays unbiased.
"""

from __future__ import annotations

import pytest
import torch

from app.drafters.calibration import prefix_survival
from app.scheduling.policies import ScheduleInput, make_policy
from app.scheduling.profile import ThroughputProfile
from tests.scheduling.helpers import provenance

P1 = torch.tensor([0.5, 0.5], dtype=torch.float64)
Q1 = torch.tensor([0.8, 0.2], dtype=torch.float64)
P2 = torch.tensor([[0.6, 0.4], [0.9, 0.1]], dtype=torch.float64)  # [x1, token]
Q2 = torch.tensor([[0.7, 0.3], [0.0, 1.0]], dtype=torch.float64)
C1, C2 = 0.7, torch.tensor([0.9, 0.1], dtype=torch.float64)  # calibrated: sum_x min(p, q)
SAMPLES = 400_000


def toy_profile(verify_ms: list[float]) -> ThroughputProfile:
    return ThroughputProfile(
        provenance=provenance(), batch_sizes=[1], tokens_per_request=[1, 2, 3], verify_ms=[verify_ms],
        draft_ms=[0.0], draft_gamma=2,
    )


STEP = toy_profile([1.0, 1.0 / 0.55, 1.0 / 0.55])
CONVEX = toy_profile([1.0, 1.0, 1.1])


def confidences(x1: int) -> torch.Tensor:
    return torch.tensor([[C1, float(C2[x1])]], dtype=torch.float64)  # [B=1, K=2]


def dspark_lengths(profile: ThroughputProfile) -> torch.Tensor:
    """l for x1 = A, B under the dspark policy: [2]."""
    policy, bounds = make_policy("dspark"), (torch.zeros(1, dtype=torch.long), torch.full((1,), 2))
    return torch.cat([policy(ScheduleInput(confidences(x), *bounds), profile) for x in (0, 1)])


def argmax_lengths(profile: ThroughputProfile) -> torch.Tensor:
    """l for x1 = A, B when the cut continues past the early stop to the best Theta: [2]."""
    out = []
    for x in (0, 1):
        survival = prefix_survival(confidences(x))[0]
        tau = 1.0 + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(survival, 0)])
        out.append(int(torch.argmax(tau * torch.from_numpy(profile.steps_per_second(torch.arange(1.0, 4.0), batch=1)))))
    return torch.tensor(out)


def draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One token per row of probs [n, 2]: [n] int64."""
    return (torch.rand(probs.shape[0], generator=g, dtype=torch.float64) < probs[:, 1]).long()


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    return r / r.sum(dim=-1, keepdim=True)


def output_distribution(lengths_by_x1: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Joint frequency of the first two output tokens (y1, y2) under speculative sampling: [2, 2]."""
    g = torch.Generator().manual_seed(seed)
    n = SAMPLES
    x1 = draw(Q1.expand(n, 2), g)
    x2 = draw(Q2[x1], g)
    l = lengths_by_x1[x1]
    u1, u2 = (torch.rand(n, generator=g, dtype=torch.float64) for _ in range(2))
    accept1 = (l >= 1) & (u1 < P1[x1] / Q1[x1])
    fallback1 = torch.where(l >= 1, draw(residual(P1, Q1).expand(n, 2), g), draw(P1.expand(n, 2), g))
    y1 = torch.where(accept1, x1, fallback1)
    accept2 = accept1 & (l >= 2) & (u2 < P2[x1, x2] / Q2[x1, x2].clamp(min=1e-12))
    rejected2 = accept1 & (l >= 2) & ~accept2
    plain2 = draw(P2[y1], g)  # bonus after an accepted prefix, or the next round after a rejection
    y2 = torch.where(accept2, x2, torch.where(rejected2, draw(residual(P2[x1], Q2[x1]), g), plain2))
    return torch.bincount(y1 * 2 + y2, minlength=4).double().view(2, 2) / n


TARGET = P1[:, None] * P2  # [y1, y2]
TOLERANCE = 5 * (0.25 / SAMPLES) ** 0.5  # 5 standard errors of a frequency


def test_continuing_past_the_early_stop_biases_the_output():
    lengths = argmax_lengths(STEP)
    assert lengths.tolist() == [2, 0]
    dist = output_distribution(lengths)
    assert dist[0].sum().item() == pytest.approx(0.6, abs=TOLERANCE)  # P(y1 = A) = 0.6, target 0.5


@pytest.mark.parametrize(("profile", "expected"), [(STEP, [0, 0]), (CONVEX, [2, 1])])
def test_dspark_early_stop_is_unbiased(profile, expected):
    lengths = dspark_lengths(profile)
    assert lengths.tolist() == expected
    assert (output_distribution(lengths) - TARGET).abs().max().item() < TOLERANCE
