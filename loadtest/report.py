"""Sweep results on disk, the readable table and the Pareto plot; merging several runs into one plot.

Owns: the results schema (``results.json``: run settings, SLO, one entry per (policy, concurrency) level;
``results.csv`` the same levels as rows; ``levels/<policy>-c<N>.json`` one level each), validating it on
load, the table, and the plot: output throughput (y) against median per-user speed (x), one curve per
policy through its concurrency levels, each point labelled with its concurrency, the TPOT SLO drawn as the
vertical line ``x = 1000 / slo_tpot_ms`` (points left of it miss the SLO at the median).

Re-plot or merge runs (for example ours and vLLM's)::

    python -m loadtest.report runs/loadtest/results.json runs/vllm/results.json --out runs/compare.png

Repeated sweeps of the same policies (a noisy shared host) reduce to one level per (policy, concurrency) with
``--median``: the level of the run whose median per-user speed is the median over the runs (``median_levels``).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
from pathlib import Path

from app.argtypes import positive_float

SCHEMA = "loadtest.sweep/1"
LEVEL_SCHEMA = "loadtest.level/1"
REQUIRED = ("policy", "concurrency", "output_throughput", "median_user_tok_s", "request_throughput")
CSV_FIELDS = (
    "series", "policy", "concurrency", "temperature", "duration", "completed", "failed", "total_output_tokens",
    "output_throughput", "request_throughput", "request_goodput", "median_user_tok_s", "mean_user_tok_s",
    "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "p50_itl_ms", "p90_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms",
    "mean_accepted_length", "mean_verify_length", "draft_acceptance_rate", "spec_fallback_requests",
    "prefix_cache_hit_rate", "p50_ttft_ms_later_turns",
    "server_mean_batch", "server_round_ms", "server_verify_ms", "server_drafter_wait_ms", "server_verify_cpu_wait_ms",
)
# the run settings (results.json's config) that runs combined by --median must share, where all of them record it
SETTINGS = ("label", "prompts", "prompt_seed", "max_tokens", "max_tokens_range_ratio", "temperature", "ignore_eos",
            "multi_turn", "system_prompt_file", "overrides")
TABLE = (  # header, key, format
    ("policy", "series", "{}"), ("conc", "concurrency", "{}"), ("T", "temperature", "{:g}"),
    ("done", "completed", "{}"),
    ("fail", "failed", "{}"), ("out tok/s", "output_throughput", "{:.1f}"),
    ("req/s", "request_throughput", "{:.2f}"), ("goodput", "request_goodput", "{:.2f}"),
    ("user tok/s", "median_user_tok_s", "{:.1f}"), ("ttft p50", "p50_ttft_ms", "{:.0f}"),
    ("ttft p99", "p99_ttft_ms", "{:.0f}"), ("tpot p50", "p50_tpot_ms", "{:.1f}"),
    ("tpot p90", "p90_tpot_ms", "{:.1f}"), ("tpot p99", "p99_tpot_ms", "{:.1f}"),
    ("itl p50", "p50_itl_ms", "{:.1f}"), ("itl p99", "p99_itl_ms", "{:.1f}"),
    ("acc len", "mean_accepted_length", "{:.2f}"), ("verify len", "mean_verify_length", "{:.2f}"),
    ("cached", "prefix_cache_hit_rate", "{:.0%}"), ("ttft p50 later turns", "p50_ttft_ms_later_turns", "{:.0f}"),
    ("batch", "server_mean_batch", "{:.1f}"), ("round ms", "server_round_ms", "{:.1f}"),
    ("verify ms", "server_verify_ms", "{:.1f}"), ("drafter ms", "server_drafter_wait_ms", "{:.1f}"),
    ("cpu wait ms", "server_verify_cpu_wait_ms", "{:.1f}"),
)


def level_name(policy: str, concurrency: int) -> str:
    return f"{policy}-c{concurrency}"


def write_level(out_dir: Path, level: dict, slo: dict) -> Path:
    path = Path(out_dir) / "levels" / f"{level_name(level['policy'], level['concurrency'])}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": LEVEL_SCHEMA, "slo": slo, **level}, indent=2))
    return path


def write_results(out_dir: Path, *, config: dict, slo: dict, levels: list[dict]) -> tuple[Path, Path]:
    """``results.json`` and ``results.csv`` in ``out_dir``; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps({"schema": SCHEMA, "config": config, "slo": slo, "levels": levels}, indent=2))
    csv_path = out_dir / "results.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for level in levels:
            writer.writerow({"series": level.get("series", level["policy"]), **level})
    return json_path, csv_path


