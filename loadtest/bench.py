"""Served single-stream benchmark: per-token time of the Serve application per policy against the engine alone.

Usage: ``python -m loadtest.bench [--policies none,dspark] [--requests 5] [--max-tokens 128]
[--prompts mt-bench] [--temperature 0.7 [--seed 0]] [--set KEY=VALUE ...]``

Measures in one run, on the same prompts (the first ``--requests`` first turns of ``--prompts``, chat template,
greedy or, with ``--temperature`` > 0, sampled with seed ``--seed + i`` for prompt i, ``max_tokens`` each):

1. the engine alone in this process: plain decoding (greedy, or sampled with the served requests' settings and
   seeds), one request at a time (ms per verify round = per token), and, when a policy speculates, the configured
   drafter offline (ms per steady drafter round at batch 1: ``propose``, then ``update`` with the verified step);
2. for each policy, the application (``deployments/dspark.yaml``'s args with ``policy`` and ``--set`` applied)
   on a fresh local Ray, driven over HTTP with sequential streamed requests after one warm-up request.

A served request's per-token time is TPOT, ``(end of stream - first text) / (tokens - 1)``; figures are medians
over requests, and each served figure is also given as a ratio to the engine-alone plain step of the same run
(the machine is shared and noisy: ratios travel better than absolute numbers). The target replica's own view
(EMAs of the drafter call as the target waits for it and of the time spent inside the drafter, rounds drafted)
comes from its ``debug_state``; the difference between the two is transport and waiting for a thread or core.
Outputs of every policy are compared with plain decoding's (the engine alone), prompt by prompt (seeded sampled
requests reproduce plain decoding with the same seed: ``app/engine/coupling.py``); an output that differs is fetched
again with its token ids and judged by the near-tie rule (``app/engine/near_tie.py``, on the coupled scores when
sampled):
the table counts outputs that are the same / differ first at a near-tie / differ otherwise (a bug, also printed
as a warning).

The local Ray starts with ``app.serving.local_ray.SERVE_ENV`` unless the environment says otherwise (worker
niceness 0, Serve's gRPC data plane), as ``make serve`` starts it; the JSON line records the values. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.near_tie import first_divergence
from app.engine.types import SamplingParams
from app.serving.config import AppConfig
from app.serving.local_ray import SERVE_ENV, init_local_ray
from app.serving.run import refusal
from loadtest.prompts import load_prompt_spec
from loadtest.server import DEFAULT_CONFIG, app_args, free_port, parse_overrides
from loadtest.stream import RequestRecord, StreamObserver, observe_stream

APP_NAME = "bench"


def request_params(max_tokens: int, temperature: float, seed: int, count: int) -> list[SamplingParams]:
    """The settings of prompt i's request: greedy, or sampled at ``temperature`` with seed ``seed + i``."""
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i if temperature > 0 else None)
            for i in range(count)]


def request_body(params: SamplingParams) -> dict:
    """The OpenAI body fields of ``params`` (max_tokens, temperature, seed when set)."""
    body = {"max_tokens": params.max_tokens, "temperature": params.temperature}
    return body if params.seed is None else {**body, "seed": params.seed}


