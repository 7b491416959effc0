"""Comparison tables and plot on hand-made rows (no model), and the --drafter argument's checks."""

from __future__ import annotations

import argparse

import pytest

from app.eval.compare import markdown, mean_tau, parse_drafter, plot


def _row(drafter: str, set_name: str, tau: float, accept: list) -> dict:
    return {"drafter": drafter, "set": set_name, "prompts": 2, "gamma": 3, "tau": tau,
            "accept_rate_per_position": accept, "draft_ms_per_round": 2.0, "verify_ms_per_round": 8.0,
            "draft_share": 0.2, "tok_s": 50.0, "same_output": 2}


def test_tables_and_plot(tmp_path):
    rows = [_row("a", "x", 2.0, [0.5, 0.4, 0.3]), _row("a", "y", 1.0, [0.1, None, None]),
            _row("mtp", "x", 1.5, [0.5, None, None]), _row("mtp", "y", 1.2, [0.2, None, None])]
    assert mean_tau(rows, "a") == pytest.approx(1.5)
    table = markdown(rows, ["a", "mtp"], ["x", "y"], gamma=3)
    assert "| a | 2.00 | 1.00 | 1.50 | 2.0 | 20.0% | 4/4 |" in table
    assert "| mtp | x | 1.50 | 0.50 | - | - | 2.0 | 8.0 | 20.0% | 50.0 |" in table
    plot(rows, ["a", "mtp"], ["x", "y"], 3, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_drafter_argument_needs_name_and_checkpoint(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=PATH"):
        parse_drafter(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="no checkpoint"):
        parse_drafter(f"x={tmp_path}")
    (tmp_path / "config.json").write_text("{}")
    assert parse_drafter(f"x={tmp_path}") == ("x", tmp_path)
