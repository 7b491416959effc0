"""The stateful verify scheduler: a policy, a profile and (for dspark-async) the stale capacity.

This module owns the state carried across rounds; every decision is made by the pure functions of
:mod:`app.scheduling.policies` and :func:`update_capacity` (the vLLM pattern: a pure decision function,
a thin class holding state). It does not draft, verify or sample.

Shape symbols: B batch, K gamma.

Stale capacity (DSpark Sec. 3.3). The production variant cuts the batch at a capacity chosen from an
earlier round's confidences, so the cut carries no information about this round's draft tokens. Here the
capacity is tracked per request (slots beyond ``min_len`` per request in the batch), smoothed with an
EMA and held unless the EMA moves by more than a hysteresis band, then scaled by the current batch size
(requests join and leave between rounds). The first round has no earlier information and runs ``dspark``
(itself lossless).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from app.scheduling.policies import ScheduleInput, VerifyPolicy, prefix_survival, theta_greedy_lengths
from app.scheduling.profile import ThroughputProfile

EMA_SMOOTHING = 0.5  # weight of the newest observation in the capacity EMA (1.0: no smoothing)
HYSTERESIS = 0.25  # slots per request the EMA must move before the capacity in use changes


def update_capacity(
    *, ema: float | None, held: float | None, observed: float, smoothing: float, hysteresis: float
) -> tuple[float, float]:
    """One step of the capacity EMA with hysteresis (pure).

    Args:
        ema: previous EMA of slots per request (None before the first observation).
        held: capacity per request currently in use (None before the first observation).
        observed: slots per request the Theta-greedy admitted on the newest confidences.
        smoothing: weight of ``observed`` in the EMA, in (0, 1].
        hysteresis: the held value changes only when ``|ema - held| > hysteresis`` (slots per request).
    Returns:
        (new_ema, new_held) in slots per request.
    """
    new_ema = observed if ema is None else smoothing * observed + (1.0 - smoothing) * ema
    if held is None or abs(new_ema - held) > hysteresis:
        return new_ema, new_ema
    return new_ema, held


class VerifyScheduler:
    """Decides verify lengths round after round for one target replica.

    Args:
        policy: from :func:`~app.scheduling.policies.make_policy`.
        profile: the replica's throughput profile (checked to cover ``max_batch`` and ``gamma``).
        max_batch, gamma: the largest batch and block size the replica will schedule.
        smoothing, hysteresis: capacity EMA settings (dspark-async only).
    Raises:
        ProfileRangeError: the profile does not cover ``max_batch`` x ``gamma``.
        ValueError: ``smoothing`` not in (0, 1] or ``hysteresis`` < 0.
    """

    def __init__(
        self,
        policy: VerifyPolicy,
        profile: ThroughputProfile,
        *,
        max_batch: int,
        gamma: int,
        smoothing: float = EMA_SMOOTHING,
        hysteresis: float = HYSTERESIS,
    ) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if hysteresis < 0.0:
            raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")
        profile.ensure_covers(max_batch=max_batch, gamma=gamma)
        self.policy = policy
        self.profile = profile
        self.smoothing = smoothing
        self.hysteresis = hysteresis
        self._ema: float | None = None
        self._held: float | None = None

    @property
    def capacity_per_request(self) -> float | None:
        """Capacity in use, slots per request (dspark-async; None before the first round)."""
        return self._held

    def schedule(self, *, confidences: torch.Tensor, min_len: torch.Tensor, max_len: torch.Tensor) -> torch.Tensor:
        """Verify lengths for this round.

        Args:
            confidences: c [B, K] in [0, 1]; min_len, max_len: [B] int64 (max capped by max_tokens left).
        Returns:
            l: [B] int64.
        Raises:
            ValueError: invalid inputs (see :class:`ScheduleInput`).
        """
        inputs = ScheduleInput(confidences, min_len, max_len)
        if not self.policy.needs_capacity:
            return self.policy(inputs, self.profile)
        survival = prefix_survival(confidences)
        greedy = theta_greedy_lengths(survival, min_len=min_len, max_len=max_len, profile=self.profile)
        if self._held is None:
            lengths = greedy
        else:
            capacity = round(self._held * inputs.batch)
            lengths = self.policy(replace(inputs, capacity=capacity), self.profile)
        # Off the critical path in a real engine: the greedy on this round's confidences sets the next cut.
        observed = float((greedy - min_len).sum()) / max(inputs.batch, 1)
        self._ema, self._held = update_capacity(
            ema=self._ema, held=self._held, observed=observed, smoothing=self.smoothing, hysteresis=self.hysteresis
        )
        return lengths