def engine_alone(config: AppConfig, prompts: list[str], params: list[SamplingParams]) -> dict:
    """Plain decoding of each prompt alone (``params[i]``) on a ``TargetEngine`` built like the target replica's.

    Returns:
        ``step_ms``: median over prompts of (verify time / rounds), i.e. ms per output token;
        ``texts``, ``token_ids``, ``prompt_ids``: the greedy outputs and the chat prompts, in prompt order;
        ``engine``: the engine (``check_outputs`` judges served outputs with its logits).
    """
    engine = TargetEngine(EngineConfig(model=config.model, dtype=config.dtype, device=config.device,
                                       max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                                       max_draft_len=config.gamma))
    chats = [engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    generate(engine, chats[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    step_ms, texts, token_ids = [], [], []
    for ids, p in zip(chats, params):
        (result,), stats = generate(engine, [ids], p)
        step_ms.append(stats.verify_s * 1000 / max(stats.rounds, 1))
        texts.append(result.text)
        token_ids.append(result.token_ids)
    return {"step_ms": statistics.median(step_ms), "texts": texts, "token_ids": token_ids, "prompt_ids": chats,
            "engine": engine, "params": params}


def check_outputs(alone: dict, served_ids: dict[int, list[int]]) -> dict:
    """Judge the served outputs that differ from plain decoding (``served_ids``: prompt index -> token ids) with
    the near-tie rule (``app/engine/near_tie.py``): counts of ``near_tie`` and ``not_near_tie`` and a description
    of each of the latter (a losslessness bug, or a stop bug for a length difference)."""
    near, bugs = 0, []
    for i, ids in served_ids.items():
        p = alone["params"][i]
        divergence = first_divergence(alone["engine"], alone["prompt_ids"][i], alone["token_ids"][i], ids, p)
        if divergence is None or divergence.near_tie:
            near += divergence is not None
        else:
            bugs.append(f"prompt {i}: {divergence.describe()}")
    return {"near_tie": near, "not_near_tie": len(bugs), "bugs": bugs}


def drafter_alone(config: AppConfig, prompts: list[str], params: SamplingParams, *, calls: int = 20) -> float:
    """Median ms of one steady drafter round of the configured drafter at batch 1, in this process: ``propose``,
    then ``update`` with the verified step's output (what a served drafter call does after a drafted round), for a
    request with the sampling settings of ``params`` (a sampled request's drafts are sampled, with its proposal
    probabilities; a seeded one's with its noise)."""
    from app.serving.drafter import make_proposer

    engine = TargetEngine(EngineConfig(model=config.model, dtype=config.dtype, device=config.device,
                                       max_model_len=config.max_model_len, max_draft_len=config.gamma))
    proposer = make_proposer(config)
    prompt = engine.encode_chat([{"role": "user", "content": prompts[0]}])
    request = dataclasses.replace(params, max_tokens=calls + 8)
    first = engine.add_request("bench", prompt, request)
    if hasattr(proposer, "set_params"):  # as the loop's drafter host does: draft at the request's own settings
        proposer.set_params("bench", request)
    proposer.start("bench", prompt, first)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        (block,) = proposer.propose(["bench"])
        t_propose = time.perf_counter() - t0
        (out,) = engine.verify([block])
        t1 = time.perf_counter()
        proposer.update([out])
        times.append((t_propose + time.perf_counter() - t1) * 1000)
        if out.finished:
            break
    return statistics.median(times[1:] or times)


def stream_one(
    client: httpx.Client, url: str, model: str, prompt: str, params: SamplingParams
) -> tuple[RequestRecord, str]:
    """One streamed chat completion under ``params``; its timing record and text.

    Raises:
        RuntimeError: the server answered an error or the stream did not finish.
    """
    body = {"model": model, "stream": True, **request_body(params), "spec_stats": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": prompt}]}
    texts: list[str] = []

    class _Collect(StreamObserver):
        def on_event(self, t: float, data: str) -> None:
            super().on_event(t, data)
            if data != "[DONE]":
                for choice in json.loads(data).get("choices") or ():
                    texts.append(choice.get("delta", {}).get("content") or "")

    observer = _Collect(user=0, start_wall=time.time(), start_perf=time.perf_counter())
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
        observe_stream(response.iter_raw(), observer)
        record = observer.record(end_perf=time.perf_counter(), status=response.status_code)
    if not record.ok:
        raise RuntimeError(f"request failed: {record.error}")
    return record, "".join(texts)


def completion_ids(client: httpx.Client, url: str, model: str, prompt: str, params: SamplingParams) -> list[int]:
    """The token ids of one non-streamed chat completion under ``params`` (``return_token_ids``).

    Raises:
        httpx.HTTPStatusError: the server answered an error.
    """
    body = {"model": model, **request_body(params), "return_token_ids": True,
            "messages": [{"role": "user", "content": prompt}]}
    response = client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["token_ids"]


def served(
    args: dict, prompts: list[str], *, params: list[SamplingParams], num_cpus: float | None, reference: list[str]
) -> dict:
    """The application with ``args`` on a fresh local Ray: one warm-up request, then one request per prompt; the
    prompts whose streamed text differs from ``reference`` (plain decoding's) are asked again non-streamed for
    their token ids (``token_ids``: prompt index -> ids).

    While Ray runs, this process's stdout goes to stderr: Ray's driver prints the errors its workers report (such as
    ``(raylet) Task ServeController.graceful_shutdown failed ... killed by ray.kill`` at shutdown) on stdout, which
    holds the bench's table and JSON line."""
    with contextlib.redirect_stdout(sys.stderr):
        return _served(args, prompts, params=params, num_cpus=num_cpus, reference=reference)


def _served(
    args: dict, prompts: list[str], *, params: list[SamplingParams], num_cpus: float | None, reference: list[str]
) -> dict:
    import ray
    from ray import serve

    from app.serving.builder import build_app

    init_local_ray(num_cpus=num_cpus)  # as `make serve` starts it (module docstring)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        url, model = f"http://127.0.0.1:{port}", args.get("served_model_name", "smollm2-135m")
        with httpx.Client(timeout=600) as client:
            stream_one(client, url, model, prompts[0], SamplingParams(max_tokens=16))  # warm-up
            runs = [stream_one(client, url, model, p, q) for p, q in zip(prompts, params)]
            state = serve.get_deployment_handle("Target", APP_NAME).debug_state.remote().result()
            differ = {i: completion_ids(client, url, model, prompts[i], params[i])
                      for i, (_, text) in enumerate(runs) if text != reference[i]}
    finally:
        serve.shutdown()
        ray.shutdown()
    records = [r for r, _ in runs]
    tpot = statistics.median(r.tpot_ms for r in records)
    accepted = [r.accepted_length for r in records if r.accepted_length is not None]
    return {
        "tpot_ms": tpot, "tok_s": 1000 / tpot, "ttft_ms": statistics.median(r.ttft_ms for r in records),
        "tokens": [r.output_tokens for r in records], "texts": [t for _, t in runs], "token_ids": differ,
        "accepted_length": statistics.median(accepted) if accepted else None,
        "draft_call_ms": state["draft_ms"], "drafter_ms": state["drafter_ms"],
        "drafted_rounds": state["drafted_rounds"], "rounds": state["rounds"], "fallbacks": state["fallbacks"],
        "drafter_transport": state["drafter_transport"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="Serve config YAML (deployments/*.yaml)")
    ap.add_argument("--policies", default="none,dspark", help="comma-separated verify policies to serve")
    ap.add_argument("--requests", type=int, default=5, help="sequential requests per policy (one per prompt)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="mt-bench", help="prompt spec (loadtest.prompts): set names or .jsonl")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, seeded (--seed)")
    ap.add_argument("--seed", type=int, default=0, help="seed of prompt 0's request (prompt i: seed + i)")
    ap.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray (default: all)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override an args field for every policy (repeatable; dotted keys for nested fields)")
    opts = ap.parse_args(argv)
    if opts.requests < 1 or opts.max_tokens < 2 or opts.temperature < 0:
        ap.error("--requests must be >= 1, --max-tokens >= 2 and --temperature >= 0")
    policies = [p.strip() for p in opts.policies.split(",") if p.strip()]
    if not policies or len(set(policies)) < len(policies):
        ap.error(f"--policies {opts.policies}: need distinct policy names")
    if not opts.config.is_file():
        ap.error(f"--config {opts.config}: no such file")
    try:
        prompts = load_prompt_spec(opts.prompts)[: opts.requests]
        base = app_args(opts.config, parse_overrides(opts.overrides))
    except (ValueError, FileNotFoundError) as err:
        ap.error(str(err))
    if refused := [f"policy {p}: {why}" for p in policies if (why := refusal({**base, "policy": p}))]:
        ap.error("; ".join(refused))
    configs = {p: AppConfig.model_validate({**base, "policy": p}) for p in policies}
    first = configs[policies[0]]
    if first.torch_threads:
        torch.set_num_threads(first.torch_threads)

    params = request_params(opts.max_tokens, opts.temperature, opts.seed, len(prompts))
    alone = engine_alone(first, prompts, params)
    speculative = next((c for c in configs.values() if c.speculates), None)
    draft_ms = drafter_alone(speculative, prompts, params[0]) if speculative is not None else None
    gc.collect()
    results = {p: served({**base, "policy": p}, prompts, params=params, num_cpus=opts.num_cpus,
                         reference=alone["texts"]) for p in policies}
    checks = {p: check_outputs(alone, r["token_ids"]) for p, r in results.items()}

    step = alone["step_ms"]
    mode = "greedy" if opts.temperature == 0 else f"sampled T={opts.temperature:g}"
    print(f"engine alone: {step:.1f} ms/token ({1000 / step:.1f} tok/s) plain {mode}"
          + (f"; drafter propose + update {draft_ms:.1f} ms (batch 1)" if draft_ms is not None else ""))
    print(f"\n{'policy':>10} {'ms/token':>9} {'tok/s':>7} {'x engine':>9} {'ttft ms':>8} {'tau':>5} "
          f"{'call ms':>8} {'inside':>7} {'drafted':>9} {'same/tie/bug':>13}")
    for p, r in results.items():
        same = sum(a == b for a, b in zip(r["texts"], alone["texts"]))
        tau = f"{r['accepted_length']:.2f}" if r["accepted_length"] else "-"
        print(f"{p:>10} {r['tpot_ms']:>9.1f} {r['tok_s']:>7.1f} {r['tpot_ms'] / step:>9.2f} {r['ttft_ms']:>8.0f} "
              f"{tau:>5} {r['draft_call_ms']:>8.1f} {r['drafter_ms']:>7.1f} {r['drafted_rounds']:>4}/{r['rounds']:<4} "
              f"{same:>5}/{checks[p]['near_tie']}/{checks[p]['not_near_tie']}")
    for p, c in checks.items():
        for bug in c["bugs"]:
            print(f"WARNING {p}: {bug}")
    summary = {
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "ray_env": {name: os.environ[name] for name in SERVE_ENV},
        "requests": len(prompts), "max_tokens": opts.max_tokens, "prompts": opts.prompts,
        "temperature": opts.temperature, "seed": opts.seed if opts.temperature > 0 else None,
        "engine_step_ms": round(step, 2), "drafter_round_ms": None if draft_ms is None else round(draft_ms, 2),
        "served": {p: {"tpot_ms": round(r["tpot_ms"], 2), "tok_s": round(r["tok_s"], 2),
                       "tpot_over_engine": round(r["tpot_ms"] / step, 3), "ttft_ms": round(r["ttft_ms"], 1),
                       "accepted_length": r["accepted_length"], "draft_call_ms": round(r["draft_call_ms"], 2),
                       "drafter_ms": round(r["drafter_ms"], 2), "drafter_transport": r["drafter_transport"],
                       "drafted_rounds": r["drafted_rounds"], "rounds": r["rounds"], "tokens": r["tokens"],
                       "same_text_as_engine": sum(a == b for a, b in zip(r["texts"], alone["texts"])),
                       "near_tie": checks[p]["near_tie"], "not_near_tie": checks[p]["not_near_tie"],
                       "fallbacks": r["fallbacks"]}
                   for p, r in results.items()},
    }
    if len(policies) > 1:
        summary["speedup_over_first"] = {p: round(results[p]["tok_s"] / results[policies[0]]["tok_s"], 3)
                                         for p in policies[1:]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
