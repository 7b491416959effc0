"""The Serve application on the mock engine and mock drafter: API schema, streaming, errors, auth, overload,
disconnect cleanup and drafter fail-over. One local Ray and one application for the whole module."""

from __future__ import annotations

import asyncio
import gzip
import importlib.metadata
import json
import math
import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from app.serving.builder import build_app
from app.engine.testing import next_token, token_text
from tests.serving.helpers import delete_in_background, shared_serve, sse_events, stream_text, wait_until

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase

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
    "router_num_cpus": 0.05, "max_request_bytes": 64 * 1024, "tool_call_parser": "hermes",
    "enable_auto_tool_choice": True,
}
APP = "mock"


@pytest.fixture(scope="module")
def url():
    base = shared_serve()
    serve.run(build_app(ARGS), name=APP, route_prefix="/")
    yield base
    delete_in_background(APP)


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
    assert httpx.get(f"{url}/version").json() == {"version": importlib.metadata.version("dspark-serve")}  # vLLM's
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
    assert choice["message"] == {"role": "assistant", "content": expected_text("hi", 20), "reasoning": None}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23,
                             "prompt_tokens_details": {"cached_tokens": 0}}
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
    assert all("usage" in e and e["usage"] is None for e in events[:-1])  # OpenAI: null but in every other chunk
    assert len({e["created"] for e in events}) == 1  # the stream's, in every chunk


