"""Results files, the table, the Pareto plot from constructed results, and merging runs (re-plot CLI)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.image
import pytest

from loadtest import report


def level(policy: str, concurrency: int, tok_s: float, user_tok_s: float | None, **extra) -> dict:
    return {"policy": policy, "concurrency": concurrency, "output_throughput": tok_s,
            "median_user_tok_s": user_tok_s, "request_throughput": tok_s / 100, "request_goodput": None,
            "completed": 10, "failed": 0, "p50_ttft_ms": 300.0, "p90_tpot_ms": 1000 / (user_tok_s or 1),
            "mean_accepted_length": 2.5 if policy != "none" else None, **extra}


LEVELS = [level("none", c, 15 * c ** 0.8, 15 / c ** 0.2) for c in (1, 2, 4, 8)] + \
         [level("dspark", c, 30 * c ** 0.7, 30 / c ** 0.3) for c in (1, 2, 4, 8)]
SLO = {"ttft_ms": None, "tpot_ms": 100.0, "e2el_ms": None}


def write_run(tmp_path, name: str, levels: list[dict], label: str = "", config: dict | None = None) -> Path:
    json_path, _ = report.write_results(tmp_path / name, config={"label": label, **(config or {})}, slo=SLO,
                                        levels=levels)
    return json_path


def test_pareto_plot_is_a_png(tmp_path):
    out = report.pareto_plot(LEVELS + [level("broken", 1, 5.0, None)], tmp_path / "p" / "pareto.png",
                             slo_tpot_ms=100)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (960, 660)


def test_results_round_trip_csv_and_level_files(tmp_path):
    json_path = write_run(tmp_path, "run", LEVELS)
    data = report.load_results(json_path)
    assert data["levels"] == LEVELS and data["slo"] == SLO
    rows = list(csv.DictReader((tmp_path / "run" / "results.csv").open()))
    assert [(r["series"], r["concurrency"]) for r in rows][:2] == [("none", "1"), ("none", "2")]
    assert float(rows[-1]["output_throughput"]) == pytest.approx(LEVELS[-1]["output_throughput"])
    path = report.write_level(tmp_path / "run", LEVELS[0], SLO)
    assert path.name == "none-c1.json" and json.loads(path.read_text())["schema"] == report.LEVEL_SCHEMA


def test_load_results_rejects_other_schemas_and_missing_fields(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other", "levels": []}))
    with pytest.raises(ValueError, match="schema"):
        report.load_results(bad)
    bad.write_text(json.dumps({"schema": report.SCHEMA, "levels": [{"policy": "x", "concurrency": 1}]}))
    with pytest.raises(ValueError, match="output_throughput"):
        report.load_results(bad)


def test_merge_labels_every_series_with_its_run_and_keeps_the_temperature(tmp_path, capsys):
    ours = write_run(tmp_path, "ours", LEVELS, config={"temperature": 0.0})
    vllm = write_run(tmp_path, "vllm", [level("vllm-cpu", c, 18 * c, 18 / c ** 0.1) for c in (1, 4)])
    again = write_run(tmp_path, "again", [level("dspark", 1, 29.0, 29.0)], label="T0.7", config={"temperature": 0.7})
    levels, slo = report.merge_results([ours, vllm, again])
    series = {lv["series"] for lv in levels}
    assert series == {"ours/none", "ours/dspark", "vllm/vllm-cpu", "T0.7/dspark"} and slo == SLO
    assert {lv["series"]: lv["temperature"] for lv in levels}["T0.7/dspark"] == 0.7
    assert {lv["series"] for lv in report.merge_results([ours])[0]} == {"none", "dspark"}  # one run: its policies
    report.main([str(ours), str(again), "--out", str(tmp_path / "m.png")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:-1]]
    assert ["ours/none", "1", "0"] == rows[0][:3] and ["T0.7/dspark", "1", "0.7"] == rows[-1][:3]


def test_table_formats_missing_values():
    table = report.format_table([level("none", 1, 15.0, None)])
    header, rule, row = table.splitlines()
    assert header.split()[:4] == ["policy", "conc", "T", "done"] and set(rule) <= {"-", " "}
    assert row.split()[0] == "none" and " - " in row
    header, _, row = report.format_table([level("dspark", 4, 80.0, 10.0, prefix_cache_hit_rate=0.8914)]).splitlines()
    assert header.endswith("cached  ttft p50 later turns  batch  round ms  verify ms  drafter ms  cpu wait ms")
    assert row.split()[-7:] == ["89%", "-", "-", "-", "-", "-", "-"]
    _, _, row = report.format_table([level("dspark", 4, 80.0, 10.0, p50_ttft_ms_later_turns=212.4,
                                           server_mean_batch=3.8, server_round_ms=60.71, server_verify_ms=50.5,
                                           server_drafter_wait_ms=6.5, server_verify_cpu_wait_ms=4.25)]).splitlines()
    assert row.split()[-7:] == ["-", "212", "3.8", "60.7", "50.5", "6.5", "4.2"]


def test_report_cli_merges_and_plots(tmp_path, capsys):
    ours = write_run(tmp_path, "ours", LEVELS)
    vllm = write_run(tmp_path, "vllm", [level("vllm-cpu", c, 18 * c, 18 / c ** 0.1) for c in (1, 4)])
    report.main([str(ours), str(vllm), "--out", str(tmp_path / "merged.png")])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["levels"] == 10 and (tmp_path / "merged.png").is_file() and (tmp_path / "merged.csv").is_file()
    assert any(line.startswith("vllm/vllm-cpu") for line in lines)  # merged: labelled by its run


@pytest.mark.parametrize(("throughput", "expected"), [
    (10.0, 20.0),  # a level's own throughput: its speed
    (15.0, 17.5),  # half-way between the levels at 10 and 20 tok/s
    (30.0, 9.0),  # on the segment 20 -> 40 tok/s
    (5.0, None),  # below the curve
    (50.0, None),  # above it
])
def test_speed_at_throughput_interpolates_along_the_curve(throughput, expected):
    levels = [level("p", 1, 10.0, 20.0), level("p", 2, 20.0, 15.0), level("p", 4, 40.0, 3.0)]
    got = report.speed_at_throughput(levels, "p", throughput)
    assert got == (None if expected is None else pytest.approx(expected))


def test_median_levels_keep_the_median_run_of_each_level(tmp_path, capsys):
    runs = [write_run(tmp_path, f"r{i}", [level("dspark", 1, tok_s, user), level("none", 1, 20.0 + i, 20.0 + i)])
            for i, (tok_s, user) in enumerate([(50.0, 60.0), (40.0, 41.0), (38.0, 39.0)])]
    levels, slo = report.median_levels(runs)
    by_policy = {lv["policy"]: lv for lv in levels}
    assert len(levels) == 2 and slo == SLO
    dspark = by_policy["dspark"]
    assert (dspark["output_throughput"], dspark["median_user_tok_s"]) == (40.0, 41.0)  # one run's level, whole
    assert dspark["runs"] == 3 and dspark["runs_median_user_tok_s"] == [39.0, 41.0, 60.0]
    assert dspark["runs_output_throughput"] == [38.0, 40.0, 50.0]
    assert by_policy["none"]["median_user_tok_s"] == 21.0
    empty = write_run(tmp_path, "empty", [level("dspark", 1, 0.0, None)])
    with_empty, _ = report.median_levels([*runs[1:], empty])  # no finished request sorts lowest
    assert {lv["policy"]: lv["median_user_tok_s"] for lv in with_empty}["dspark"] == 39.0
    two, _ = report.median_levels(runs[:2])
    assert {lv["policy"]: lv["median_user_tok_s"] for lv in two}["dspark"] == 41.0  # even count: the lower middle
    report.main([*map(str, runs), "--median", "--out", str(tmp_path / "m.png"), "--matched", "dspark:none"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["levels"] == 2


def test_matched_speedups_and_cli(tmp_path, capsys):
    levels = [level("mtp1", 1, 15.0, 15.0), level("mtp1", 4, 40.0, 10.0),
              level("dspark", 1, 10.0, 30.0), level("dspark", 2, 20.0, 20.0), level("dspark", 4, 30.0, 15.0)]
    rows = report.matched_speedups(levels, "dspark", "mtp1")
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert rows[0]["ratio"] == pytest.approx(25.0 / 15.0) and rows[1]["ratio"] is None  # 40 tok/s: beyond dspark
    path = write_run(tmp_path, "run", levels)
    report.main([str(path), "--out", str(tmp_path / "p.png"), "--matched", "dspark:mtp1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["matched"]["dspark:mtp1"][0]["ratio"] == pytest.approx(25.0 / 15.0)
    with pytest.raises(SystemExit):
        report.main([str(path), "--out", str(tmp_path / "p.png"), "--matched", "dspark:eagle"])


def test_median_refuses_runs_of_a_policy_with_different_settings(tmp_path, capsys):
    greedy = write_run(tmp_path, "greedy", [level("dspark", 1, 40.0, 41.0)], config={"temperature": 0.0})
    sampled = write_run(tmp_path, "sampled", [level("dspark", 1, 30.0, 31.0), level("none", 1, 20.0, 20.0)],
                        config={"temperature": 0.7, "max_tokens": 64})
    other = write_run(tmp_path, "other", [level("none", 1, 21.0, 21.0)], config={"temperature": 0.0})
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(greedy), str(sampled), "--median", "--out", str(tmp_path / "m.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "the runs of 'dspark' differ in settings, not combined: temperature 0.0" in err
    assert "max_tokens" not in err  # recorded by one run only
    with pytest.raises(ValueError, match=r"'none' differ in settings, not combined: temperature 0.7 \(.*sampled"):
        report.median_levels([sampled, other])
    levels, _ = report.median_levels([greedy, other])  # other policies: nothing to combine
    assert len(levels) == 2


@pytest.mark.parametrize(("content", "message"), [
    (None, "No such file or directory"),
    ("", "not a JSON file"),
    ('{"schema": "loadtest.sweep/1", "levels": [', "not a JSON file"),  # cut short
    ("[]", "a JSON list, not a sweep's results"),
    ("{}", "schema None, expected 'loadtest.sweep/1'"),
])
def test_report_refuses_unreadable_results_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(path), "--out", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"error: {path}: " in err and message in err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--out", "plot/noext"], "--out plot/noext: the plot is a PNG, name it *.png"),
    (["--out", "x.txt"], "--out x.txt: the plot is a PNG, name it *.png"),
    (["--out", "p.png", "--slo-tpot-ms", "0"], "--slo-tpot-ms: expected a number > 0, got 0"),
    (["--out", "p.png", "--slo-tpot-ms", "-5"], "--slo-tpot-ms: expected a number > 0, got -5"),
])
def test_report_refuses_a_plot_not_named_png_and_a_slo_not_positive(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    results = write_run(tmp_path, "run", LEVELS)
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(results), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "plot").exists()
