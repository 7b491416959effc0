"""What drafting can gain before any draft exists: the best equal verify length for a batch under a throughput
profile, and the speed-up it expects over plain decoding.

Owns :func:`best_uniform_length`, read by the draft gate (``scheduler.DraftGate``) and the Router's verification
capacity (``app.serving.router``). numpy only, no torch: the Router and the HTTP ingress (which holds the Router's
request router) import it, and their processes never load torch.

Shape symbols: R requests, K gamma (draft block size).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from app.scheduling.profile import ThroughputProfile


def best_uniform_length(
    acceptance: ArrayLike,
    *,
    batch: int,
    profile: ThroughputProfile,
    draft_ms: float | None = None,
    verify_scale: float = 1.0,
    sampled: float = 0.0,
) -> tuple[int, float]:
    """The verify length l* that maximises expected tokens/s when each of B requests verifies l drafts.

    Used *before* drafting (whether a round should draft at all, and the Router's capacity): the drafter's
    step is paid whatever lengths are verified, so speculation must beat plain decoding including it.
    With a_j = prod_{i <= j} acceptance_i (prefix survival), Theta(l) = B (1 + sum_{j <= l} a_j) /
    (verify_ms(B (1 + l)) + draft_ms) and Theta(0) = B / verify_ms(B) (no draft step); DSpark Sec. 3
    (Theta = tau * SPS) restricted to equal lengths, which the per-slot Theta-greedy can only improve on when
    confidences differ. Given one acceptance row per request, a_j is their mean (the expected accepted tokens of
    an average request).

    Args:
        acceptance: [K] or [R, K] float (a numpy array or a CPU torch tensor), per-position conditional acceptance
            P(draft j accepted | drafts < j accepted), for every request alike or per request.
        batch: B >= 1 requests (clamped to the profile's largest batch).
        draft_ms: drafter time per round (ms); None takes the profile's ``draft_time_ms(B)``.
        verify_scale: measured / profiled verify time on this replica (> 0): a served step also pays the
            serving loop, so measured drafter times are only comparable with verify times scaled alike.
        sampled: the fraction of the requests that sample (their rows priced as sampled, ``ThroughputProfile``).
    Returns:
        (l*, Theta(l*) / Theta(0)): l* in [0, K] (0: do not draft), the expected speed-up over plain decoding.
    Raises:
        ValueError: ``batch`` < 1, ``verify_scale`` not finite and > 0, ``draft_ms`` not finite and >= 0,
            ``sampled`` outside [0, 1], or acceptance not a [K] or [R >= 1, K] array (K >= 1) in [0, 1].
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not 0 < verify_scale < math.inf:
        raise ValueError(f"verify_scale must be finite and > 0, got {verify_scale}")
    if draft_ms is not None and not 0 <= draft_ms < math.inf:
        raise ValueError(f"draft_ms must be finite and >= 0, got {draft_ms}")
    acceptance = np.asarray(acceptance, dtype=np.float64)
    if acceptance.ndim not in (1, 2) or acceptance.size == 0 or not ((acceptance >= 0) & (acceptance <= 1)).all():
        raise ValueError(f"acceptance must be a [K] or [R, K] array in [0, 1], got {acceptance.tolist()}")
    b = min(batch, profile.max_batch_size)
    gamma = min(acceptance.shape[-1], profile.max_verify_len)
    survival = np.cumprod(acceptance[..., :gamma], axis=-1)
    if survival.ndim == 2:
        survival = survival.mean(0)
    tau = np.concatenate([[1.0], 1.0 + np.cumsum(survival)])  # [K + 1]
    ms = verify_scale * profile.verify_time_ms(b * np.arange(1, gamma + 2), batch=b, sampled=sampled)
    ms[1:] += profile.draft_time_ms(b) if draft_ms is None else draft_ms
    theta = tau / ms
    best = int(np.argmax(theta))
    return best, float(theta[best] / theta[0])
