"""The stateful verify scheduler: a policy, a profile and (for dspark-async) the stale capacity.

This module owns the state carried across rounds; every decision is made by the pure functions of
:mod:`app.scheduling.policies` and :func:`update_capacity` (the vLLM pattern: a pure decision function,
a thin class holding state). It does not draft, verify or sample.

Shape symbols: B batch, K gamma.

Stale capacity (DSpark Sec. 3.3). The production variant cuts the batch at a capacity chosen from an
earlier round's confidences, so the cut carries no information about this round's draft tokens. Here the
capacity is tracked per drafting request (slots beyond ``min_len`` per request with a draft to verify), smoothed
with an EMA and held unless the EMA moves by more than a hysteresis band, then scaled by the current number of
drafting requests (requests join and leave between rounds, and a round of prompt-lookup drafts may draft for a
few). The first round has no earlier information and runs ``dspark`` (itself lossless).

Draft gate. The drafter's step is paid before any length is chosen, so a round whose best verify lengths
cannot pay for it should not draft at all (on a CPU with a weak drafter, or under heavy load, plain
decoding is faster). :class:`DraftGate` estimates each request's per-position acceptance from its own recent
rounds (acceptance depends on the request: one chat answer the drafter cannot predict must not close the gate
for the arithmetic answers that follow; a new request starts from what requests of its temperature class got
(``temperature_class``: sampled acceptance is lower than greedy), or the prior before any) and drafts only when
:func:`~app.scheduling.gain.best_uniform_length` expects a speed-up for the batch. The counts decay every
round, slowly while the gate is closed. A closed gate reopens when a request joins (decided on the
estimate at once) or on the outcome of a probe round: it drafts one after ``PROBE_EVERY`` closed rounds,
then after twice as many each time the probe leaves it closed (up to ``PROBE_MAX``); the counts faded
meanwhile, so the probe's outcome weighs more than the rounds that closed the gate. A join restarts that
back-off only when its temperature class has no outcomes yet: a probe pays the drafter's catch-up on every
request's context since its last call, and under steady traffic requests join every few rounds. Its decision depends
on earlier rounds only, and a round that verifies no drafts is plain decoding: lossless either way.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from app.drafters.calibration import prefix_survival
from app.scheduling.gain import best_uniform_length
from app.scheduling.policies import ScheduleInput, VerifyPolicy, theta_greedy_lengths
from app.scheduling.profile import ThroughputProfile

log = logging.getLogger(__name__)

EMA_SMOOTHING = 0.5  # weight of the newest observation in the capacity EMA (1.0: no smoothing)
HYSTERESIS = 0.25  # slots per request the EMA must move before the capacity in use changes
GATE_DECAY = 0.9  # decay of the draft gate's acceptance counts per drafted round (~10 rounds of memory)
GATE_IDLE_DECAY = 0.97  # ... and per round without drafts (half-life ~23 rounds: forgets, slowly, while closed)
GATE_PRIOR = (0.5, 1.0)  # pseudo-counts (accepted, tried) per position before any observation
# A new request of a temperature class starts from the class's pooled, decayed acceptance, weighted as GATE_PRIOR[1]
# tried drafts per position (as weak as the prior: its own rounds take over at once).
GATE_CLASS_DECAY = 0.98  # decay of a class's pooled counts per drafted round (~50 rounds of memory)
GATE_MIN_GAIN = 1.02  # expected speed-up over plain decoding the gate asks for before drafting
PROBE_EVERY = 8  # a closed gate drafts again after this many rounds ...
PROBE_MAX = 64  # ... doubling the wait after each probe that leaves it closed, up to this many rounds


def temperature_class(temperature: float) -> str:
    """The draft gate's class of a request: ``greedy``, or its temperature to one decimal (``T0.7``)."""
    return "greedy" if temperature == 0 else f"T{temperature:.1f}"


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


