"""The speculation guard: speculate unless plain decoding measurably commits tokens faster.

The draft gate and the verify-length policy decide from a model: calibrated acceptance and the throughput profile.
Where the model is wrong (a ragged verify step costs more than the uniform steps the profile timed, a profile without
a sampled table prices sampled rows as greedy, a drafter call waits for a core that streaming holds), speculation can
fall below plain decoding under load, the regime the scheduler exists for. The guard checks the outcome instead of
the model: per batch-size bucket (the next power of two) it keeps the outcomes of its last ``window`` rounds, rounds it
lets speculate (whatever the draft gate and the verify-length policy then do: a closed gate's cheap rounds and the
catch-up call that follows them both belong to speculation's cost) and rounds it runs plain.

Each mode's rate is time-weighted, committed tokens per request over the rounds' summed time (a ratio of sums, not a
mean of per-round rates: speculation whose cost comes in occasional long rounds, a catch-up drafter call after a
closed gate, would look faster than it is in a mean of rates, which weighs a 300-ms round as much as a 60-ms one).
Round time is counted in units of ``step_ms(batch)``, the profile's plain step for the round's batch, so rounds of 9
and 16 requests in one bucket compare (without it, milliseconds).

It pauses speculation in a bucket only on evidence: plain faster than speculation by more than ``margin``, by ``z``
standard errors of the difference (each rate's error by the ratio estimator's delta method, Cochran, Sampling
Techniques, 3rd ed., Sec. 6.3; each mode with at least ``min_samples`` rounds). It resumes as soon as the rates no
longer say so. Round times are noisy (a shared CPU, requests joining), and a wrong pause costs what speculation gains,
so doubt keeps the scheduler's own decision.

Both modes stay measured: while speculating, one plain round every ``probe_every`` rounds (every ``GUARD_CLEAR_SPACING
probe_every`` while speculation is clearly ahead, ``GUARD_CLEAR_GAIN``); while paused, two speculative rounds every
``probe_every`` rounds. Only steady speculative rounds are measured: the first speculative round after the guard's
own plain rounds catches up on their context, a cost of the probe, not of speculation (the caller says which). A
plain round is plain decoding, so the guard never changes what is generated (lossless either way), only how fast.

Pure Python, no torch: decisions depend on earlier rounds only.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

GUARD_WINDOW = 320  # a bucket's last rounds whose outcomes count: spans 8 plain probes, sparse ones included
GUARD_MARGIN = 0.05  # plain rounds must commit this fraction more tokens per unit of time ...
GUARD_Z = 3.0  # ... by this many standard errors, before speculation pauses
GUARD_MIN_SAMPLES = 8  # rounds of each mode a bucket needs before it may pause
GUARD_PROBE_EVERY = 16  # rounds between probes of the other mode ...
GUARD_CLEAR_GAIN = 1.25  # ... and GUARD_CLEAR_SPACING x as many while speculation's rate is this many times plain's
GUARD_CLEAR_SPACING = 2
SPEC_PROBE_ROUNDS = 2  # speculative rounds per probe while paused (the first drafter call catches up)


def batch_bucket(batch: int) -> int:
    """The guard's bucket of a round of ``batch`` requests: the smallest power of two >= batch.

    Raises:
        ValueError: batch < 1.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return 1 << (batch - 1).bit_length()


def _ratio(rounds: deque | list) -> tuple[float, float, float]:
    """(summed tokens per request, summed time, their ratio) of non-empty ``rounds``."""
    tokens = math.fsum(x for _, x, _ in rounds)
    time = math.fsum(y for _, _, y in rounds)
    return tokens, time, tokens / time


def time_weighted_rate(rounds: deque | list) -> tuple[float, float]:
    """The rate of ``rounds`` [(round number, tokens per request, time)] as a ratio of sums, and its standard error
    (the ratio estimator's delta method: se^2 = sum (x - R y)^2 / ((n - 1) n ybar^2); Cochran, Sampling Techniques,
    Sec. 6.3).

    Raises:
        ValueError: fewer than 2 rounds.
    """
    n = len(rounds)
    if n < 2:
        raise ValueError(f"need at least 2 rounds, got {n}")
    _, time, rate = _ratio(rounds)
    spread = math.fsum((x - rate * y) ** 2 for _, x, y in rounds) / (n - 1)
    return rate, math.sqrt(spread / n) / (time / n)


@dataclass
class BucketState:
    """One bucket's recent rounds, (round number, committed tokens per request, time in step units), of speculative
    and plain rounds, and its mode."""

    spec: deque
    plain: deque
    clock: int = 0  # rounds of this bucket so far
    paused: bool = False
    clear: bool = False  # speculating and clearly ahead: probe less often
    logged: bool = False  # its first pause was logged
    rounds_since_probe: int = 0
    probe_left: int = 0  # rounds of the probe in progress (they run the other mode)


