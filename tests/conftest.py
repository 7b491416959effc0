"""Shared fixtures: the real default target (loaded once per session) and evaluation prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The project's shared folder lies beside the repository (CI lays a copy there); DSPARK_SHARED_DIR overrides.
SHARED = Path(os.environ.get("DSPARK_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))


def load_prompts(name: str, *, start: int = 0, count: int = 10) -> list[str]:
    """First user turns of ``shared/datasets/<name>.jsonl`` lines [start, start + count)."""
    lines = (SHARED / "datasets" / f"{name}.jsonl").read_text().splitlines()[start : start + count]
    return [json.loads(line)["turns"][0] for line in lines]


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """``shared/datasets`` (the prompt sets of ``shared/datasets/README.md``)."""
    return SHARED / "datasets"


@pytest.fixture(scope="session")
def engine():
    from app.engine.engine import EngineConfig, TargetEngine

    return TargetEngine(EngineConfig(max_num_seqs=24, max_model_len=1024))


@pytest.fixture(scope="session")
def eval_prompts() -> list[str]:
    """20 evaluation prompts across chat, code and math (never used for drafter training)."""
    return load_prompts("mt-bench", count=7) + load_prompts("humaneval", count=6) + load_prompts(
        "gsm8k", start=700, count=7
    )
