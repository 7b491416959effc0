"""The Locust user and the sweep in ``--url`` mode against a stub server with a known timeline (no Ray).

The stub sends its headers at once, the first text after 300 ms and a 2-token chunk every 100 ms: the
measured TTFT, ITL and TPOT must match that timeline, which they would not if the stream were read through
a buffer (TTFT would wait for later bytes, inter-token gaps would collapse to 0).
"""

from __future__ import annotations

import csv
import itertools
import json

import pytest

from loadtest import rounds, sweep
from loadtest.prompts import chat_messages, load_conversation_spec, load_prompt_spec, max_tokens_plan
from loadtest.server import app_args, parse_overrides
from tests.loadtest.stub_server import Timeline, stub_server

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase

TIMELINE = Timeline(ttft_s=0.3, itl_s=0.1, tokens_per_chunk=2)
MAX_TOKENS = 9  # first token + 4 chunks of 2: e2el ~ 0.7 s, TPOT = 400 ms / 8 = 50 ms


def test_parse_overrides_and_app_args(tmp_path):
    assert parse_overrides(["policy=mtp1", "gamma=5", "target.num_cpus=0.5", "api_key=null"]) == {
        "policy": "mtp1", "gamma": 5, "target": {"num_cpus": 0.5}, "api_key": None}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_overrides(["policy"])
    args = app_args(sweep.DEFAULT_CONFIG, parse_overrides(["policy=none", "target.num_cpus=0.5"]))
    assert args["policy"] == "none" and args["target"] == {"num_replicas": 1, "num_cpus": 0.5}
    assert args["gamma"] == 7  # untouched fields keep the config's values
    out = ["--out", str(tmp_path)]
    assert sweep.parse_args(out).policies == ["none", "mtp1", "dspark"]  # a server per policy
    assert sweep.parse_args(["--url", "http://127.0.0.1:1", *out]).policies == ["server"]  # one server, one series
    assert sweep.parse_args(["--url", "http://127.0.0.1:1", "--policies", "vllm-cpu", *out]).policies == ["vllm-cpu"]