def test_continuous_usage_stats_give_each_chunk_its_choice_s_usage_so_far(url):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk of a choice (its role chunk too) carries that
    choice's prompt tokens and completion tokens so far; the last chunk the whole request's."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=30,
                      json=chat(max_tokens=9, n=2, stream=True,
                                stream_options={"include_usage": True, "continuous_usage_stats": True})) as r:
        events = sse_events(r)
    prompt = events[-1]["usage"]["prompt_tokens"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 18
    for index in (0, 1):
        own = [e for e in events if e["choices"] and e["choices"][0]["index"] == index]
        counts = [e["usage"]["completion_tokens"] for e in own]
        assert own[0]["choices"][0]["delta"]["role"] == "assistant" and counts[0] == 0
        assert counts == sorted(counts) and counts[-1] == 9 and len(set(counts)) > 2
        assert all(e["usage"]["prompt_tokens"] == prompt
                   and e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in own)
    # completions, two prompts with two choices each, echoed: each choice its own prompt's tokens; the echo is no
    # completion token
    prompts = ["ab", "a b c d e f"]
    alone = [httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30, json={
        "model": MODEL, "prompt": p, "max_tokens": 1}).json()["usage"]["prompt_tokens"] for p in prompts]
    assert alone[0] != alone[1]
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=30, json={
            "model": MODEL, "prompt": prompts, "n": 2, "echo": True, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = sse_events(r)
    assert events[-1]["usage"]["prompt_tokens"] == sum(alone) and events[-1]["usage"]["completion_tokens"] == 20
    for index in range(4):
        own = [e["usage"] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert {u["prompt_tokens"] for u in own} == {alone[index // 2]} and own[-1]["completion_tokens"] == 5
        assert "prompt_tokens_details" not in own[-1]  # vLLM's: cached tokens only in the last chunk's usage


def test_completions_and_stop_string(url):
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "ab", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["stop_reason"] is None
    full = expected_text("hi", 12)
    stop = full.split()[5]  # the 6th word
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=12, stop=["zz", stop]), headers=AUTH,
                   timeout=30)
    body = r.json()
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", stop)  # vLLM's
    assert body["choices"][0]["message"]["content"] == full[: full.index(stop)]
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=30,
                      json=chat(max_tokens=12, stop=[stop], stream=True)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ends = [(c["finish_reason"], c["stop_reason"]) for e in events for c in e["choices"]]
    assert ends[-1] == ("stop", stop) and set(ends[:-1]) == {(None, None)}


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
    ("n over 16", chat(n=17, max_tokens=3), 400),
    ("tool name not OpenAI's", chat(max_tokens=3, tools=[{"type": "function", "function": {"name": "a b"}}]), 400),
    ("tool_choice without tools", chat(max_tokens=3, tool_choice="required"), 400),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("unknown field", chat(max_tokens=3, frobnicate=1), 400),
    ("deeply nested", b'{"model": "mock-model", "metadata": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400),
    ("nested past the depth limit", chat(max_tokens=3, metadata=json.loads("[" * 70 + "]" * 70)), 400),
    ("seed over 64 bits", chat(seed=10**23), 400),
    ("integer of 5001 digits", b'{"model": "mock-model", "seed": ' + b"9" * 5001 + b"}", 400),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("not an object", b"[1, 2]", 400),
    ("null body", b"null", 400),
    ("service_tier not OpenAI's", chat(max_tokens=3, service_tier="bogus"), 400),
    ("body over max_request_bytes", chat("x" * 100_000, max_tokens=5), 413),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_openai_error(url, name, body, status):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30, **kwargs)
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] and "sys." not in err["message"]


def test_body_and_header_edge_cases_are_openai_errors(url):
    """A JSON null is "not an object" (not a nesting error), a compressed body a 415, a trailing slash a JSON 404 (no
    redirect); the API key's scheme matches in any case."""
    route = f"{url}/v1/chat/completions"
    r = httpx.post(route, headers={**AUTH, "Content-Type": "application/json"}, content=b"null", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body must be a JSON object"
    r = httpx.post(route, headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"},
                   content=gzip.compress(json.dumps(chat(max_tokens=3)).encode()), timeout=30)
    assert r.status_code == 415 and "gzip" in r.json()["error"]["message"]
    r = httpx.post(f"{route}/", headers=AUTH, json=chat(max_tokens=3), timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    for scheme in ("bearer", "BEARER"):
        r = httpx.post(route, headers={"Authorization": f"{scheme} {KEY}"}, json=chat(max_tokens=3), timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(route, headers={"Authorization": f"Basic {KEY}"}, json=chat(max_tokens=3), timeout=30)
    assert r.status_code == 401


def test_context_length_errors_name_the_field_to_change(url):
    """OpenAI's ``param``: the field that set max_tokens when a smaller one would fit, else the prompt (``messages``
    for a chat)."""
    long_chat, long_prompt = chat("x" * (MAX_MODEL_LEN + 10), max_tokens=5), "x " * (MAX_MODEL_LEN + 10)
    cases = [("chat/completions", chat(max_tokens=MAX_MODEL_LEN * 4), "max_tokens"),
             ("chat/completions", chat(max_completion_tokens=MAX_MODEL_LEN * 4), "max_completion_tokens"),
             ("chat/completions", long_chat, "messages"),
             ("completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 5}, "prompt")]
    for route, body, param in cases:
        r = httpx.post(f"{url}/v1/{route}", headers=AUTH, json=body, timeout=30)
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (400, "context_length_exceeded", param), r.text
        if param.startswith("max_"):  # the message names the field the request set
            assert f"+ {param} {MAX_MODEL_LEN * 4} =" in err["message"], err["message"]
    # max_tokens 0 (echo: the prompt alone) samples 1 token the response leaves out: the message names no max_tokens
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "x" * MAX_MODEL_LEN, "max_tokens": 0, "echo": True})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt"), r.text
    assert r.json()["error"]["message"] == (f"prompt of {MAX_MODEL_LEN} tokens leaves no room for a generated token "
                                            f"within the context limit of {MAX_MODEL_LEN} tokens")


def test_a_request_without_max_tokens_gets_what_the_context_leaves_its_prompt(url):
    """vLLM's rule: with no max_tokens the API default (256 for chat, 16 for completions) is lowered to the room the
    prompt leaves; a prompt that fills the context is refused naming it, and a min_tokens over the room naming that."""
    cases = [("chat/completions", chat("x" * 200, ignore_eos=True), 201, MAX_MODEL_LEN - 201),
             ("completions", {"model": MODEL, "prompt": "x" * 250, "temperature": 0, "ignore_eos": True}, 250, 6)]
    for route, body, prompt_tokens, room in cases:
        r = httpx.post(f"{url}/v1/{route}", headers=AUTH, json=body, timeout=30)
        assert r.status_code == 200, r.text
        usage, choice = r.json()["usage"], r.json()["choices"][0]
        assert (usage["prompt_tokens"], usage["completion_tokens"], choice["finish_reason"]) == (
            prompt_tokens, room, "length")
    for body, param, message in (
            (chat("x" * (MAX_MODEL_LEN - 1)), "messages",
             f"prompt of {MAX_MODEL_LEN} tokens leaves no room for a generated token within the context limit of "
             f"{MAX_MODEL_LEN} tokens"),  # the default max_tokens it would lower is not named
            (chat("x" * (MAX_MODEL_LEN - 1), max_tokens=5), "messages",
             f"+ max_tokens 5 = {MAX_MODEL_LEN + 5} exceeds"),
            (chat("x" * 200, min_tokens=100), "min_tokens", "min_tokens 100 exceeds the 55 tokens the context leaves")):
        r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
        assert message in r.json()["error"]["message"]


def test_a_prompt_list_with_one_over_the_context_is_refused_before_any_prompt_runs(url):
    """A completions request with several prompts, one over the context: the 400 comes before the others are admitted
    (started together, they were prefilled, decoded and then cancelled)."""
    rounds = target_state()["rounds"]
    for prompts in (["hi", "x " * (MAX_MODEL_LEN + 10)], ["x " * (MAX_MODEL_LEN + 10), "hi", "ho"]):
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                           json={"model": MODEL, "prompt": prompts, "max_tokens": 50, "stream": stream})
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["param"]) == (400, "context_length_exceeded", "prompt"), r.text
    time.sleep(0.3)  # a round or more at mock_step_ms, had any prompt started
    assert target_state()["rounds"] == rounds and target_state()["cancelled_pending"] == 0


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


def test_errors_of_the_engines_settings_name_the_request_field(url):
    """``param`` for errors the engine's settings raise (``min_tokens`` above max_tokens, a control the mock engine
    refuses, best_of beside n): the OpenAI field behind the engine's name."""
    cases = [("chat/completions", chat(max_tokens=8, min_tokens=50), "min_tokens"),
             ("chat/completions", chat(max_completion_tokens=8, min_tokens=50), "min_tokens"),
             ("chat/completions", chat(max_tokens=8, response_format={"type": "json_object"}), "response_format"),
             ("completions", {"model": MODEL, "prompt": "a", "best_of": 3, "n": 1}, "best_of")]
    for route, body, param in cases:
        r = httpx.post(f"{url}/v1/{route}", headers=AUTH, json=body, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text


def test_validator_errors_have_no_pydantic_prefix(url):
    r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=chat(top_logprobs=2), timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["message"] == "top_logprobs: needs logprobs: true"
    assert error["param"] == "top_logprobs"


def test_overload_answers_json_503_with_retry_after_at_once(url):
    """200 concurrent requests against 4 KV slots + 2 queued: every rejection is the ingress's JSON 503 with
    Retry-After and a message with the figures, sent without waiting for any work (within twice what 200 concurrent
    ``/health`` calls take on this host, plus a second: on a loaded 2-core host the HTTP stack itself takes seconds,
    and a rejection queued behind work took 9.5 s); nothing hangs and the server serves normally afterwards."""
    async def timed(client: httpx.AsyncClient, method: str, path: str, **kwargs) -> tuple[httpx.Response, float]:
        t0 = time.perf_counter()
        r = await client.request(method, f"{url}{path}", **kwargs)
        return r, time.perf_counter() - t0

    async def burst(method: str, path: str, **kwargs) -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*[timed(client, method, path, **kwargs) for _ in range(200)])

    baseline = max(s for _, s in asyncio.run(burst("GET", "/health")))  # what this host's HTTP stack costs now
    results = asyncio.run(burst("POST", "/v1/chat/completions", json=chat(max_tokens=60), headers=AUTH))
    codes = sorted(r.status_code for r, _ in results)
    assert set(codes) <= {200, 503} and codes.count(200) >= 6, codes
    rejected = [(r, s) for r, s in results if r.status_code == 503]
    assert len(rejected) >= 100, codes
    for r, _ in rejected:
        assert r.headers["Retry-After"] == "1" and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "overloaded" and "limit" in r.json()["error"]["message"], r.text
    assert any("the limit is 6" in r.json()["error"]["message"] for r, _ in rejected)  # the ingress's own limit
    assert max(s for _, s in rejected) < 2 * baseline + 1.0, (baseline, sorted(s for _, s in rejected)[-5:])
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=5), headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected_text("hi", 5)


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
    # While Serve replaces the replica (seconds), new requests decode plain at once instead of each waiting out
    # drafter_timeout_s; once a probe gets an answer, they speculate again, and state does not leak.
    causes = []

    def speculates() -> bool:
        t0 = time.monotonic()
        stats = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=10, spec_stats=True), headers=AUTH,
                           timeout=30).json()["spec_stats"]
        causes.append((stats["fallback_cause"], time.monotonic() - t0))
        return stats["fallback"] is False

    wait_until(speculates, timeout_s=60, interval_s=0.5)
    # backing off (drafter_backoff) or served by the replacement already, none waits out a timeout (the backoff
    # itself is tested deterministically in test_target_replica.py)
    assert all(cause in (None, "drafter_backoff") and seconds < ARGS["drafter_timeout_s"]
               for cause, seconds in causes), causes
    assert target_state()["drafter_backoff"] is None
    wait_until(lambda: drafter_states() == 0)
    # the replacement is called over its channel, as the first replica was (drafter_channel)
    assert target_state()["drafter_transport"] == "channel"
    assert serve.get_deployment_handle("Drafter", APP).debug_state.remote().result()["channel"]


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
    delete_in_background("failing-step")


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
    delete_in_background("colocated")


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
    delete_in_background(app)


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
    delete_in_background("broken")


