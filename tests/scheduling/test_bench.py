"""The policy-decision benchmark CLI: one table row and JSON entry per policy; bad flags are usage errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app.scheduling.bench import POLICIES, main

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "roofline-llama-3.1-8b-h200.json"


def test_bench_times_every_policy(capsys):
    main(["--profile", str(PROFILE), "--batch", "8", "--gamma", "3", "--repeats", "2"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["batch"], report["gamma"]) == (8, 3)
    assert set(report["policies"]) == set(POLICIES)
    assert all(row["median_ms"] > 0 for row in report["policies"].values())


@pytest.mark.parametrize("flags, message", [
    (["--gamma", "0"], "argument --gamma: expected an integer >= 1, got 0"),
    (["--repeats", "x"], "argument --repeats: expected an integer, got 'x'"),
    (["--batch", "100000"], "--batch 100000 / --gamma 7: .*batch size 100000 is outside the profile grid"),
    (["--gamma", "100"], "--gamma 100: .*gamma 100 needs tokens_per_request up to 101"),
    (["--profile", "missing.json"], "--profile: .*No such file"),
])
def test_bad_flags_are_usage_errors(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--profile", str(PROFILE), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
