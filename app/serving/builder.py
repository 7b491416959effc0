"""``build_app(args)``: the Serve application builder named by ``deployments/*.yaml`` (``import_path``).

Validates ``args`` into ``AppConfig`` (an unknown or bad key fails here, naming the field), checks the files it
points at, then binds the undecorated deployment classes with ``serve.deployment(cls, **options)``:

    Ingress (FastAPI) -> Target replicas  -> Drafter replicas (one call per round, sticky per target replica)
                      \\-> Router (one replica: load reports in, target choice and snapshot out)

With ``drafter_placement: colocated`` there is no Drafter deployment: each target replica drafts on its own
torch thread. Target and Drafter replicas each ask for their own resource group (``target`` / ``drafter_replicas``
placement: CPUs, GPUs, custom resources), so a cluster config can pin them to different nodes; with a CUDA
``engine.device`` a replica whose placement names no GPUs asks for one.

Before binding anything, a trained drafter checkpoint is checked against the target (``check_drafter_fits_target``):
a drafter trained for another model fails here, naming the field, instead of inside a replica. With
``autoscaling.enabled`` both get a Ray Serve ``autoscaling_config`` instead of a fixed ``num_replicas``; the
SLO policy that moves them is the application-level ``autoscaling_policy`` of the YAML (``autoscale/``).
"""

from __future__ import annotations

import logging

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.serving.config import AppConfig, Placement
from app.serving.drafter import DrafterReplica
from app.serving.ingress import FastAPIIngress, admission_limit
from app.serving.router import PinnedReplicaRouter, Router
from app.serving.target import TargetReplica

log = logging.getLogger("ray.serve")
SERVE_QUEUE_MARGIN = 8  # calls a replica accepts beyond its own admission limit (its own 503 answers them)
# HTTP requests an ingress replica takes beyond its admission limit: those it answers at once (503s, 4xx, models,
# metrics). Beyond them Serve's proxy would hold requests in its own queue and retry with back-off for seconds.
INGRESS_REQUEST_MARGIN = 1000


def checked_config(args: dict) -> AppConfig:
    """The YAML ``args`` as an ``AppConfig`` whose files exist and whose drafter fits its target.

    Raises:
        pydantic.ValidationError: a bad or unknown field (the message names it).
        FileNotFoundError: the profile or the DSpark checkpoint is missing (the message names the field).
        ProfileMismatchError: a named profile was measured for another model or dtype.
        DrafterMismatchError: the drafter checkpoint was trained for another target (``check_drafter_fits_target``).
    """
    config = AppConfig.model_validate(args)
    config.check_files()
    check_drafter_fits_target(config)
    return config


def build_app(args: dict) -> Application:
    """Build the application from the YAML ``args`` (see ``AppConfig`` for every field).

    Raises:
        What ``checked_config`` raises.
    """
    config = checked_config(args)
    pinned = RequestRouterConfig(request_router_class=PinnedReplicaRouter)
    slo = config.autoscaling
    max_targets = slo.max_target_replicas if slo.enabled else config.target.num_replicas
    router = serve.deployment(
        Router, name="Router", num_replicas=1,
        ray_actor_options={"num_cpus": config.router_num_cpus, "resources": dict(config.router_resources)},
        # every request an ingress admits may ask for its target at once, beside the targets' load reports: Serve's
        # default of 5 in flight made a burst's calls wait in back-off retries (25 ms and more each)
        max_ongoing_requests=config.ingress.num_replicas * admission_limit(config) + max_targets + SERVE_QUEUE_MARGIN,
        # its calls (load reports every stats_interval_s, one target choice per request) are not worth a log line
        logging_config={"enable_access_log": False},
    ).bind(config)
    drafter = None
    if config.speculates and config.drafter_placement == "separate":
        drafter = serve.deployment(
            DrafterReplica, name="Drafter", **_scaling(config, "drafter"),
            ray_actor_options=_actor_options(config, config.drafter_replicas),
            max_ongoing_requests=2 * max_targets + SERVE_QUEUE_MARGIN,
            request_router_config=pinned,
            # one call per target round: an access-log line each would flood the log (dspark_draft_call_ms counts them)
            logging_config={"enable_access_log": False},
        ).bind(config)
    per_target = config.max_num_seqs + config.max_queued_requests + SERVE_QUEUE_MARGIN
    target = serve.deployment(
        TargetReplica, name="Target", **_scaling(config, "target"),
        ray_actor_options=_actor_options(config, config.target),
        max_ongoing_requests=per_target, max_queued_requests=per_target * max_targets,
        request_router_config=pinned,
    ).bind(config, drafter, router)
    return serve.deployment(
        FastAPIIngress, name="Ingress", num_replicas=config.ingress.num_replicas,
        ray_actor_options=config.ingress.actor_options(),
        max_ongoing_requests=admission_limit(config) + INGRESS_REQUEST_MARGIN,
    ).bind(config, target, router)


