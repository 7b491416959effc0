"""Cluster-level routing: the Router deployment (one replica) and the pinned-replica request router.

``Router`` collects load reports that target replicas push every ``stats_interval_s`` (active requests, queue
length, step time, tokens per step, recent acceptance), computes each replica's load-aware verification
capacity from the throughput profile, picks the target replica for a new request (one call per request,
never per token) and exposes a snapshot for metrics and autoscaling. It also carries a graceful shutdown's drain:
once told to ``drain``, it answers ``DRAINING`` instead of a target (the Ingress then refuses the request with a 503)
and counts the requests still in flight (``in_flight``) for the launcher to wait on.

Load-aware capacity (DSpark Sec. 3.3, the asynchronous variant, evaluated per replica): with B active requests
and recent per-draft acceptance rate alpha, the expected committed tokens for verify length l are
``tau(l) = B (1 + alpha + ... + alpha^l)`` and the step rate ``SPS(B (1 + l))`` (drafter step included when
l > 0) comes from the profile; the capacity is ``B * l*`` slots with ``l* = argmax_l tau(l) SPS``
(``app.scheduling.gain.best_uniform_length``; 0 when drafting does not pay). It shrinks as the batch grows
(verification waste costs more when the target is busy) and grows with acceptance.

``PinnedReplicaRouter`` is a Ray Serve request router: a call with ``replica_key=<replica unique id>`` goes to
that replica (the Router's choice of target); any other key is mapped by rendezvous hashing to one replica,
the same one for as long as the replica set is unchanged (a target replica's drafter: sticky per-request
state). No key: any replica with room.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from app.scheduling.gain import best_uniform_length
from app.scheduling.profile import ThroughputProfile, load_profile
from app.serving.config import AppConfig
from app.serving.metrics import RouterMetrics
from app.serving.protocol import DRAINING, SpecCounters

STALE_AFTER_REPORTS = 5  # a replica silent for this many report intervals is dropped from routing

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class TargetLoad:
    """One target replica's load report."""

    replica_id: str
    active: int  # requests holding a KV slot: decoding, or prefilled in pieces
    waiting: int  # requests queued for a KV slot
    max_num_seqs: int
    step_ms: float  # EMA of one round (draft + verify)
    tokens_per_step: float  # EMA of tokens committed per round (whole batch)
    acceptance: float  # EMA of accepted / verified draft tokens (0 when nothing was verified)
    counters: SpecCounters = field(default_factory=SpecCounters)  # cumulative since the replica started
    reported_at: float = 0.0

    @property
    def drafter_failures(self) -> int:
        """Requests failed over to plain decoding since the replica started (all causes)."""
        return sum(self.counters.fallbacks.values())


