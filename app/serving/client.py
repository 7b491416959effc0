"""Stream one chat answer from the running server and report tokens per second.

Usage: ``python -m app.serving.client "prompt" [--url URL] [--model NAME] [--max-tokens N] [--temperature T]``
(API key from ``--api-key`` or ``$DSPARK_API_KEY``). Prints the answer as it arrives, then one summary line
with the request's speculative statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx

from app.serving.config import API_KEY_ENV


def stream_chat(
    url: str, prompt: str, *, model: str, max_tokens: int, temperature: float, api_key: str | None, out=sys.stdout
) -> dict:
    """Stream the answer to ``out``; return usage, spec_stats, finish_reason and wall seconds."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}, "spec_stats": True,
    }
    result: dict = {}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url.rstrip('/')}/v1/chat/completions", json=body, headers=headers,
                      timeout=httpx.Timeout(600.0, connect=10.0)) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                result["usage"] = event["usage"]
            for choice in event["choices"]:
                out.write(choice["delta"].get("content") or "")
                out.flush()
                if choice["finish_reason"]:
                    result["finish_reason"] = choice["finish_reason"]
                    result["spec_stats"] = event.get("spec_stats")
    result["wall_s"] = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV))
    args = ap.parse_args(argv)
    res = stream_chat(args.url, args.prompt, model=args.model, max_tokens=args.max_tokens,
                      temperature=args.temperature, api_key=args.api_key)
    n = res.get("usage", {}).get("completion_tokens", 0)
    stats = res.get("spec_stats") or {}
    print(f"\n\n[{n} tokens in {res['wall_s']:.2f} s: {n / res['wall_s']:.1f} tok/s, "
          f"finish={res.get('finish_reason')}, mean accepted length {stats.get('mean_accepted_length', 0):.2f}]")


if __name__ == "__main__":
    main()
