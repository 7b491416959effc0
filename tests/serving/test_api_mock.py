"""The Serve application on the mock engine and mock drafter: API schema, streaming, errors, auth, overload,
disconnect cleanup and drafter fail-over. One local Ray and one application for the whole module."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import ray
from ray import serve

from app.serving.builder import build_app
from app.serving.mock import next_token, token_text
from tests.serving.helpers import local_serve, sse_events, stream_text, wait_until

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "mock-model"
VOCAB = 512
MAX_MODEL_LEN = 256
ARGS = {
    "mock_engine": True, "drafter": "mock", "policy": "dspark", "gamma": 4, "served_model_name": MODEL,
    "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "max_queued_requests": 2, "mock_step_ms": 10,
    "mock_vocab_size": VOCAB, "api_key": KEY, "drafter_timeout_s": 2.0, "stats_interval_s": 0.2,
    "target": {"num_cpus": 0.1}, "drafter_replicas": {"num_cpus": 0.1}, "ingress": {"num_cpus": 0.1},
    "router_num_cpus": 0.05, "max_request_bytes": 64 * 1024,
}
APP = "mock"


@pytest.fixture(scope="module")
def url():
    with local_serve(num_cpus=2) as base:
        serve.run(build_app(ARGS), name=APP, route_prefix="/")
        yield base


def expected_text(content: str, n: int) -> str:
    tok, out = (1, [])  # encode_chat ends with token 1
    for _ in range(n):
        tok = next_token(tok, VOCAB)
        out.append(token_text(tok))
    return "".join(out)


def chat(content: str = "hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def test_health_open_and_api_key(url):
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=3), headers=headers)
        assert r.status_code == 401 and "w" not in r.text.replace("authentication_error", "")
    r = httpx.get(f"{url}/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_chat_non_streaming_schema_usage_and_stats(url):
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=20, spec_stats=True), headers=AUTH,
                   timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected_text("hi", 20)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}
    stats = body["spec_stats"]
    assert stats["rounds"] >= 1 and stats["accepted_tokens"] > 0 and not stats["fallback"]
    assert stats["accepted_tokens"] + stats["rounds"] == 19  # every token after the prefill came from a round


def test_streaming_equals_non_streamed_and_usage(url):
    plain = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=15), headers=AUTH, timeout=30).json()
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=30,
                      json=chat(max_tokens=15, stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len([e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]) > 1
    assert stream_text(events) == plain["choices"][0]["message"]["content"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 15 and events[-1]["choices"] == []


def test_completions_and_stop_string(url):
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "ab", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert r.json()["usage"]["completion_tokens"] == 8
    full = expected_text("hi", 12)
    stop = full.split()[5]  # the 6th word
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=12, stop=[stop]), headers=AUTH, timeout=30)
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == full[: full.index(stop)]


BAD = [
    ("malformed json", b"{not json", 400),
    ("missing messages", {"model": MODEL}, 400),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("unknown model", {**chat(), "model": "gpt-9"}, 404),
    ("prompt over context", chat("x" * (MAX_MODEL_LEN + 10), max_tokens=5), 400),
    ("max_tokens 0", chat(max_tokens=0), 400),
    ("max_tokens over limit", chat(max_tokens=MAX_MODEL_LEN * 4), 400),
    ("temperature high", chat(temperature=2.5), 400),
    ("temperature negative", chat(temperature=-1), 400),
    ("top_p zero", chat(top_p=0), 400),
    ("top_p high", chat(top_p=1.5), 400),
    ("n > 1", chat(n=2), 400),
    ("seed over 64 bits", chat(seed=10**23), 400),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("not an object", b"[1, 2]", 400),
    ("body over max_request_bytes", chat("x" * 100_000, max_tokens=5), 413),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_openai_error(url, name, body, status):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30, **kwargs)
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"]


def test_oversized_chunked_body_and_unknown_routes_are_openai_errors(url):
    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "mock-model", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}]}'

    r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, content=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{url}/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/nothing", headers=AUTH, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_validator_errors_have_no_pydantic_prefix(url):
    r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=chat(logprobs=True), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "logprobs is not supported"


def test_overload_answers_503_with_retry_after(url):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[
                client.post(f"{url}/v1/chat/completions", json=chat(max_tokens=120), headers=AUTH)
                for _ in range(14)
            ])

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 4, codes
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["Retry-After"] == "1" and rejected.json()["error"]["code"] == "overloaded"


def target_state() -> dict:
    return serve.get_deployment_handle("Target", APP).debug_state.remote().result()


def drafter_states() -> int:
    return serve.get_deployment_handle("Drafter", APP).debug_state.remote().result()["states"]


def test_disconnects_free_target_and_drafter_state(url):
    async def disconnect_once(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"{url}/v1/chat/completions", headers=AUTH,
                                 json=chat(max_tokens=200, stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"content"' in line:
                    break  # leave mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(25):
                await asyncio.gather(*[disconnect_once(client) for _ in range(4)])

    asyncio.run(run())
    wait_until(lambda: (s := target_state())["active"] == 0 and s["engine_active"] == 0 and s["waiting"] == 0)
    wait_until(lambda: drafter_states() == 0)


def _drafter_actor():
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if "Drafter" in a["name"] and a["namespace"] == "serve"]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace="serve")


def test_drafter_failure_falls_back_to_plain_decoding(url):
    """Kill the drafter replica mid-request: the request completes, exactly, with plain decoding."""
    n = 150
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json=chat(max_tokens=n, stream=True, spec_stats=True)) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"content"' in line:
                break
        ray.kill(_drafter_actor(), no_restart=True)
        rest = [line for line in lines]
    events = [e for e in sse_events(_Lines([line] + rest))]
    final = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["spec_stats"]["fallback"] is True
    full = expected_text("hi", n)
    assert full.endswith(stream_text(events))
    assert target_state()["drafter_failures"] >= 1
    # The replica is replaced; later requests speculate again and state does not leak.
    wait_until(lambda: httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=10, spec_stats=True),
                                  headers=AUTH, timeout=30).json()["spec_stats"]["fallback"] is False,
               timeout_s=60, interval_s=1.0)
    wait_until(lambda: drafter_states() == 0)


def test_a_failing_step_ends_its_requests_with_an_error_and_the_server_goes_on(url):
    """A verify step that raises: a streamed request gets an error event after its first tokens, a non-streamed
    one a 500 JSON error, and later requests are served (the step loop survives)."""
    serve.run(build_app({**ARGS, "mock_verify_fails_after": 6}), name="failing-step", route_prefix="/failing-step")
    base = f"{url}/failing-step/v1/chat/completions"
    with httpx.stream("POST", base, headers=AUTH, timeout=30, json=chat(max_tokens=20, stream=True)) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"content"' in lines[1], lines
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "internal_error", lines
    r = httpx.post(base, headers=AUTH, timeout=30, json=chat(max_tokens=20))
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    for _ in range(2):
        r = httpx.post(base, headers=AUTH, timeout=30, json=chat(max_tokens=5))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected_text("hi", 5)
    serve.delete("failing-step")


class _Lines:
    """Adapter so ``sse_events`` can parse already-read lines."""

    def __init__(self, lines: list[str]) -> None:
        self._lines = lines

    def iter_lines(self):
        return iter(self._lines)


COLOCATED = {**ARGS, "drafter_placement": "colocated"}


def _app_target_state(app: str) -> dict:
    return serve.get_deployment_handle("Target", app).debug_state.remote().result()


def test_colocated_drafter_speculates_exactly_and_frees_state(url):
    """``drafter_placement: colocated``: no Drafter deployment, the target drafts itself, lossless, no leaks."""
    serve.run(build_app(COLOCATED), name="colocated", route_prefix="/colocated")
    assert "Drafter" not in serve.status().applications["colocated"].deployments
    base = f"{url}/colocated"
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(max_tokens=40, spec_stats=True), headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected_text("hi", 40)
    assert body["spec_stats"]["accepted_tokens"] > 0 and not body["spec_stats"]["fallback"]
    for _ in range(5):  # leave mid-stream
        with httpx.stream("POST", f"{base}/v1/chat/completions", headers=AUTH, timeout=30,
                          json=chat(max_tokens=200, stream=True)) as s:
            next(line for line in s.iter_lines() if '"content"' in line)
    wait_until(lambda: (s := _app_target_state("colocated"))["active"] == 0 and s["engine_active"] == 0
               and s["colocated_drafter_states"] == 0)
    serve.delete("colocated")


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_drafter_that_raises_falls_back_and_its_state_is_dropped(url, placement):
    """A drafter that raises half-way through a call (after ``start``, in ``propose``), in its own replica or
    colocated: the request completes exactly with plain decoding, and the state the call left is dropped."""
    app = f"raising-{placement}"
    serve.run(build_app({**ARGS, "drafter_placement": placement, "mock_drafter_fails": "propose"}), name=app,
              route_prefix=f"/{app}")
    r = httpx.post(f"{url}/{app}/v1/chat/completions", json=chat(max_tokens=30, spec_stats=True), headers=AUTH,
                   timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected_text("hi", 30)
    assert body["spec_stats"]["fallback"] is True and body["spec_stats"]["accepted_tokens"] == 0
    state = _app_target_state(app)
    assert state["drafter_failures"] >= 1
    if placement == "colocated":
        assert state["colocated_drafter_states"] == 0
    else:
        wait_until(lambda: serve.get_deployment_handle("Drafter", app).debug_state.remote().result()["states"] == 0)
    serve.delete(app)


def test_colocated_drafter_that_cannot_drop_state_stops_drafting_on_its_replica(url):
    """start, propose and finish all raise: requests complete exactly with plain decoding, the replica stops
    drafting (no hang, no retry loop) and the state it could not drop stays counted."""
    serve.run(build_app({**COLOCATED, "mock_drafter_fails": "all"}), name="broken", route_prefix="/broken")
    for n in (12, 9):  # the second request arrives after the replica stopped drafting
        r = httpx.post(f"{url}/broken/v1/chat/completions", json=chat(max_tokens=n, spec_stats=True), headers=AUTH,
                       timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected_text("hi", n)
        assert r.json()["spec_stats"]["accepted_tokens"] == 0
    state = _app_target_state("broken")
    assert state["drafter_failures"] == 1 and state["colocated_drafter_states"] == 1
    serve.delete("broken")
