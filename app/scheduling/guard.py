"""The speculation guard: speculate unless plain decoding measurably commits tokens faster.

The draft gate and the verify-length policy decide from a model: calibrated acceptance and the throughput profile.
Where the model is wrong (a ragged verify step costs more than the uniform steps the profile timed, a profile without
a sampled table prices sampled rows as greedy, a drafter call waits for a core that streaming holds), speculation can
fall below plain decoding under load, the regime the scheduler exists for. The guard checks the outcome instead of
the model: per batch-size bucket (the next power of two) it keeps the last ``window`` rates, committed tokens per
request per millisecond of round time (per request, so batches of 5 and 8 in one bucket compare), of rounds it lets
speculate (whatever the draft gate and the verify-length policy then do: a closed gate's cheap rounds and the
catch-up call that follows them both belong to speculation's cost) and of rounds it runs plain.

It pauses speculation in a bucket only on evidence: plain rounds faster than speculative ones by more than
``margin``, by ``z`` standard errors of the difference of the two means (each mode with at least ``min_samples``
rates). It resumes as soon as the means no longer say so. Round times are noisy (a shared CPU, requests joining),
and a wrong pause costs what speculation gains, so doubt keeps the scheduler's own decision.

Both modes stay measured: while speculating, one plain round every ``probe_every`` rounds (every ``4 probe_every``
while speculation is clearly ahead, ``GUARD_CLEAR_GAIN``); while paused, two speculative rounds every
``probe_every`` rounds. Only steady speculative rounds are measured: the first speculative round after the guard's
own plain rounds catches up on their context, a cost of the probe, not of speculation (the caller says which). A
plain round is plain decoding, so the guard never changes what is generated (lossless either way), only how fast.

Pure Python, no torch: decisions depend on earlier rounds only.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

GUARD_WINDOW = 16  # rates kept per mode and bucket
GUARD_MARGIN = 0.05  # plain rounds must commit this fraction more tokens per ms ...
GUARD_Z = 3.0  # ... by this many standard errors, before speculation pauses
GUARD_MIN_SAMPLES = 8  # rates of each mode a bucket needs before it may pause
GUARD_PROBE_EVERY = 16  # rounds between probes of the other mode ...
GUARD_CLEAR_GAIN = 1.25  # ... and 4x as many while speculation's mean rate is at least this many times plain's
SPEC_PROBE_ROUNDS = 2  # speculative rounds per probe while paused (the first drafter call catches up)


def batch_bucket(batch: int) -> int:
    """The guard's bucket of a round of ``batch`` requests: the smallest power of two >= batch.

    Raises:
        ValueError: batch < 1.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return 1 << (batch - 1).bit_length()


@dataclass
class BucketState:
    """One bucket's recent rates (committed tokens per request per ms) of speculative and plain rounds, and its mode."""

    spec: deque  # maxlen: the guard's window
    plain: deque
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
        margin, z, min_samples: the evidence a pause needs; window: rates kept per mode and bucket;
        probe_every: rounds between probes of the mode not in use.
    Raises:
        ValueError: margin < 0, z < 0, min_samples < 2, window < min_samples or probe_every < 1.
    """

    def __init__(self, *, margin: float = GUARD_MARGIN, z: float = GUARD_Z, min_samples: int = GUARD_MIN_SAMPLES,
                 window: int = GUARD_WINDOW, probe_every: int = GUARD_PROBE_EVERY) -> None:
        if margin < 0 or z < 0 or not 2 <= min_samples <= window or probe_every < 1:
            raise ValueError(f"need margin >= 0, z >= 0, 2 <= min_samples <= window and probe_every >= 1, got "
                             f"margin={margin}, z={z}, min_samples={min_samples}, window={window}, "
                             f"probe_every={probe_every}")
        self.margin, self.z, self.min_samples, self.window = margin, z, min_samples, window
        self.probe_every = probe_every
        self.buckets: dict[int, BucketState] = {}
        self.plain_rounds = 0  # rounds this guard ran plain (probes and pauses)

    def _bucket(self, batch: int) -> BucketState:
        key = batch_bucket(batch)
        if key not in self.buckets:
            self.buckets[key] = BucketState(spec=deque(maxlen=self.window), plain=deque(maxlen=self.window))
        return self.buckets[key]

    def speculate(self, batch: int) -> bool:
        """Whether a round of ``batch`` requests may speculate (False: run it plain).

        Raises:
            ValueError: batch < 1.
        """
        b = self._bucket(batch)
        if b.probe_left:
            b.probe_left -= 1
            mode = b.paused
        elif b.rounds_since_probe >= self.probe_every * (4 if b.clear else 1):
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
            ValueError: batch < 1, committed < 0 or round_ms <= 0.
        """
        if committed < 0 or not round_ms > 0:
            raise ValueError(f"need committed >= 0 and round_ms > 0, got {committed}, {round_ms}")
        b = self._bucket(batch)
        if speculative and not steady:
            return
        (b.spec if speculative else b.plain).append(committed / batch / round_ms)
        if min(len(b.spec), len(b.plain)) < self.min_samples:
            return
        spec, plain = statistics.fmean(b.spec), statistics.fmean(b.plain)
        was_paused = b.paused
        if b.paused:
            b.paused = plain > spec * (1 + self.margin)
        else:
            se = math.sqrt(statistics.variance(b.spec) / len(b.spec) + statistics.variance(b.plain) / len(b.plain))
            b.paused = plain - spec * (1 + self.margin) > self.z * se
        b.clear = not b.paused and spec >= GUARD_CLEAR_GAIN * plain
        if b.paused and not was_paused and not b.logged:
            b.logged = True
            log.warning("speculation guard: rounds of up to %d requests run plain: %.4f tokens per request per ms "
                        "plain against %.4f speculative (%d and %d rounds); counted in dspark_guard_plain_rounds, "
                        "later pauses of this batch size are not logged", batch_bucket(batch), plain, spec,
                        len(b.plain), len(b.spec))

    def state(self) -> dict[int, dict]:
        """Per bucket: the mean rates (tokens per request per ms; None before any), how many, whether speculation is
        paused."""
        return {k: {"spec_rate": statistics.fmean(b.spec) if b.spec else None, "spec_samples": len(b.spec),
                    "plain_rate": statistics.fmean(b.plain) if b.plain else None, "plain_samples": len(b.plain),
                    "paused": b.paused}
                for k, b in sorted(self.buckets.items())}
