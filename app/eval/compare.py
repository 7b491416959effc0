"""Side-by-side comparison of drafters: the same engine, prompts, block size and temperature for every drafter.

Owns: running several drafters (trained checkpoints of any kind, and the model-free n-gram drafter) through
``generate`` on the evaluation sets, and writing one comparison: tau (committed tokens per round) per set and its
mean over sets, per-position conditional acceptance P(draft k accepted | drafts < k accepted), draft ms per
round (propose + context update, as in ``evaluate.py``) and the draft share of a round (draft / (draft +
verify)), measured after a short unmeasured warm-up of each drafter; also how many outputs equal the first
drafter's (greedy runs are lossless, so all should, up to near-ties of the bfloat16 target). Writes
``compare.json``, ``compare.md`` and ``compare.png`` (conditional acceptance vs position, one line per drafter,
one panel per set); prints the tables and one JSON line.

Usage:
    python -m app.eval.compare --drafter dspark=checkpoints/dspark-smollm2-135m --drafter eagle3=runs/eagle3 \
        --ngram --limit 8 --max-tokens 128 --out runs/compare
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from app.drafters.checkpoint import load_checkpoint
from app.drafters.ngram import NgramProposer
from app.drafters.registry import make_proposer
from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.types import SamplingParams, batch_accepted_length
from app.datasets import DEFAULT_DATASETS_DIR, EVAL_SETS, load_prompts
from app.argtypes import non_negative_float, positive_int
from app.eval.evaluate import RecordingProposer, summarize


def parse_drafter(spec: str) -> tuple[str, Path]:
    """``NAME=PATH`` -> (name, checkpoint folder).

    Raises:
        argparse.ArgumentTypeError: no ``=``, an empty name, or a folder without config.json.
    """
    name, sep, path = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--drafter expects NAME=PATH, got {spec!r}")
    if not (Path(path) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"--drafter {name}: no checkpoint (config.json) in {path}")
    return name, Path(path)


def run_drafter(
    engine: TargetEngine, proposer, prompts: list[list[int]], *, temperature: float, max_tokens: int, gamma: int,
    seed: int,
) -> tuple[dict, list[list[int]]]:
    """One drafter on one prompt set: its row of the comparison (positions past its own gamma are None) and the
    output token ids."""
    rec = RecordingProposer(proposer)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
              for i in range(len(prompts))]
    results, stats = generate(engine, prompts, params, proposer=rec)
    summary = summarize(rec.records, proposer.gamma)
    accept = summary["accept_rate_per_position"] + [None] * (gamma - proposer.gamma)
    row = {
        "prompts": len(prompts),
        "gamma": proposer.gamma,
        "tau": batch_accepted_length(results),
        "rounds": stats.rounds,
        "tokens": sum(len(r.token_ids) for r in results),
        "accept_rate_per_position": accept,
        "draft_ms_per_round": 1e3 * rec.draft_s / stats.rounds,
        "verify_ms_per_round": 1e3 * stats.verify_s / stats.rounds,
        "draft_share": rec.draft_s / (rec.draft_s + stats.verify_s),
        "tok_s": sum(len(r.token_ids) for r in results) / stats.wall_s,
    }
    return row, [r.token_ids for r in results]


def mean_tau(rows: list[dict], drafter: str) -> float:
    """Unweighted mean over sets of a drafter's tau."""
    taus = [r["tau"] for r in rows if r["drafter"] == drafter]
    return sum(taus) / len(taus)