def _scaling(config: AppConfig, deployment: str) -> dict:
    """``num_replicas`` of the deployment, or its ``autoscaling_config`` when SLO autoscaling is on.

    The fallback ``target_ongoing_requests`` (Ray's default policy, used only if the YAML lacks the SLO
    policy) is a full KV-slot set per target and one drafter call per ``1 / drafters_per_target`` targets.
    """
    slo = config.autoscaling
    if not slo.enabled:
        placement = config.target if deployment == "target" else config.drafter_replicas
        return {"num_replicas": placement.num_replicas}
    fallback = config.max_num_seqs if deployment == "target" else 1 / slo.drafters_per_target
    return {"autoscaling_config": slo.deployment_autoscaling(deployment=deployment,
                                                             fallback_ongoing_requests=fallback)}


def _actor_options(config: AppConfig, placement: Placement) -> dict:
    """``placement``'s Ray actor options for a replica that runs torch on ``engine.device``: with a CUDA device and
    no GPUs in ``placement``, one GPU (a replica without one would fail to load on ``cuda``)."""
    options = placement.actor_options()
    if config.device.startswith("cuda") and placement.num_gpus == 0:
        options["num_gpus"] = 1
    return options


class DrafterMismatchError(ValueError):
    """A trained drafter checkpoint that does not fit the configured target."""


def check_drafter_fits_target(config: AppConfig) -> None:
    """For ``drafter: dspark`` (a trained checkpoint of any kind) on the real engine: the checkpoint's vocabulary size,
    hidden size and feature layers must be the target's (from its ``config.json``), and its tokenizer the same as the
    tokenizer of the model it was trained for (compared when that model is also present locally; logged when not).

    Raises:
        DrafterMismatchError: naming the drafter checkpoint, the target and the first field that differs, and the
            drafters that need no training.
    """
    if config.mock_engine or not config.speculates or config.drafter != "dspark":
        return
    from transformers import AutoConfig

    from app.drafters.checkpoint import KINDS, read_checkpoint_config
    from app.engine.loader import local_checkpoint
    from app.engine.model import ModelArgs
    from app.scheduling.profile import model_matches

    doc = read_checkpoint_config(config.drafter_checkpoint)
    kind = doc.get("kind", "dspark")
    if kind not in KINDS:
        raise DrafterMismatchError(f"drafter checkpoint {config.drafter_checkpoint}: unknown kind {kind!r}; expected "
                                   f"one of {sorted(KINDS)}")
    shape = KINDS[kind][0].model_validate(doc["config"])
    target_dir = local_checkpoint(config.model)
    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(target_dir, local_files_only=True))
    layers = config.engine.feature_layers or tuple(shape.feature_layers)  # unset: the engine takes the drafter's
    wanted = {"vocab_size": args.vocab_size, "hidden_size": args.hidden_size, "target_hidden_size": args.hidden_size,
              "feature_layers": list(layers)}

    def mismatch(what: str) -> DrafterMismatchError:
        return DrafterMismatchError(
            f"drafter checkpoint {config.drafter_checkpoint} (trained for {shape.target}) does not fit the target "
            f"{config.model}: {what}. Train a drafter for this target (python -m app.pipeline --model "
            f"{config.model} --out runs/drafter, docs/drafter.md), or use a drafter that needs no training: "
            "drafter: ngram, or policy: none"
        )

    for field, value in wanted.items():
        have = getattr(shape, field)
        if (list(have) if field == "feature_layers" else have) != value:
            raise mismatch(f"{field} {have} in the drafter, {value} in the target")
    if not all(0 <= layer < args.num_layers for layer in layers):
        raise mismatch(f"feature_layers {list(layers)} in the drafter, the target has {args.num_layers} layers")
    if model_matches(shape.target, config.model):
        return
    try:
        trained_for = local_checkpoint(shape.target)
    except FileNotFoundError:
        log.warning("drafter checkpoint %s was trained for %s, which is not present here: its tokenizer is not "
                    "compared with %s's", config.drafter_checkpoint, shape.target, config.model)
        return
    if _vocabulary(trained_for) != _vocabulary(target_dir):
        raise mismatch(f"the tokenizer of {shape.target} differs from the target's")


def _vocabulary(model_dir) -> dict[str, int]:
    """The token -> id map of the tokenizer in ``model_dir``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True).get_vocab()
