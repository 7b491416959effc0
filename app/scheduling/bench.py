"""Benchmark: wall time of each policy's decision for 256 requests x gamma 7 (goal for dspark: < 1 ms).

    python -m app.scheduling.bench [--profile profiles/roofline-llama-3.1-8b-h200.json] [--repeats 500]

Prints a table (median and p90 per policy, ms) then one JSON line. Times the policy call on prepared
inputs (input validation included, drafting and verification excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from app.argtypes import positive_int
from app.scheduling.policies import ScheduleInput, make_policy
from app.scheduling.profile import ProfileRangeError, load_profile

POLICIES = ("none", "mtp1", "fixed-7", "threshold-0.5", "dspark", "dspark-async")
WARMUP = 20


def time_policy(name: str, inputs: ScheduleInput, profile, *, repeats: int) -> list[float]:
    """Per-call wall times (ms) of the policy, ScheduleInput construction (validation) included."""
    policy = make_policy(name)
    capacity = 2 * inputs.batch if policy.needs_capacity else None
    times = []
    for i in range(WARMUP + repeats):
        start = time.perf_counter()
        policy(ScheduleInput(inputs.confidences, inputs.min_len, inputs.max_len, capacity=capacity), profile)
        if i >= WARMUP:
            times.append(1e3 * (time.perf_counter() - start))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.scheduling.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=Path, default=Path("profiles/roofline-llama-3.1-8b-h200.json"),
                        help="throughput profile JSON the policies read")
    parser.add_argument("--batch", type=positive_int, default=256, help="requests in the decision B")
    parser.add_argument("--gamma", type=positive_int, default=7, help="draft tokens per request K")
    parser.add_argument("--repeats", type=positive_int, default=500, help="timed calls per policy (after warm-up)")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as e:
        parser.error(f"--profile: {e}")
    try:
        profile.ensure_covers(max_batch=args.batch, gamma=args.gamma)
    except ProfileRangeError as e:
        parser.error(f"--batch {args.batch} / --gamma {args.gamma}: {args.profile}: {e}")
    inputs = ScheduleInput.make_dummy(batch=args.batch, gamma=args.gamma, seed=0)
    rows = {}
    print(f"{'policy':<14} {'median ms':>10} {'p90 ms':>8}   (B={args.batch}, K={args.gamma}, "
          f"torch threads {torch.get_num_threads()})")
    for name in POLICIES:
        times = sorted(time_policy(name, inputs, profile, repeats=args.repeats))
        rows[name] = {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * len(times))]}
        print(f"{name:<14} {rows[name]['median_ms']:>10.3f} {rows[name]['p90_ms']:>8.3f}")
    print(json.dumps({"batch": args.batch, "gamma": args.gamma, "profile": str(args.profile), "policies": rows}))


if __name__ == "__main__":
    main()
