"""Discrete-event simulation of N target replicas decoding with speculative verification.

This module owns the event loop, the replicas' batch state and the metrics. Costs come from a
:class:`~app.scheduling.profile.ThroughputProfile`, verify lengths from a
:class:`~app.scheduling.scheduler.VerifyScheduler` per replica, acceptance from an
:class:`~app.sim.acceptance.AcceptanceModel`. It models decoding only: prefill, network and the drafter's
accuracy beyond the acceptance model are out of scope.

Shape symbols: B batch (requests in one replica's round), K gamma.

Model. Requests wait in one FIFO queue; a replica takes queued requests into free batch slots at every round
boundary (continuous batching) and runs rounds back to back while it has requests. A round drafts (unless
the policy is ``none``), picks l_r in [0, min(K, remaining_r - 1)], verifies, and commits
``min(accepted run, l_r) + 1`` tokens per request; it lasts ``profile.step_time_ms(N, batch=B)``, N = B + sum l
(``B (1 + max l)`` on a padded profile: ``ThroughputProfile.step_tokens``).
Events (round ends, Poisson arrivals) are processed in time order from a heap; each round is vectorised
over its B requests. Load is closed-loop (C users, each sends its next request as soon as the previous one
ends) or open-loop Poisson (rate in requests/s).

Metrics, over the window after the warm-up (the first ``warmup`` fraction of the simulated time):
    throughput_tok_s   tokens committed in the window / window length.
    user_tok_s         mean over requests finished in the window of output tokens / (finish - admission).
    tpot_ms            median over those requests of (finish - admission) / output tokens (no prefill).
    wasted_per_token   draft tokens verified but rejected, per committed token.
    mean_verify_len    mean l_r over request-rounds; mean_batch: mean B over rounds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm

from app.scheduling.policies import make_policy
from app.scheduling.profile import ThroughputProfile
from app.scheduling.scheduler import VerifyScheduler
from app.sim.acceptance import AcceptanceModel


class SimConfig(BaseModel):
    """One simulation run: load, cluster and request shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(description="Policy name for make_policy, e.g. 'dspark' or 'fixed-5'.")
    load: Literal["closed", "poisson"] = Field(default="closed", description="Closed-loop users or Poisson.")
    concurrency: int = Field(default=16, ge=1, description="Closed loop: number of users C.")
    rate: float = Field(default=1.0, gt=0, description="Poisson: arrival rate (requests/s).")
    replicas: int = Field(default=1, ge=1, description="Target replicas N.")
    max_batch: int | None = Field(
        default=None, ge=1, description="Batch slots per replica; None: the profile's largest batch size."
    )
    gamma: int = Field(default=7, ge=1, description="Draft block size K.")
    output_tokens: tuple[int, int] = Field(
        default=(64, 192), description="Output length per request, uniform over [low, high] (tokens)."
    )
    rounds: int = Field(
        default=1000, ge=10, description="Closed loop: stop after rounds x replicas rounds in total."
    )
    duration_s: float = Field(default=60.0, gt=0, description="Poisson: simulated seconds.")
    warmup: float = Field(default=0.25, ge=0.0, lt=1.0, description="Fraction of simulated time not measured.")
    seed: int = Field(default=0, description="Seed of the simulation's random generator.")
    draft_gate: bool = Field(
        default=True, description="Adaptive policies skip drafting in rounds where it cannot pay (scheduler.DraftGate)."
    )

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        make_policy(self.policy)
        low, high = self.output_tokens
        if not 1 <= low <= high:
            raise ValueError(f"output_tokens must satisfy 1 <= low <= high, got {self.output_tokens}")
        return self


@dataclass(frozen=True)
class SimResult:
    """Metrics of one run (definitions in the module docstring)."""

    policy: str
    load: str
    concurrency: int
    rate: float
    replicas: int
    throughput_tok_s: float
    user_tok_s: float
    tpot_ms: float
    wasted_per_token: float
    mean_verify_len: float
    mean_batch: float
    finished_requests: int
    simulated_s: float