# ---------------------------------------------------------------------- the official openai client

LN2 = math.log(2)


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=30, max_retries=0)


def test_client_text_parts_models_and_n(client):
    """Text-part content reads as the joined text; models.retrieve / list carry vLLM's fields; n choices."""
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=6,
        messages=[{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}])
    plain = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                           messages=[{"role": "user", "content": "h\ni"}])
    assert reply.choices[0].message.content == plain.choices[0].message.content
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "dspark-serve"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN and card.model_extra["root"] == "smollm2-135m"
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    many = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, n=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens == 12
    assert {c.message.content for c in many.choices} == {expected_text("hi", 4)}


def test_client_completions_prompt_list_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=3, temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt in zip(out.choices, ["ab", "cd"]):
        tok, words = ord(prompt[-1]) % VOCAB, []
        for _ in range(3):
            tok = next_token(tok, VOCAB)
            words.append(token_text(tok))
        assert choice.text == prompt + "".join(words)
    # vLLM's add_special_tokens on both endpoints (the mock tokenizer has none to add: the same tokens)
    again = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=3, temperature=0, echo=True,
                                      extra_body={"add_special_tokens": False})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    chat_out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ab"}], max_tokens=2,
                                              extra_body={"add_special_tokens": True})
    assert chat_out.usage.prompt_tokens == 3
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="ab", max_tokens=3, suffix="end")
    assert err.value.body["param"] == "suffix"


