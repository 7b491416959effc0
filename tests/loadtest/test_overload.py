"""The overload benchmark's command line: bad or conflicting flags are usage errors before any server starts."""

from __future__ import annotations

import pytest

from loadtest import overload


@pytest.mark.parametrize(("flags", "message"), [
    (["--requests", "0"], "argument --requests: expected an integer >= 1, got 0"),
    (["--rounds", "-1"], "argument --rounds: expected an integer >= 1, got -1"),
    (["--config", "/nonexistent.yaml"], "--config /nonexistent.yaml: no such file"),
    (["--url", "http://127.0.0.1:1", "--set", "gamma=3"], "--set: for a server this starts only; with --url none"),
    (["--url", "http://127.0.0.1:1", "--config", "deployments/dspark.yaml"], "--config: for a server this starts"),
])
def test_bad_flags_are_usage_errors_before_any_server_starts(monkeypatch, capsys, flags, message):
    def server_starts(**kwargs):
        raise AssertionError("a server would start")

    monkeypatch.setattr(overload, "ManagedServer", server_starts)
    monkeypatch.setattr(overload, "run_round", lambda *a, **k: pytest.fail("a burst would be sent"))
    with pytest.raises(SystemExit) as exit_info:
        overload.main(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