def position_outcomes(
    num_draft: torch.Tensor, num_accepted: torch.Tensor, gamma: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position acceptance outcomes of verified blocks (pure).

    Draft j of a block was *tried* when j <= l and drafts < j were accepted (j <= accepted + 1), and
    *accepted* when j <= accepted.

    Args:
        num_draft: [B] int, drafts verified per block (l); num_accepted: [B] int, drafts accepted.
    Returns:
        (accepted, tried): [B, K] float64 indicators per block and position.
    """
    j = torch.arange(1, gamma + 1)
    tried = (j <= num_draft[:, None]) & (j <= num_accepted[:, None] + 1)
    accepted = j <= num_accepted[:, None]
    return accepted.double(), tried.double()


def _check_distinct(requests: Sequence[Hashable]) -> None:
    """Raises ValueError when a request id appears twice."""
    if len(set(requests)) != len(requests):
        raise ValueError(f"request ids must be distinct, got {list(requests)}")


class DraftGate:
    """Whether the next round should draft at all (module docstring, "Draft gate").

    Holds per-request decayed counts (accepted, tried) per position, prior ``GATE_PRIOR``; a request's counts
    are dropped the first round it is no longer in the batch.

    Args:
        profile: the replica's throughput profile; gamma: K, the block size.
        decay, idle_decay, min_gain, probe_every, probe_max: see the module constants.
    Raises:
        ValueError: a decay outside (0, 1], gamma < 1, or not 1 <= probe_every <= probe_max.
    """

    def __init__(
        self,
        profile: ThroughputProfile,
        *,
        gamma: int,
        decay: float = GATE_DECAY,
        idle_decay: float = GATE_IDLE_DECAY,
        min_gain: float = GATE_MIN_GAIN,
        probe_every: int = PROBE_EVERY,
        probe_max: int = PROBE_MAX,
    ) -> None:
        if not (0.0 < decay <= 1.0 and 0.0 < idle_decay <= 1.0) or not 1 <= probe_every <= probe_max:
            raise ValueError(f"need 0 < decay, idle_decay <= 1 and 1 <= probe_every <= probe_max, got {decay}, "
                             f"{idle_decay}, {probe_every}, {probe_max}")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.profile, self.gamma = profile, gamma
        self.decay, self.idle_decay, self.min_gain = decay, idle_decay, min_gain
        self.probe_every, self.probe_max = probe_every, probe_max
        self._wait, self._probing, self._open, self._fresh = probe_every, False, True, False
        self._requests: list[Hashable] = []
        self._row: dict[Hashable, int] = {}
        self._accepted = torch.empty(0, gamma, dtype=torch.float64)  # [R, K], rows in self._requests order
        self._tried = torch.empty(0, gamma, dtype=torch.float64)
        self._closed_rounds = 0
        self.last_gain = float("nan")
        self._class: dict[Hashable, str] = {}  # request of the last should_draft -> its temperature class
        self._pooled: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # class -> decayed (accepted, tried) [K]

    def _prior(self, request: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Pseudo-counts (accepted, tried) [K] a new request starts from: its class's pooled rate at weight
        GATE_PRIOR[1], or GATE_PRIOR."""
        pooled = self._pooled.get(self._class.get(request))
        tried = torch.full((self.gamma,), GATE_PRIOR[1], dtype=torch.float64)
        if pooled is None:
            return torch.full((self.gamma,), GATE_PRIOR[0], dtype=torch.float64), tried
        rate = (pooled[0] + GATE_PRIOR[0]) / (pooled[1] + GATE_PRIOR[1])
        return rate * GATE_PRIOR[1], tried

    def acceptance(self, request: Hashable) -> torch.Tensor:
        """[K] float64 estimated P(draft j accepted | drafts < j accepted) for ``request`` (its prior if unseen)."""
        row = self._row.get(request)
        if row is None:
            accepted, tried = self._prior(request)
            return accepted / tried
        return self._accepted[row] / self._tried[row]

    def should_draft(
        self, requests: Sequence[Hashable], *, draft_ms: float | None = None, verify_scale: float = 1.0,
        temperatures: Sequence[float] | None = None, sampled: Sequence[bool] | None = None,
    ) -> bool:
        """Decide for a round of ``requests`` (the ids of the requests that would draft; B = their number).

        Args:
            draft_ms: the measured drafter time per round (None: the profile's).
            verify_scale: measured / profiled verify time (see ``best_uniform_length``).
            temperatures: [B] the requests' temperatures: a new request starts from its class's pooled acceptance
                (``temperature_class``), and this round's outcomes feed its class (None: every new request starts
                from ``GATE_PRIOR``, no class learns).
            sampled: [B] whether each request's rows are sampled (``SamplingParams.full_logits``), priced as such
                (``ThroughputProfile``); None: every row greedy.
        Raises:
            ValueError: an id given twice, or temperatures or sampled not one per request.
        """
        for name, values in (("temperature", temperatures), ("sampled flag", sampled)):
            if values is not None and len(values) != len(requests):
                raise ValueError(f"need one {name} per request, got {len(values)} for {len(requests)}")
        self._class = {} if temperatures is None else {r: temperature_class(t) for r, t in zip(requests, temperatures)}
        joined = self._align(requests)
        if not self._requests:
            return False
        # a join restarts the probe back-off only when the gate knows nothing of the request: one of a temperature
        # class with pooled outcomes starts from them, and this round decides on that (a probe per join would
        # catch the drafter up on every request's context each few rounds under steady traffic)
        unknown = any(self._class.get(r) not in self._pooled for r in joined)
        fraction = sum(sampled) / len(sampled) if sampled else 0.0
        _, self.last_gain = best_uniform_length(self._accepted / self._tried, batch=len(self._requests),
                                                profile=self.profile, draft_ms=draft_ms, verify_scale=verify_scale,
                                                sampled=fraction)
        if unknown:  # a request the gate has no evidence on: restart the back-off (a probe just failed or not)
            self._wait, self._closed_rounds, self._probing = self.probe_every, 0, False
        # A closed gate reopens on new outcomes (a probe's) or a new request, not on counts that merely faded.
        fresh, self._fresh = self._fresh, False
        if self.last_gain >= self.min_gain and (self._open or fresh or bool(joined)):
            if self._open:  # open two rounds running: the back-off starts over
                self._wait = self.probe_every
            self._probing = not self._open  # a reopening round is on trial, as a probe is
            self._open, self._closed_rounds = True, 0
            return True
        if self._probing:  # the last probe round left the gate closed: wait twice as long for the next
            self._wait = min(2 * self._wait, self.probe_max)
        self._open, self._probing = False, False
        self._closed_rounds += 1
        if self._closed_rounds >= self._wait:
            self._closed_rounds, self._probing = 0, True
            return True
        self._accepted, self._tried = self._decayed(self._accepted, self._tried, self.idle_decay)
        return False

    def observe(
        self,
        requests: Sequence[Hashable],
        num_draft: Sequence[int] | torch.Tensor,
        num_accepted: Sequence[int] | torch.Tensor,
    ) -> None:
        """Fold one drafted round's outcomes into the estimate.

        Args:
            requests: ids of the requests whose drafts were verified; num_draft, num_accepted: [n] int, per
                request, drafts verified and drafts accepted. Ids not in the round's batch start from the prior.
        Raises:
            ValueError: lengths differ, an id given twice, outcomes not integers, or not 0 <= num_accepted <=
                num_draft <= gamma. Requests that verified no drafts are ignored (no evidence).
        """
        num_draft, num_accepted = torch.as_tensor(num_draft), torch.as_tensor(num_accepted)
        if num_draft.is_floating_point() or num_accepted.is_floating_point():
            raise ValueError(f"num_draft and num_accepted must be integers, got {num_draft.dtype}, {num_accepted.dtype}")
        num_draft, num_accepted = num_draft.long().reshape(-1), num_accepted.long().reshape(-1)
        if len(requests) != num_draft.numel() or len(requests) != num_accepted.numel():
            raise ValueError(f"need one outcome per request, got {len(requests)} ids, {num_draft.numel()} "
                             f"num_draft, {num_accepted.numel()} num_accepted")
        if not bool(((num_accepted >= 0) & (num_accepted <= num_draft) & (num_draft <= self.gamma)).all()):
            raise ValueError(f"need 0 <= num_accepted <= num_draft <= gamma={self.gamma}, got num_draft "
                             f"{num_draft.tolist()}, num_accepted {num_accepted.tolist()}")
        _check_distinct(requests)
        verified = num_draft > 0  # a request that verified no drafts brings no evidence
        requests = [r for r, v in zip(requests, verified.tolist()) if v]
        if not requests:
            return
        num_draft, num_accepted = num_draft[verified], num_accepted[verified]
        self._align(list(self._requests) + [r for r in requests if r not in self._row])
        accepted, tried = position_outcomes(num_draft, num_accepted, self.gamma)
        rows = torch.tensor([self._row[r] for r in requests], dtype=torch.long)
        decayed_a, decayed_t = self._decayed(self._accepted[rows], self._tried[rows], self.decay)
        self._accepted[rows] = decayed_a + accepted
        self._tried[rows] = decayed_t + tried
        self._fresh = True
        for i, r in enumerate(requests):
            cls = self._class.get(r)
            if cls is not None:
                pooled_a, pooled_t = self._pooled.get(cls, (torch.zeros(self.gamma, dtype=torch.float64),) * 2)
                self._pooled[cls] = (GATE_CLASS_DECAY * pooled_a + accepted[i], GATE_CLASS_DECAY * pooled_t + tried[i])

    def _align(self, requests: Sequence[Hashable]) -> list[Hashable]:
        """Make the rows ``requests``, in order: keep known requests' counts, prior for new, drop the rest.
        Returns the new requests."""
        requests = list(requests)
        if requests == self._requests:
            return []
        _check_distinct(requests)
        keep = torch.tensor([self._row.get(r, -1) for r in requests], dtype=torch.long)
        priors = [self._prior(r) for r in requests]
        accepted = torch.stack([a for a, _ in priors]) if priors else torch.empty(0, self.gamma, dtype=torch.float64)
        tried = torch.stack([t for _, t in priors]) if priors else torch.empty(0, self.gamma, dtype=torch.float64)
        known = keep >= 0
        accepted[known], tried[known] = self._accepted[keep[known]], self._tried[keep[known]]
        self._requests, self._row = requests, {r: i for i, r in enumerate(requests)}
        self._accepted, self._tried = accepted, tried
        return [r for r, k in zip(requests, known.tolist()) if not k]

    @staticmethod
    def _decayed(accepted: torch.Tensor, tried: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts aged by one round towards the prior (old rounds fade, the pseudo-counts stay)."""
        prior_a, prior_t = GATE_PRIOR
        return prior_a + decay * (accepted - prior_a), prior_t + decay * (tried - prior_t)


class VerifyScheduler:
    """Decides verify lengths round after round for one target replica.

    Args:
        policy: from :func:`~app.scheduling.policies.make_policy`.
        profile: the replica's throughput profile (checked to cover ``max_batch`` and ``gamma``).
        max_batch, gamma: the largest batch and block size the replica will schedule.
        smoothing, hysteresis: capacity EMA settings (dspark-async only).
        draft_gate: skip drafting in rounds where it cannot pay (adaptive policies only; :class:`DraftGate`).
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
        draft_gate: bool = True,
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
        self._warned_sampled = False
        self.gate = DraftGate(profile, gamma=gamma) if draft_gate and policy.adaptive else None

    def should_draft(
        self, requests: Sequence[Hashable], *, draft_ms: float | None = None, verify_scale: float = 1.0,
        temperatures: Sequence[float] | None = None, sampled: Sequence[bool] | None = None,
    ) -> bool:
        """Whether the next round of ``requests`` (their ids; ``temperatures`` and ``sampled`` as in
        ``DraftGate.should_draft``) should run the drafter (always, without a gate)."""
        if self.gate is None:
            return True
        return self.gate.should_draft(requests, draft_ms=draft_ms, verify_scale=verify_scale,
                                      temperatures=temperatures, sampled=sampled)

    def observe(
        self,
        requests: Sequence[Hashable],
        num_draft: Sequence[int] | torch.Tensor,
        num_accepted: Sequence[int] | torch.Tensor,
    ) -> None:
        """Outcomes of a drafted round, per drafted request (feeds the draft gate; see :meth:`DraftGate.observe`)."""
        if self.gate is not None:
            self.gate.observe(requests, num_draft, num_accepted)

    @property
    def capacity_per_request(self) -> float | None:
        """Capacity in use, slots per request (dspark-async; None before the first round)."""
        return self._held

    def schedule(self, *, confidences: torch.Tensor, min_len: torch.Tensor, max_len: torch.Tensor,
                 sampled: torch.Tensor | None = None, with_draft: bool = True) -> torch.Tensor:
        """Verify lengths for this round, over every request of its verify step (one that drafted nothing: its
        confidences zero and max_len 0; the step's cost counts its row).

        Args:
            confidences: c [B, K] in [0, 1]; min_len, max_len: [B] int64 (max capped by max_tokens left).
            sampled: [B] bool, the requests whose rows are sampled (priced with the profile's sampled table; a
                profile without one prices them as greedy, logged once); None: all greedy.
            with_draft: whether this round called the drafter (a round of prompt-lookup drafts did not).
        Returns:
            l: [B] int64.
        Raises:
            ValueError: invalid inputs (see :class:`ScheduleInput`).
        """
        inputs = ScheduleInput(confidences, min_len, max_len, sampled=sampled, with_draft=with_draft)
        if sampled is not None and not self.profile.has_sampled and not self._warned_sampled and bool(sampled.any()):
            self._warned_sampled = True
            log.warning("profile of %s has no sampled_verify_ms: sampled rows are priced as greedy ones (measure it "
                        "with python -m app.scheduling.profiler)", self.profile.provenance.model)
        if not self.policy.needs_capacity:
            return self.policy(inputs, self.profile)
        survival = prefix_survival(confidences)
        greedy = theta_greedy_lengths(survival, min_len=min_len, max_len=max_len, profile=self.profile,
                                      sampled=sampled, with_draft=with_draft)
        # capacity is per request that has slots to verify (the step's others bring no draft this round)
        drafting = int((max_len > min_len).sum())
        if self._held is None:
            lengths = greedy
        else:
            capacity = round(self._held * drafting)
            lengths = self.policy(replace(inputs, capacity=capacity), self.profile)
        if drafting:  # off the critical path in a real engine: the greedy on this round's confidences sets the next cut
            observed = float((greedy - min_len).sum()) / drafting
            self._ema, self._held = update_capacity(
                ema=self._ema, held=self._held, observed=observed, smoothing=self.smoothing,
                hysteresis=self.hysteresis)
        return lengths