def test_client_tools_are_served_with_the_server_s_parser(client):
    """With ``tool_call_parser`` and ``enable_auto_tool_choice`` (this app's), a request with tools is served: the
    mock's text holds no call, so it is the content; an earlier call and its result are taken back as the next turn.
    A ``tool_choice`` without tools, and OpenAI's deprecated ``functions``, are 400s naming them."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                         tools=[weather], temperature=0)
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "length"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    again = client.chat.completions.create(model=MODEL, max_tokens=3, messages=history, tools=[weather])
    assert again.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                       tool_choice="required")
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                       functions=[weather["function"]])
    assert err.value.body["param"] == "functions" and "tools" in err.value.body["message"]


def _check_chat_logprobs(content, k: int) -> None:
    for entry in content:
        assert entry.logprob == pytest.approx(-LN2) and entry.bytes == list(entry.token.encode())
        first = int(entry.token.removeprefix(" w"))
        assert [t.token for t in entry.top_logprobs] == [token_text((first + r) % VOCAB) for r in range(k)]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([-(r + 1) * LN2 for r in range(k)])


def test_client_chat_logprobs_streamed_and_not(client):
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert "".join(e.token for e in content) == out.choices[0].message.content == expected_text("hi", 12)
    _check_chat_logprobs(content, 3)
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    _check_chat_logprobs(streamed, 3)
    bare = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], [], []]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3).choices[0].logprobs is None


def test_client_completion_logprobs_streamed_and_not(client):
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and lp.token_logprobs == pytest.approx([-LN2] * 8)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, top in zip(lp.tokens, lp.top_logprobs):
        first = int(token.removeprefix(" w"))
        assert top == pytest.approx({token: -LN2, token_text((first + 1) % VOCAB): -2 * LN2})
    tokens, offsets = [], []
    for chunk in client.completions.create(model=MODEL, prompt="ab", max_tokens=8, temperature=0, logprobs=2,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_client_completion_echo_with_logprobs_scores_the_prompt_streamed_and_not(client):
    """``echo`` with ``logprobs``: the prompt's tokens come first (the first with null logprob and alternatives, the
    others scored by the mock's rule: app/engine/testing.py), then the answer's; streamed, in the first chunk."""
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=4, temperature=0, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    rank = (ord("b") - next_token(ord("a") % VOCAB, VOCAB)) % VOCAB  # of the prompt's second token after its first
    assert lp.tokens[:2] == [token_text(ord("a")), token_text(ord("b"))] and len(lp.tokens) == 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([-(rank + 1) * LN2] + [-LN2] * 4)
    assert lp.top_logprobs[1] == pytest.approx({token_text(next_token(ord("a"), VOCAB)): -LN2,
                                                token_text(ord("b")): -(rank + 1) * LN2})
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), 2] and out.choices[0].text.startswith("ab")
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt="ab", max_tokens=4, temperature=0, logprobs=1, echo=True, stream=True)
        if c.choices and c.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [v for s in streamed for v in s.text_offset] == lp.text_offset


def test_client_completion_max_tokens_0_with_echo_returns_the_prompt_alone(client):
    """``max_tokens: 0`` with ``echo`` (OpenAI's legacy way to score a text, vLLM's too): the prompt's text and
    logprobs as with ``max_tokens: 4``, no answer token, ``length``, 0 completion tokens; streamed alike. Without
    ``echo``, or with ``min_tokens``, a 400 naming the field."""
    scored = client.completions.create(model=MODEL, prompt="ab", max_tokens=4, temperature=0, logprobs=1, echo=True)
    n = scored.usage.prompt_tokens
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt="ab", max_tokens=0, temperature=0.9, logprobs=1,
                                        echo=True, stream=stream, stream_options={"include_usage": True} if stream
                                        else None)
        chunks = list(out) if stream else [out]
        choices = [c.choices[0] for c in chunks if c.choices]
        lps = [c.logprobs for c in choices if c.logprobs is not None]
        assert "".join(c.text for c in choices) == "ab" and choices[-1].finish_reason == "length"
        assert [t for lp in lps for t in lp.tokens] == scored.choices[0].logprobs.tokens[:n]
        assert [v for lp in lps for v in lp.token_logprobs] == scored.choices[0].logprobs.token_logprobs[:n]
        assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == n
    plain = client.completions.create(model=MODEL, prompt=["ab", "c"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in plain.choices] == ["ab", "ab", "c", "c"] and plain.choices[0].logprobs is None
    for extra, param in (({}, "max_tokens"), ({"echo": True, "extra_body": {"min_tokens": 1}}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="ab", max_tokens=0, **extra)
        assert err.value.body["param"] == param


def test_prompt_logprobs_in_vllm_shape_for_completions_and_chat(client):
    """vLLM's ``prompt_logprobs`` extension: per prompt token None (the first), else {token id: logprob, rank,
    decoded_token}, the prompt token first, then its k alternatives of ranks 1..k (the mock's rule:
    app/engine/testing.py); per choice for completions, once for a chat; alongside ``echo``, each view keeps its k."""
    ln2, vocab = math.log(2), VOCAB
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, temperature=0, logprobs=1, echo=True,
                                    extra_body={"prompt_logprobs": 3})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    rank = (ord("b") - next_token(ord("a"), vocab)) % vocab + 1
    assert scored[0] is None and len(scored) == out.usage.prompt_tokens == 2
    first_alt = next_token(ord("a"), vocab)
    assert scored[1] == {
        str(ord("b")): {"logprob": pytest.approx(-rank * ln2), "rank": rank, "decoded_token": token_text(ord("b"))},
        **{str((first_alt + r) % vocab): {"logprob": pytest.approx(-(r + 1) * ln2), "rank": r + 1,
                                          "decoded_token": token_text((first_alt + r) % vocab)} for r in range(3)}}
    assert list(scored[1])[0] == str(ord("b"))  # the prompt token first
    assert len(out.choices[0].logprobs.top_logprobs[1]) == 2  # echo's own k = 1 (+ the prompt token)
    plain = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 0})
    assert [c.logprobs for c in plain.choices] == [None, None] and plain.choices[0].text == out.choices[0].text[2:]
    assert [len(d) for c in plain.choices for d in c.model_extra["prompt_logprobs"][1:]] == [1, 1]
    chat_out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ab"}], max_tokens=2,
                                              temperature=0, n=2, extra_body={"prompt_logprobs": 1})
    prompt = chat_out.model_extra["prompt_logprobs"]
    assert len(prompt) == chat_out.usage.prompt_tokens and prompt[0] is None
    assert all(1 <= len(d) <= 2 and any(v["rank"] == 1 for v in d.values()) for d in prompt[1:])


def test_tokenize_and_detokenize_as_vllm_offers_them(client, url):
    """``POST /tokenize``: a prompt's or chat's token ids as the completions endpoints count them (usage), with
    ``max_model_len`` and, on request, each token's string; ``POST /detokenize`` gives the text back. Bad bodies are
    400s naming the field, another model a 404."""
    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}/{route}", headers=AUTH, json=body, timeout=30)

    text = post("tokenize", {"model": MODEL, "prompt": "abc", "return_token_strs": True}).json()
    assert text == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [ord(c) for c in "abc"],
                    "token_strs": [token_text(ord(c)) for c in "abc"]}
    messages = [{"role": "user", "content": "ab"}]
    chat_ids = post("tokenize", {"messages": messages}).json()  # model is optional, as in vLLM
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    assert chat_ids["count"] == used == 3 and chat_ids["token_strs"] is None
    bare = post("tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat_ids["tokens"][:-1]  # the mock's generation prompt is one token
    assert post("tokenize", {"messages": messages, "continue_final_message": True}).json()["tokens"] == bare["tokens"]
    assert post("detokenize", {"model": MODEL, "tokens": text["tokens"]}).json() == \
        {"prompt": "".join(token_text(ord(c)) for c in "abc")}
    for route, body, status, param in (
            ("tokenize", {"prompt": "a", "messages": messages}, 400, "messages"),
            ("tokenize", {}, 400, "prompt"),
            ("tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
            ("tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}}, 400, "chat_template_kwargs"),
            ("tokenize", {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
            ("tokenize", {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}, 400,
             "continue_final_message"),
            ("tokenize", {"prompt": "a", "chat_template": "x"}, 400, "chat_template"),
            ("tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
            ("detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
            ("detokenize", {"tokens": [-1]}, 400, "tokens")):
        r = post(route, body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    assert httpx.post(f"{url}/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401


def test_client_token_id_prompts_decode_as_their_text_and_echo_it(client, url):
    """A token-id prompt (one, or a list of them) is the prompt those tokens are; ``echo`` gives its text (the mock
    tokenizer's), scored with ``logprobs``; an id outside the vocabulary is a 400 naming ``prompt``."""
    as_text = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0).choices[0].text
    ids = [ord("a"), ord("b")]
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0).choices[0].text == as_text
    both = client.completions.create(model=MODEL, prompt=[ids, [ord("c")]], max_tokens=3, temperature=0, echo=True,
                                     logprobs=0)
    echoed = token_text(ord("a")) + token_text(ord("b"))
    assert both.choices[0].text == echoed + as_text and both.usage.prompt_tokens == 3
    lp = both.choices[0].logprobs
    assert lp.tokens == [token_text(t) for t in ids] + [token_text(t) for t in _mock_answer(ord("b"), 3)]
    assert lp.token_logprobs[0] is None and lp.text_offset[2] == len(echoed)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed + as_text
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [[1], [VOCAB]], "max_tokens": 2},
                   headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"token id {VOCAB} is outside the vocabulary" in r.json()["error"]["message"]


