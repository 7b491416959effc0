"""Evaluator statistics on hand-made rounds (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from app.drafters.calibration import auc, ece
from app.eval.evaluate import RoundRecord, markdown, summarize


def test_per_position_acceptance_counts_only_reached_positions():
    c = torch.full((3,), 0.9)
    records = [RoundRecord(c, c, 3, 3), RoundRecord(c, c, 3, 1), RoundRecord(c, c, 3, 0), RoundRecord(c, c, 2, 2)]
    s = summarize(records, gamma=3)
    # position 1: 4 reached, 3 accepted; position 2: 3 reached (acc >= 1), 2 accepted; position 3: 1 reached, 1
    assert s["accept_rate_per_position"] == [0.75, round(2 / 3, 4), 1.0]
    row = {"set": "x", "temperature": 0.0, "prompts": 4, "tau": 2.5, "draft_ms_per_round": 1.0,
           "verify_ms_per_round": 10.0, "draft_share": 0.09, **s}
    assert "| x | 0 | 4 | 2.50 |" in markdown([row], gamma=3)


def test_ece_and_auc_reference_values():
    assert ece(torch.tensor([0.9, 0.9]), torch.tensor([1.0, 0.0])) == pytest.approx(0.4)
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert math.isnan(auc(torch.tensor([0.2, 0.3]), torch.tensor([1, 1])))


def test_no_scored_rounds_gives_empty_figures_not_a_crash():
    """Tiny budgets: every round ended its request, so no round is scored; the table still renders."""
    s = summarize([], gamma=3)
    assert s["accept_rate_per_position"] == [None] * 3 and s["ece_after"] is None
    row = {"set": "x", "temperature": 0.0, "prompts": 1, "tau": 1.0, "draft_ms_per_round": 1.0,
           "verify_ms_per_round": 10.0, "draft_share": 0.09, **s}
    line = markdown([row], gamma=3).splitlines()[-1]
    assert line.count("|") == markdown([row], gamma=3).splitlines()[0].count("|")


@pytest.mark.parametrize("bad", [["--gamma", "0"], ["--limit", "0"], ["--max-tokens", "-1"],
                                 ["--checkpoint", "/nonexistent-checkpoint"]])
def test_evaluator_rejects_bad_arguments_before_loading_anything(bad, capsys):
    from app.eval.evaluate import main

    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("text", ['{"config": {', '[1, 2]', '{"config": {"block_size": 7}}'])
def test_evaluator_rejects_a_malformed_checkpoint_config(text, tmp_path, capsys):
    from app.eval.evaluate import main

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(tmp_path)])
    assert exc.value.code == 2 and f"{tmp_path / 'config.json'}" in capsys.readouterr().err


def test_a_run_whose_every_draft_was_accepted_reports_auc_as_null_not_nan():
    """AUC needs both outcomes; NaN in report.json is not JSON (strict parsers refuse the file)."""
    import json as json_module

    records = [RoundRecord(torch.full((4,), 0.9), torch.full((4,), 0.8), 4, 4) for _ in range(3)]
    stats = summarize(records, gamma=4)
    assert stats["auc_before"] is None and stats["auc_after"] is None
    json_module.loads(json_module.dumps(stats, allow_nan=False))
