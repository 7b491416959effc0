"""SLO autoscaling settings: one pydantic model, read from the Serve YAML ``args.autoscaling`` section.

Owns: the interactivity SLO (a TPOT percentile limit and/or a per-user speed floor), the windows and
hysteresis of the scaling decision, replica bounds for the Target and Drafter deployments and the
drafter-per-target ratio, and the Ray Serve ``autoscaling_config`` each deployment gets from them.

Does not own: the decision itself (``autoscale/policy.py``) or measuring TPOT (``app/serving/telemetry.py``).
The same model validates the application-level policy's ``policy_kwargs`` (a YAML anchor shares the section;
see ``docs/observability.md``), so the builder and the policy can never disagree on a field.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

REPORTED_PERCENTILES = (50, 90, 99)  # TPOT percentiles target replicas report (tpot_p<q>_ms)


class SLOAutoscalingConfig(BaseModel):
    """Interactivity SLO and how the Target / Drafter replica counts follow it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        False, description="Autoscale Target and Drafter replicas on the SLO (needs the application-level "
        "policy in the YAML, see docs/observability.md). False: fixed `num_replicas`.",
    )
    tpot_ms: float | None = Field(
        100.0, gt=0, description="SLO: the `tpot_percentile` of time per output token over recent requests "
        "(ms) must not exceed this. None: only `min_user_tok_s` applies.",
    )
    min_user_tok_s: float | None = Field(
        None, gt=0, description="SLO: per-user decode speed floor (output tokens/s); equivalent to a TPOT limit "
        "of 1000 / min_user_tok_s ms at the same percentile. None: only `tpot_ms` applies.",
    )
    tpot_percentile: Literal[50, 90, 99] = Field(
        90, description="Which TPOT percentile the SLO constrains (replicas report p50, p90 and p99).",
    )
    window_s: float = Field(
        15.0, gt=0, description="Target replicas compute TPOT percentiles over requests finished in the last "
        "window_s seconds plus the requests still decoding.",
    )
    min_samples: int = Field(
        3, ge=1, description="Fewer TPOT samples than this over all target replicas, while requests are "
        "running, counts as missing data (the policy holds steady).",
    )
    upscale_after_s: float = Field(
        5.0, ge=0, description="The SLO must be violated this long, without a break, before a target replica is "
        "added.",
    )
    downscale_after_s: float = Field(
        30.0, ge=0, description="The SLO must be comfortably met and replicas lightly loaded this long before a "
        "target replica is removed.",
    )
    cooldown_s: float = Field(
        15.0, ge=0, description="After any scaling action, no further action for this long (lets a new replica "
        "start and the TPOT window refill).",
    )
    downscale_headroom: float = Field(
        0.6, gt=0, lt=1, description="Comfortably met: the TPOT percentile is at most this fraction of the limit "
        "(or no request is running).",
    )
    downscale_max_load: float = Field(
        0.5, gt=0, le=1, description="Lightly loaded: (running + queued requests) / max_num_seqs per replica would "
        "stay at or below this with one target replica fewer.",
    )
    min_target_replicas: int = Field(1, ge=1, description="Fewest Target replicas.")
    max_target_replicas: int = Field(4, ge=1, description="Most Target replicas.")
    drafters_per_target: float = Field(
        1.0, gt=0, description="Drafter replicas per Target replica (rounded up, then clamped to the drafter "
        "bounds).",
    )
    min_drafter_replicas: int = Field(1, ge=1, description="Fewest Drafter replicas.")
    max_drafter_replicas: int = Field(4, ge=1, description="Most Drafter replicas.")
    metrics_interval_s: float = Field(
        1.0, gt=0, description="How often replicas push their autoscaling stats to the Serve controller.",
    )
    look_back_period_s: float = Field(
        2.0, gt=0, description="Serve controller's metrics look-back window (the policy reads each replica's "
        "latest report within it).",
    )

    @model_validator(mode="after")
    def _check(self) -> SLOAutoscalingConfig:
        if self.tpot_ms is None and self.min_user_tok_s is None:
            raise ValueError("autoscaling: set tpot_ms, min_user_tok_s or both (the SLO needs a limit)")
        if self.min_target_replicas > self.max_target_replicas:
            raise ValueError(f"autoscaling: min_target_replicas {self.min_target_replicas} > max_target_replicas "
                             f"{self.max_target_replicas}")
        if self.min_drafter_replicas > self.max_drafter_replicas:
            raise ValueError(f"autoscaling: min_drafter_replicas {self.min_drafter_replicas} > "
                             f"max_drafter_replicas {self.max_drafter_replicas}")
        return self

    @property
    def tpot_limit_ms(self) -> float:
        """The TPOT limit in force (ms): the tighter of ``tpot_ms`` and ``1000 / min_user_tok_s``."""
        limits = [x for x in (self.tpot_ms, 1000.0 / self.min_user_tok_s if self.min_user_tok_s else None) if x]
        return min(limits)

    def drafters_for(self, targets: int) -> int:
        """Drafter replicas for ``targets`` Target replicas (ratio, rounded up, clamped)."""
        wanted = math.ceil(targets * self.drafters_per_target - 1e-9)
        return min(max(wanted, self.min_drafter_replicas), self.max_drafter_replicas)

    def deployment_autoscaling(self, *, deployment: Literal["target", "drafter"],
                               fallback_ongoing_requests: float) -> dict:
        """Ray Serve ``autoscaling_config`` for one deployment.

        Ray's own up/down delays are zero: the SLO policy applies its windows and cooldown itself.
        ``fallback_ongoing_requests`` is the ``target_ongoing_requests`` of Ray's default queue-length policy,
        which runs only when the YAML lacks the application-level policy.
        """
        lo, hi = ((self.min_target_replicas, self.max_target_replicas) if deployment == "target"
                  else (self.drafters_for(self.min_target_replicas), self.max_drafter_replicas))
        return {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
            "metrics_interval_s": self.metrics_interval_s, "look_back_period_s": self.look_back_period_s,
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "target_ongoing_requests": fallback_ongoing_requests,
        }