def test_logprobs_tokens_can_be_named_by_id(client):
    """vLLM's ``return_tokens_as_token_ids``: every logprobs token (chat and completions, streamed and not) reads
    ``token_id:<id>``, the ids the completion has."""
    extra = {"return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={**extra, "return_token_ids": True})
    ids = chat.model_extra["token_ids"]
    assert [c.token for c in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    assert [t.token for t in chat.choices[0].logprobs.content[0].top_logprobs] == [f"token_id:{ids[0]}",
                                                                                   f"token_id:{ids[0] + 1}"]
    streamed = [c.token for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
        stream=True, extra_body=extra) for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert streamed == [f"token_id:{t}" for t in ids]
    text = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0, logprobs=0,
                                     extra_body=extra).choices[0]
    answer = _mock_answer(ord("b"), 3)
    assert text.logprobs.tokens == [f"token_id:{t}" for t in answer]
    assert text.logprobs.text_offset == [sum(len(token_text(t)) for t in answer[:i]) for i in range(3)]  # the text's


def test_responses_api_answers_as_the_chat_completion_it_is(client, url):
    """``POST /v1/responses`` through the official client: the output text is the chat completion's for the same
    messages, streamed as the Responses events (deltas joining into the text, usage at the end); ``max_output_tokens``
    reached is ``incomplete``; what the server cannot do is a 400 naming the Responses field."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="hi", max_output_tokens=5,
                                       temperature=0)
    assert response.output_text == answer.choices[0].message.content and response.id.startswith("resp_")
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (answer.usage.prompt_tokens, 5)
    # a conversation goes on with the earlier output sent back as the SDK gives it (null fields included)
    again = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": "hi"}, *[item.model_dump() for item in response.output],
        {"role": "user", "content": "more"}])
    assert again.status == "incomplete" and again.usage.input_tokens > response.usage.input_tokens
    followed = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        *messages, answer.choices[0].message.model_dump(), {"role": "user", "content": "more"}])
    assert followed.choices[0].finish_reason == "length"  # chat too: annotations, audio, function_call null
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", stream=True, max_output_tokens=5,
                                          input=[{"role": "user", "content": "hi"}], temperature=0))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response  # the mock ends at max_output_tokens: response.incomplete (OpenAI's last event then)
    assert (events[0].type, events[-1].type) == ("response.created", "response.incomplete")
    assert "".join(deltas) == final.output_text == response.output_text and final.usage.output_tokens == 5
    r = httpx.post(f"{url}/v1/responses", headers=AUTH, timeout=30,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": MAX_MODEL_LEN * 4})
    assert "max_output_tokens" in r.json()["error"]["message"] and "max_completion" not in r.text  # its own name
    for body, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"max_output_tokens": MAX_MODEL_LEN * 4}, "max_output_tokens"),
                        ({"input": [{"role": "user", "content": "x" * (MAX_MODEL_LEN + 10)}]}, "input")):
        r = httpx.post(f"{url}/v1/responses", headers=AUTH, timeout=30, json={"model": MODEL, "input": "hi", **body})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text


def test_a_priority_needs_the_server_s_priority_scheduling(url):
    """vLLM's rule: ``priority`` other than 0 on a server that admits in arrival order is a 400 naming it."""
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=2, priority=1), headers=AUTH, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "priority")
    assert httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=2, priority=0), headers=AUTH,
                      timeout=30).status_code == 200
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", "priority": -1}, headers=AUTH,
                   timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "priority")


