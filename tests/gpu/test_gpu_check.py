"""scripts/gpu_check.sh and scripts/train_gpu.sh on a machine without CUDA: each says so and exits 0 without running
anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the script would run")
@pytest.mark.parametrize("script", ["gpu_check", "train_gpu"])
def test_without_cuda_the_script_says_so_and_runs_nothing(tmp_path, script):
    out = tmp_path / "check"
    run = subprocess.run(["bash", str(ROOT / "scripts" / f"{script}.sh"), str(out)], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert run.returncode == 0, run.stderr
    assert f"{script}: no CUDA device on this machine; nothing was run" in run.stdout
    assert not out.exists()
