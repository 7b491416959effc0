"""Imports run one way: the engine, drafters and scheduling packages pull in no serving, evaluation or load-test code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOWER = ("app.engine", "app.drafters", "app.scheduling")
UPPER = ("app.serving", "app.eval", "loadtest")

PROBE = f"""
import importlib, pkgutil, sys
for name in {LOWER!r}:
    package = importlib.import_module(name)
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m.split(".")[0] == "loadtest" or m.startswith({UPPER!r})))
"""


def test_lower_packages_import_no_serving_eval_or_loadtest_module():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


INGRESS_PROBE = """
import pickle, sys
import app.serving.ingress
config = pickle.loads(sys.stdin.buffer.read())  # a replica gets its config pickled, not validated again
print(config.served_model_name, sorted(m for m in ("torch", "transformers", "llguidance") if m in sys.modules))
"""


def test_http_ingress_runs_without_torch_or_transformers():
    """The ingress (HTTP, OpenAI schemas, streaming) loads neither torch nor transformers: its replicas start fast
    and stay small."""
    import pickle

    from app.serving.config import AppConfig

    config = pickle.dumps(AppConfig(served_model_name="m"))
    out = subprocess.run([sys.executable, "-c", INGRESS_PROBE], cwd=REPO, input=config, capture_output=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.decode().strip().splitlines()[-1] == "m []", out.stdout[-2000:]


def test_router_runs_without_torch():
    """The Router deployment and its request router (which runs in the ingress's process) load no torch: the
    capacity they compute comes from ``app.scheduling.gain``, numpy only."""
    probe = "import sys, app.serving.router; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
