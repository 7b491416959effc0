"""Chunked prefill benchmark: what a long prompt arriving costs the requests already decoding.

Usage: ``python -m app.engine.bench_prefill [--prompt-tokens 1500] [--budgets 512,256] [--runs 3] [--temperature 0.7]``

Fifteen requests decode a short chat prompt (``--tokens`` each, plain decoding, greedy or sampled at
``--temperature``); after ``--arrive-after`` rounds a prompt of ``--prompt-tokens`` tokens arrives. A ``SpecLoop``
drives the engine as the Target replica does (before each round: admissions as ``SpecLoop.admission_size`` allows,
then the next piece of a prompt prefilled in pieces when ``SpecLoop.piece_due``; then the round), once with the
prompt prefilled whole (``chunked_prefill`` off, ``max_prefill_tokens`` 2048) and once per budget with chunked
prefill, configurations alternated within each run.

Per configuration, medians over runs: the decoding requests' longest and 99th-percentile inter-token gap (ms) over
the whole run, the long prompt's time to first token (ms), and the output tok/s of the whole run. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from tqdm import tqdm

from app.argtypes import int_list, non_negative_float, positive_int
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.errors import ContextLengthError
from app.engine.hardware import hardware_name
from app.engine.types import NewRequest, SamplingParams
from app.loop import SpecLoop

SHORT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " \
        "How many clips did Natalia sell altogether in April and May?"
LONG = "Summarise the following notes in three sentences.\n\n" + " ".join(
    f"Note {i}: the quarterly review of the northern warehouse found {i * 7 % 97} misplaced pallets, "
    f"{i * 13 % 41} late deliveries and a backlog of {i * 29 % 113} orders." for i in range(400))
NUM_DECODING = 15
LONG_MAX_TOKENS = 8  # tokens the arriving prompt generates


def run_once(engine: TargetEngine, *, chunked: bool, budget: int, long_prompt: list[int], tokens: int,
             arrive_after: int, temperature: float) -> dict:
    """One run (module docstring): returns the gaps, the long prompt's TTFT and the output tok/s."""
    loop = SpecLoop(engine, gamma=None, speculates=False, max_prefill_tokens=budget, chunked_prefill=chunked)
    short = engine.encode_chat([{"role": "user", "content": SHORT}])
    params = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True)
    waiting = [NewRequest(f"short-{i}", short, params) for i in range(NUM_DECODING)]
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    arrived = long_first = None
    committed, rounds, start = 0, 0, time.perf_counter()

    def started(results) -> None:
        nonlocal committed, long_first
        for result in results:
            if result is None:
                continue
            if isinstance(result, Exception):
                raise result
            record, first = result
            committed += len(first.new_token_ids)
            now = time.perf_counter()
            last_token[record.request_id] = now
            if record.request_id == "long":
                long_first = now

    while waiting or loop.active or loop.prefilling:
        while n := loop.admission_size([r.prompt_ids for r in waiting], params=[r.params for r in waiting]):
            started(loop.admit(waiting[:n]))
            waiting = waiting[n:]
        if loop.piece_due:
            started([loop.continue_prefill()[1]])
        if loop.active:
            outputs = loop.step(None, speculate=False).outputs
            now = time.perf_counter()
            rounds += 1
            for out in outputs:
                committed += len(out.new_token_ids)
                if out.request_id != "long":
                    gaps.append(now - last_token[out.request_id])
                last_token[out.request_id] = now
        if rounds == arrive_after and arrived is None:
            arrived = time.perf_counter()
            long_params = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=temperature, ignore_eos=True)
            waiting.append(NewRequest("long", long_prompt, long_params))
    wall = time.perf_counter() - start
    return {"max_gap_ms": max(gaps) * 1000, "p99_gap_ms": float(np.percentile(gaps, 99)) * 1000,
            "ttft_ms": (long_first - arrived) * 1000, "tok_s": committed / wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-tokens", type=positive_int, default=1500, help="tokens of the arriving prompt")
    ap.add_argument("--budgets", type=int_list, default=[512, 256],
                    help="max_prefill_tokens of the chunked configurations (comma-separated)")
    ap.add_argument("--tokens", type=positive_int, default=48, help="tokens each decoding request generates")
    ap.add_argument("--arrive-after", type=positive_int, default=8,
                    help="rounds before the long prompt arrives (below --tokens - 1)")
    ap.add_argument("--runs", type=positive_int, default=3)
    ap.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy; > 0: sampled (unseeded)")
    args = ap.parse_args(argv)
    if args.arrive_after >= args.tokens - 1:  # the decoding requests take --tokens - 1 rounds after their prefill
        ap.error(f"--arrive-after {args.arrive_after}: the long prompt must arrive while the others decode, before "
                 f"their last round ({args.tokens - 1} with --tokens {args.tokens})")

    try:
        engine = TargetEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=NUM_DECODING + 1,
                                           max_model_len=2048))
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"the engine refuses these flags: {e}")
    try:
        engine.check_context(args.prompt_tokens, LONG_MAX_TOKENS)
    except ContextLengthError as e:
        ap.error(f"--prompt-tokens {args.prompt_tokens}: {e}")
    short = len(engine.encode_chat([{"role": "user", "content": SHORT}]))
    if too_small := [b for b in args.budgets if b < short]:
        ap.error(f"--budgets {','.join(map(str, too_small))}: each budget must admit the {short}-token prompts of "
                 "the decoding requests whole")
    configs = [("whole", False, 2048)] + [(f"chunked {b}", True, b) for b in args.budgets]
    figures: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for run in tqdm(range(args.runs + 1), desc="runs (the first warms up)"):
        order = configs if run % 2 else configs[::-1]
        for name, chunked, budget in order:
            # a prompt no earlier run left in the prefix cache
            prompt = engine.encode_chat([{"role": "user", "content": f"Run {run}, {name}. {LONG}"}])
            if len(prompt) < args.prompt_tokens:
                raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: the built-in prompt has {len(prompt)}")
            result = run_once(engine, chunked=chunked, budget=budget, long_prompt=prompt[: args.prompt_tokens],
                              tokens=args.tokens, arrive_after=args.arrive_after, temperature=args.temperature)
            if run:
                figures[name].append(result)
    medians = {name: {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
               for name, runs in figures.items()}
    print(f"\n{NUM_DECODING} requests decoding {args.tokens} tokens at T = {args.temperature}, a {args.prompt_tokens}-"
          f"token prompt arriving after {args.arrive_after} rounds; medians of {args.runs} runs")
    print(f"{'prefill':>14} {'max ITL ms':>11} {'p99 ITL ms':>11} {'long TTFT ms':>13} {'tok/s':>7}")
    for name, m in medians.items():
        print(f"{name:>14} {m['max_gap_ms']:>11.1f} {m['p99_gap_ms']:>11.1f} {m['ttft_ms']:>13.1f} {m['tok_s']:>7.1f}")
    result = {"model": args.model, "dtype": str(engine.cache.k.dtype).removeprefix("torch."),
              "hardware": hardware_name(engine.device), "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "temperature": args.temperature,
              "runs": args.runs, "medians": medians}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
