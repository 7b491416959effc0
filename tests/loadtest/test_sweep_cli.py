"""The sweep's command line and control flow with fakes for the server and Locust (no server, Ray or Locust runs)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from loadtest import sweep


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
    monkeypatch.setattr(sweep, "warm_up", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "settled_counters", lambda *a, **k: {})
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
