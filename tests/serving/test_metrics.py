"""Prometheus metrics end to end: the mock application on a local Ray with a metrics export port; a few
requests; the node's /metrics endpoint is scraped until the counters settle and they must agree with each other
and with what the clients received."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from app.serving.builder import build_app
from tests.serving.helpers import free_port, local_serve

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase

MODEL = "mock-model"
ARGS = {
    "mock_engine": True, "drafter": "mock", "policy": "dspark", "gamma": 4, "served_model_name": MODEL,
    "max_model_len": 256, "max_num_seqs": 4, "max_queued_requests": 8, "mock_step_ms": 5, "api_key": "",
    "stats_interval_s": 0.2, "target": {"num_cpus": 0.1}, "drafter_replicas": {"num_cpus": 0.1},
    "ingress": {"num_cpus": 0.1}, "router_num_cpus": 0.05,
    # a flat profile, not this host's: where verifying past the mock drafter's confidence drop never pays, its
    # planted error is never verified and no token is wasted
    "profile": "tests/fixtures/profiles/test-mock-model-any.json",
}
REQUESTS, MAX_TOKENS = 8, 30
FLUSH_TIMEOUT_S = 60


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted tag items without Ray's own labels -> value}, for ``ray_dspark_*`` samples."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_dspark_"):
                tags = tuple(sorted((k, v) for k, v in s.labels.items() if k in ("policy", "replica", "position",
                                                                                  "quantile", "le")))
                out[s.name][tags] = out[s.name].get(tags, 0.0) + s.value
    return out


def total(metrics: dict, name: str, **match: str) -> float:
    return sum(v for tags, v in metrics.get(name, {}).items() if all((k, val) in tags for k, val in match.items())
               and not any(k == "le" for k, _ in tags))


@pytest.fixture(scope="module")
def served():
    port = free_port()
    with local_serve(num_cpus=2, _metrics_export_port=port) as base:
        serve.run(build_app(ARGS), name="metrics", route_prefix="/")
        yield base, port


@pytest.mark.slow
def test_counters_move_consistently(served):
    base, port = served

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(*[client.post(f"{base}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "spec_stats": True}) for i in range(REQUESTS)])
        return [r.json() for r in responses]

    bodies = asyncio.run(run())
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    accepted_sent = sum(b["spec_stats"]["accepted_tokens"] for b in bodies)
    assert completion == REQUESTS * MAX_TOKENS
    prompt_tokens = sum(b["usage"]["prompt_tokens"] for b in bodies)
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)

    def settled(m: dict) -> bool:
        """Every replica (target, drafter, router) has exported its figures of the last round."""
        return (total(m, "ray_dspark_output_tokens_total") == completion
                and total(m, "ray_dspark_requests_finished_total") == REQUESTS
                and total(m, "ray_dspark_accepted_tokens_total") == accepted_sent
                and total(m, "ray_dspark_draft_call_ms_count") >= total(m, "ray_dspark_drafted_rounds_total") > 0
                and "ray_dspark_router_verify_capacity" in m
                and total(m, "ray_dspark_prefix_cache_queries_total") == prompt_tokens)

    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while not settled(m := scrape(port)):  # each worker exports every few seconds, independently
        assert time.monotonic() < deadline, {k: total(m, k) for k in m}
        time.sleep(1.0)

    drafted = total(m, "ray_dspark_drafted_tokens_total", policy="dspark")
    verified = total(m, "ray_dspark_verified_tokens_total", policy="dspark")
    accepted = total(m, "ray_dspark_accepted_tokens_total", policy="dspark")
    wasted = total(m, "ray_dspark_wasted_tokens_total", policy="dspark")
    assert 0 < accepted < verified <= drafted  # the mock drafter errs once per block
    assert wasted == verified - accepted
    assert total(m, "ray_dspark_prefix_cache_hits_total") == cached
    assert total(m, "ray_dspark_position_verified_total") == verified
    assert total(m, "ray_dspark_position_accepted_total") == accepted
    assert total(m, "ray_dspark_position_accepted_total", position="1") >= \
        total(m, "ray_dspark_position_accepted_total", position="4")
    rounds = total(m, "ray_dspark_rounds_total")
    assert rounds > 0 and total(m, "ray_dspark_verify_step_ms_count") == rounds
    if sys.platform.startswith("linux"):  # the engine thread's scheduler times come from Linux's schedstat
        assert total(m, "ray_dspark_verify_cpu_ms_total") > 0
    assert total(m, "ray_dspark_tokens_per_step_count") == rounds
    assert total(m, "ray_dspark_accepted_length_count") == REQUESTS
    assert total(m, "ray_dspark_tpot_ms_count") == total(m, "ray_dspark_ttft_ms_count") == REQUESTS
    assert "ray_dspark_router_live_replicas" in m
    assert "ray_dspark_active_requests" in m and "ray_dspark_slo_state" in m
    replicas = {dict(tags)["replica"] for tags in m["ray_dspark_accepted_tokens_total"]}
    assert len(replicas) == 1  # one target replica, tagged with its id


def api_metrics(base: str) -> dict[tuple[str, tuple], float]:
    """``GET /metrics`` on the API port: (sample name, sorted labels) -> value."""
    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


@pytest.mark.slow
def test_api_port_metrics_carry_vllm_spec_decode_names_and_ray_metrics_stay_on_loopback(served):
    """``/metrics`` on the API port agrees with Ray's own export (vLLM's names included); Ray's node address and
    its metrics endpoint are on 127.0.0.1 as the HTTP host is (``local_ray.init_local_ray``)."""
    import ray

    base, port = served
    assert {(n["NodeManagerAddress"], n["MetricsExportPort"]) for n in ray.nodes() if n["Alive"]} == {
        ("127.0.0.1", port)}
    label = (("model_name", MODEL),)

    def settled() -> dict | None:
        ours, theirs = api_metrics(base), scrape(port)
        accepted = total(theirs, "ray_dspark_accepted_tokens_total")
        same = ours.get(("vllm:spec_decode_num_accepted_tokens_total", label)) == accepted > 0 and \
            ours.get(("vllm:spec_decode_num_draft_tokens_total", label)) == \
            total(theirs, "ray_dspark_verified_tokens_total")
        return ours if same else None

    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while (ours := settled()) is None:  # the Router hears every stats_interval_s, Ray's export every few seconds
        assert time.monotonic() < deadline
        time.sleep(1.0)
    per_pos = [ours[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*label, ("position", str(k))))]
               for k in range(ARGS["gamma"])]
    assert sum(per_pos) == ours[("vllm:spec_decode_num_accepted_tokens_total", label)]
    assert per_pos == sorted(per_pos, reverse=True)  # accepting position k needs k - 1 accepted before it
    assert ours[("vllm:spec_decode_num_drafts_total", label)] > 0
    assert ours[("dspark_requests_finished_total", label)] >= REQUESTS
    assert ours[("vllm:generation_tokens_total", label)] == ours[("dspark_output_tokens_total", label)] > 0
    assert ours[("vllm:prompt_tokens_total", label)] == ours[("dspark_prefix_cache_queries_total", label)] > 0
    ended = {reason: ours[("vllm:request_success_total", (("finished_reason", reason), *label))]
             for reason in ("stop", "length", "abort")}
    assert ended["stop"] + ended["length"] == ours[("dspark_requests_finished_total", label)]
    assert ended["abort"] == ours[("dspark_requests_cancelled_total", label)]
    assert ours[("vllm:num_requests_running", label)] == ours[("vllm:num_requests_waiting", label)] == 0  # all done
    finished = ours[("dspark_requests_finished_total", label)]
    admitted = ours[("vllm:request_prompt_tokens_count", label)]
    assert admitted == ours[("vllm:request_queue_time_seconds_count", label)] == \
        ours[("vllm:time_to_first_token_seconds_count", label)] >= finished
    assert ours[("vllm:request_prompt_tokens_sum", label)] == ours[("vllm:prompt_tokens_total", label)]
    assert ours[("vllm:e2e_request_latency_seconds_count", label)] == \
        ours[("vllm:request_generation_tokens_count", label)] == finished
    assert ours[("vllm:request_generation_tokens_sum", label)] == \
        ours[("vllm:generation_tokens_total", label)]  # no request was cancelled
    assert ours[("vllm:request_generation_tokens_bucket", (("le", "50.0"), *label))] == finished  # 30 tokens each
    assert 0 < ours[("vllm:inter_token_latency_seconds_count", label)] < ours[("vllm:generation_tokens_total", label)]
    assert 0 < ours[("vllm:time_to_first_token_seconds_sum", label)] < \
        ours[("vllm:e2e_request_latency_seconds_sum", label)]
    rounds = ours[("dspark_rounds_total", label)]
    assert 1 <= ours[("dspark_round_requests_total", label)] / rounds <= ARGS["max_num_seqs"]
    round_s, verify_s, wait_s = (ours[(f"dspark_{name}_seconds_total", label)]
                                 for name in ("round", "verify", "drafter_wait"))
    assert rounds * ARGS["mock_step_ms"] / 1000 <= verify_s and 0 < wait_s and verify_s + wait_s <= round_s