class _Replica:
    """Batch slots of one replica: parallel arrays [S], S = batch slots."""

    def __init__(self, slots: int, scheduler: VerifyScheduler) -> None:
        self.scheduler = scheduler
        self.active = np.zeros(slots, dtype=bool)
        self.remaining = np.zeros(slots, dtype=np.int64)  # tokens still to generate
        self.total = np.zeros(slots, dtype=np.int64)  # output length of the request in the slot
        self.admitted = np.zeros(slots)  # admission time (s)
        self.difficulty = np.zeros(slots)  # delta_r of the acceptance model
        self.request_id = np.zeros(slots, dtype=np.int64)  # run-wide id of the request in the slot
        self.busy = False
        self.pending: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None  # idx, committed, wasted, B


class _Run:
    """Event loop state of one simulation."""

    def __init__(self, config: SimConfig, profile: ThroughputProfile, acceptance: AcceptanceModel) -> None:
        if acceptance.gamma < config.gamma:
            raise ValueError(
                f"acceptance model covers {acceptance.gamma} draft positions, the run needs gamma {config.gamma}"
            )
        self.config = config
        self.profile = profile
        self.acceptance = acceptance
        self.mu = acceptance.logit_means()[: config.gamma]
        self.rng = np.random.default_rng(config.seed)
        self.policy = make_policy(config.policy)
        slots = config.max_batch or profile.max_batch_size
        self.replicas = [
            _Replica(slots, VerifyScheduler(
                self.policy, profile, max_batch=slots, gamma=config.gamma, draft_gate=config.draft_gate
            ))
            for _ in range(config.replicas)
        ]
        self.queue: deque[float] = deque()  # arrival times of waiting requests
        self.events: list[tuple[float, int, int]] = []  # (time, seq, replica index or -1 for an arrival)
        self.seq = 0
        self.now = 0.0
        self.rounds = 0
        self.admitted_requests = 0
        self.log_rounds: list[tuple[float, int, int, int, int]] = []  # (end, committed, wasted, verified, B)
        self.log_requests: list[tuple[float, float, int]] = []  # (finish, admitted, tokens)

    def push(self, time: float, who: int) -> None:
        heapq.heappush(self.events, (time, self.seq, who))
        self.seq += 1

    def fill_and_start(self, rep_id: int) -> None:
        rep = self.replicas[rep_id]
        free = np.flatnonzero(~rep.active)[: len(self.queue)]
        if free.size:
            for _ in range(free.size):
                self.queue.popleft()
            low, high = self.config.output_tokens
            lengths = self.rng.integers(low, high + 1, size=free.size)
            rep.active[free] = True
            rep.remaining[free] = lengths
            rep.total[free] = lengths
            rep.admitted[free] = self.now
            rep.difficulty[free] = self.acceptance.draw_difficulty(self.rng, free.size)
            rep.request_id[free] = self.admitted_requests + np.arange(free.size)
            self.admitted_requests += free.size
        if rep.active.any():
            self.start_round(rep_id)

    def start_round(self, rep_id: int) -> None:
        rep = self.replicas[rep_id]
        idx = np.flatnonzero(rep.active)
        batch = idx.size
        max_len = np.minimum(rep.remaining[idx] - 1, self.config.gamma)
        ids = rep.request_id[idx].tolist()
        drafts = self.policy.speculates and rep.scheduler.should_draft(ids)
        if drafts:
            conf, run = self.acceptance.sample_round(self.rng, rep.difficulty[idx], self.mu)
            lengths = rep.scheduler.schedule(
                confidences=torch.from_numpy(conf),
                min_len=torch.zeros(batch, dtype=torch.long),
                max_len=torch.from_numpy(max_len),
            ).numpy()
            accepted = np.minimum(run, lengths)
            verified = np.flatnonzero(lengths)  # as served: only requests that verified drafts report outcomes
            rep.scheduler.observe([ids[i] for i in verified], torch.from_numpy(lengths[verified]),
                                  torch.from_numpy(accepted[verified]))
        else:
            lengths = accepted = np.zeros(batch, dtype=np.int64)
        tokens = self.profile.step_tokens(batch=batch, verified=int(lengths.sum()), longest=int(lengths.max()))
        ms = float(self.profile.step_time_ms(tokens, batch=batch, with_draft=drafts))
        rep.busy = True
        rep.pending = (idx, accepted + 1, lengths - accepted, batch)
        self.push(self.now + ms / 1000.0, rep_id)

    def end_round(self, rep_id: int) -> None:
        rep = self.replicas[rep_id]
        idx, committed, wasted, batch = rep.pending
        rep.busy, rep.pending = False, None
        self.rounds += 1
        rep.remaining[idx] -= committed
        self.log_rounds.append(
            (self.now, int(committed.sum()), int(wasted.sum()), int((committed - 1 + wasted).sum()), batch)
        )
        done = idx[rep.remaining[idx] <= 0]
        for slot in done:
            self.log_requests.append((self.now, float(rep.admitted[slot]), int(rep.total[slot])))
        rep.active[done] = False
        if self.config.load == "closed":
            self.queue.extend([self.now] * done.size)
        self.fill_and_start(rep_id)

    def wake_idle(self) -> None:
        for rep_id, rep in enumerate(self.replicas):
            if not self.queue:
                return
            if not rep.busy:
                self.fill_and_start(rep_id)

    def run(self, progress: bool) -> SimResult:
        cfg = self.config
        closed = cfg.load == "closed"
        if closed:
            self.queue.extend([0.0] * cfg.concurrency)
            self.wake_idle()
            target = cfg.rounds * cfg.replicas
        else:
            self.push(self.rng.exponential(1.0 / cfg.rate), -1)
        bar = tqdm(total=target if closed else cfg.duration_s, disable=not progress, leave=False, desc=cfg.policy)
        while self.events:
            time, _, who = heapq.heappop(self.events)
            if not closed and time > cfg.duration_s:
                break
            self.now = time
            if who < 0:
                self.queue.append(time)
                self.push(time + self.rng.exponential(1.0 / cfg.rate), -1)
                self.wake_idle()
            else:
                self.end_round(who)
                bar.update(1 if closed else 0)
            if closed and self.rounds >= target:
                break
        bar.close()
        return self.result(end=self.now if closed else cfg.duration_s)

    def result(self, *, end: float) -> SimResult:
        cfg = self.config
        start = cfg.warmup * end
        rounds = np.array(self.log_rounds, dtype=np.float64).reshape(-1, 5)
        rounds = rounds[rounds[:, 0] > start]
        reqs = np.array(self.log_requests, dtype=np.float64).reshape(-1, 3)
        reqs = reqs[reqs[:, 0] > start]
        committed = rounds[:, 1].sum()
        decode_s = reqs[:, 0] - reqs[:, 1]
        return SimResult(
            policy=cfg.policy,
            load=cfg.load,
            concurrency=cfg.concurrency,
            rate=cfg.rate,
            replicas=cfg.replicas,
            throughput_tok_s=committed / (end - start) if end > start else math.nan,
            user_tok_s=float(np.mean(reqs[:, 2] / decode_s)) if reqs.size else math.nan,
            tpot_ms=float(np.median(1e3 * decode_s / reqs[:, 2])) if reqs.size else math.nan,
            wasted_per_token=float(rounds[:, 2].sum() / committed) if committed else math.nan,
            mean_verify_len=float(rounds[:, 3].sum() / rounds[:, 4].sum()) if rounds.size else math.nan,
            mean_batch=float(rounds[:, 4].mean()) if rounds.size else math.nan,
            finished_requests=int(reqs.shape[0]),
            simulated_s=end,
        )


def simulate(
    config: SimConfig, *, profile: ThroughputProfile, acceptance: AcceptanceModel, progress: bool = False
) -> SimResult:
    """Run one simulation and return its metrics.

    Raises:
        ProfileRangeError: the profile does not cover the batch slots or gamma.
        ValueError: the acceptance model covers fewer positions than gamma.
    """
    return _Run(config, profile, acceptance).run(progress)
