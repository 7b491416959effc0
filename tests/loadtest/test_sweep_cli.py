"""The sweep's command line and control flow with fakes for the server and Locust (no server, Ray or Locust runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from loadtest import sweep
from loadtest.prompts import DEFAULT_PROMPTS, level_offsets, load_prompt_spec, rotated
from loadtest.stream import RequestRecord


class FakeServer:
    """Stands in for ``ManagedServer``: records whether it was stopped."""

    started: list[FakeServer] = []

    def __init__(self, **kwargs) -> None:
        self.url, self.model, self.stopped = "http://127.0.0.1:1", "fake-model", False

    def __enter__(self) -> FakeServer:
        FakeServer.started.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.stopped = True


@pytest.fixture
def fake_server(monkeypatch):
    FakeServer.started = []
    monkeypatch.setattr(sweep, "ManagedServer", FakeServer)
    monkeypatch.setattr(sweep, "check_configs", lambda args: None)
    monkeypatch.setattr(sweep, "warm_up", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "settled_counters", lambda *a, **k: None)  # a server without /metrics
    return FakeServer


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_and_keeps_what_finished(tmp_path, monkeypatch, capsys, fake_server, sig):
    def locust_killed_by_signal(*args, **kwargs):
        os.kill(os.getpid(), sig)
        raise AssertionError("the signal did not interrupt the sweep")

    monkeypatch.setattr(sweep, "run_locust", locust_killed_by_signal)
    before = signal.getsignal(sig)
    code = sweep.main(["--policies", "none", "--concurrency", "1", "--out", str(tmp_path / "run")])
    assert code == 128 + sig
    assert [s.stopped for s in fake_server.started] == [True]
    err = capsys.readouterr().err
    assert f"sweep stopped by {signal.Signals(sig).name}: 0 finished levels are kept in" in err
    assert "Traceback" not in err
    assert json.loads((tmp_path / "run" / "results.json").read_text())["levels"] == []
    assert signal.getsignal(sig) is before  # the handlers are put back


def test_a_negative_temperature_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse_args(["--url", "http://127.0.0.1:1", "--temperature", "-1", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and "--temperature: expected a number >= 0, got -1" in capsys.readouterr().err


def test_url_takes_the_openai_base_url(tmp_path):
    args = sweep.parse_args(["--url", "http://127.0.0.1:8300/v1", "--out", str(tmp_path / "run")])
    assert args.url == "http://127.0.0.1:8300"


def fake_locust(calls: list, *, lines_sent: int = 1, ticks: tuple[float, ...] = ()):
    """A ``run_locust`` that records its call, ticks at each of ``ticks`` seconds and writes a records file:
    ``lines_sent`` successful first turns."""

    def run(args, *, url, model, users, name, prompt_offset, tick=lambda elapsed: None):
        calls.append((name, prompt_offset))
        for elapsed in ticks:
            tick(elapsed)
        path = args.out / "records" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"kind": "spawning_complete", "t": 1000.0, "user_count": users}]
        rows += [RequestRecord(user=0, start=1000.0 + i / 100, end=1000.5 + i / 100, ok=True, ttft_ms=100.0,
                               e2el_ms=500.0, output_tokens=5).to_json() for i in range(lines_sent)]
        rows.append({"kind": "test_stopping", "t": 1000.0 + args.warmup + args.duration})
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    return run


def test_each_level_starts_at_its_own_slice_of_the_prompts_the_same_for_every_policy(tmp_path, monkeypatch,
                                                                                      capsys, fake_server):
    calls = []
    monkeypatch.setattr(sweep, "run_locust", fake_locust(calls))
    code = sweep.main(["--policies", "none,dspark", "--concurrency", "1,2,4", "--duration", "5", "--warmup", "0",
                       "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    lines = len(load_prompt_spec(DEFAULT_PROMPTS))
    step = lines // 3
    assert calls == [(f"{p}-c{c}", i * step) for p in ("none", "dspark") for i, c in enumerate((1, 2, 4))]
    levels = json.loads((tmp_path / "run" / "results.json").read_text())["levels"]
    assert [lv["prompt_offset"] for lv in levels] == [0, step, 2 * step] * 2


def test_a_level_that_sends_more_lines_than_its_slice_says_so(tmp_path, monkeypatch, capsys, fake_server):
    prompts = tmp_path / "six.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(6)))
    monkeypatch.setattr(sweep, "run_locust", fake_locust([], lines_sent=4))
    sweep.main(["--policies", "none", "--concurrency", "1,2", "--duration", "5", "--warmup", "0",
                "--prompts", str(prompts), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "none-c1: sent 4 prompt lines, more than its slice of 3: the rest were the next slice's" in err


def test_level_offsets_give_disjoint_slices_and_rotated_starts_there():
    assert level_offsets(618, 5) == [0, 123, 246, 369, 492]
    assert level_offsets(80, 1) == [0]
    assert level_offsets(3, 5) == [0, 1, 2, 0, 1]  # fewer lines than levels: slices of one line, reused
    assert rotated(["a", "b", "c", "d"], 1) == ["b", "c", "d", "a"] and rotated(["a", "b"], 5) == ["b", "a"]


def test_out_must_be_a_new_or_empty_folder(tmp_path, capsys):
    url = ["--url", "http://127.0.0.1:1"]
    assert sweep.parse_args([*url, "--out", str(tmp_path)]).out == tmp_path  # an empty folder is fine
    (tmp_path / "notes.txt").write_text("mine")
    assert sweep.parse_args([*url, "--out", str(tmp_path)]).out == tmp_path  # and so are files of other kinds
    (tmp_path / "levels").mkdir()
    (tmp_path / "server-none.log").write_text("")
    for out, message in ((tmp_path, f"--out {tmp_path} holds an earlier run (levels, server-none.log): choose another "
                                    "folder or remove it"),
                         (tmp_path / "notes.txt", f"--out {tmp_path / 'notes.txt'} is a file, not a folder")):
        with pytest.raises(SystemExit) as exit_info:
            sweep.parse_args([*url, "--out", str(out)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--policies", "none,bogus"], "error: policy bogus: ValidationError: policy: Value error, unknown policy 'bogus'"),
    (["--policies", "none", "--set", "gamma=0"], "error: policy none: ValidationError: gamma: Input should be greater"),
    (["--set", "gamma"], "error: --set: override 'gamma' is not KEY=VALUE (nothing started)"),
    (["--config", "/nonexistent.yaml"], "error: --config /nonexistent.yaml: no such file"),
    (["--prompts", "nosuchset"], "error: prompts: 'nosuchset' is neither an evaluation set"),
    (["--max-tokens", "0"], "error: argument --max-tokens: expected an integer >= 1, got 0"),
    (["--policies", "none,mtp1,none"], "error: argument --policies: none given more than once"),
    (["--concurrency", "1,2,1"], "error: argument --concurrency: 1 given more than once"),
    (["--duration", "0"], "error: argument --duration: expected a number > 0, got 0"),
    (["--url", "http://127.0.0.1:1", "--set", "gamma=3", "--port", "8123"],
     "error: --set, --port: for the servers the sweep starts only; with --url none is started"),
    (["--url", "http://127.0.0.1:1", "--config", "deployments/dspark.yaml"],
     "error: --config: for the servers the sweep starts only"),
    (["--port", "70000"], "error: argument --port: expected a port number 0-65535, got 70000"),
])
def test_bad_flags_are_usage_errors_before_any_server_starts(tmp_path, monkeypatch, capsys, flags, message):
    def server_starts(**kwargs):
        raise AssertionError("a server would start")

    monkeypatch.setattr(sweep, "ManagedServer", server_starts)
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([*flags, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


class FakeProcess:
    """A ``subprocess.Popen`` whose ``wait`` times out ``waits`` times, then returns 0."""

    def __init__(self, waits: int) -> None:
        self.waits = waits

    def wait(self, timeout=None) -> int:
        if self.waits:
            self.waits -= 1
            raise subprocess.TimeoutExpired("locust", timeout)
        return 0


def test_wait_ticking_ticks_while_the_process_runs():
    ticks = []
    assert sweep.wait_ticking(FakeProcess(3), timeout_s=600, tick=ticks.append) == 0
    assert len(ticks) == 3 and ticks == sorted(ticks)
    assert sweep.wait_ticking(FakeProcess(3), timeout_s=0, tick=ticks.append) is None  # hung: no exit status


class FakeBar:
    """Records the progress bar's updates."""

    def __init__(self, total, **kwargs) -> None:
        self.total, self.n, self.updates = total, 0, []

    def update(self, n=1) -> None:
        self.n += n
        self.updates.append(n)

    def set_description(self, *args, **kwargs) -> None:
        pass

    set_postfix = write = close = set_description