def load_results(path: Path) -> dict:
    """A ``results.json``, checked against the schema.

    Raises:
        ValueError: an unreadable file, not JSON (empty or cut short), another schema, or a level without a required
            field (the message names it).
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON {type(data).__name__}, not a sweep's results (schema {SCHEMA!r})")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    if not isinstance(data.get("levels", []), list):
        raise ValueError(f"{path}: levels is not a list")
    for i, level in enumerate(data.get("levels", [])):
        missing = [k for k in REQUIRED if k not in level] if isinstance(level, dict) else list(REQUIRED)
        if missing:
            raise ValueError(f"{path}: level {i} lacks {missing}")
    return data


def merge_results(paths: list[Path]) -> tuple[list[dict], dict]:
    """All levels of several runs with a ``series`` name and the run's ``temperature`` each, and the first run's SLO.

    With more than one run, every series is its policy prefixed with its run's label (``--label``, else the results
    folder's name), so every curve says which run it is; one run's series are its policies.
    """
    runs = [(Path(p), load_results(p)) for p in paths]
    levels = []
    for path, data in runs:
        label = data.get("config", {}).get("label") or path.parent.name
        for level in with_temperature(data):
            levels.append({**level, "series": f"{label}/{level['policy']}" if len(runs) > 1 else level["policy"]})
    return levels, (runs[0][1].get("slo") or {}) if runs else {}


def median_levels(paths: list[Path]) -> tuple[list[dict], dict]:
    """One level per (policy, concurrency) over repeated runs, and the first run's SLO.

    Of a (policy, concurrency)'s levels, sorted by ``median_user_tok_s`` (a level without one, where no request
    finished, sorts first), the middle one (the lower middle for an even count) is kept whole, so its fields stay
    those of one measured level; ``runs`` gives how many levels it was chosen from and ``runs_median_user_tok_s`` /
    ``runs_output_throughput`` all their values, sorted.

    Raises:
        ValueError: the runs of a policy differ in a run setting (``SETTINGS``; the message names each).
    """
    runs = [load_results(p) for p in paths]
    check_same_settings(list(zip(map(Path, paths), runs)))
    groups: dict[tuple[str, int], list[dict]] = {}
    for data in runs:
        for lv in with_temperature(data):
            groups.setdefault((lv["policy"], lv["concurrency"]), []).append(lv)
    levels = []
    for group in groups.values():
        group.sort(key=lambda lv: _speed_or_lowest(lv["median_user_tok_s"]))
        levels.append({**group[(len(group) - 1) // 2], "runs": len(group),
                       "runs_median_user_tok_s": [lv["median_user_tok_s"] for lv in group],
                       "runs_output_throughput": sorted(lv["output_throughput"] for lv in group)})
    return levels, (runs[0].get("slo") or {}) if runs else {}


def with_temperature(data: dict) -> list[dict]:
    """A run's levels, each with its ``temperature`` (the run's setting where a level does not record it)."""
    temperature = (data.get("config") or {}).get("temperature")
    return [{"temperature": temperature, **level} for level in data["levels"]]


def check_same_settings(runs: list[tuple[Path, dict]]) -> None:
    """Refuse to combine runs of one policy measured under different settings (``SETTINGS`` of their configs; a setting
    that some run does not record is not compared).

    Raises:
        ValueError: naming the policy, and each differing setting with its values and runs.
    """
    by_policy: dict[str, list[tuple[Path, dict]]] = {}
    for path, data in runs:
        for policy in sorted({lv["policy"] for lv in data["levels"]}):
            by_policy.setdefault(policy, []).append((path, data.get("config") or {}))
    for policy, group in by_policy.items():
        differ = []
        for key in (k for k in SETTINGS if all(k in config for _, config in group)):
            values: dict[str, list[str]] = {}
            for path, config in group:
                values.setdefault(json.dumps(config[key]), []).append(str(path))
            if len(values) > 1:
                differ.append(f"{key} " + " vs ".join(f"{v} ({', '.join(p)})" for v, p in values.items()))
        if differ:
            raise ValueError(f"the runs of {policy!r} differ in settings, not combined: {'; '.join(differ)}")


def _speed_or_lowest(speed: float | None) -> float:
    return float("-inf") if speed is None or math.isnan(speed) else speed


def _cell(level: dict, key: str, fmt: str) -> str:
    value = level.get(key, level["policy"] if key == "series" else None)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_table(levels: list[dict]) -> str:
    rows = [[h for h, _, _ in TABLE]] + [[_cell(lv, k, f) for _, k, f in TABLE] for lv in levels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def speed_at_throughput(levels: list[dict], series: str, throughput: float) -> float | None:
    """Median per-user speed (tok/s/user) of ``series``'s curve at ``throughput`` (output tok/s), by linear
    interpolation between the two levels whose throughputs bracket it; None outside the curve's range.

    The curve runs through the series' levels in concurrency order; where it is not monotone in throughput, the
    first bracketing segment from low concurrency up is used.
    """
    curve = sorted((lv for lv in levels if lv.get("series", lv["policy"]) == series), key=lambda lv: lv["concurrency"])
    points = [(lv["output_throughput"], lv["median_user_tok_s"]) for lv in curve]
    for (t0, s0), (t1, s1) in itertools.pairwise(points):
        lo, hi = min(t0, t1), max(t0, t1)
        if lo <= throughput <= hi:
            return s0 if t1 == t0 else s0 + (throughput - t0) / (t1 - t0) * (s1 - s0)
    return next((s for t, s in points if t == throughput), None)


def matched_speedups(levels: list[dict], series: str, baseline: str) -> list[dict]:
    """Per-user speed of ``series`` against ``baseline`` at matched throughput: at each baseline level's output
    throughput, ``series``'s interpolated per-user speed (``speed_at_throughput``) over the baseline's (the
    comparison of DSpark Sec. 5's per-user speed at equal throughput). Levels outside ``series``'s throughput
    range get ``ratio`` None."""
    rows = []
    for lv in sorted((lv for lv in levels if lv.get("series", lv["policy"]) == baseline),
                     key=lambda lv: lv["concurrency"]):
        speed = speed_at_throughput(levels, series, lv["output_throughput"])
        rows.append({"concurrency": lv["concurrency"], "throughput": lv["output_throughput"],
                     "baseline_user_tok_s": lv["median_user_tok_s"], "user_tok_s": speed,
                     "ratio": None if speed is None else speed / lv["median_user_tok_s"]})
    return rows


def pareto_plot(levels: list[dict], out: Path, *, slo_tpot_ms: float | None = None, title: str | None = None) -> Path:
    """Output throughput vs median per-user speed, one curve per series, SLO line; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    series: dict[str, list[dict]] = {}
    for level in levels:
        series.setdefault(level.get("series", level["policy"]), []).append(level)
    for name, points in series.items():
        points = sorted((p for p in points if p.get("median_user_tok_s") is not None),
                        key=lambda p: p["concurrency"])
        if not points:
            continue
        xs = [p["median_user_tok_s"] for p in points]
        ys = [p["output_throughput"] for p in points]
        (line,) = ax.plot(xs, ys, marker="o", label=name)
        for p, x, y in zip(points, xs, ys):
            ax.annotate(f"c{p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                        color=line.get_color())
    if slo_tpot_ms:
        x_slo = 1000.0 / slo_tpot_ms
        ax.axvline(x_slo, color="crimson", linestyle="--", linewidth=1.2,
                   label=f"SLO: TPOT <= {slo_tpot_ms:g} ms ({x_slo:.1f} tok/s/user)")
        ax.axvspan(0, x_slo, color="crimson", alpha=0.06)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("per-user speed, median (tok/s/user)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title(title or "Throughput vs interactivity (labels: concurrency)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Re-plot or merge sweep results into one table and Pareto plot.")
    ap.add_argument("results", nargs="+", type=Path, help="results.json files of one or more sweeps")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write, *.png (a CSV of the levels beside it)")
    ap.add_argument("--slo-tpot-ms", type=positive_float, default=None, help="SLO line (default: the first run's)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--median", action="store_true",
                    help="the runs repeat the same policies: one level per (policy, concurrency), the run with the "
                    "median per-user speed (median_levels); runs of a policy must share their settings (SETTINGS)")
    ap.add_argument("--matched", action="append", default=[], metavar="SERIES:BASELINE",
                    help="also print SERIES's per-user speed over BASELINE's at BASELINE's throughputs (repeatable)")
    args = ap.parse_args(argv)
    if args.out.suffix.lower() != ".png":
        ap.error(f"--out {args.out}: the plot is a PNG, name it *.png")
    pairs = [m.split(":", 1) for m in args.matched]
    if any(len(p) != 2 or not all(p) for p in pairs):
        ap.error("--matched takes SERIES:BASELINE")
    try:
        levels, slo = median_levels(args.results) if args.median else merge_results(args.results)
    except ValueError as err:
        ap.error(str(err))
    slo_tpot = args.slo_tpot_ms if args.slo_tpot_ms is not None else slo.get("tpot_ms")
    png = pareto_plot(levels, args.out, slo_tpot_ms=slo_tpot, title=args.title)
    csv_path = args.out.with_suffix(".csv")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(levels)
    print(format_table(levels))
    names = {lv.get("series", lv["policy"]) for lv in levels}
    matched = {}
    for series, baseline in pairs:
        if not {series, baseline} <= names:
            ap.error(f"--matched {series}:{baseline}: series are {sorted(names)}")
        matched[f"{series}:{baseline}"] = rows = matched_speedups(levels, series, baseline)
        print(f"\n{series} per-user speed over {baseline}'s at {baseline}'s throughput:")
        for r in rows:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
            print(f"  c={r['concurrency']:<3} {r['throughput']:7.1f} tok/s: {ratio}")
    print(json.dumps({"plot": str(png), "csv": str(csv_path), "levels": len(levels), "matched": matched}))


if __name__ == "__main__":
    main()
