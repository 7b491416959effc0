"""CLI: simulate policies x loads on a profile, print a table and one JSON line, write results and a Pareto PNG.

    python -m app.sim --profile profiles/roofline-llama-3.1-8b-h200.json \\
        --policies none,mtp1,fixed-3,fixed-5,fixed-7,dspark --concurrency 1,4,16,64,256 --out runs/sim/

Writes ``<out>/<profile stem>.json`` (all results) and ``<out>/<profile stem>-pareto.png``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from app.argtypes import float_list, int_list, name_list, positive_float, positive_int
from app.scheduling.profile import ProfileRangeError, load_profile
from app.sim.acceptance import AcceptanceModel, load_acceptance_stats
from app.sim.report import format_table, plot_pareto, speedup_at_matched_throughput
from app.sim.simulator import SimConfig, simulate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.sim", description=__doc__.split("\n")[0])
    p.add_argument("--profile", type=Path, required=True, help="throughput profile JSON")
    p.add_argument("--policies", type=name_list, default=["none", "mtp1", "fixed-3", "fixed-5", "fixed-7", "dspark"])
    p.add_argument("--load", choices=["closed", "poisson"], default="closed", help="closed-loop users or Poisson")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64, 256], help="closed loop: users C")
    p.add_argument("--rates", type=float_list, default=[1.0], help="poisson: arrival rates (requests/s)")
    p.add_argument("--replicas", type=positive_int, default=1, help="target replicas N")
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="batch slots per replica (default: profile max)")
    p.add_argument("--gamma", type=positive_int, default=7, help="draft block size K")
    p.add_argument("--rounds", type=positive_int, default=1000, help="closed loop: rounds per replica (>= 10)")
    p.add_argument("--duration", type=positive_float, default=60.0, help="poisson: simulated seconds")
    p.add_argument("--acceptance-stats", type=Path, default=None,
                   help="per-position acceptance: the evaluator's report.json (python -m app.eval.evaluate) or a "
                        "JSON object with per_position_acceptance (default: a synthetic model)")
    p.add_argument("--acceptance-row", default=None,
                   help="the report row to use, named as the evaluator's JSON line does: SET/T<temperature>/<rule>, "
                        "e.g. gsm8k-eval/T0/greedy (needed when the report has several rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-draft-gate", action="store_true", help="adaptive policies draft every round")
    p.add_argument("--out", type=Path, default=Path("runs/sim"))
    return p


def main(argv: list[str] | None = None) -> dict:
    usage = build_parser()
    args = usage.parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as e:
        usage.error(f"--profile: {e}")
    if args.acceptance_row is not None and args.acceptance_stats is None:
        usage.error("--acceptance-row: names a row of --acceptance-stats, which is not given")
    try:
        acceptance = (load_acceptance_stats(args.acceptance_stats, args.acceptance_row) if args.acceptance_stats
                      else AcceptanceModel())
    except (OSError, ValueError) as e:
        usage.error(f"--acceptance-stats: {e}")
    if acceptance.gamma < args.gamma:
        source = "the acceptance statistics cover" if args.acceptance_stats else "the synthetic acceptance model has"
        usage.error(f"--gamma {args.gamma}: {source} {acceptance.gamma} draft positions")
    try:
        profile.ensure_covers(max_batch=args.max_batch or profile.max_batch_size, gamma=args.gamma)
    except ProfileRangeError as e:
        usage.error(f"--max-batch / --gamma: {args.profile}: {e}")
    loads = (
        [{"concurrency": c} for c in args.concurrency] if args.load == "closed" else [{"rate": r} for r in args.rates]
    )
    try:
        configs = [
            SimConfig(policy=policy, load=args.load, replicas=args.replicas, max_batch=args.max_batch,
                      gamma=args.gamma, rounds=args.rounds, duration_s=args.duration, seed=args.seed,
                      draft_gate=not args.no_draft_gate, **load)
            for policy in args.policies
            for load in loads
        ]
    except ValidationError as e:
        usage.error("; ".join(("--" + "-".join(map(str, err["loc"])).replace("_", "-") + ": " if err["loc"] else "")
                              + err["msg"].removeprefix("Value error, ") for err in e.errors()))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        usage.error(f"--out: {e}")
    results = [
        simulate(cfg, profile=profile, acceptance=acceptance)
        for cfg in tqdm(configs, desc="simulations", unit="run")
    ]
    print(format_table(results))
    stem = args.profile.stem
    png = plot_pareto(
        results, args.out / f"{stem}-pareto.png",
        title=f"{stem}: {args.replicas} replica(s), gamma {args.gamma}, {args.load} load",
    )
    heaviest = max(results, key=lambda r: (r.concurrency, r.rate))
    summary = {
        "profile": str(args.profile),
        "png": str(png),
        "dspark_vs_mtp1_user_speed_at_matched_throughput": speedup_at_matched_throughput(results, "dspark", "mtp1"),
        "throughput_at_highest_load": {
            r.policy: round(r.throughput_tok_s, 1)
            for r in results
            if (r.concurrency, r.rate) == (heaviest.concurrency, heaviest.rate)
        },
        "results": [r.__dict__ for r in results],
    }
    summary = _nan_to_none(summary)
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, separators=(",", ":")))
    return summary


def _nan_to_none(value: object) -> object:
    """NaN (a metric with no data, e.g. no finished request) becomes JSON null."""
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


if __name__ == "__main__":
    main()
