"""``build_app(args)``: the Serve application builder named by ``deployments/*.yaml`` (``import_path``).

Validates ``args`` into ``AppConfig`` (an unknown or bad key fails here, naming the field), checks the files it
points at, then binds the undecorated deployment classes with ``serve.deployment(cls, **options)``:

    Ingress (FastAPI) -> Target replicas  -> Drafter replicas (one call per round, sticky per target replica)
                      \\-> Router (one replica: load reports in, target choice and snapshot out)

With ``drafter_placement: colocated`` there is no Drafter deployment: each target replica drafts on its own
torch thread. Target and Drafter replicas each ask for their own resource group (``target`` / ``drafter_replicas``
placement: CPUs, GPUs, custom resources), so a cluster config can pin them to different nodes. With
``autoscaling.enabled`` both get a Ray Serve ``autoscaling_config`` instead of a fixed ``num_replicas``; the
SLO policy that moves them is the application-level ``autoscaling_policy`` of the YAML (``autoscale/``).
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.serving.config import AppConfig
from app.serving.drafter import DrafterReplica
from app.serving.ingress import FastAPIIngress, admission_limit
from app.serving.router import PinnedReplicaRouter, Router
from app.serving.target import TargetReplica

SERVE_QUEUE_MARGIN = 8  # calls a replica accepts beyond its own admission limit (its own 503 answers them)
# HTTP requests an ingress replica takes beyond its admission limit: those it answers at once (503s, 4xx, models,
# metrics). Beyond them Serve's proxy would hold requests in its own queue and retry with back-off for seconds.
INGRESS_REQUEST_MARGIN = 1000


def build_app(args: dict) -> Application:
    """Build the application from the YAML ``args`` (see ``AppConfig`` for every field).

    Raises:
        pydantic.ValidationError: a bad or unknown field (the message names it).
        FileNotFoundError: the profile or the DSpark checkpoint is missing (the message names the field).
    """
    config = AppConfig.model_validate(args)
    config.check_files()
    pinned = RequestRouterConfig(request_router_class=PinnedReplicaRouter)
    slo = config.autoscaling
    max_targets = slo.max_target_replicas if slo.enabled else config.target.num_replicas
    router = serve.deployment(
        Router, name="Router", num_replicas=1,
        ray_actor_options={"num_cpus": config.router_num_cpus, "resources": dict(config.router_resources)},
        # its calls (load reports every stats_interval_s, one target choice per request) are not worth a log line
        logging_config={"enable_access_log": False},
    ).bind(config)
    drafter = None
    if config.speculates and config.drafter_placement == "separate":
        drafter = serve.deployment(
            DrafterReplica, name="Drafter", **_scaling(config, "drafter"),
            ray_actor_options=config.drafter_replicas.actor_options(),
            max_ongoing_requests=2 * max_targets + SERVE_QUEUE_MARGIN,
            request_router_config=pinned,
        ).bind(config)
    per_target = config.max_num_seqs + config.max_queued_requests + SERVE_QUEUE_MARGIN
    target = serve.deployment(
        TargetReplica, name="Target", **_scaling(config, "target"),
        ray_actor_options=config.target.actor_options(),
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