def test_the_progress_bar_moves_within_a_level(tmp_path, monkeypatch, fake_server):
    bars = []
    monkeypatch.setattr(sweep, "tqdm", lambda **kwargs: bars.append(FakeBar(**kwargs)) or bars[-1])
    monkeypatch.setattr(sweep, "run_locust", fake_locust([], ticks=(1.5, 3.2, 99.0)))
    sweep.main(["--policies", "none", "--concurrency", "1,2", "--duration", "5", "--warmup", "1",
                "--out", str(tmp_path / "run")])
    (bar,) = bars
    assert bar.total == 2 * 7  # two levels of 1 + 5 s and a second to spawn
    assert bar.updates == [1, 2, 4, 0] * 2 and bar.n == bar.total


def test_the_server_warm_up_sends_none_of_the_prompt_sets_prompts(monkeypatch):
    """A warm-up prompt from a set would sit in the prefix cache when a level sends it (its TTFT measured cached)."""
    from types import SimpleNamespace

    sent = []
    monkeypatch.setattr(sweep.httpx, "post", lambda url, json, **kw: sent.append(json) or SimpleNamespace(
        status_code=200, text=""))
    sweep.warm_up("http://x", model="m", api_key="", requests=3)
    prompts = [body["messages"][0]["content"] for body in sent]
    assert len(set(prompts)) == 3 and not set(prompts) & set(load_prompt_spec("gsm8k-eval,humaneval,mt-bench"))
