"""``python -m app.engine.bench`` refuses bad flags before it times anything (a bad ``--prefill-context`` failed after
minutes of timings, losing them all)."""

from __future__ import annotations

import pytest

from app.engine import bench


@pytest.mark.parametrize("argv,message", [
    (["--prefill-context", "32"], "--prefill-context must be in [64, 1920], got 32"),
    (["--prefill-context", "4096"], "--prefill-context must be in [64, 1920], got 4096"),
    (["--context", "3000"], "--context must be at most 1920"),
    (["--runs", "0"], "--runs: expected an integer >= 1"),
    (["--model", "nosuch"], "model 'nosuch' is neither an embedded model"),
])
def test_bad_flags_are_usage_errors_before_any_timing(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "decode_speed", lambda *a, **k: pytest.fail("timed"))
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_each_cached_prefix_length_is_timed_once():
    """At 64 tokens, half the prompt and all but 32 tokens are both 32: timed twice, the second found it cached."""
    assert bench.cached_prefixes(64) == [0, 32, 63] and bench.cached_prefixes(1024) == [0, 512, 992, 1023]
