"""Verification policies: how many draft tokens of each request the target verifies this round.

This module owns the pure, vectorised decision functions and the policy objects that wrap them. It holds no
state across rounds (the stale capacity of ``dspark-async`` is kept by :mod:`app.scheduling.scheduler`) and
does no I/O; step costs come from a :class:`~app.scheduling.profile.ThroughputProfile`.

Shape symbols: B batch (requests in the round), K gamma (draft block size), N total tokens of the verify
step, ``N = sum_r (1 + l_r)``, M eligible slots (``sum_r (max_r - min_r)``).

Definitions (DSpark, arXiv 2607.05147, Sec. 3):
    c_{r,j}   calibrated confidence: P(draft token j of request r is accepted | tokens < j accepted).
    a_{r,j}   prefix survival, a_{r,j} = c_{r,1} * ... * c_{r,j}; non-increasing in j.
    l_r       verify length of request r, min_r <= l_r <= max_r <= K.
    tau       expected committed tokens, tau = sum_r (1 + sum_{j <= l_r} a_{r,j}).
    Theta     expected tokens per second, Theta = tau * SPS(N), SPS from the profile: the verify step of the round's
              B requests (its sampled rows priced as sampled, ``ThroughputProfile`` "Sampled rows") plus the
              drafter step when the round called the drafter.

Policies:
    none           l = 0, plain decoding (the round does not draft).
    mtp1           l = 1.
    fixed-k        l = k.
    threshold-t    l_r = #{j : a_{r,j} >= t}.
    dspark         Theta-greedy with early stop (Sec. 3, Alg. 1): slots in descending a, admit while Theta
                   grows, stop at the first slot that does not grow it.
    dspark-async   top-``capacity`` slots of the current a, capacity fixed from an earlier round (Sec. 3.3).
Every policy clamps to ``[min_r, max_r]``; a request's remaining ``max_tokens`` is expected in ``max_r``.

Losslessness: a slot's inclusion may depend on the request's confidences at or before that slot and on
other requests, never on its deeper slots (those depend on the unverified draft token itself). The early
stop and the stale capacity both respect this; taking the argmax of Theta over all cut points does not
(Appendix A; see ``tests/scheduling/test_lossless.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch

from app.drafters.calibration import prefix_survival
from app.scheduling.profile import ThroughputProfile


@dataclass(frozen=True)
class ScheduleInput:
    """One round's scheduling problem.

    Raises:
        ValueError: on a wrong shape, dtype, a confidence outside [0, 1] or lengths outside 0 <= min <= max <= K.
    """

    confidences: torch.Tensor  # [B, K] float, c_{r,j} in [0, 1]
    min_len: torch.Tensor  # [B] int64, smallest allowed l_r
    max_len: torch.Tensor  # [B] int64, largest allowed l_r (already capped by max_tokens left)
    capacity: int | None = None  # slots beyond min_len; dspark-async only, from an earlier round
    sampled: torch.Tensor | None = None  # [B] bool, requests whose rows are sampled (None: all greedy)
    with_draft: bool = True  # whether the round called the drafter (its step is part of the round's time)

    def __post_init__(self) -> None:
        c = self.confidences
        if c.dim() != 2 or not c.is_floating_point():
            raise ValueError(f"confidences must be a float [B, K] tensor, got {c.dtype} {tuple(c.shape)}")
        batch, gamma = c.shape
        for name, t in (("min_len", self.min_len), ("max_len", self.max_len)):
            if t.shape != (batch,) or t.is_floating_point():
                raise ValueError(f"{name} must be an integer [B={batch}] tensor, got {t.dtype} {tuple(t.shape)}")
        if self.sampled is not None and (self.sampled.shape != (batch,) or self.sampled.dtype != torch.bool):
            raise ValueError(f"sampled must be a bool [B={batch}] tensor, got {self.sampled.dtype} "
                             f"{tuple(self.sampled.shape)}")
        if batch == 0:
            return
        if not bool(((c >= 0) & (c <= 1)).all()):
            raise ValueError(f"confidences must lie in [0, 1], got min {c.min().item()} max {c.max().item()}")
        if not bool(((self.min_len >= 0) & (self.min_len <= self.max_len) & (self.max_len <= gamma)).all()):
            raise ValueError(
                f"need 0 <= min_len <= max_len <= K={gamma}, got min_len {self.min_len.tolist()} "
                f"max_len {self.max_len.tolist()}"
            )
        if self.capacity is not None and self.capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {self.capacity}")

    @property
    def batch(self) -> int:
        return self.confidences.shape[0]

    @property
    def gamma(self) -> int:
        return self.confidences.shape[1]

    @classmethod
    def make_dummy(cls, *, batch: int = 4, gamma: int = 7, seed: int = 0) -> ScheduleInput:
        """Random confidences, min 0, max gamma: for tests and warm-up."""
        g = torch.Generator().manual_seed(seed)
        return cls(
            confidences=torch.rand(batch, gamma, generator=g),
            min_len=torch.zeros(batch, dtype=torch.long),
            max_len=torch.full((batch,), gamma, dtype=torch.long),
        )


def fixed_lengths(k: int, *, min_len: torch.Tensor, max_len: torch.Tensor) -> torch.Tensor:
    """l_r = clamp(k, min_r, max_r): [B] int64."""
    return torch.minimum(torch.clamp(min_len, min=k), max_len)


def threshold_lengths(
    survival: torch.Tensor, threshold: float, *, min_len: torch.Tensor, max_len: torch.Tensor
) -> torch.Tensor:
    """l_r = #{j : a_{r,j} >= threshold}, clamped to [min_r, max_r]; a non-increasing makes it a prefix.

    Args:
        survival: a [B, K]. Returns: [B] int64.
    """
    counts = (survival >= threshold).sum(dim=1)
    return torch.minimum(torch.maximum(counts, min_len), max_len)


def _sorted_slots(
    survival: torch.Tensor, min_len: torch.Tensor, max_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forced-slot mask and the eligible slots sorted by a descending.

    Slot (r, j) (1-indexed j) is forced when j <= min_r and eligible when min_r < j <= max_r. The stable sort
    over the row-major flattening puts (r, j) before (r, j+1) on ties, so every prefix of the order is
    prefix-closed per request.

    Returns:
        forced: [B, K] bool; order: [M] flat indices r * K + (j - 1); values: [M] float64 a of those slots.
    """
    gamma = survival.shape[1]
    j = torch.arange(1, gamma + 1)
    forced = j <= min_len[:, None]
    eligible = (j > min_len[:, None]) & (j <= max_len[:, None])
    masked = torch.where(eligible, survival.double(), -1.0).flatten()
    values, order = torch.sort(masked, descending=True, stable=True)
    m = int(eligible.sum())
    return forced, order[:m], values[:m]