def _rendezvous(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


class PinnedReplicaRouter(RequestRouter):
    """Routes by the call's ``replica_key`` keyword (module docstring)."""

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        key = pending_request.kwargs.get("replica_key") if pending_request is not None else None
        if not key:
            return [candidate_replicas]
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == key:
                return [[replica]]
        ranked = sorted(candidate_replicas, key=lambda r: _rendezvous(key, r.replica_id.unique_id), reverse=True)
        return [[r] for r in ranked]


def verification_capacity(profile: ThroughputProfile, *, batch: int, acceptance: float, gamma: int) -> int:
    """Slots (draft tokens per round, whole batch) that maximise expected tokens/s (module docstring).

    ``acceptance`` is the replica's recent per-draft acceptance rate, taken for every position.
    """
    if batch == 0:
        return 0
    length, _ = best_uniform_length([min(max(acceptance, 0.0), 1.0)] * gamma, batch=batch, profile=profile)
    return batch * length


class Router:
    """The Router deployment (module docstring). Holds soft state only: losing it costs balance, not requests."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.profile: ThroughputProfile | None = None  # see _capacity_profile
        self._loads: dict[str, TargetLoad] = {}
        self._counters: dict[str, SpecCounters] = {}  # every replica that ever reported, gone ones too
        self._assigned: dict[str, int] = {}  # requests sent to a replica since its last report
        self._choices = 0
        self._warned_no_profile = False
        self.draining = False
        self.metrics = RouterMetrics(policy=config.policy)

    def report(self, load: TargetLoad) -> None:
        self._loads[load.replica_id] = replace(load, reported_at=time.monotonic())
        self._counters[load.replica_id] = load.counters
        self._assigned[load.replica_id] = 0
        self.metrics.snapshot(self.snapshot())

    def choose_target(self) -> str | None:
        """The live target replica with the lowest expected load; None before any replica reported; ``DRAINING``
        once ``drain`` was called."""
        if self.draining:
            return DRAINING
        live = self._live()
        if not live:
            return None
        self._choices += 1

        def score(load: TargetLoad) -> tuple[float, int]:
            queued = load.active + load.waiting + self._assigned.get(load.replica_id, 0)
            return queued / load.max_num_seqs, (hash(load.replica_id) + self._choices) % len(live)

        best = min(live, key=score)
        self._assigned[best.replica_id] = self._assigned.get(best.replica_id, 0) + 1
        return best.replica_id

    def drain(self) -> None:
        """Start a graceful shutdown's drain: from now on ``choose_target`` answers ``DRAINING``."""
        if not self.draining:
            log.warning("router: draining: new requests are refused (503) while those in flight finish")
        self.draining = True

    def is_draining(self) -> bool:
        """Whether ``drain`` was called (the Ingress's ``/health`` answers 503 then)."""
        return self.draining

    def in_flight(self) -> int:
        """Requests the live target replicas held at their last report (running or queued) plus those sent to each
        since. A request sent just before a report may be missed by that report and counted by the next one, so a
        drain waits for this to stay 0 over two report intervals."""
        return sum(load.active + load.waiting + self._assigned.get(load.replica_id, 0) for load in self._live())

    def counters(self) -> SpecCounters:
        """The target replicas' counters summed, including replicas that have since gone (so totals never drop
        while this Router lives)."""
        return sum(self._counters.values(), SpecCounters())

    def snapshot(self) -> dict:
        """Per-replica load, capacity and totals (for metrics and the autoscaler)."""
        replicas = {}
        for load in self._live():
            profile = self._capacity_profile() if self.config.speculates else None
            capacity = verification_capacity(
                profile, batch=load.active, acceptance=load.acceptance, gamma=self.config.gamma
            ) if profile is not None else 0
            figures = {k: v for k, v in asdict(load).items() if k != "counters"}
            figures["drafter_failures"] = load.drafter_failures
            replicas[load.replica_id] = {**figures, "verify_capacity": capacity}
        return {
            "replicas": replicas,
            "active": sum(r["active"] for r in replicas.values()),
            "waiting": sum(r["waiting"] for r in replicas.values()),
            "policy": self.config.policy,
        }

    def _capacity_profile(self) -> ThroughputProfile | None:
        """The profile of ``AppConfig.profile_path``, read once it exists: with 'auto' and nothing measured, the
        first target replica measures and caches it at start-up (``profiles.py``) before it reports; until then
        (or on a node without that cache, or where the engine's GPU is not visible) the capacity is reported as 0,
        logged once."""
        if self.profile is None:
            path = self.config.profile_path()
            if path is not None:
                self.profile = load_profile(path)
            elif not self._warned_no_profile:
                self._warned_no_profile = True
                log.warning("router: no throughput profile of %s here (none measured on this node yet, or the "
                            "engine's GPU is not visible here); verify_capacity reads 0 until a target replica on "
                            "this node has cached one, or name the profile file", self.config.model)
        return self.profile

    def _live(self) -> list[TargetLoad]:
        cutoff = time.monotonic() - STALE_AFTER_REPORTS * self.config.stats_interval_s
        return [load for load in self._loads.values() if load.reported_at >= cutoff]