def test_a_chat_can_continue_its_final_message(client):
    """vLLM's ``continue_final_message``: the prompt ends inside the final message (no generation prompt), so the
    model continues the reply the client started; with ``add_generation_prompt`` too it is a 400 naming it."""
    started = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    whole = client.chat.completions.create(model=MODEL, messages=started, max_tokens=3, temperature=0)
    opened = client.chat.completions.create(model=MODEL, messages=started, max_tokens=3, temperature=0,
                                            extra_body={"continue_final_message": True})
    assert opened.usage.prompt_tokens == whole.usage.prompt_tokens - 1  # the mock's generation prompt: one token
    assert opened.choices[0].message.content == "".join(token_text(t) for t in _mock_answer(ord("b"), 3))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=started, max_tokens=3, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})
    assert err.value.body["param"] == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(client):
    """vLLM's ``truncate_prompt_tokens``: the target takes the prompt's last k tokens, ``usage`` counts them and
    ``echo`` shows their text (a text prompt's too), for token-id and text prompts and chats."""
    kept = token_text(ord("a")) + token_text(ord("b"))
    answer = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0).choices[0].text
    for prompt in ([ord(c) for c in "wxab"], "wxab"):
        cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                        extra_body={"truncate_prompt_tokens": 2})
        assert (cut.choices[0].text, cut.usage.prompt_tokens) == (kept + answer, 2), prompt
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 3})
    assert whole.usage.prompt_tokens > 3 and cut.usage.prompt_tokens == 3