def test_sweep_against_stub_measures_the_timeline(tmp_path, capsys):
    out = tmp_path / "run"
    with stub_server(TIMELINE) as url:
        code = sweep.main(["--url", url, "--policies", "stub", "--concurrency", "1,3", "--duration", "3",
                           "--warmup", "0", "--drain-timeout", "10", "--max-tokens", str(MAX_TOKENS),
                           "--server-warmup", "1", "--slo-tpot-ms", "150", "--out", str(out), "--label", "stub"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["errors"] == 0 and len(summary["levels"]) == 2
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["label"] == "stub" and data["slo"]["tpot_ms"] == 150
    for level in data["levels"]:
        assert level["failed"] == 0 and level["completed"] >= 3 * level["concurrency"]
        assert 290 <= level["p50_ttft_ms"] <= 450, level["p50_ttft_ms"]
        assert 90 <= level["p50_itl_ms"] <= 160, level["p50_itl_ms"]
        assert 48 <= level["p50_tpot_ms"] <= 75, level["p50_tpot_ms"]
        assert 13 <= level["median_user_tok_s"] <= 21
        assert level["mean_accepted_length"] == pytest.approx(2.0) and level["mean_verify_length"] == 3.0
        assert level["output_tokens_from_usage"]
        assert all(level[k] is None for k in rounds.FIGURES)  # the stub has no /metrics
        # closed loop, one ~0.7 s answer after another per user: ~9 tokens / 0.7 s per user
        assert 8 * level["concurrency"] <= level["output_throughput"] <= 14 * level["concurrency"]
        # every TPOT ~50 ms, far under the 150 ms SLO even when a busy host delays a chunk (which a 60 ms SLO
        # did not survive on a 2-core CI machine); goodput's comparison itself is tested in test_metrics.py
        assert level["request_goodput"] == pytest.approx(level["request_throughput"])
    assert (out / "pareto.png").is_file() and (out / "levels" / "stub-c3.json").is_file()
    locust_rows = {row["Name"]: row for row in csv.DictReader((out / "locust" / "stub-c1_stats.csv").open())}
    assert {"/v1/chat/completions", "ttft_ms", "tpot_ms", "itl_ms", "user_tok_s"} <= set(locust_rows)
    assert 290 <= float(locust_rows["ttft_ms"]["Median Response Time"]) <= 450


def test_sweep_reports_a_failed_policy_and_exits_nonzero(tmp_path, capsys):
    with stub_server(TIMELINE) as url:
        code = sweep.main(["--url", url, "--model", "no-such-model", "--policies", "stub", "--concurrency", "1",
                           "--duration", "1", "--warmup", "0", "--server-warmup", "1", "--out", str(tmp_path)])
    assert code == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["errors"] == 1 and summary["levels"] == []
    assert "warm-up request failed: HTTP 404" in json.loads((tmp_path / "results.json").read_text())[
        "config"]["errors"][0]["error"]


def test_a_level_without_a_successful_request_is_an_error(tmp_path, capsys):
    with stub_server(TIMELINE) as url:  # the stub answers 404 to every request for another model
        code = sweep.main(["--url", url, "--model", "no-such-model", "--policies", "stub", "--concurrency", "1",
                           "--duration", "1", "--warmup", "0", "--server-warmup", "0", "--out", str(tmp_path)])
    assert code == 1
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    (level,) = summary["levels"]
    assert level["completed"] == 0 and level["failed"] >= 1
    assert summary["errors"] == summary["failed_requests"] == level["failed"]
    assert f"stub-c1: 0 requests succeeded, {level['failed']} failed; the first failure: HTTP 404" in err
    assert "no request succeeded at stub-c1" in err
    assert json.loads((tmp_path / "results.json").read_text())["levels"][0]["first_error"].startswith("HTTP 404")


def test_max_tokens_plan_is_seeded_and_in_range():
    assert list(itertools.islice(max_tokens_plan(128, 0.0, seed=3), 5)) == [128] * 5
    plan = list(itertools.islice(max_tokens_plan(100, 0.5, seed=3), 400))
    assert plan == list(itertools.islice(max_tokens_plan(100, 0.5, seed=3), 400))  # every run sends the same
    assert plan != list(itertools.islice(max_tokens_plan(100, 0.5, seed=4), 400))
    assert min(plan) >= 50 and max(plan) <= 150 and len(set(plan)) > 50
    assert 90 <= sum(plan) / len(plan) <= 110
    assert set(itertools.islice(max_tokens_plan(1, 0.9, seed=0), 50)) == {1, 2}  # never below one token
    for bad in ((0, 0.0), (16, -0.1), (16, 1.0)):
        with pytest.raises(ValueError, match="range_ratio"):
            max_tokens_plan(*bad, seed=0)  # at the call: a Locust process fails at start, not at its first request


def test_sweep_varies_max_tokens_per_request_and_sends_a_system_prompt(tmp_path, capsys):
    system = tmp_path / "system.txt"
    system.write_text("You are a careful assistant who answers in one short paragraph.\n")  # 11 words
    with stub_server(TIMELINE) as url:
        code = sweep.main(["--url", url, "--policies", "stub", "--concurrency", "2", "--duration", "3",
                           "--warmup", "0", "--drain-timeout", "10", "--max-tokens", "12",
                           "--max-tokens-range-ratio", "0.5", "--server-warmup", "1", "--system-prompt-file",
                           str(system), "--out", str(tmp_path / "out")])
    assert code == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["config"]["max_tokens_range_ratio"] == 0.5 and data["config"]["system_prompt_file"] == str(system)
    records = [json.loads(line) for line in (tmp_path / "out" / "records" / "stub-c2.jsonl").read_text().splitlines()]
    requests = [r for r in records if r["kind"] == "request"]
    lengths = [r["output_tokens"] for r in requests]
    assert all(6 <= n <= 18 for n in lengths) and len(set(lengths)) > 1, lengths
    assert {r["cached_tokens"] for r in requests} == {11} and all(r["prompt_tokens"] > 11 for r in requests)
    (level,) = data["levels"]
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    assert level["prefix_cache_hit_rate"] == pytest.approx(11 * level["completed"] / level["total_input_tokens"])
    for argv, message in ((["--max-tokens-range-ratio", "1.0"], "--max-tokens-range-ratio must be in [0, 1)"),
                          (["--system-prompt-file", str(tmp_path / "none.txt")], "--system-prompt-file: "),
                          (["--system-prompt-file", str(empty)], "is empty")):
        with pytest.raises(SystemExit):
            sweep.parse_args(argv)
        assert message in capsys.readouterr().err


def test_multi_turn_sends_each_turn_after_the_answers_to_the_earlier_ones(tmp_path):
    prompts = tmp_path / "talks.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"first turn {i}", f"and the second turn {i}"]}) + "\n"
                               for i in range(3)))
    with stub_server(TIMELINE) as url:
        code = sweep.main(["--url", url, "--policies", "stub", "--concurrency", "2", "--duration", "3",
                           "--warmup", "0", "--drain-timeout", "10", "--max-tokens", "5", "--server-warmup", "1",
                           "--prompts", str(prompts), "--multi-turn", "--out", str(tmp_path / "out")])
    assert code == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["config"]["multi_turn"] is True
    records = [json.loads(line) for line in (tmp_path / "out" / "records" / "stub-c2.jsonl").read_text().splitlines()]
    requests = [r for r in records if r["kind"] == "request"]
    for user in (0, 1):
        turns = [r["turn"] for r in requests if r["user"] == user]
        assert len(turns) >= 4 and turns == [i % 2 for i in range(len(turns))], turns
    # the second turn carries the first (3 words) and the stub's 5-word answer to it, all found in the "cache"
    assert {(r["prompt_tokens"], r["cached_tokens"]) for r in requests if r["turn"] == 1} == {(13, 8)}
    assert {(r["prompt_tokens"], r["cached_tokens"]) for r in requests if r["turn"] == 0} == {(3, 0)}
    (level,) = data["levels"]
    assert 290 <= level["p50_ttft_ms_later_turns"] <= 450


def test_conversations_keep_every_turn_and_messages_carry_the_earlier_ones(tmp_path):
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text(json.dumps({"turns": ["q1", "q2"]}) + "\n" + json.dumps({"turns": ["only"]}) + "\n")
    assert load_conversation_spec(str(prompts)) == [["q1", "q2"], ["only"]]
    assert load_prompt_spec(str(prompts)) == ["q1", "only"]
    assert chat_messages("q2", "be brief", [("q1", "a1")]) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert chat_messages("q1") == [{"role": "user", "content": "q1"}]
