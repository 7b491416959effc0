"""SLO autoscaling: a pure scaling decision and the Ray Serve application-level policy around it.

Target replicas report, through ``record_autoscaling_stats``, their TPOT percentiles over a recent window
(``tpot_p50_ms``, ``tpot_p90_ms``, ``tpot_p99_ms``), the number of TPOT samples behind them
(``tpot_samples``) and their load (``load`` = (running + queued requests) / max_num_seqs). Each tick the
policy reduces them to one ``SLOObservation`` (the worst replica's percentile, total samples, mean load)
and ``decide`` returns the Target replica count and the signal that drove it:

- ``no_metrics``: no replica reported, or requests are running but too few TPOT samples exist: hold steady;
- ``scale_up``: the SLO was violated for ``upscale_after_s`` without a break: one replica more;
- ``scale_down``: the SLO was comfortably met (TPOT <= headroom * limit, or nothing running) and the load
  per replica with one replica fewer stays <= ``downscale_max_load``, for ``downscale_after_s``: one fewer;
- ``steady``: anything else (including the ``cooldown_s`` after an action and the wait inside a window).

Drafter replicas follow the Target count in the ``drafters_per_target`` ratio, so both deployments move in
the same tick (an application-level policy, Ray Serve 2.60). Ray's own delays are configured to zero; the
windows and the cooldown here are the hysteresis.

Does not own: measuring TPOT (``app/serving/telemetry.py``) or the settings (``autoscale/config.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from autoscale.config import REPORTED_PERCENTILES, SLOAutoscalingConfig

if TYPE_CHECKING:
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingContext

log = logging.getLogger("ray.serve")

TARGET_DEPLOYMENT = "Target"  # deployment names given by app/serving/builder.py
DRAFTER_DEPLOYMENT = "Drafter"
STAT_SAMPLES = "tpot_samples"
STAT_LOAD = "load"
STATE_KEY = "slo"  # the policy's entry in the Target deployment's policy_state

Signal = Literal["no_metrics", "scale_up", "scale_down", "steady"]


def tpot_stat(percentile: int) -> str:
    """Name of the reported TPOT percentile stat, e.g. ``tpot_p90_ms``."""
    if percentile not in REPORTED_PERCENTILES:
        raise ValueError(f"percentile {percentile} is not reported (choose from {REPORTED_PERCENTILES})")
    return f"tpot_p{percentile}_ms"


@dataclass(frozen=True)
class SLOObservation:
    """The Target deployment's state as the policy sees it in one tick."""

    tpot_ms: float | None  # worst replica's TPOT percentile (ms); None without samples
    samples: int  # TPOT samples over all replicas
    load: float | None  # mean (running + queued) / max_num_seqs over replicas; None: no replica reported


@dataclass(frozen=True)
class ScaleState:
    """What the decision carries from one tick to the next (times in seconds, the controller's clock)."""

    violated_since: float | None = None  # start of the current unbroken SLO violation
    comfortable_since: float | None = None  # start of the current unbroken comfortable stretch
    last_action_at: float | None = None  # last scale up or down


@dataclass(frozen=True)
class Decision:
    target_replicas: int
    signal: Signal
    state: ScaleState


def decide(obs: SLOObservation, *, current: int, now: float, state: ScaleState,
           config: SLOAutoscalingConfig) -> Decision:
    """One scaling decision for the Target deployment (pure; module docstring for the rules).

    Args:
        obs: this tick's observation.
        current: the Target replica count currently decided (Ray's target, not only the running ones).
        now: current time (s).
        state: the previous tick's ``Decision.state``.
        config: SLO and bounds.

    Returns:
        The Target replica count (within the configured bounds), the signal and the state for the next tick.
    """
    lo, hi = config.min_target_replicas, config.max_target_replicas
    bounded = min(max(current, lo), hi)
    idle = obs.load == 0.0
    if obs.load is None or (not idle and (obs.tpot_ms is None or obs.samples < config.min_samples)):
        return Decision(bounded, "no_metrics", replace_timers(state, violated=None, comfortable=None))
    limit = config.tpot_limit_ms
    violated = not idle and obs.tpot_ms > limit
    load_after = obs.load * current / (current - 1) if current > 1 else float("inf")
    comfortable = (idle or obs.tpot_ms <= config.downscale_headroom * limit) and \
        load_after <= config.downscale_max_load
    state = replace_timers(
        state,
        violated=(state.violated_since if state.violated_since is not None else now) if violated else None,
        comfortable=(state.comfortable_since if state.comfortable_since is not None else now)
        if comfortable else None,
    )
    cooling = state.last_action_at is not None and now - state.last_action_at < config.cooldown_s
    if not cooling and violated and now - state.violated_since >= config.upscale_after_s and bounded < hi:
        return Decision(bounded + 1, "scale_up", ScaleState(last_action_at=now))
    if not cooling and comfortable and now - state.comfortable_since >= config.downscale_after_s and bounded > lo:
        return Decision(bounded - 1, "scale_down", ScaleState(last_action_at=now))
    return Decision(bounded, "steady", state)