def _mock_answer(last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = next_token(last, VOCAB)
        out.append(last)
    return out


def test_streamed_chunks_carry_the_tokens_of_their_text_while_a_stop_string_holds_text_back(client):
    """With ``stop`` the server holds back text that could start the stop string: the tokens (and logprobs) of that
    text wait with it, so each chunk's text is its tokens' text, and ``text_offset`` indexes the answer."""
    full = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0).choices[0].text
    stop = full.split()[7][:3]  # the first 3 characters of the 8th word
    answer = full[: full.index(stop)]
    chunks = [(c.text, c.logprobs) for chunk in client.completions.create(
        model=MODEL, prompt="ab", max_tokens=12, temperature=0, logprobs=1, stop=[stop], stream=True)
        for c in chunk.choices if c.logprobs is not None]
    assert "".join(text for text, _ in chunks) == answer and len(chunks) > 1
    for text, lp in chunks[:-1]:
        assert text == "".join(lp.tokens)
    assert answer.endswith(chunks[-1][0]) and "".join(chunks[-1][1].tokens).startswith(chunks[-1][0])
    tokens = [t for _, lp in chunks for t in lp.tokens]
    offsets = [o for _, lp in chunks for o in lp.text_offset]
    assert len(tokens) == 8 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(8)]
    whole = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0, logprobs=1,
                                      stop=[stop]).choices[0]
    assert whole.text == answer and whole.logprobs.tokens == tokens and whole.logprobs.text_offset == offsets


# ---------------------------------------------------------------------- the field walk: nothing silently ignored

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SAMPLE = {  # a value that is not the field's neutral one, per OpenAI request field (chat and completions)
    "model": MODEL, "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.5, "top_p": 0.9, "n": 2,
    "stream": True, "stream_options": {"include_usage": True}, "stop": ["zz"], "seed": 7, "frequency_penalty": 0.5,
    "presence_penalty": 0.5, "logit_bias": {"5": 2.0}, "top_logprobs": 2, "user": "u-1", "metadata": {"k": "v"},
    "store": True, "safety_identifier": "s-1", "prompt_cache_key": "c-1", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "24h"}, "service_tier": "auto", "prediction": {"type": "content", "content": "x"},
    "parallel_tool_calls": False, "modalities": ["text"], "tools": [FUNCTION], "tool_choice": "auto",
    "functions": [FUNCTION["function"]], "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"},
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "moderation": {"model": "m"},
    "response_format": {"type": "json_object"}, "echo": True, "best_of": 1, "suffix": "end",
}
ENGINE_NAMES = {"response_format": "guided"}  # request field -> the SamplingParams field the engine names


def _sdk_fields(params_module) -> list[str]:
    return sorted(set(params_module.CompletionCreateParamsBase.__annotations__) | {"stream"})


WALK = [("chat", f) for f in _sdk_fields(openai.types.chat.completion_create_params)] + \
       [("completions", f) for f in _sdk_fields(openai.types.completion_create_params)]
RESPONSES_SAMPLE = {  # a value that is not the field's neutral one, per Responses request field
    "model": MODEL, "input": "hi", "instructions": "Be brief.", "max_output_tokens": 3, "temperature": 0.5,
    "top_p": 0.9, "stream": True, "text": {"format": {"type": "json_object"}}, "user": "u-1", "metadata": {"k": "v"},
    "store": True, "safety_identifier": "s-1", "prompt_cache_key": "c-1", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "24h"}, "service_tier": "auto", "parallel_tool_calls": False,
    "max_tool_calls": 2, "stream_options": {"include_obfuscation": False}, "previous_response_id": "resp_1",
    "conversation": "conv_1", "prompt": {"id": "p"}, "tools": [{"type": "function", "name": "f"}],
    "tool_choice": "auto", "reasoning": {"effort": "low"}, "truncation": "auto", "include": ["reasoning"],
    "background": True, "top_logprobs": 2, "access_programs": ["x"], "context_management": [{"type": "x"}],
    "image": {"x": 1}, "moderation": {"model": "m"},
}
RESPONSES_WALK = sorted(set(openai.types.responses.response_create_params.ResponseCreateParamsBase.__annotations__)
                        | {"stream"})


@pytest.mark.parametrize("name", RESPONSES_WALK)
def test_field_walk_every_responses_field_acts_is_harmless_or_400(url, name):
    """As the chat and completions walk: each field of the client's Responses request, set away from its neutral
    value, is served (acting, harmless) or a 400 naming it (rejected, or an acting one the mock engine refuses)."""
    from app.serving import responses as api

    assert name in api.ACTING + api.HARMLESS + api.REJECTED, f"responses: {name} is not sorted"
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "temperature": 0, name: RESPONSES_SAMPLE[name]}
    r = httpx.post(f"{url}/v1/responses", json=body, headers=AUTH, timeout=30)
    if name in api.REJECTED:
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    elif name in api.HARMLESS:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 200 or (r.status_code == 400 and r.json()["error"]["param"].startswith(name)), r.text


