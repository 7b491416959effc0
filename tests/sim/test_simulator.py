"""Simulator smoke tests: both load kinds, metric sanity, acceptance statistics, report helpers, CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pydantic
import pytest

from app.scheduling.profile import load_profile
from app.sim.__main__ import main
from app.sim.acceptance import RATE_FLOOR, AcceptanceModel, load_acceptance_stats
from app.sim.report import pareto_front, speedup_at_matched_throughput
from app.sim.simulator import SimConfig, SimResult, simulate

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
GPU = load_profile(PROFILES / "roofline-llama-3.1-8b-h200.json")


@pytest.mark.parametrize("policy", ["none", "mtp1", "fixed-7", "threshold-0.5", "dspark", "dspark-async"])
def test_closed_loop_smoke(policy):
    cfg = SimConfig(policy=policy, concurrency=8, rounds=200, output_tokens=(16, 32), max_batch=16)
    r = simulate(cfg, profile=GPU, acceptance=AcceptanceModel())
    assert r.finished_requests > 0 and r.mean_batch == pytest.approx(8.0)
    assert r.throughput_tok_s > 0 and r.user_tok_s > 0 and r.tpot_ms > 0
    # tokens per round per request = 1 + accepted <= 1 + mean l; wasted = verified - accepted
    assert 0 <= r.mean_verify_len <= 7
    if policy == "none":
        assert r.mean_verify_len == 0 and r.wasted_per_token == 0


def test_speculation_speeds_up_a_single_user():
    runs = {
        p: simulate(SimConfig(policy=p, concurrency=1, rounds=300), profile=GPU, acceptance=AcceptanceModel())
        for p in ("none", "dspark")
    }
    assert runs["dspark"].user_tok_s > 1.5 * runs["none"].user_tok_s


def test_poisson_smoke():
    cfg = SimConfig(policy="dspark", load="poisson", rate=200.0, duration_s=2.0, replicas=2, max_batch=64)
    r = simulate(cfg, profile=GPU, acceptance=AcceptanceModel())
    assert r.finished_requests > 100 and r.simulated_s == 2.0


def test_profile_must_cover_batch_and_gamma():
    with pytest.raises(ValueError, match="gamma 16"):
        simulate(SimConfig(policy="dspark", gamma=16), profile=GPU, acceptance=AcceptanceModel(
            per_position_acceptance=[0.5] * 16))
    with pytest.raises(ValueError, match="batch size 1024"):
        simulate(SimConfig(policy="dspark", max_batch=1024), profile=GPU, acceptance=AcceptanceModel())


def test_acceptance_model_matches_its_means():
    model = AcceptanceModel(per_position_acceptance=[0.9, 0.5, 0.2])
    rng = np.random.default_rng(0)
    conf, run = model.sample_round(rng, model.draw_difficulty(rng, 50_000), model.logit_means())
    assert conf.mean(axis=0) == pytest.approx([0.9, 0.5, 0.2], abs=0.01)
    assert (run >= 0).all() and (run <= 3).all()


def test_acceptance_stats_file(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"per_position_acceptance": [0.8, 0.6], "mean_accepted": 1.7}))
    assert load_acceptance_stats(path, slot_noise=0.5).per_position_acceptance == [0.8, 0.6]
    path.write_text(json.dumps({"acceptance": [0.8]}))
    with pytest.raises(ValueError, match="per_position_acceptance"):
        load_acceptance_stats(path)
    path.write_text(json.dumps({"per_position_acceptance": [1.2]}))
    with pytest.raises(pydantic.ValidationError, match="\\(0, 1\\)"):
        load_acceptance_stats(path)


def _report(path: Path, rows: list[dict]) -> Path:
    """An evaluator report.json as app/eval/evaluate.py writes it (only the keys read here)."""
    path.write_text(json.dumps({"checkpoint": "x.safetensors", "gamma": 4, "rows": [
        {"set": s, "temperature": t, "rule": rule, "tau": 2.0, "accept_rate_per_position": rates}
        for s, t, rule, rates in rows
    ]}))
    return path


def test_an_evaluator_report_is_read_row_by_row(tmp_path):
    report = _report(tmp_path / "report.json", [
        ("gsm8k-eval", 0.0, "greedy", [0.8, 1.0, 0.5, None]),
        ("gsm8k-eval", 0.7, "coupling", [0.0, 0.4, 0.3, 0.2]),
    ])
    greedy = load_acceptance_stats(report, "gsm8k-eval/T0/greedy").per_position_acceptance
    assert greedy == [0.8, 1 - RATE_FLOOR, 0.5]  # ends at the first unreached position; 1.0 clipped
    assert load_acceptance_stats(report, "gsm8k-eval/T0.7/coupling").per_position_acceptance[0] == RATE_FLOOR
    with pytest.raises(ValueError, match="2 rows; name one: gsm8k-eval/T0/greedy, gsm8k-eval/T0.7/coupling"):
        load_acceptance_stats(report)
    with pytest.raises(ValueError, match="no row 'mt-bench/T0/greedy'"):
        load_acceptance_stats(report, "mt-bench/T0/greedy")
    single = _report(tmp_path / "single.json", [("humaneval", 1.0, "rejection", [0.6, 0.5])])
    assert load_acceptance_stats(single).per_position_acceptance == [0.6, 0.5]
    unreached = _report(tmp_path / "unreached.json", [("humaneval", 0.0, "greedy", [None, None])])
    with pytest.raises(ValueError, match="reached no draft position"):
        load_acceptance_stats(unreached)
    with pytest.raises(ValueError, match="no rows"):
        load_acceptance_stats(_report(tmp_path / "empty.json", []))
    with pytest.raises(ValueError, match="rows repeat a name \\(a/T0/greedy\\)"):
        load_acceptance_stats(_report(tmp_path / "twice.json", [("a", 0.0, "greedy", [0.5])] * 2), "a/T0/greedy")
    with pytest.raises(ValueError, match="not an evaluator report"):
        load_acceptance_stats(_stats(tmp_path, [0.8]), "humaneval/T0/greedy")


def _stats(tmp_path: Path, rates: list[float]) -> Path:
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"per_position_acceptance": rates}))
    return path


def test_cli_simulates_with_an_evaluator_report(tmp_path, capsys):
    report = _report(tmp_path / "report.json", [("gsm8k-eval", 0.0, "greedy", [0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5])])
    summary = main([
        "--profile", str(PROFILES / "roofline-llama-3.1-8b-h200.json"), "--policies", "none,dspark",
        "--concurrency", "1", "--rounds", "40", "--acceptance-stats", str(report), "--out", str(tmp_path / "out"),
    ])
    assert {r["policy"] for r in summary["results"]} == {"none", "dspark"}


@pytest.mark.parametrize("flags, message", [
    (["--gamma", "0"], "--gamma: expected an integer >= 1, got 0"),
    (["--concurrency", "1,0"], "--concurrency: expected an integer >= 1, got 0"),
    (["--rates", "2,-1"], "--rates: expected a number > 0, got -1"),
    (["--policies", "dspark,dspark"], "--policies: dspark given more than once"),
    (["--policies", "fast"], "error: unknown policy"),
    (["--rounds", "5"], "error: --rounds: Input should be greater than or equal to 10"),
    (["--policies", "dspark", "--max-batch", "1024"], "--max-batch / --gamma: .*outside the profile grid"),
    (["--gamma", "8"], "--gamma 8: the synthetic acceptance model has 7 draft positions"),
    (["--gamma", "3", "--acceptance-stats", "STATS"], "--gamma 3: the acceptance statistics cover 2 draft positions"),
    (["--acceptance-stats", "REPORT"], "--acceptance-stats: .* 2 rows; name one"),
    (["--acceptance-row", "gsm8k-eval/T0/greedy"], "--acceptance-row: names a row of --acceptance-stats"),
    (["--acceptance-stats", "MISSING"], "--acceptance-stats: .*No such file"),
    (["--profile", "MISSING"], "--profile: .*No such file"),
    (["--out", "FILE/sub"], "--out: "),
])
def test_cli_refuses_bad_flags_with_a_usage_error(tmp_path, capsys, flags, message):
    stats = _stats(tmp_path, [0.8, 0.6])
    report = _report(tmp_path / "report.json", [("a", 0.0, "greedy", [0.8]), ("b", 0.0, "greedy", [0.7])])
    (tmp_path / "file").write_text("")
    paths = {"STATS": str(stats), "REPORT": str(report), "MISSING": str(tmp_path / "missing.json"),
             "FILE/sub": str(tmp_path / "file" / "sub")}
    argv = ["--profile", str(PROFILES / "roofline-llama-3.1-8b-h200.json"), "--out", str(tmp_path / "out"),
            *[paths.get(f, f) for f in flags]]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _result(policy: str, thr: float, user: float) -> SimResult:
    return SimResult(policy, "closed", 1, 1.0, 1, thr, user, 1000 / user, 0.0, 0.0, 1.0, 1, 1.0)


def test_pareto_and_matched_speedup():
    assert pareto_front([(1, 5), (2, 4), (2, 3), (3, 1), (1, 2), (math.nan, 9)]) == [(1, 5), (2, 4), (3, 1)]
    results = [_result("dspark", 10, 40), _result("dspark", 30, 20), _result("mtp1", 20, 10)]
    assert speedup_at_matched_throughput(results, "dspark", "mtp1")["median"] == pytest.approx(3.0)
    assert speedup_at_matched_throughput(results, "dspark", "none")["points"] == 0


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    summary = main([
        "--profile", str(PROFILES / "roofline-llama-3.1-8b-h200.json"), "--policies", "none,mtp1,dspark",
        "--concurrency", "1,8", "--rounds", "60", "--max-batch", "8", "--out", str(tmp_path),
    ])
    out = capsys.readouterr().out.strip().splitlines()
    assert "tok/s/user" in out[0]
    assert json.loads(out[-1])["throughput_at_highest_load"].keys() == {"none", "mtp1", "dspark"}
    assert Path(summary["png"]).stat().st_size > 0
    assert (tmp_path / "roofline-llama-3.1-8b-h200.json").exists()
