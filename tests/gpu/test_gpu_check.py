"""scripts/gpu_check.sh on a machine without CUDA: it says so and exits 0 without running anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the script would run")
def test_without_cuda_the_check_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "check"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert run.returncode == 0, run.stderr
    assert "no CUDA device on this machine; nothing was run" in run.stdout
    assert not out.exists()
