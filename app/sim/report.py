"""Tables, Pareto frontiers and plots of simulator results.

This module owns the presentation of :class:`~app.sim.simulator.SimResult` lists: a text table, the
non-dominated (throughput, per-user speed) points, the per-user speedup of one policy over another at
matched throughput, and the Pareto PNG. It runs no simulation.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from app.sim.simulator import SimResult

_COLUMNS = (
    ("policy", "policy", "{:<12}"),
    ("load", "load", "{:>8}"),
    ("throughput_tok_s", "tok/s", "{:>10.1f}"),
    ("user_tok_s", "tok/s/user", "{:>10.2f}"),
    ("tpot_ms", "TPOT ms", "{:>9.2f}"),
    ("wasted_per_token", "waste/tok", "{:>9.3f}"),
    ("mean_verify_len", "mean l", "{:>7.2f}"),
    ("mean_batch", "mean B", "{:>7.1f}"),
    ("finished_requests", "done", "{:>6d}"),
)


def load_label(result: SimResult) -> str:
    """'C=16' for closed loop, 'λ=2.5/s' for Poisson."""
    return f"C={result.concurrency}" if result.load == "closed" else f"λ={result.rate:g}/s"


def format_table(results: list[SimResult]) -> str:
    """One row per result, columns as in ``_COLUMNS``."""
    header = " ".join(f"{title:>{len(fmt.format(0) if 'd' in fmt else fmt.format(0.0))}}" for _, title, fmt in _COLUMNS)
    lines = [header, "-" * len(header)]
    for r in results:
        values = {**r.__dict__, "load": load_label(r)}
        lines.append(" ".join(fmt.format(values[key]) for key, _, fmt in _COLUMNS))
    return "\n".join(lines)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Non-dominated (throughput, user speed) points, sorted by throughput ascending (both maximised)."""
    finite = sorted((p for p in points if all(math.isfinite(v) for v in p)), key=lambda p: (-p[0], -p[1]))
    front, best_user = [], -math.inf
    for thr, user in finite:
        if user > best_user:
            front.append((thr, user))
            best_user = user
    return front[::-1]


def speedup_at_matched_throughput(results: list[SimResult], policy: str, baseline: str) -> dict[str, float]:
    """Per-user speed of ``policy`` over ``baseline`` at the baseline's throughputs.

    ``policy``'s Pareto front is interpolated linearly in throughput at each baseline point inside its
    range. Returns {"min", "median", "max", "points"} (NaN and 0 points when the ranges do not overlap).
    """
    mine = pareto_front([(r.throughput_tok_s, r.user_tok_s) for r in results if r.policy == policy])
    base = [(r.throughput_tok_s, r.user_tok_s) for r in results if r.policy == baseline]
    if not mine or not base:
        return {"min": math.nan, "median": math.nan, "max": math.nan, "points": 0}
    thr, user = np.array(mine).T
    ratios = [float(np.interp(t, thr, user)) / u for t, u in base if thr[0] <= t <= thr[-1] and u > 0]
    if not ratios:
        return {"min": math.nan, "median": math.nan, "max": math.nan, "points": 0}
    return {"min": min(ratios), "median": float(np.median(ratios)), "max": max(ratios), "points": len(ratios)}


def plot_pareto(results: list[SimResult], path: Path, *, title: str) -> Path:
    """Throughput (x) vs per-user speed (y), one line per policy labelled with its loads; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for policy in dict.fromkeys(r.policy for r in results):
        rows = [r for r in results if r.policy == policy]
        line = ax.plot([r.throughput_tok_s for r in rows], [r.user_tok_s for r in rows], marker="o", label=policy)
        for r in rows:
            ax.annotate(load_label(r), (r.throughput_tok_s, r.user_tok_s), fontsize=6, color=line[0].get_color(),
                        xytext=(3, 3), textcoords="offset points")
    front = pareto_front([(r.throughput_tok_s, r.user_tok_s) for r in results])
    if front:
        ax.plot(*zip(*front), linestyle="--", color="black", linewidth=0.8, label="Pareto frontier")
    ax.set_xscale("log")
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("per-user speed (tok/s/user)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
