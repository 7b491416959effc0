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

from app.engine.config import EngineConfig, is_template_text
from app.serving.reasoning import ReasoningParserName
from app.serving.tools import ToolParserName
from autoscale.config import SLOAutoscalingConfig

log = logging.getLogger("ray.serve")
REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO_ROOT / "profiles"
AUTO_PROFILE = "auto"
API_KEY_ENV = "DSPARK_API_KEY"
TOP_LEVEL_ENGINE_KEYS = frozenset({"model", "dtype", "device", "max_model_len", "max_num_seqs",
                                   "chat_template"})  # engine shorthands


def read_chat_template(path: str) -> str:
    """The text of the chat template file at ``path`` (``resolve_path``).

    Raises:
        ValueError: no such file (naming it).
    """
    file = Path(resolve_path(path))
    if not file.is_file():
        raise ValueError(f"chat_template {path!r} is neither a Jinja template's text nor a file ({file} not found)")
    return file.read_text(encoding="utf-8")


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
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="The target engine, every field of app/engine/config.py's EngineConfig: model, load_format, "
        "dtype, device, max_model_len, max_num_seqs, feature_layers, prepack, fp32_lm_head, greedy_screen, "
        "chat_template (max_draft_len is `gamma`). The keys model, dtype, device, max_model_len, max_num_seqs and "
        "chat_template are also accepted at the top level of `args`; chat_template there or here is a Jinja "
        "template's text or a file's path (vLLM's --chat-template).",
    )
    served_model_name: str = Field(
        "smollm2-135m", min_length=1, description="Name clients pass as `model`; anything else answers 404. Unset: "
        "`engine.model` as written (vLLM's default)."
    )
    reasoning_parser: ReasoningParserName | None = Field(
        None, description="vLLM's `--reasoning-parser`: a reasoning model's `<think>` ... `</think>` text apart from "
        "its answer in chat responses (`message.reasoning`, streamed `delta.reasoning`): `deepseek_r1` or `qwen3` "
        "(app/serving/reasoning.py). Unset: the text as the model wrote it."
    )
    tool_call_parser: ToolParserName | None = Field(
        None, description="vLLM's `--tool-call-parser`: how a chat answer's tool calls are read from its text when "
        "the model chooses (`tool_choice: auto`): `hermes` (`<tool_call>{...}</tool_call>`: Qwen2.5, Qwen3, Hermes, "
        "deployments/templates/chatml_tools.jinja) or `llama3_json` (Llama 3.1's JSON calls) (app/serving/tools.py). "
        "Named and `required` tool choices need no parser: their grammar writes the calls."
    )
    enable_auto_tool_choice: bool = Field(
        False, description="vLLM's `--enable-auto-tool-choice`: the model may answer with tool calls when it chooses "
        "(`tool_choice: auto`, the default with tools); needs `tool_call_parser`. Off: such requests answer 400."
    )
    sanitize_chat_control_tokens: bool = Field(
        False, description="Encode a control token's text inside chat messages (`<|im_start|>`) as text, so only the "
        "chat template writes control tokens and a client cannot write turns of other roles (Hugging Face's "
        "`sanitize_control_tokens`). Off: such text becomes the control token, as in vLLM."
    )
    mock_engine: bool = Field(
        False, description="Replace the TargetEngine by a deterministic weight-free engine (tests; `engine` unused)."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM's `--scheduling-policy`: `fcfs` admits a target replica's queued requests in "
        "arrival order; `priority` by the requests' `priority` (lower first; arrival order among equals). Running "
        "requests are not preempted."
    )
    max_queued_requests: int = Field(
        32, ge=0, description="Requests waiting for a KV slot per target replica; beyond it answers 503."
    )
    max_prefill_tokens: int = Field(
        512, ge=1, description="Prompt tokens prefilled in one forward: requests admitted together share one batched "
        "prefill up to this many computed tokens, and with chunked prefill a longer prompt goes in pieces of this "
        "size, so a round waits for at most this much prefill; a prefix reused from the prefix cache does not count "
        "(vLLM's max_num_batched_tokens for prefills)."
    )
    enable_chunked_prefill: bool | None = Field(
        None, description="A prompt over what is left of max_prefill_tokens is prefilled in pieces of at most "
        "max_prefill_tokens tokens, one prefill forward between two rounds (its next piece and admissions of prompts "
        "that fit the budget whole, in turn), so the running requests go on streaming and short ones get in while a "
        "long prompt is prefilled (vLLM's --enable-chunked-prefill). None: on, except with engine.batch_invariant "
        "(a prompt's keys/values would depend on where it was cut); true with batch_invariant is an error."
    )
    stream_interval: int = Field(
        1, ge=1, description="Tokens a request gathers before its text is sent (vLLM's --stream-interval): fewer, "
        "larger chunks cost the streaming path (two processes and the HTTP proxy) less per token. The first token "
        "and the last are always sent at once."
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
    speculation_guard: bool = Field(
        True, description="dspark / dspark-async run plain rounds in batch sizes where measured speculative rounds "
        "commit fewer tokens per ms than plain ones, probing both (app/scheduling/guard.py)."
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
        description="Throughput profile JSON of the target (verify-step and draft-step times), checked against "
        "`engine.model` and dtype at build, or 'auto': the measured profile in profiles/ of `engine.model` on this "
        "host's CPU (at `torch_threads` threads) or GPU, as `python -m app.scheduling.profiler` writes it; without "
        "one, each target replica measures one at start-up within `profile_budget_s` and caches it on this host for "
        "the next start (app/serving/profiles.py).",
    )
    profile_budget_s: float = Field(
        60.0, gt=0, description="profile 'auto' with no measured profile: the time a target replica aims to spend "
        "measuring one at start-up (seconds; fewer repeats per grid cell when the estimate exceeds it).",
    )
    drafter_placement: Literal["separate", "colocated"] = Field(
        "separate",
        description="'separate': Drafter replicas on their own resource group (drafter_replicas), one call between "
        "replicas per round; 'colocated': the drafter runs inside each target replica, on its torch thread (no "
        "Drafter deployment; drafter_replicas is unused). Colocated is faster on a small CPU host (docs/serving.md).",
    )
    drafter_channel: bool = Field(
        True, description="Separate placement: a target replica sends its drafter calls over a Unix socket its "
        "Drafter replica listens on (app/serving/channel.py) when both run on one Ray node, instead of through "
        "Serve's handle, whose router and data plane add milliseconds to every round; across nodes, or with false, "
        "calls go through the handle. Serve does not count channel calls as the Drafter's ongoing requests: with "
        "Ray's default autoscaling policy instead of the SLO policy, set false.",
    )
    drafter_timeout_s: float = Field(
        5.0, gt=0, description="A call to a Drafter replica slower than this fails over to plain decoding for its "
        "requests (separate placement; a colocated drafter runs on the engine's thread and has no timeout).",
    )
    drafter_state_ttl_s: float = Field(
        600.0, gt=0, description="A Drafter replica drops the state of a target replica's requests once it has heard "
        "nothing (no call, no probe) from that target for this long: the target died or was replaced and cannot tell "
        "it to forget them. A live target with speculating requests calls far more often.",
    )
    step_timeout_s: float = Field(
        120.0, ge=1.0, description="A replica whose torch thread has been in one call (a round, a prefill piece, a "
        "drafter call) for longer than this is stuck: it fails Serve's health check, so Serve replaces it, and a "
        "Target stops reporting its load, so the Router sends it no new request (vLLM's engine iteration timeout is "
        "the same idea). At least 1 s; keep it well above the slowest legitimate step (a long prompt's prefill "
        "piece, a first step that compiles): a replica that trips it under load is replaced again and again.",
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
        None, description=f"Bearer key required on /v1 routes, /tokenize and /detokenize (None: read "
        f"${API_KEY_ENV}; unset or empty: open)."
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

    @model_validator(mode="before")
    @classmethod
    def _engine_keys_at_top(cls, data):
        """Move the top-level shorthands of ``TOP_LEVEL_ENGINE_KEYS`` into the ``engine`` section; an unset
        ``served_model_name`` is the model reference."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = data.get("engine", {})
        engine = dict(engine.model_dump(exclude_unset=True) if isinstance(engine, EngineConfig) else engine)
        for key in sorted(TOP_LEVEL_ENGINE_KEYS & data.keys()):
            if key in engine:
                raise ValueError(f"{key} is set both at the top level and in the engine section; keep one")
            engine[key] = data.pop(key)
        if isinstance(template := engine.get("chat_template"), str) and not is_template_text(template):
            engine["chat_template"] = read_chat_template(template)
        data["engine"] = engine
        if "served_model_name" not in data and isinstance(engine.get("model"), str):
            data["served_model_name"] = engine["model"]
        return data

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, value: str) -> str:
        # imported here: the scheduling package needs torch, this module does not (the HTTP ingress reads it)
        from app.scheduling.policies import make_policy

        make_policy(value)  # raises ValueError naming the policy
        return value

    @field_validator("drafter_checkpoint", "profile")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return value if value == AUTO_PROFILE else resolve_path(value)

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        if "max_draft_len" in self.engine.model_fields_set:
            raise ValueError("engine.max_draft_len is set by gamma (the draft block size); set gamma instead")
        if self.gamma >= self.max_model_len // 2:
            raise ValueError(f"gamma {self.gamma} leaves no room in max_model_len {self.max_model_len}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} exceeds ngram_max {self.ngram_max}")
        if self.enable_chunked_prefill and self.engine.batch_invariant:
            raise ValueError("enable_chunked_prefill cuts prompts where the budget falls; it cannot be combined with "
                             "engine.batch_invariant (leave enable_chunked_prefill null or set it false)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice reads the calls from the model's text: set tool_call_parser")
        if self.mock_engine and self.drafter == "dspark" and self.speculates:
            raise ValueError("drafter 'dspark' needs the real engine (the mock engine has no features); use 'mock'")
        return self

    def engine_config(self) -> EngineConfig:
        """The target replica's ``EngineConfig``: the ``engine`` section with ``max_draft_len = gamma``, and, when a
        trained drafter (``drafter: dspark``, any checkpoint format) speculates and the section names no
        ``feature_layers``, the target layers that drafter was trained on."""
        fields = {**self.engine.model_dump(exclude_unset=True), "max_draft_len": self.gamma}
        if self.engine.feature_layers is None and self.speculates and self.drafter == "dspark" and not self.mock_engine:
            from app.drafters.checkpoint import read_checkpoint_config

            fields["feature_layers"] = tuple(read_checkpoint_config(self.drafter_checkpoint)["config"]["feature_layers"])
        return EngineConfig.model_validate(fields)

    @property
    def chunked_prefill(self) -> bool:
        """``enable_chunked_prefill`` resolved (None: on unless ``engine.batch_invariant``)."""
        if self.enable_chunked_prefill is None:
            return not self.engine.batch_invariant
        return self.enable_chunked_prefill

    @property
    def model(self) -> str:
        """The target model reference (``engine.model``)."""
        return self.engine.model

    @property
    def dtype(self) -> str:
        """The target dtype (``engine.dtype``)."""
        return self.engine.dtype

    @property
    def device(self) -> str:
        """The target device (``engine.device``)."""
        return self.engine.device

    @property
    def max_model_len(self) -> int:
        """Per-request context limit in tokens (``engine.max_model_len``)."""
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        """Requests decoded concurrently per target replica (``engine.max_num_seqs``)."""
        return self.engine.max_num_seqs

    @property
    def speculates(self) -> bool:
        """Whether rounds call the drafter (policy 'none' never does)."""
        from app.scheduling.policies import make_policy

        return make_policy(self.policy).speculates

    @property
    def resolved_api_key(self) -> str | None:
        """The API key in force: the config's, else ``$DSPARK_API_KEY``; empty means none."""
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return key or None

    def profile_path(self) -> str | None:
        """The throughput profile in force before any replica starts: ``committed_profile_path()``, else the one
        this host measured at start-up before (``profiles.profile_cache_path``), else None (a target replica will
        measure one; also where this process does not see the engine's GPU, ``_hardware``).

        Raises:
            FileNotFoundError: 'auto', the mock engine and no measured profile of ``model`` at all.
        """
        committed = self.committed_profile_path()
        hardware = self._hardware()
        if committed is not None or self.mock_engine or hardware is None:
            return committed
        from app.engine.loader import resolve_dtype
        from app.serving.profiles import profile_cache_path

        dtype = str(resolve_dtype(self.dtype, self._torch_device())).removeprefix("torch.")
        cached = profile_cache_path(self, hardware=hardware, dtype=dtype)
        return str(cached) if cached.is_file() else None

    def committed_profile_path(self) -> str | None:
        """``profile`` when named; for 'auto' the first measured profile of ``model`` in ``PROFILES_DIR`` for this
        host's hardware (named as the profiler records it), the target's dtype and the engine's ``verify_step``
        (real weights before dummy ones, each newest first), else None (also where this process does not see the
        engine's GPU). The mock engine cannot be measured: it takes the newest measured profile of ``model`` on any
        hardware, with a warning.

        Raises:
            FileNotFoundError: 'auto', the mock engine and no measured profile of ``model`` at all.
        """
        if self.profile != AUTO_PROFILE:
            return self.profile
        from app.engine.loader import resolve_dtype
        from app.scheduling.profile import measured_profiles

        hardware = self._hardware()
        if hardware is None:
            return None
        dtype = str(resolve_dtype(self.dtype, self._torch_device())).removeprefix("torch.")
        profiles = measured_profiles(PROFILES_DIR, model=self.model, verify_step=self.engine.verify_step)
        here = [path for provenance, path in profiles if (provenance.hardware, provenance.dtype) == (hardware, dtype)]
        if here:
            return str(here[0])
        if not self.mock_engine:
            return None
        if not profiles:
            raise FileNotFoundError(f"profile: auto found no measured profile of {self.model} in {PROFILES_DIR} "
                                    "for the mock engine; name a profile file")
        log.warning("profile: mock engine, no measured profile of %s on %r in %s; using %s, measured on %r",
                    self.model, hardware, PROFILES_DIR, profiles[0][1].name, profiles[0][0].hardware)
        return str(profiles[0][1])

    def _torch_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def _hardware(self) -> str | None:
        """The engine's hardware as the profiler names it (``hardware_name``), or None where this process cannot
        see it: a CUDA engine from a node without a GPU (the application's build or the Router on a CPU-only head
        node). The target replicas then resolve 'auto' on their own GPUs."""
        import torch

        from app.engine.hardware import hardware_name

        device = self._torch_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            return None
        return hardware_name(device, self.torch_threads)

    def check_files(self) -> None:
        """Fail fast, naming the field, when a file the config points at is missing.

        Raises:
            FileNotFoundError: ``engine.model`` names no local checkpoint, or one without a tokenizer or (load_format
                'auto') weights (``loader.check_target``); ``profile`` or (for drafter 'dspark')
                ``drafter_checkpoint`` does not exist.
            ProfileMismatchError: a profile named explicitly was measured for another model or dtype.
            ValueError: the model's architecture is not supported, its config and weights disagree (names or shapes
                in the safetensors headers), or its context is shorter than
                ``engine.max_model_len``; ``prompt_lookup`` with a checkpoint that has no lookup table.
        """
        if not self.mock_engine:
            from app.engine.loader import check_target

            try:
                _, _, args = check_target(self.model, load_format=self.engine.load_format)
            except (FileNotFoundError, ValueError) as e:
                raise type(e)(f"engine.model: {e}") from e
            if self.max_model_len > args.max_position_embeddings:
                raise ValueError(f"engine.max_model_len: {self.max_model_len} exceeds the context limit of "
                                 f"{self.model}, {args.max_position_embeddings} tokens (its max_position_embeddings, "
                                 "or its sliding window)")
        path = self.profile_path()
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"profile: no such file {self.profile}")
        if self.profile != AUTO_PROFILE and not self.mock_engine:
            self._check_profile_matches()
        checkpoint = Path(self.drafter_checkpoint) / "config.json"
        if self.speculates and self.drafter == "dspark" and not checkpoint.is_file():
            raise FileNotFoundError(
                f"drafter_checkpoint: no DSpark checkpoint at {self.drafter_checkpoint} (expected config.json and "
                f"model.safetensors). Train one for {self.model} with python -m app.pipeline --model "
                f"{self.model} --out runs/drafter (docs/drafter.md) and set drafter_checkpoint: "
                "runs/drafter/checkpoint, or use a drafter that needs no training: drafter: ngram, or policy: none"
            )
        if self.speculates and self.drafter == "dspark" and self.prompt_lookup:
            from app.drafters.lookup import read_lookup_rates

            if read_lookup_rates(self.drafter_checkpoint) is None:
                raise ValueError(
                    f"prompt_lookup: the checkpoint at {self.drafter_checkpoint} has no lookup table; fit one with "
                    "python -m app.drafters.train.calibrate_lookup or set prompt_lookup: false"
                )

    def _check_profile_matches(self) -> None:
        """Raise ``ProfileMismatchError`` naming the profile file and the target unless ``profile`` was measured for
        ``model`` (``profile.model_matches``) in the target's dtype; warn when it was measured with another
        ``engine.verify_step`` (its costs are another layout's: a ragged profile under-prices padded steps)."""
        from app.engine.loader import resolve_dtype
        from app.scheduling.profile import ProfileMismatchError, load_profile

        dtype = str(resolve_dtype(self.dtype, self._torch_device())).removeprefix("torch.")
        profile = load_profile(self.profile)
        try:
            profile.ensure_matches(self.model, dtype=dtype)
        except ProfileMismatchError as e:
            raise ProfileMismatchError(f"profile {self.profile} does not fit the target {self.model} ({dtype}): {e}; "
                                       "or set profile: auto") from e
        if profile.verify_step != self.engine.verify_step:
            log.warning("profile %s was measured with verify_step %s, the engine runs %s: the scheduler prices steps "
                        "by that layout; measure one with python -m app.scheduling.profiler --verify-step %s, or set "
                        "profile: auto", self.profile, profile.verify_step, self.engine.verify_step,
                        self.engine.verify_step)
