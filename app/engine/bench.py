"""Engine benchmark: plain decoding speed, verify-step cost by total tokens and batch size, verify steps over
mixed contexts (where a step's attention may be split into several calls, ``app/engine/model.py``; beside the same
steps with the split turned off), and prefill time with part of the prompt in the prefix cache
(``app/engine/prefix_cache.py``).

Usage: ``python -m app.engine.bench [--model smollm2-135m] [--runs 3] [--tokens 128]``

Prints readable tables, then one JSON line with every figure. Timings are medians; the verify-step
ratios (16 tokens vs 1) are measured in the same run, so they survive a noisy shared machine better than
absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from typing import get_args

from app.argtypes import positive_int
from app.loop import generate
from app.engine.config import EngineConfig, VerifyStep
from app.engine import model
from app.engine.engine import TargetEngine
from app.engine.hardware import hardware_name
from app.engine.timing import time_mixed_step, time_prefill, time_verify_step
from app.engine.types import SamplingParams

# 16 requests: contexts spread over 100-350 tokens (fixed draw), and fifteen at 200 beside one at 1,700
MIN_PREFILL_CONTEXT = 64  # the prefill timings' cached prefixes: 0, half, all but 32, all but 1 token
MIXED_CONTEXTS = {
    "spread 100-350": [305, 149, 269, 188, 133, 212, 341, 101, 250, 327, 176, 120, 290, 231, 158, 199],
    "one long (15 x 200, 1 x 1700)": [200] * 7 + [1700] + [200] * 8,
}
MIXED_TOKENS = {"1 token each": [1] * 16, "8 x 1, 4 x 4, 4 x 8": [1, 4, 8, 1] * 4}

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " \
         "How many clips did Natalia sell altogether in April and May?"


def decode_speed(engine: TargetEngine, *, batch: int, tokens: int, runs: int) -> float:
    """Median output tok/s of plain greedy decoding of ``batch`` copies of a chat prompt, ``tokens`` each."""
    prompt = engine.encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    generate(engine, [prompt] * batch, SamplingParams(max_tokens=4))  # warm-up
    speeds = []
    for _ in range(runs):
        results, stats = generate(engine, [prompt] * batch, params)
        speeds.append(sum(len(r.token_ids) for r in results) / stats.wall_s)
    return statistics.median(speeds)


def mixed_steps(engine: TargetEngine, *, runs: int) -> tuple[dict, dict]:
    """Verify steps over ``MIXED_CONTEXTS`` x ``MIXED_TOKENS`` (ms, median of ``runs`` ``time_mixed_step`` medians),
    as the engine splits their attention (``model.attention_chunks``) and with the split turned off (one call per
    layer), the two alternated so that both see the same machine."""
    split, whole = {}, {}
    for c in MIXED_CONTEXTS:
        for t in MIXED_TOKENS:
            times = {False: [], True: []}
            for _ in range(runs):
                for one in (False, True):
                    with one_attention_call(one):
                        times[one].append(time_mixed_step(engine, contexts=MIXED_CONTEXTS[c], tokens=MIXED_TOKENS[t]))
            split[(c, t)], whole[(c, t)] = statistics.median(times[False]), statistics.median(times[True])
    return split, whole


@contextlib.contextmanager
def one_attention_call(on: bool):
    """While ``on``: every verify step's attention is one call per layer (``model.attention_chunks`` keeps all the
    requests together)."""
    if not on:
        yield
        return
    chunks = model.attention_chunks
    model.attention_chunks = lambda slots, *args, **kwargs: [(0, len(slots))]
    try:
        yield
    finally:
        model.attention_chunks = chunks


def cached_prefixes(context: int) -> list[int]:
    """The cached prefix lengths the prefill timings of a ``context``-token prompt use: none, half, all but 32 and
    all but 1 token, each once (a length timed twice would find its prompt cached whole)."""
    return sorted({0, context // 2, context - 32, context - 1})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--runs", type=positive_int, default=3, help="decode runs per figure (median)")
    ap.add_argument("--tokens", type=positive_int, default=128, help="tokens generated per request in decode runs")
    ap.add_argument("--context", type=positive_int, default=200,
                    help="KV cache length per request for verify timings")
    ap.add_argument("--verify-step", choices=get_args(VerifyStep), default="ragged",
                    help="verify steps in exact shapes, bucketed static shapes, or bucketed CUDA graphs "
                    "(EngineConfig.verify_step)")
    ap.add_argument("--prefill-context", type=positive_int, default=1024,
                    help=f"prompt tokens of the prefill timings (at least {MIN_PREFILL_CONTEXT})")
    ap.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=True,
                    help="oneDNN-prepacked linear layers on the CPU (EngineConfig.prepack)")
    args = ap.parse_args(argv)
    try:
        config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=16, max_draft_len=127,
                              prepack=args.prepack, verify_step=args.verify_step)
    except ValueError as err:  # pydantic's, naming the field
        ap.error(str(err).splitlines()[0] + ": " + " ".join(str(err).splitlines()[1:])[:300])
    longest = config.max_model_len - config.max_draft_len - 1  # a prompt, its first token and a draft block
    if not MIN_PREFILL_CONTEXT <= args.prefill_context <= longest:
        ap.error(f"--prefill-context must be in [{MIN_PREFILL_CONTEXT}, {longest}], got {args.prefill_context}")
    if args.context > longest:
        ap.error(f"--context must be at most {longest}, got {args.context}")

    try:
        engine = TargetEngine(config)
    except (FileNotFoundError, ValueError) as err:  # a model that is not there, a dtype or step this device lacks
        ap.error(str(err))
    single = decode_speed(engine, batch=1, tokens=args.tokens, runs=args.runs)
    batch16 = decode_speed(engine, batch=16, tokens=args.tokens, runs=max(1, args.runs // 2))
    print(f"plain greedy decode: {single:.1f} tok/s single stream, {batch16:.1f} tok/s with 16 requests")

    by_tokens = {n: time_verify_step(engine, batch=1, tokens_per_request=n, context=args.context)
                 for n in (1, 2, 4, 8, 16, 32, 64, 128)}
    print(f"\nverify step, 1 request, context {args.context}:\n{'tokens':>8} {'ms':>8} {'x 1-token':>10}")
    for n, ms in by_tokens.items():
        print(f"{n:>8} {ms:>8.1f} {ms / by_tokens[1]:>10.2f}")

    grid = {(b, t): time_verify_step(engine, batch=b, tokens_per_request=t, context=args.context)
            for b in (1, 2, 4, 8, 16) for t in (1, 4, 8)}
    print(f"\nverify step by batch size (ms), context {args.context}:\n{'batch':>6}"
          + "".join(f"{f'{t} tok/req':>12}" for t in (1, 4, 8)))
    for b in (1, 2, 4, 8, 16):
        print(f"{b:>6}" + "".join(f"{grid[(b, t)]:>12.1f}" for t in (1, 4, 8)))

    mixed, one_call = mixed_steps(engine, runs=args.runs)
    print(f"\nverify step, 16 requests, mixed contexts (ms; in brackets: the same steps in one attention call):\n"
          f"{'contexts':>32}" + "".join(f"{t:>30}" for t in MIXED_TOKENS))
    for c in MIXED_CONTEXTS:
        print(f"{c:>32}" + "".join(f"{f'{mixed[(c, t)]:.1f} ({one_call[(c, t)]:.1f})':>30}" for t in MIXED_TOKENS))

    n = args.prefill_context
    prefill = {shared: time_prefill(engine, context=n, shared=shared) for shared in cached_prefixes(n)}
    print(f"\nprefill and first token, a {n}-token prompt, its first tokens in the prefix cache:\n"
          f"{'cached':>8} {'ms':>8}")
    for shared, ms in prefill.items():
        print(f"{shared:>8} {ms:>8.1f}")

    result = {
        "model": args.model,
        "dtype": str(engine.cache.k.dtype).removeprefix("torch."),
        "prepacked": engine.prepacked,
        "verify_step": args.verify_step,
        "device": str(engine.device),
        "hardware": hardware_name(engine.device),
        "decode_tok_s_single": round(single, 2),
        "decode_tok_s_batch16": round(batch16, 2),
        "verify_ms_by_tokens": {str(n): round(ms, 2) for n, ms in by_tokens.items()},
        "verify_16_over_1": round(by_tokens[16] / by_tokens[1], 3),
        "verify_ms_by_batch": {f"{b}x{t}": round(ms, 2) for (b, t), ms in grid.items()},
        "verify_ms_mixed": {f"{c} / {t}": round(ms, 2) for (c, t), ms in mixed.items()},
        "verify_ms_mixed_one_call": {f"{c} / {t}": round(ms, 2) for (c, t), ms in one_call.items()},
        "prefill_ms_by_cached": {str(shared): round(ms, 2) for shared, ms in prefill.items()},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