def _lengths_from_slots(order: torch.Tensor, *, min_len: torch.Tensor, gamma: int) -> torch.Tensor:
    """min_r plus the number of admitted slots of request r: [B] int64."""
    return min_len + torch.bincount(order // gamma, minlength=min_len.numel())


def theta_greedy_lengths(
    survival: torch.Tensor, *, min_len: torch.Tensor, max_len: torch.Tensor, profile: ThroughputProfile,
    sampled: torch.Tensor | None = None, with_draft: bool = True,
) -> torch.Tensor:
    """DSpark's Theta-greedy with early stop (Sec. 3, Alg. 1), vectorised over all slots.

    Admits eligible slots in descending a_{r,j}; after admitting the i-th slot, tau_i = tau_0 + sum of the
    admitted a and N_i = N_0 + i, and Theta_i = tau_i * SPS(N_i) with SPS at B requests (the drafter step included
    when ``with_draft``).
    Admission stops before the first i with Theta_i <= Theta_{i-1}. Exact (equal to brute force over all l
    vectors) when the profile's marginal cost per token does not decrease in N.

    On a padded profile (``profile.padded``: the engine pads every run to the step's longest) a step costs what its
    longest run costs, so N_i = B (1 + the longest l after i slots) (``ThroughputProfile.step_tokens``): slots no
    deeper than the longest run so far come free, and a slot that starts a deeper token bucket pays that bucket's
    whole step. The early stop can then halt at a bucket edge that later slots would have paid for; stopping
    there keeps the rule lossless (no slot's inclusion looks at deeper slots of its own request).

    Sampled rows cost more than greedy ones (``ThroughputProfile`` "Sampled rows"): after i slots the step's sampled
    fraction is (sampled rows) / N_i, so a slot of a sampled request costs more than one of a greedy request (the
    slot order stays by a).

    Args:
        survival: a [B, K]; min_len, max_len: [B] int64.
        sampled: [B] bool, the sampled requests (None: all greedy).
        with_draft: whether the round called the drafter (its step time is part of the round's).
    Returns:
        l: [B] int64.
    Raises:
        ProfileRangeError: the profile grid does not cover B requests or the tokens per request tried.
    """
    batch, gamma = survival.shape
    forced, order, values = _sorted_slots(survival, min_len, max_len)
    if order.numel() == 0:
        return min_len.clone()
    tau0 = batch + float((survival.double() * forced).sum())
    n0 = batch + int(min_len.sum())
    tau = torch.cat([torch.tensor([tau0], dtype=torch.float64), tau0 + torch.cumsum(values, dim=0)])
    is_sampled = torch.zeros(batch, dtype=torch.bool) if sampled is None else sampled
    if profile.padded:  # N_i = B (1 + longest run after i slots); slot (r, j) at flat index r * K + j - 1
        floor = int(min_len.max())
        longest = torch.cummax(order % gamma + 1, dim=0).values.clamp(min=floor)
        tokens = batch * (1.0 + torch.cat([torch.tensor([floor]), longest]).double())
        fraction = torch.full_like(tokens, float(is_sampled.sum()) / batch)  # every run is padded alike
    else:
        tokens = torch.arange(n0, n0 + values.numel() + 1, dtype=torch.float64)
        rows0 = float(((1 + min_len) * is_sampled).sum())
        sampled_rows = rows0 + torch.cat([torch.zeros(1), torch.cumsum(is_sampled[order // gamma].double(), 0)])
        fraction = sampled_rows / tokens
    sps = profile.steps_per_second(tokens, batch=batch, with_draft=with_draft, sampled=fraction.numpy())
    theta = tau * torch.from_numpy(sps)
    admitted = int(torch.cumprod((theta[1:] > theta[:-1]).long(), dim=0).sum())
    return _lengths_from_slots(order[:admitted], min_len=min_len, gamma=gamma)


def top_capacity_lengths(
    survival: torch.Tensor, capacity: int, *, min_len: torch.Tensor, max_len: torch.Tensor
) -> torch.Tensor:
    """The ``capacity`` eligible slots with the largest a_{r,j}, without an early stop (DSpark Sec. 3.3).

    Lossless only when ``capacity`` does not depend on this round's draft tokens (it comes from an earlier
    round). Returns: l [B] int64.
    """
    _, order, _ = _sorted_slots(survival, min_len, max_len)
    return _lengths_from_slots(order[:capacity], min_len=min_len, gamma=survival.shape[1])


class VerifyPolicy(Protocol):
    """One interface for every policy: ``policy(inputs, profile) -> l [B] int64``."""

    name: str

    @property
    def speculates(self) -> bool:
        """Whether rounds under this policy run the drafter (and pay its step time)."""

    @property
    def needs_capacity(self) -> bool:
        """Whether ``inputs.capacity`` must be set (stale capacity from an earlier round)."""

    @property
    def adaptive(self) -> bool:
        """Whether the policy adapts to cost (dspark family): only these rounds may skip drafting (draft gate)."""

    def __call__(self, inputs: ScheduleInput, profile: ThroughputProfile) -> torch.Tensor: ...


@dataclass(frozen=True)
class FixedLength:
    """none (k = 0), mtp1 (k = 1) and fixed-k: l_r = clamp(k, min_r, max_r)."""

    name: str
    k: int
    needs_capacity = False
    adaptive = False

    @property
    def speculates(self) -> bool:
        return self.k > 0

    def __call__(self, inputs: ScheduleInput, profile: ThroughputProfile) -> torch.Tensor:
        return fixed_lengths(self.k, min_len=inputs.min_len, max_len=inputs.max_len)


@dataclass(frozen=True)
class Threshold:
    """threshold-t: verify while a_{r,j} >= t."""

    name: str
    threshold: float
    speculates = True
    needs_capacity = False
    adaptive = False

    def __call__(self, inputs: ScheduleInput, profile: ThroughputProfile) -> torch.Tensor:
        survival = prefix_survival(inputs.confidences)
        return threshold_lengths(survival, self.threshold, min_len=inputs.min_len, max_len=inputs.max_len)


@dataclass(frozen=True)
class ThetaGreedy:
    """dspark: Theta-greedy with early stop."""

    name: str = "dspark"
    speculates = True
    needs_capacity = False
    adaptive = True

    def __call__(self, inputs: ScheduleInput, profile: ThroughputProfile) -> torch.Tensor:
        survival = prefix_survival(inputs.confidences)
        return theta_greedy_lengths(survival, min_len=inputs.min_len, max_len=inputs.max_len, profile=profile,
                                    sampled=inputs.sampled, with_draft=inputs.with_draft)


@dataclass(frozen=True)
class StaleCapacity:
    """dspark-async: top-``inputs.capacity`` slots of the current confidences."""

    name: str = "dspark-async"
    speculates = True
    needs_capacity = True
    adaptive = True

    def __call__(self, inputs: ScheduleInput, profile: ThroughputProfile) -> torch.Tensor:
        if inputs.capacity is None:
            raise ValueError("dspark-async needs inputs.capacity (from an earlier round); use VerifyScheduler")
        survival = prefix_survival(inputs.confidences)
        return top_capacity_lengths(survival, inputs.capacity, min_len=inputs.min_len, max_len=inputs.max_len)


_NAME = re.compile(r"^(?P<kind>[a-z0-9]+(?:-async)?)(?:-(?P<value>[0-9.]+))?$")
POLICY_NAMES = ("none", "mtp1", "fixed-<k>", "threshold-<t>", "dspark", "dspark-async")


def make_policy(name: str, **kwargs: float) -> VerifyPolicy:
    """Build a policy from its name: 'none', 'mtp1', 'fixed-5', 'threshold-0.5', 'dspark', 'dspark-async'.

    The value may also be given as a keyword: ``make_policy("fixed", k=5)``,
    ``make_policy("threshold", threshold=0.5)``.

    Raises:
        ValueError: unknown name, missing / malformed / out-of-range value, or an unexpected keyword.
    """
    match = _NAME.match(name.strip().lower())
    if match is None:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    kind, value = match["kind"], match["value"]
    key = {"fixed": "k", "threshold": "threshold"}.get(kind)
    unexpected = set(kwargs) - ({key} if key else set())
    if unexpected:
        raise ValueError(f"policy {name!r} takes no keyword(s) {sorted(unexpected)}")
    if key is None:
        if value is not None:
            raise ValueError(f"policy {kind!r} takes no value, got {name!r}")
        simple = {"none": FixedLength("none", 0), "mtp1": FixedLength("mtp1", 1)}
        if kind in simple:
            return simple[kind]
        if kind == "dspark":
            return ThetaGreedy()
        if kind == "dspark-async":
            return StaleCapacity()
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    if (value is None) == (key not in kwargs):
        raise ValueError(f"policy {kind!r} needs exactly one value, as '{kind}-<value>' or {key}=, got {name!r}")
    raw = kwargs[key] if value is None else value
    if kind == "fixed":
        k = int(raw) if str(raw).isdigit() else -1
        if k < 0:
            raise ValueError(f"fixed-k needs an integer k >= 0, got {raw!r}")
        return FixedLength(f"fixed-{k}", k)
    try:
        t = float(raw)
    except ValueError:
        raise ValueError(f"threshold-t needs a number t in [0, 1], got {raw!r}") from None
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"threshold-t needs t in [0, 1], got {raw!r}")
    return Threshold(f"threshold-{t:g}", t)
