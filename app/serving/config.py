"""Serving settings: one validated pydantic model built from the Serve YAML ``args``.

Owns: every knob of the Ray Serve application (target model and engine, drafter, verify policy, profile,
replica counts and placement, queue limits, API key) and the cross-field checks between them. A bad value or
an unknown key fails at start with a message naming the field. Relative paths are resolved against the
repository root, so ``serve run deployments/dspark.yaml`` works from any directory.

Does not own: building the deployments (``builder.py``) or loading anything heavy (models, checkpoints).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.scheduling.policies import make_policy
from autoscale.config import SLOAutoscalingConfig

log = logging.getLogger("ray.serve")
REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO_ROOT / "profiles"
AUTO_PROFILE = "auto"
API_KEY_ENV = "DSPARK_API_KEY"


def resolve_path(path: str) -> str:
    """An absolute path; a relative one is taken from the repository root."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else REPO_ROOT / p)


class Placement(BaseModel):
    """Resources one replica of a deployment asks Ray for (its resource group)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(1, ge=1, description="Replicas of this deployment.")
    num_cpus: float = Field(0.0, ge=0, description="CPUs per replica (fractional allowed, e.g. 0.5).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (fractional allowed).")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {'target_group': 1}: pins the replica to nodes "
        "started with that resource (`ray start --resources`).",
    )

    def actor_options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.resources)}


class AppConfig(BaseModel):
    """The whole serving application (the ``args`` of ``deployments/*.yaml``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # ------------------------------------------------------------------ target
    model: str = Field("smollm2-135m", description="Target model reference (see app/engine/loader.py).")
    served_model_name: str = Field(
        "smollm2-135m", min_length=1, description="Name clients pass as `model`; anything else answers 404."
    )
    engine: Literal["real", "mock"] = Field(
        "real", description="'real': the TargetEngine; 'mock': a deterministic weight-free engine for tests."
    )
    dtype: str = Field("auto", description="Target dtype: auto (bfloat16), bfloat16, float16, float32.")
    device: str = Field("auto", description="Target device: auto, cpu, cuda, cuda:N.")
    max_model_len: int = Field(2048, ge=32, description="Per-request context limit in tokens (prompt + output).")
    max_num_seqs: int = Field(16, ge=1, description="Requests decoded concurrently per target replica (KV slots).")
    batch_invariant: bool = Field(
        False, description="Target engine: a request's logits do not depend on the rest of its step (each request "
        "runs alone at a fixed shape), so seeded requests reproduce exactly and greedy ones are identical in any "
        "batch; costs one forward per request per round (app/engine/engine.py EngineConfig, docs/serving.md).",
    )
    max_queued_requests: int = Field(
        32, ge=0, description="Requests waiting for a KV slot per target replica; beyond it answers 503."
    )
    max_prefill_tokens: int = Field(
        2048, ge=1, description="Prompt tokens prefilled in one forward: requests admitted together (between two "
        "rounds) share one batched prefill up to this many tokens (vLLM's max_num_batched_tokens for prefills)."
    )
    max_request_bytes: int = Field(
        1 << 20, ge=1024, description="Largest HTTP request body accepted (bytes); larger bodies answer 413."
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads in target and drafter replicas (None: torch default)."
    )
    drafter_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads while drafting, colocated or in a Drafter replica (None: "
        "torch_threads). A drafter's kernels are small; on a small shared host one thread keeps them clear of "
        "OpenMP stalls when another process holds a core (docs/serving.md)."
    )

    # ------------------------------------------------------------------ speculation
    policy: str = Field(
        "dspark", description="Verify-length policy: none, mtp1, fixed-<k>, threshold-<t>, dspark, dspark-async."
    )
    gamma: int = Field(7, ge=1, le=32, description="Draft block size K (tokens drafted per request per round).")
    draft_gate: bool = Field(
        True, description="dspark / dspark-async skip the drafter in rounds where, from recent acceptance and the "
        "measured drafter call time, speculation cannot beat plain decoding (app/scheduling/scheduler.py)."
    )
    drafter: Literal["dspark", "ngram", "mock"] = Field(
        "dspark",
        description="Drafter: a trained checkpoint (any kind: DSpark, DFlash-style, EAGLE-3-style, MTP-1), a "
        "prompt-lookup n-gram drafter, or the test mock.",
    )
    drafter_checkpoint: str = Field(
        "checkpoints/dspark-smollm2-135m",
        description="Drafter checkpoint directory (model.safetensors + config.json); used when drafter='dspark'.",
    )
    prompt_lookup: bool = Field(
        True, description="Drafter 'dspark' only: each round, per request, draft by prompt lookup instead when the "
        "checkpoint's lookup table expects more accepted tokens than the drafter's calibrated confidences, and by "
        "prompt lookup alone in rounds whose draft gate skips the drafter (it runs on the target replica; "
        "app/drafters/lookup.py; needs the checkpoint's lookup_rates, written by "
        "app.drafters.train.calibrate_lookup).",
    )
    ngram_max: int = Field(3, ge=1, le=8, description="Longest suffix n-gram the n-gram drafter matches.")
    ngram_min: int = Field(
        1, ge=1, le=8, description="Shortest suffix n-gram the n-gram drafter matches (<= ngram_max)."
    )
    profile: str = Field(
        AUTO_PROFILE,
        description="Throughput profile JSON of the target (verify-step and draft-step times), or 'auto': the "
        "measured profile in profiles/ for `model` on this host's CPU (at `torch_threads` threads) or GPU, as "
        "`python -m app.scheduling.profiler` writes it; without one, the newest measured profile of `model`, "
        "with a warning (see `profile_path`).",
    )
    drafter_placement: Literal["separate", "colocated"] = Field(
        "separate",
        description="'separate': Drafter replicas on their own resource group (drafter_replicas), one call between "
        "replicas per round; 'colocated': the drafter runs inside each target replica, on its torch thread (no "
        "Drafter deployment; drafter_replicas is unused). Colocated is faster on a small CPU host (docs/serving.md).",
    )
    drafter_timeout_s: float = Field(
        5.0, gt=0, description="A call to a Drafter replica slower than this fails over to plain decoding for its "
        "requests (separate placement; a colocated drafter runs on the engine's thread and has no timeout).",
    )

    # ------------------------------------------------------------------ placement
    target: Placement = Field(
        default_factory=lambda: Placement(num_cpus=1.0), description="Target replicas' count and resources."
    )
    drafter_replicas: Placement = Field(
        default_factory=lambda: Placement(num_cpus=0.5), description="Drafter replicas' count and resources."
    )
    ingress: Placement = Field(
        default_factory=lambda: Placement(num_cpus=0.2), description="HTTP ingress replicas' count and resources."
    )
    router_num_cpus: float = Field(0.1, ge=0, description="CPUs of the single Router replica.")
    router_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources of the Router replica."
    )
    stats_interval_s: float = Field(0.5, gt=0, description="How often target replicas report load to the Router.")
    autoscaling: SLOAutoscalingConfig = Field(
        default_factory=SLOAutoscalingConfig,
        description="Interactivity SLO (also behind the SLO metrics) and SLO autoscaling of the Target and Drafter "
        "replicas (off by default; docs/observability.md).",
    )

    # ------------------------------------------------------------------ HTTP
    api_key: str | None = Field(
        None, description=f"Bearer key required on /v1 routes (None: read ${API_KEY_ENV}; unset or empty: open)."
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with 503 overload answers.")

    # ------------------------------------------------------------------ test knobs
    mock_step_ms: float = Field(0.0, ge=0, description="Mock engine: sleep per verify step (ms), for timing tests.")
    mock_vocab_size: int = Field(512, ge=16, description="Mock engine: vocabulary size.")
    mock_drafter_fails: Literal["none", "propose", "all"] = Field(
        "none", description="Mock drafter: 'propose' raises in every propose; 'all' also in start and finish (a "
        "drafter that cannot even drop its state); fail-over tests.",
    )
    mock_verify_fails_after: int = Field(
        0, ge=0, description="Mock engine: a verify step raises once a request in it has this many tokens (0: "
        "never); tests of a failing step.",
    )

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, value: str) -> str:
        make_policy(value)  # raises ValueError naming the policy
        return value

    @field_validator("drafter_checkpoint", "profile")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return value if value == AUTO_PROFILE else resolve_path(value)

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        if self.gamma >= self.max_model_len // 2:
            raise ValueError(f"gamma {self.gamma} leaves no room in max_model_len {self.max_model_len}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} exceeds ngram_max {self.ngram_max}")
        if self.engine == "mock" and self.drafter == "dspark" and self.speculates:
            raise ValueError("drafter 'dspark' needs engine 'real' (the mock engine has no features); use 'mock'")
        return self

    @property
    def speculates(self) -> bool:
        """Whether rounds call the drafter (policy 'none' never does)."""
        return make_policy(self.policy).speculates

    @property
    def resolved_api_key(self) -> str | None:
        """The API key in force: the config's, else ``$DSPARK_API_KEY``; empty means none."""
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return key or None

    def profile_path(self) -> str:
        """The throughput profile in force: ``profile``, or for 'auto' the first measured profile of ``model`` in
        ``PROFILES_DIR`` for this host's hardware (named as the profiler records it), else the first measured profile
        of ``model`` on any hardware, with a warning (verify costs measured on another machine). First in the order
        of ``measured_profiles``: timed on the model's real weights before dummy weights, each newest first.

        Raises:
            FileNotFoundError: 'auto' and no measured profile of ``model`` at all.
        """
        if self.profile != AUTO_PROFILE:
            return self.profile
        import torch

        from app.scheduling.profile import measured_profiles
        from app.scheduling.profiler import hardware_name

        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
        hardware = hardware_name(device, self.torch_threads)
        profiles = measured_profiles(PROFILES_DIR, model=self.model)
        here = [path for provenance, path in profiles if provenance.hardware == hardware]
        if here:
            return str(here[0])
        if not profiles:
            raise FileNotFoundError(f"profile: auto found no measured profile of {self.model} in {PROFILES_DIR}; "
                                    "measure one with python -m app.scheduling.profiler or name a profile file")
        log.warning("profile: no measured profile of %s on %r in %s; using %s, measured on %r (verify costs may be "
                    "off: python -m app.scheduling.profiler measures this host)", self.model, hardware, PROFILES_DIR,
                    profiles[0][1].name, profiles[0][0].hardware)
        return str(profiles[0][1])

    def check_files(self) -> None:
        """Fail fast, naming the field, when a file the config points at is missing.

        Raises:
            FileNotFoundError: ``profile`` or (for drafter 'dspark') ``drafter_checkpoint`` does not exist.
            ValueError: ``prompt_lookup`` with a checkpoint that has no lookup table.
        """
        if not Path(self.profile_path()).is_file():
            raise FileNotFoundError(f"profile: no such file {self.profile}")
        checkpoint = Path(self.drafter_checkpoint) / "config.json"
        if self.speculates and self.drafter == "dspark" and not checkpoint.is_file():
            raise FileNotFoundError(
                f"drafter_checkpoint: no DSpark checkpoint at {self.drafter_checkpoint} (expected config.json and "
                "model.safetensors); train one (app/drafters/train) or set drafter: ngram"
            )
        if self.speculates and self.drafter == "dspark" and self.prompt_lookup:
            from app.drafters.lookup import read_lookup_rates

            if read_lookup_rates(self.drafter_checkpoint) is None:
                raise ValueError(
                    f"prompt_lookup: the checkpoint at {self.drafter_checkpoint} has no lookup table; fit one with "
                    "python -m app.drafters.train.calibrate_lookup or set prompt_lookup: false"
                )
