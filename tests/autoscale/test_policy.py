"""SLO autoscaling: the pure decision (table-driven), the observation reduced from constructed Ray contexts, the
application-level callable (state round trip, drafter ratio) and the config checks. No Ray cluster."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from autoscale.config import SLOAutoscalingConfig
from autoscale.policy import (
    STATE_KEY,
    Decision,
    ScaleState,
    SLOAutoscalingPolicy,
    SLOObservation,
    decide,
    observe,
    tpot_stat,
)

CFG = SLOAutoscalingConfig(
    enabled=True, tpot_ms=50, upscale_after_s=5, downscale_after_s=30, cooldown_s=10, min_samples=3,
    downscale_headroom=0.6, downscale_max_load=0.5, min_target_replicas=1, max_target_replicas=3,
    drafters_per_target=0.5, min_drafter_replicas=1, max_drafter_replicas=2,
)
NOW = 1000.0


def obs(tpot: float | None, load: float | None = 0.5, samples: int = 10) -> SLOObservation:
    return SLOObservation(tpot_ms=tpot, samples=samples if tpot is not None else 0, load=load)


# (case, observation, current replicas, previous state, expected replicas, expected signal)
CASES = [
    ("no replica reported", obs(None, load=None), 2, ScaleState(), 2, "no_metrics"),
    ("running but no TPOT yet", obs(None, load=0.4), 2, ScaleState(violated_since=NOW - 60), 2, "no_metrics"),
    ("too few samples", obs(90, samples=2), 2, ScaleState(violated_since=NOW - 60), 2, "no_metrics"),
    ("violation just started", obs(90), 1, ScaleState(), 1, "steady"),
    ("violation not yet sustained", obs(90), 1, ScaleState(violated_since=NOW - 4), 1, "steady"),
    ("violation sustained", obs(90), 1, ScaleState(violated_since=NOW - 5), 2, "scale_up"),
    ("violation sustained, at max", obs(90), 3, ScaleState(violated_since=NOW - 60), 3, "steady"),
    ("violation sustained, in cooldown", obs(90), 2, ScaleState(violated_since=NOW - 60, last_action_at=NOW - 9),
     2, "steady"),
    ("violation sustained, cooldown over", obs(90), 2,
     ScaleState(violated_since=NOW - 60, last_action_at=NOW - 10), 3, "scale_up"),
    ("met but not comfortably", obs(40, load=0.1), 2, ScaleState(comfortable_since=NOW - 60), 2, "steady"),
    ("comfortable, sustained, light load", obs(20, load=0.2), 2, ScaleState(comfortable_since=NOW - 30), 1,
     "scale_down"),
    ("comfortable, not sustained", obs(20, load=0.2), 2, ScaleState(comfortable_since=NOW - 29), 2, "steady"),
    ("comfortable but load too high after removing one", obs(20, load=0.3), 2,
     ScaleState(comfortable_since=NOW - 60), 2, "steady"),
    ("comfortable, at min", obs(20, load=0.1), 1, ScaleState(comfortable_since=NOW - 60), 1, "steady"),
    ("idle counts as comfortable", obs(None, load=0.0), 3, ScaleState(comfortable_since=NOW - 30), 2,
     "scale_down"),
    ("current above max is clamped", obs(40), 5, ScaleState(), 3, "steady"),
    ("current below min is clamped", obs(None, load=None), 0, ScaleState(), 1, "no_metrics"),
]


@pytest.mark.parametrize("case,observation,current,state,replicas,signal", CASES, ids=[c[0] for c in CASES])
def test_decide_table(case, observation, current, state, replicas, signal):
    decision = decide(observation, current=current, now=NOW, state=state, config=CFG)
    assert (decision.target_replicas, decision.signal) == (replicas, signal), case


def test_timers_start_reset_and_action_starts_cooldown():
    d = decide(obs(90), current=1, now=NOW, state=ScaleState(), config=CFG)
    assert d.state.violated_since == NOW and d.state.comfortable_since is None
    d = decide(obs(45), current=1, now=NOW + 1, state=d.state, config=CFG)  # a break resets the window
    assert d.state.violated_since is None
    d = decide(obs(90), current=1, now=NOW + 2, state=d.state, config=CFG)
    d = decide(obs(90), current=1, now=NOW + 7, state=d.state, config=CFG)
    assert d == Decision(2, "scale_up", ScaleState(last_action_at=NOW + 7))
    d = decide(obs(None, load=None), current=2, now=NOW + 8, state=d.state, config=CFG)
    assert d.signal == "no_metrics" and d.state.last_action_at == NOW + 7  # missing data keeps the cooldown


def test_user_speed_floor_sets_the_limit():
    cfg = CFG.model_copy(update={"tpot_ms": None, "min_user_tok_s": 25.0})  # 40 ms
    assert cfg.tpot_limit_ms == 40
    both = CFG.model_copy(update={"min_user_tok_s": 10.0})  # 100 ms vs tpot_ms 50: the tighter wins
    assert both.tpot_limit_ms == 50
    d = decide(obs(45), current=1, now=NOW, state=ScaleState(violated_since=NOW - 10), config=cfg)
    assert d.signal == "scale_up"


@pytest.mark.parametrize("targets,drafters", [(1, 1), (2, 1), (3, 2), (8, 2)])
def test_drafter_ratio_is_rounded_up_and_clamped(targets, drafters):
    assert CFG.drafters_for(targets) == drafters


@pytest.mark.parametrize("update,message", [
    ({"tpot_ms": None}, "tpot_ms, min_user_tok_s"),
    ({"min_target_replicas": 4}, "min_target_replicas"),
    ({"min_drafter_replicas": 3}, "min_drafter_replicas"),
    ({"downscale_headroom": 1.0}, "downscale_headroom"),
    ({"tpot_percentile": 95}, "tpot_percentile"),
    ({"upscale_after": 3}, "upscale_after"),
])
def test_bad_config_names_the_field(update, message):
    with pytest.raises(ValidationError, match=message):
        SLOAutoscalingConfig.model_validate({**CFG.model_dump(), **update})


def test_deployment_autoscaling_config_is_accepted_by_ray():
    for deployment in ("target", "drafter"):
        ray_cfg = AutoscalingConfig(**CFG.deployment_autoscaling(deployment=deployment, fallback_ongoing_requests=4))
        assert ray_cfg.upscale_delay_s == 0 and ray_cfg.downscale_delay_s == 0
    assert AutoscalingConfig(**CFG.deployment_autoscaling(deployment="target", fallback_ongoing_requests=4)) \
        .max_replicas == 3
    with pytest.raises(ValueError, match="percentile 95"):
        tpot_stat(95)


# ---------------------------------------------------------------------------- contexts

APP = "dspark"
TARGET = DeploymentID(name="Target", app_name=APP)
DRAFTER = DeploymentID(name="Drafter", app_name=APP)


def replica(dep: DeploymentID, i: int) -> ReplicaID:
    return ReplicaID(unique_id=f"{dep.name.lower()}-{i}", deployment_id=dep)


def series(*values: float) -> list[TimeStampedValue]:
    """Reports at t = 1, 2, ...; the last one is the latest."""
    return [TimeStampedValue(timestamp=float(t), value=v) for t, v in enumerate(values, start=1)]


def context(dep: DeploymentID, *, replicas: int, target: int | None = None, raw: dict | None = None,
            state: dict | None = None, now: float = NOW) -> AutoscalingContext:
    running = [replica(dep, i) for i in range(replicas)]
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=APP, current_num_replicas=replicas,
        target_num_replicas=replicas if target is None else target, running_replicas=running,
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics={}, raw_metrics=raw or {},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None,
    )


def target_raw(per_replica: list[tuple[float, float, float]]) -> dict:
    """(tpot_p90_ms, samples, load) latest per replica, preceded by a stale report that must be ignored."""
    raw: dict = {"tpot_p90_ms": {}, "tpot_samples": {}, "load": {}}
    for i, (tpot, n, load) in enumerate(per_replica):
        r = replica(TARGET, i)
        raw["tpot_p90_ms"][r] = series(999.0, tpot)
        raw["tpot_samples"][r] = series(99.0, n)
        raw["load"][r] = series(9.0, load)
    return raw


def test_observe_takes_latest_report_worst_tpot_mean_load():
    ctx = context(TARGET, replicas=2, raw=target_raw([(30.0, 4, 0.5), (80.0, 2, 0.25)]))
    assert observe(ctx, 90) == SLOObservation(tpot_ms=80.0, samples=6, load=0.375)


def test_observe_ignores_replicas_without_samples_and_stopped_replicas():
    raw = target_raw([(30.0, 4, 0.5), (0.0, 0, 0.0)])
    stopped = replica(TARGET, 7)
    for name, value in (("tpot_p90_ms", 500.0), ("tpot_samples", 9.0), ("load", 1.0)):
        raw[name][stopped] = series(value)
    assert observe(context(TARGET, replicas=2, raw=raw), 90) == SLOObservation(30.0, 4, 0.25)
    assert observe(context(TARGET, replicas=2), 90) == SLOObservation(None, 0, None)


def test_policy_scales_target_and_drafters_together_and_keeps_state():
    policy = SLOAutoscalingPolicy(**CFG.model_dump())
    raw = target_raw([(90.0, 10, 0.8)])
    decisions, states = policy({TARGET: context(TARGET, replicas=1, raw=raw, now=NOW),
                                DRAFTER: context(DRAFTER, replicas=1, now=NOW)})
    assert decisions == {TARGET: 1, DRAFTER: 1}
    slo = states[TARGET][STATE_KEY]
    assert slo["signal"] == "steady" and slo["violated_since"] == NOW and slo["tpot_ms"] == 90.0
    decisions, states = policy({TARGET: context(TARGET, replicas=1, raw=raw, state=states[TARGET], now=NOW + 5),
                                DRAFTER: context(DRAFTER, replicas=1, now=NOW + 5)})
    assert decisions == {TARGET: 2, DRAFTER: 1} and states[TARGET][STATE_KEY]["signal"] == "scale_up"
    decisions, states = policy({TARGET: context(TARGET, replicas=2, raw=raw, state=states[TARGET], now=NOW + 6)})
    assert decisions == {TARGET: 2} and states[TARGET][STATE_KEY]["signal"] == "steady"  # cooldown; no drafter


def test_policy_holds_steady_without_metrics_and_needs_the_target():
    policy = SLOAutoscalingPolicy(**CFG.model_dump())
    decisions, states = policy({TARGET: context(TARGET, replicas=2, target=3), DRAFTER: context(DRAFTER, replicas=1)})
    assert decisions == {TARGET: 3, DRAFTER: 2} and states[TARGET][STATE_KEY]["signal"] == "no_metrics"
    with pytest.raises(ValueError, match="'Target'"):
        policy({DRAFTER: context(DRAFTER, replicas=1)})
    with pytest.raises(ValidationError, match="tpot_budget"):
        SLOAutoscalingPolicy(tpot_budget=3)
