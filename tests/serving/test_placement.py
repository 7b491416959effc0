"""Placement: on a local two-node Ray with fake resource groups (the head node holds the target group, the other
node the drafter group), target and drafter replicas land on the node of their own group."""

from __future__ import annotations

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from app.serving.builder import build_app
from tests.serving.helpers import end_shared_serve, free_port, require_serial

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase


def test_replicas_land_on_their_resource_groups():
    require_serial()
    end_shared_serve()  # this test needs a Ray of its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "resources": {"target_group": 2}})
    target_node = cluster.head_node
    drafter_node = cluster.add_node(num_cpus=1, resources={"drafter_group": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({
            "mock_engine": True, "drafter": "mock", "policy": "fixed-2", "gamma": 3, "served_model_name": "m",
            "max_model_len": 128, "max_num_seqs": 2,
            "target": {"num_replicas": 2, "num_cpus": 0.1, "resources": {"target_group": 1}},
            "drafter_replicas": {"num_replicas": 2, "num_cpus": 0.1, "resources": {"drafter_group": 1}},
            "ingress": {"num_cpus": 0.1}, "router_num_cpus": 0.05,
        }), name="placed", route_prefix="/")
        targets = {serve.get_deployment_handle("Target", "placed").debug_state.remote().result()["node_id"]
                   for _ in range(8)}
        drafters = {serve.get_deployment_handle("Drafter", "placed").debug_state.remote().result()["node_id"]
                    for _ in range(8)}
        assert targets == {target_node.node_id}
        assert drafters == {drafter_node.node_id}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                             "spec_stats": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        assert r.json()["spec_stats"]["accepted_tokens"] > 0
    finally:  # no serve.shutdown: its graceful wait for every replica costs seconds; the cluster goes anyway
        ray.shutdown()
        cluster.shutdown()
