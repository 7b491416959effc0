"""Stream one chat answer from the running server and report tokens per second.

Usage: ``python -m app.serving.client "prompt" [--url URL] [--model NAME] [--max-tokens N] [--temperature T]``
(API key from ``--api-key`` or ``$DSPARK_API_KEY``). Prints the answer as it arrives, then one summary line
with the request's speculative statistics. A client of the server's OpenAI-compatible API through the ``openai``
package; an HTTP error, an error event in the stream, a stream cut before its finish reason or a server that cannot
be reached ends it with one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx
import openai

from app.argtypes import base_url, non_negative_float, positive_int
from app.serving.config import API_KEY_ENV

DEFAULT_URL = "http://127.0.0.1:8000/v1"


def api_base(url: str) -> str:
    """The API's base URL from ``url`` given with or without its ``/v1`` (the server's ready line prints it with).

    Raises:
        ValueError: not an http(s) URL.
    """
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http:// or https:// URL, got {url.rstrip('/')!r}")
    return f"{base_url(url)}/v1"


def stream_chat(
    url: str, prompt: str, *, model: str, max_tokens: int, temperature: float, api_key: str | None, out=sys.stdout,
    http_client: httpx.Client | None = None,
) -> dict:
    """Stream the answer to ``out``; return usage, spec_stats, finish_reason and wall seconds.

    Raises:
        SystemExit: with one line saying what went wrong (HTTP error, error event, cut stream, unreachable server).
    """
    client = openai.OpenAI(base_url=api_base(url), api_key=api_key or "none", max_retries=0,
                           timeout=openai.Timeout(600.0, connect=10.0), http_client=http_client)
    result: dict = {}
    start = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, stream=True, stream_options={"include_usage": True},
            extra_body={"spec_stats": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                result["usage"] = chunk.usage.model_dump()
            for choice in chunk.choices:
                out.write(choice.delta.content or "")
                out.flush()
                if choice.finish_reason:
                    result["finish_reason"] = choice.finish_reason
                    result["spec_stats"] = (chunk.model_extra or {}).get("spec_stats")
    except openai.APIStatusError as err:  # the body's error message (``err.message`` prefixes the status)
        message = err.body.get("message") if isinstance(err.body, dict) else None
        raise SystemExit(f"\nHTTP {err.status_code}: {message or err.message}") from None
    except openai.APIConnectionError as err:
        raise SystemExit(f"\ncannot reach {api_base(url)}: {err.__cause__ or err}") from None
    except openai.APIError as err:  # an error event in the stream
        raise SystemExit(f"\nthe server ended the stream with an error: {err.message}") from None
    if "finish_reason" not in result:
        raise SystemExit("\nthe stream ended before the answer did (no finish_reason): the server went away?")
    result["wall_s"] = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("prompt")
    ap.add_argument("--url", default=DEFAULT_URL, help="the API's base URL, with or without /v1")
    ap.add_argument("--model", default="smollm2-135m", help="the served model name")
    ap.add_argument("--max-tokens", type=positive_int, default=256)
    ap.add_argument("--temperature", type=non_negative_float, default=0.0)
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"default: ${API_KEY_ENV}")
    args = ap.parse_args(argv)
    try:
        api_base(args.url)
    except ValueError as err:
        ap.error(str(err))
    res = stream_chat(args.url, args.prompt, model=args.model, max_tokens=args.max_tokens,
                      temperature=args.temperature, api_key=args.api_key)
    n = (res.get("usage") or {}).get("completion_tokens", 0)
    stats = res.get("spec_stats") or {}
    print(f"\n\n[{n} tokens in {res['wall_s']:.2f} s: {n / res['wall_s']:.1f} tok/s, "
          f"finish={res.get('finish_reason')}, mean accepted length {stats.get('mean_accepted_length', 0):.2f}]")


if __name__ == "__main__":
    main()