@pytest.mark.parametrize("endpoint,name", WALK, ids=[f"{e}-{f}" for e, f in WALK])
def test_field_walk_every_openai_field_acts_is_harmless_or_400(url, endpoint, name):
    """Each field of the official client's request types, set away from its neutral value: a harmless field is
    served, a rejected one answers a 400 naming it, an acting one is served or (a sampling control the engine does
    not apply yet) answers a 400 naming it; a field in none of the lists fails (a new SDK field must be sorted)."""
    from app.serving import openai_api as api

    chat_api = endpoint == "chat"
    acting = api.ACTING_CHAT if chat_api else api.ACTING_COMPLETIONS
    harmless = api.HARMLESS_CHAT if chat_api else api.HARMLESS_COMPLETIONS
    rejected = api.REJECTED_CHAT if chat_api else api.REJECTED_COMPLETIONS
    assert name in acting + harmless + rejected, f"{endpoint}: {name} is not sorted"
    base = chat(max_tokens=3) if chat_api else {"model": MODEL, "prompt": "ab", "max_tokens": 3, "temperature": 0}
    value = {"logprobs": True if chat_api else 2}.get(name, SAMPLE.get(name))
    body = {**base, name: value} if name not in ("messages", "prompt") else base
    if name == "top_logprobs":
        body["logprobs"] = True
    r = httpx.post(f"{url}/v1/{'chat/completions' if chat_api else 'completions'}", json=body, headers=AUTH,
                   timeout=30)
    if name in harmless:
        assert r.status_code == 200, r.text
    elif name in rejected:
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    else:
        named = name in r.text or ENGINE_NAMES.get(name, name) in r.text
        assert r.status_code == 200 or (r.status_code == 400 and named), r.text


def served_counts(url: str) -> dict[str, float]:
    """``GET /metrics``: sample name -> value (the target replicas' counts as the Router last heard them)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def settled_counts(url: str) -> dict[str, float]:
    """``served_counts`` once the target is idle and two reads a few report intervals apart agree (the Router hears
    the target every ``stats_interval_s``)."""
    wait_until(lambda: (s := target_state())["active"] == s["waiting"] == s["prefilling"] == 0)
    reads = [served_counts(url)]

    def same() -> dict | None:
        time.sleep(3 * ARGS["stats_interval_s"])
        reads.append(served_counts(url))
        return reads[-1] if reads[-1] == reads[-2] else None

    return wait_until(same)


def test_a_client_gone_before_its_first_token_never_runs(url):
    """Clients that leave while their requests wait for a KV slot (streamed and not): the requests are dropped, not
    run to ``max_tokens`` for no one once a slot frees. The server's counters finish the 4 answered requests only; a
    left request admitted while its cancellation was on its way may commit a round's tokens, never its 200."""
    finished, tokens = "dspark_requests_finished_total", "dspark_output_tokens_total"
    before = settled_counts(url)  # earlier tests' requests all counted

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            busy = [asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=chat(max_tokens=200)))
                    for _ in range(4)]  # the 4 KV slots, for 40 rounds or more (at most 5 tokens a round)
            left = [asyncio.create_task(client.post(f"{url}/v1/chat/completions",
                                                    json=chat("left", max_tokens=200, stream=stream)))
                    for stream in (True, False)]
            # the clients go away once both requests wait in the target's queue
            await asyncio.to_thread(wait_until, lambda: target_state()["waiting"] == 2, 10.0, 0.01)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            assert all(r.status_code == 200 for r in await asyncio.gather(*busy))

    asyncio.run(run())
    time.sleep(1.0)  # an abandoned request admitted once the others ended would have ended too
    after = settled_counts(url)
    assert after[finished] - before[finished] == 4 and 4 * 200 <= after[tokens] - before[tokens] < 5 * 200
    state = target_state()
    assert (state["active"], state["waiting"], state["engine_active"]) == (0, 0, 0), state


def _router_actor():
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if f"{APP}#Router" in a["name"] and a["namespace"] == "serve"]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace="serve")


def test_a_drain_refuses_new_requests_with_503_while_those_in_flight_finish(url):
    """What the launcher's Ctrl-C does before shutting down (``app.serving.run.drain``): a new request (a
    ``/tokenize`` call too) gets a JSON 503 with Retry-After and ``/health`` a 503 ``draining``, while a stream
    already running finishes, exactly. The Router is soft state: the one Serve starts in its place serves again (this
    module's later tests need it)."""
    router = serve.get_deployment_handle("Router", APP)
    n = 120
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json=chat(max_tokens=n, stream=True)) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if '"content"' in line)
        router.drain.remote().result()
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=4), headers=AUTH, timeout=30)
        untokenized = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, headers=AUTH, timeout=30)
        health = httpx.get(f"{url}/health", timeout=30)
        events = sse_events(_Lines([first] + list(lines)))
    assert refused.status_code == 503 and refused.headers["retry-after"] == str(ARGS.get("retry_after_s", 1))
    assert refused.json()["error"]["code"] == "unavailable" and "shutting down" in refused.json()["error"]["message"]
    assert untokenized.status_code == 503 and untokenized.json()["error"]["code"] == "unavailable"
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert stream_text(events) == expected_text("hi", n)
    wait_until(lambda: router.in_flight.remote().result() == 0)
    ray.kill(_router_actor(), no_restart=False)
    wait_until(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, timeout_s=60, interval_s=0.5)
    assert httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=4), headers=AUTH, timeout=30).status_code \
        == 200
