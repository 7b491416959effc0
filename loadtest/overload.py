"""Overload benchmark: a burst of concurrent requests against a server whose queues it overfills.

Prints, per round and as medians over rounds: status codes, whether every rejection was the ingress's JSON 503 with
``Retry-After``, the rejections' latency (p50 / p99 / max, seconds from the burst's start), the time to the first
rejection, and what a burst of as many ``/health`` calls costs on this host at the same moment (the HTTP stack's own
floor). Either against a running server (``--url``) or one it starts (``--config`` with ``--set`` overrides)::

    python -m loadtest.overload --config deployments/dspark.yaml --requests 200 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx

from app.argtypes import base_url, positive_int
from loadtest.metrics import distribution
from loadtest.server import DEFAULT_CONFIG, REPO_ROOT, ManagedServer, check_server_flags


async def _burst(url: str, n: int, method: str, path: str, **kwargs) -> list[tuple[int, float, httpx.Headers, str]]:
    """``n`` concurrent requests: (status, seconds from the burst's start, headers, body) each."""
    t0 = time.perf_counter()

    async def one(client: httpx.AsyncClient):
        r = await client.request(method, f"{url}{path}", **kwargs)
        return r.status_code, time.perf_counter() - t0, r.headers, r.text

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*[one(client) for _ in range(n)])


def run_round(url: str, model: str, n: int, max_tokens: int, headers: dict) -> dict:
    """One health burst then one overload burst; the round's figures."""
    health = asyncio.run(_burst(url, n, "GET", "/health"))
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Count from one to fifty in words."}]}
    results = asyncio.run(_burst(url, n, "POST", "/v1/chat/completions", json=body, headers=headers))
    rejected = [(s, h, t) for code, s, h, t in results if code == 503]
    well_formed = all(h.get("Retry-After") and h.get("content-type") == "application/json" and '"overloaded"' in t
                      for _, h, t in rejected)
    latencies = [s for s, _, _ in rejected]
    spread = distribution(latencies, "s")  # the sweep's percentiles; None without a rejection
    return {
        "ok": sum(code == 200 for code, *_ in results),
        "rejected": len(rejected),
        "other": sorted(code for code, *_ in results if code not in (200, 503)),
        "well_formed": well_formed,
        "first_s": min(latencies, default=float("nan")),
        "p50_s": spread["p50_s"] if latencies else float("nan"),
        "p99_s": spread["p99_s"] if latencies else float("nan"),
        "max_s": max(latencies, default=float("nan")),
        "health_max_s": max(s for _, s, _, _ in health),
        "healthy_after": httpx.get(f"{url}/health", timeout=30).status_code == 200,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", type=base_url,
                    help="a running server, http://HOST:PORT (a trailing /v1 is dropped; otherwise one is started "
                    "from --config)")
    ap.add_argument("--config", type=Path, default=None,
                    help=f"Serve config YAML of the server to start (default: {DEFAULT_CONFIG.relative_to(REPO_ROOT)})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override an application args field of the started server (repeatable)")
    ap.add_argument("--model", default=None, help="model name to send (default: the config's)")
    ap.add_argument("--requests", type=positive_int, default=200, help="concurrent requests per burst")
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args(argv)
    check_server_flags(ap, args, started="a server this starts")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def rounds(url: str, model: str) -> list[dict]:
        out = []
        for i in range(args.rounds):
            out.append(run_round(url, model, args.requests, args.max_tokens, headers))
            r = out[-1]
            print(f"round {i + 1}: 200 x{r['ok']}, 503 x{r['rejected']}, other {r['other']}, "
                  f"JSON 503 + Retry-After: {r['well_formed']}; 503 latency first {r['first_s']:.3f} s, "
                  f"p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s, max {r['max_s']:.3f} s; "
                  f"{args.requests} x /health max {r['health_max_s']:.3f} s; healthy after: {r['healthy_after']}",
                  flush=True)
            time.sleep(2.0)
        return out

    if args.url:
        results = rounds(args.url, args.model or "smollm2-135m")
    else:
        with ManagedServer(config=args.config, overrides=args.overrides, api_key=args.api_key) as server:
            results = rounds(server.url, args.model or server.model)
    med = {k: statistics.median(r[k] for r in results) for k in ("first_s", "p50_s", "p99_s", "max_s", "health_max_s")}
    print(f"median of {len(results)} rounds: 503 latency first {med['first_s']:.3f} s, p50 {med['p50_s']:.3f} s, "
          f"p99 {med['p99_s']:.3f} s, max {med['max_s']:.3f} s; /health burst max {med['health_max_s']:.3f} s")


if __name__ == "__main__":
    main()