class SpeculationGuard:
    """Pauses speculation in batch-size buckets where plain rounds measurably commit faster (module docstring).

    Use: ``speculate(batch)`` before a round (False: run it plain: no drafter call, no draft verified), then
    ``observe(batch, speculative=..., committed=..., round_ms=..., steady=...)`` with what the round did.

    Args:
        margin, z, min_samples: the evidence a pause needs; window: a bucket's last rounds whose outcomes count (the
            mode in use fills most of them, the other gets its probes: at least ``min_samples`` of the sparsest);
        probe_every: rounds between probes of the mode not in use;
        step_ms: the plain step time (ms, > 0) of a batch of that many requests (``ThroughputProfile``), the unit of
            round time; None: milliseconds.
    Raises:
        ValueError: margin < 0, z < 0, min_samples < 2, probe_every < 1, or a window shorter than
            ``min_samples`` of the sparsest probes ((GUARD_CLEAR_SPACING probe_every + 1) min_samples rounds).
    """

    def __init__(self, *, margin: float = GUARD_MARGIN, z: float = GUARD_Z, min_samples: int = GUARD_MIN_SAMPLES,
                 window: int = GUARD_WINDOW, probe_every: int = GUARD_PROBE_EVERY,
                 step_ms: Callable[[int], float] | None = None) -> None:
        sparsest = GUARD_CLEAR_SPACING * probe_every + 1
        if margin < 0 or z < 0 or min_samples < 2 or probe_every < 1 or window < sparsest * min_samples:
            raise ValueError(f"need margin >= 0, z >= 0, min_samples >= 2, probe_every >= 1 and window >= "
                             f"({GUARD_CLEAR_SPACING} probe_every + 1) min_samples, got "
                             f"margin={margin}, z={z}, min_samples={min_samples}, window={window}, "
                             f"probe_every={probe_every}")
        self.margin, self.z, self.min_samples, self.window = margin, z, min_samples, window
        self.probe_every = probe_every
        self.step_ms = step_ms
        self.buckets: dict[int, BucketState] = {}
        self.plain_rounds = 0  # rounds this guard ran plain (probes and pauses)

    def _bucket(self, batch: int) -> BucketState:
        key = batch_bucket(batch)
        if key not in self.buckets:
            self.buckets[key] = BucketState(spec=deque(), plain=deque())
        return self.buckets[key]

    def speculate(self, batch: int) -> bool:
        """Whether a round of ``batch`` requests may speculate (False: run it plain).

        Raises:
            ValueError: batch < 1.
        """
        b = self._bucket(batch)
        b.clock += 1
        if b.probe_left:
            b.probe_left -= 1
            mode = b.paused
        elif b.rounds_since_probe >= self.probe_every * (GUARD_CLEAR_SPACING if b.clear else 1):
            b.rounds_since_probe = 0
            b.probe_left = (SPEC_PROBE_ROUNDS if b.paused else 1) - 1
            mode = b.paused
        else:
            b.rounds_since_probe += 1
            mode = not b.paused
        self.plain_rounds += not mode
        return mode

    def observe(self, batch: int, *, speculative: bool, committed: int, round_ms: float, steady: bool = True) -> None:
        """Fold one round in: ``speculative`` whether the guard let it speculate (``speculate``), ``committed`` the
        tokens it committed over the batch, ``round_ms`` its time (drafter call included), ``steady`` False for a
        speculative round that catches up on the guard's own plain rounds: not measured.

        Raises:
            ValueError: batch < 1, committed < 0, round_ms <= 0, or ``step_ms`` not > 0 for this batch.
        """
        if committed < 0 or not round_ms > 0:
            raise ValueError(f"need committed >= 0 and round_ms > 0, got {committed}, {round_ms}")
        b = self._bucket(batch)
        if speculative and not steady:
            return
        unit = 1.0 if self.step_ms is None else float(self.step_ms(batch))
        if not unit > 0:
            raise ValueError(f"step_ms({batch}) must be > 0, got {unit}")
        (b.spec if speculative else b.plain).append((b.clock, committed / batch, round_ms / unit))
        for rounds in (b.spec, b.plain):
            while rounds and rounds[0][0] <= b.clock - self.window:
                rounds.popleft()
        if min(len(b.spec), len(b.plain)) < self.min_samples:
            return
        (spec, spec_se), (plain, plain_se) = time_weighted_rate(b.spec), time_weighted_rate(b.plain)
        was_paused = b.paused
        if b.paused:
            b.paused = plain > spec * (1 + self.margin)
        else:
            se = math.sqrt(((1 + self.margin) * spec_se) ** 2 + plain_se ** 2)
            b.paused = plain - spec * (1 + self.margin) > self.z * se
        b.clear = not b.paused and spec >= GUARD_CLEAR_GAIN * plain
        if b.paused and not was_paused and not b.logged:
            b.logged = True
            log.warning("speculation guard: rounds of up to %d requests run plain: %.4f tokens per request per %s "
                        "plain against %.4f speculative (%d and %d rounds); counted in dspark_guard_plain_rounds, "
                        "later pauses of this batch size are not logged", batch_bucket(batch), plain, self.unit_name,
                        spec, len(b.plain), len(b.spec))

    @property
    def unit_name(self) -> str:
        """The unit of round time in the rates: ``plain step`` (with ``step_ms``) or ``ms``."""
        return "ms" if self.step_ms is None else "plain step"

    def state(self) -> dict[int, dict]:
        """Per bucket: the time-weighted rates (tokens per request per ``unit_name``; None before any round), how
        many rounds, whether speculation is paused."""
        return {k: {"spec_rate": _ratio(b.spec)[2] if b.spec else None, "spec_samples": len(b.spec),
                    "plain_rate": _ratio(b.plain)[2] if b.plain else None, "plain_samples": len(b.plain),
                    "paused": b.paused}
                for k, b in sorted(self.buckets.items())}
