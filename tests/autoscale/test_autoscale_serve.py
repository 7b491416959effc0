"""SLO autoscaling on a local Ray: the mock application, deployed from a config with the application-level
policy (as `serve run deployments/dspark-autoscale.yaml` does), under load whose TPOT exceeds the SLO, gains a
Target replica and, in the drafter ratio, a Drafter replica, and the added Target replica decodes requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml
from ray import serve
from ray.serve._private import api as serve_api
from ray.serve.schema import ServeDeploySchema

from app.serving.config import REPO_ROOT, AppConfig
from autoscale.policy import SLOAutoscalingPolicy
from tests.serving.helpers import shared_serve

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase

APP = "scale"
MODEL = "mock-model"
SLO = {  # TPOT of the mock at 40 ms per verify step is far above 5 ms: violated as soon as requests run
    "enabled": True, "tpot_ms": 5, "window_s": 4, "min_samples": 2, "upscale_after_s": 2, "cooldown_s": 5,
    "min_target_replicas": 1, "max_target_replicas": 2, "drafters_per_target": 1.0, "max_drafter_replicas": 2,
    "metrics_interval_s": 0.5, "look_back_period_s": 1.0,
}
ARGS = {
    "mock_engine": True, "drafter": "mock", "policy": "dspark", "gamma": 4, "served_model_name": MODEL,
    "max_model_len": 256, "max_num_seqs": 4, "max_queued_requests": 8, "mock_step_ms": 40, "api_key": "",
    "stats_interval_s": 0.2, "target": {"num_cpus": 0.1}, "drafter_replicas": {"num_cpus": 0.1},
    "ingress": {"num_cpus": 0.1}, "router_num_cpus": 0.05, "autoscaling": SLO,
}
SCALE_TIMEOUT_S = 45
ROUTED_TIMEOUT_S = 15


def test_example_config_shares_one_slo_section():
    doc = yaml.safe_load((REPO_ROOT / "deployments" / "dspark-autoscale.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(doc).applications
    assert app.autoscaling_policy["policy_function"] == "autoscale.policy:SLOAutoscalingPolicy"
    config = AppConfig.model_validate(app.args)
    assert config.autoscaling.enabled
    assert SLOAutoscalingPolicy(**app.autoscaling_policy["policy_kwargs"]).config == config.autoscaling


def decoding_replicas(url: str) -> list[str]:
    """The Target replicas in the Router's snapshot that have committed tokens (EMA of tokens per round > 0)."""
    replicas = httpx.get(f"{url}/router/snapshot", timeout=10).json()["replicas"]
    return [rid for rid, load in replicas.items() if load["tokens_per_step"] > 0]


def running(status, deployment: str) -> int:
    return status.applications[APP].deployments[deployment].replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_load_above_slo_adds_target_and_drafter_replicas():
    url = shared_serve()
    stop = threading.Event()
    try:
        client = serve_api.serve_start()
        client.deploy_apps(ServeDeploySchema.model_validate({"applications": [{
            "name": APP, "route_prefix": "/", "import_path": "app.serving.builder:build_app", "args": ARGS,
            "autoscaling_policy": {"policy_function": "autoscale.policy:SLOAutoscalingPolicy", "policy_kwargs": SLO},
        }]}), _blocking=True)
        status = serve.status()
        assert (running(status, "Target"), running(status, "Drafter")) == (1, 1)

        def user() -> None:
            with httpx.Client(timeout=60) as http:
                while not stop.is_set():
                    r = http.post(f"{url}/v1/chat/completions", json={
                        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40})
                    assert r.status_code in (200, 503), r.text

        users = [threading.Thread(target=user, daemon=True) for _ in range(4)]
        for u in users:
            u.start()
        deadline = time.monotonic() + SCALE_TIMEOUT_S
        while (running(status := serve.status(), "Target"), running(status, "Drafter")) != (2, 2):
            assert time.monotonic() < deadline, status.applications[APP].deployments
            time.sleep(1.0)
        # the added replica takes requests: the Router has its load reports and chooses it
        deadline = time.monotonic() + ROUTED_TIMEOUT_S
        while len(decoding := decoding_replicas(url)) < 2:
            assert time.monotonic() < deadline, decoding
            time.sleep(0.2)
        stop.set()
        for u in users:
            u.join(timeout=60)
    finally:
        stop.set()
        serve.delete(APP)
