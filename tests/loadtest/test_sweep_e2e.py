"""The short sweep end to end: the real default server (one policy, started by the sweep in a child process on
a free port), 2 levels x 8 s of Locust, report and plot written with sane numbers.

Uses the DSpark checkpoint when it is present, else the n-gram drafter (the serving path is the same).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import sweep

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase

CHECKPOINT = sweep.REPO_ROOT / "checkpoints" / "dspark-smollm2-135m" / "config.json"
DRAFTER = [] if CHECKPOINT.is_file() else ["--set", "drafter=ngram", "--set", "gamma=5"]


@pytest.mark.slow
def test_short_sweep_on_the_real_server(tmp_path: Path, capsys):
    out = tmp_path / "sweep"
    code = sweep.main(["--policies", "dspark", "--concurrency", "1,4", "--duration", "8", "--warmup", "1",
                       "--max-tokens", "32", "--num-cpus", "2", "--server-warmup", "1", "--drain-timeout", "60",
                       "--out", str(out), *DRAFTER])
    printed = capsys.readouterr().out.strip().splitlines()
    assert code == 0, printed[-1]
    summary = json.loads(printed[-1])
    assert [(lv["policy"], lv["concurrency"]) for lv in summary["levels"]] == [("dspark", 1), ("dspark", 4)]
    assert any(line.startswith("dspark") for line in printed[:-1])  # the table
    data = json.loads((out / "results.json").read_text())
    for level in data["levels"]:
        assert level["failed"] == 0 and level["completed"] >= 3, level
        assert 0 < level["p50_ttft_ms"] <= level["p99_ttft_ms"] < 10_000
        assert 5 < level["p50_tpot_ms"] < 1_000 and 0 < level["p50_itl_ms"] < 2_000
        assert level["median_user_tok_s"] == pytest.approx(1000 / level["p50_tpot_ms"], rel=0.25)
        assert 1 < level["output_throughput"] < 500 and level["request_throughput"] > 0
        assert level["output_tokens_from_usage"]
        assert level["spec_requests"] == level["completed"]
        assert level["mean_accepted_length"] > 1.0 and 0 < level["mean_verify_length"] <= 7
        assert 1 <= level["server_mean_batch"] <= level["concurrency"]
        assert 0 < level["server_verify_ms"] < level["server_round_ms"] < 2_000
        assert 0 <= level["server_drafter_wait_ms"] < level["server_round_ms"] - level["server_verify_ms"] + 1e-6
        assert 0 <= level["server_verify_cpu_wait_ms"] < level["server_verify_ms"]
    c1, c4 = data["levels"]
    assert c4["output_throughput"] > c1["output_throughput"]  # batching pays, even on 2 cores
    png = out / "pareto.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (out / "results.csv").read_text().count("\n") == 3
    assert "READY" in (out / "server-dspark.log").read_text()
