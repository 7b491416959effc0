"""Demo: stream one chat answer from the default target with plain decoding and report tok/s.

Usage: ``python -m app.demo [--prompt TEXT] [--max-tokens N] [--model REF]``

The engine alone, no Ray: the served application is ``make serve`` (``deployments/dspark.yaml``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from app.argtypes import positive_int
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.types import DraftBlock, SamplingParams

# An MT-Bench writing prompt (Apache-2.0), shipped here so the demo needs no dataset.
DEFAULT_PROMPT = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
    "and must-see attractions."
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m app.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    ap.add_argument("--max-tokens", type=positive_int, default=200, help="tokens to generate at most")
    ap.add_argument("--model", default="smollm2-135m",
                    help="embedded model name, local directory, .gguf file or cached model id")
    args = ap.parse_args(argv)

    try:
        engine = TargetEngine(EngineConfig(model=args.model, max_num_seqs=1))
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--model: {e}")
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}])
    print(f"> {args.prompt}\n")
    start = time.perf_counter()
    out = engine.add_request("demo", prompt, SamplingParams(max_tokens=args.max_tokens))
    n = len(out.new_token_ids)
    sys.stdout.write(out.text)
    while not out.finished:
        (out,) = engine.verify([DraftBlock("demo", torch.zeros(0, dtype=torch.long))])
        n += len(out.new_token_ids)
        sys.stdout.write(out.text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print(f"\n\n[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s, plain decoding, finish={out.finish_reason.value}]")


if __name__ == "__main__":
    main()