def replace_timers(state: ScaleState, *, violated: float | None, comfortable: float | None) -> ScaleState:
    return ScaleState(violated_since=violated, comfortable_since=comfortable, last_action_at=state.last_action_at)


def observe(ctx: AutoscalingContext, percentile: int) -> SLOObservation:
    """Reduce the Target replicas' latest reports (``ctx.raw_metrics``) to one observation.

    Only replicas that are running and have reported ``load`` count; a replica without TPOT samples
    contributes its load but no TPOT.
    """
    raw = ctx.raw_metrics or {}
    latest: dict[str, dict] = {}
    for name in (STAT_LOAD, STAT_SAMPLES, tpot_stat(percentile)):
        for replica, series in raw.get(name, {}).items():
            if series and replica in ctx.running_replicas:
                latest.setdefault(name, {})[replica] = max(series, key=lambda p: p.timestamp).value
    loads = latest.get(STAT_LOAD, {})
    if not loads:
        return SLOObservation(tpot_ms=None, samples=0, load=None)
    samples = {r: int(n) for r, n in latest.get(STAT_SAMPLES, {}).items() if r in loads}
    tpots = [v for r, v in latest.get(tpot_stat(percentile), {}).items() if samples.get(r, 0) > 0]
    return SLOObservation(tpot_ms=max(tpots) if tpots else None, samples=sum(samples.values()),
                          load=sum(loads.values()) / len(loads))


class SLOAutoscalingPolicy:
    """Ray Serve application-level autoscaling policy (``autoscaling_policy.policy_function`` in the YAML).

    Ray instantiates the class once with ``policy_kwargs`` (the ``autoscaling`` section of the app ``args``)
    and calls it every control-loop tick with one ``AutoscalingContext`` per autoscaled deployment. The
    decision state lives in the Target deployment's ``policy_state`` (key ``slo``), with the signal named.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.config = SLOAutoscalingConfig.model_validate(kwargs)
        self._last_signal: Signal | None = None

    def __call__(
        self, contexts: Mapping[DeploymentID, AutoscalingContext]
    ) -> tuple[dict[DeploymentID, int], dict[DeploymentID, dict]]:
        by_name = {dep.name: (dep, ctx) for dep, ctx in contexts.items()}
        if TARGET_DEPLOYMENT not in by_name:
            raise ValueError(f"SLO autoscaling needs the {TARGET_DEPLOYMENT!r} deployment autoscaled; got "
                             f"{sorted(by_name)}")
        target_id, target = by_name[TARGET_DEPLOYMENT]
        previous = target.policy_state.get(STATE_KEY, {})
        state = ScaleState(**{k: previous[k] for k in asdict(ScaleState()) if k in previous})
        obs = observe(target, self.config.tpot_percentile)
        decision = decide(obs, current=target.target_num_replicas, now=target.current_time, state=state,
                          config=self.config)
        if decision.signal != self._last_signal or decision.signal in ("scale_up", "scale_down"):
            log.info("SLO autoscaling: %s -> %d target replicas (tpot p%d %s ms, limit %.1f ms, load %s, "
                     "samples %d)", decision.signal, decision.target_replicas, self.config.tpot_percentile,
                     _fmt(obs.tpot_ms), self.config.tpot_limit_ms, _fmt(obs.load), obs.samples)
            self._last_signal = decision.signal
        decisions = {target_id: decision.target_replicas}
        states = {target_id: {STATE_KEY: {**asdict(decision.state), "signal": decision.signal,
                                          "tpot_ms": obs.tpot_ms, "load": obs.load}}}
        if DRAFTER_DEPLOYMENT in by_name:
            drafter_id, _ = by_name[DRAFTER_DEPLOYMENT]
            decisions[drafter_id] = self.config.drafters_for(decision.target_replicas)
            states[drafter_id] = {}
        return decisions, states


def _fmt(value: float | None) -> str:
    return "none" if value is None else f"{value:.2f}"