def markdown(rows: list[dict], drafters: list[str], sets: list[str], gamma: int) -> str:
    """Two tables: tau per set (+ mean, mean draft ms and share), then per-position acceptance and costs."""
    by = {(r["drafter"], r["set"]): r for r in rows}
    head = ["drafter", *sets, "mean tau", "draft ms/rd", "draft share", "same output"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in drafters:
        mine = [by[d, s] for s in sets]
        cells = [d] + [f"{r['tau']:.2f}" for r in mine] + [f"{mean_tau(rows, d):.2f}"]
        cells += [f"{sum(r['draft_ms_per_round'] for r in mine) / len(mine):.1f}",
                  f"{100 * sum(r['draft_share'] for r in mine) / len(mine):.1f}%",
                  f"{sum(r['same_output'] for r in mine)}/{sum(r['prompts'] for r in mine)}"]
        lines.append("| " + " | ".join(cells) + " |")
    head = ["drafter", "set", "tau"] + [f"a{k + 1}" for k in range(gamma)] + ["draft ms/rd", "verify ms/rd",
                                                                               "draft share", "tok/s"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in drafters:
        for s in sets:
            r = by[d, s]
            cells = [d, s, f"{r['tau']:.2f}"]
            cells += ["-" if a is None else f"{a:.2f}" for a in r["accept_rate_per_position"]]
            cells += [f"{r['draft_ms_per_round']:.1f}", f"{r['verify_ms_per_round']:.1f}",
                      f"{100 * r['draft_share']:.1f}%", f"{r['tok_s']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], drafters: list[str], sets: list[str], gamma: int, path: Path) -> None:
    """Conditional acceptance vs draft position, one panel per set, one line per drafter (PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["drafter"], r["set"]): r for r in rows}
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.4), sharey=True, squeeze=False)
    for ax, s in zip(axes[0], sets):
        for d in drafters:
            acc = [math.nan if a is None else a for a in by[d, s]["accept_rate_per_position"]]
            ax.plot(range(1, gamma + 1), acc, marker="o", markersize=3, linewidth=1.2, label=d)
        ax.set_title(s, fontsize=10)
        ax.set_xlabel("draft position k")
        ax.set_xticks(range(1, gamma + 1))
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(accept k | accepted < k)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", type=parse_drafter, action="append", default=[], metavar="NAME=PATH",
                    help="a trained checkpoint of any kind (repeat); rows keep this order")
    ap.add_argument("--ngram", action="store_true", help="add the prompt-lookup n-gram drafter as a row")
    ap.add_argument("--ngram-min", type=positive_int, default=2, help="shortest suffix n-gram matched")
    ap.add_argument("--ngram-max", type=positive_int, default=4, help="longest suffix n-gram matched")
    ap.add_argument("--sets", nargs="+", default=list(EVAL_SETS), choices=list(EVAL_SETS))
    ap.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    ap.add_argument("--gamma", type=positive_int, default=7,
                    help="draft tokens per round (a drafter's block size caps it)")
    ap.add_argument("--limit", type=positive_int, default=None, help="first N prompts of each set")
    ap.add_argument("--max-tokens", type=positive_int, default=256)
    ap.add_argument("--max-batch", type=positive_int, default=16, help="concurrent requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="target model reference")
    ap.add_argument("--out", type=Path, default=Path("runs/compare"))
    ap.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    args = ap.parse_args(argv)
    if not args.drafter and not args.ngram:
        ap.error("nothing to compare: give --drafter NAME=PATH and/or --ngram")
    names = [n for n, _ in args.drafter] + (["ngram"] if args.ngram else [])
    if len(set(names)) != len(names):
        ap.error(f"drafter names must be distinct, got {names}")
    if args.ngram_min > args.ngram_max:
        ap.error(f"--ngram-min {args.ngram_min} is above --ngram-max {args.ngram_max}")
    try:
        engine = TargetEngine(EngineConfig(model=args.model, max_num_seqs=args.max_batch,
                                           max_draft_len=max(8, args.gamma)))
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"the engine refuses these flags: {e}")
    embed = engine.model.embed_tokens.weight
    drafters = {name: load_checkpoint(path, embed)[:2] for name, path in args.drafter}

    def proposer_for(name: str):
        if name == "ngram" and args.ngram:
            return NgramProposer(gamma=args.gamma, max_ngram=args.ngram_max, min_ngram=args.ngram_min)
        drafter, calibration = drafters[name]
        return make_proposer(drafter, calibration, gamma=args.gamma, temperature=args.temperature, seed=args.seed)

    prompts = {s: [engine.encode_chat([{"role": "user", "content": p}])
                   for p in load_prompts(EVAL_SETS[s], args.datasets_dir)[: args.limit]] for s in args.sets}
    rows, first_outputs, warm = [], {}, prompts[args.sets[0]][:1]
    for name, set_name in tqdm([(n, s) for n in names for s in args.sets], desc="compare"):
        if set_name == args.sets[0]:  # warm-up, not measured: first-call allocations and kernel selection
            generate(engine, warm, SamplingParams(max_tokens=8), proposer=proposer_for(name))
        row, outputs = run_drafter(engine, proposer_for(name), prompts[set_name], temperature=args.temperature,
                                   max_tokens=args.max_tokens, gamma=args.gamma, seed=args.seed)
        reference = first_outputs.setdefault(set_name, outputs)
        row["same_output"] = sum(a == b for a, b in zip(outputs, reference))
        rows.append({"drafter": name, "set": set_name, **row})
    args.out.mkdir(parents=True, exist_ok=True)
    sources = {n: str(p) for n, p in args.drafter}
    if args.ngram:
        sources["ngram"] = f"prompt lookup, n-gram {args.ngram_min}..{args.ngram_max}"
    report = {"drafters": sources,
              "gamma": args.gamma, "temperature": args.temperature, "limit": args.limit, "max_tokens": args.max_tokens,
              "max_batch": args.max_batch, "torch_threads": torch.get_num_threads(), "rows": rows,
              "mean_tau": {n: mean_tau(rows, n) for n in names}}
    (args.out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(rows, names, args.sets, args.gamma)
    (args.out / "compare.md").write_text(table)
    plot(rows, names, args.sets, args.gamma, args.out / "compare.png")
    print(table)
    print(json.dumps({f"mean_tau/{n}": round(t, 3) for n, t in report["mean_tau"].items()}))


if __name__ == "__main__":
    main()
