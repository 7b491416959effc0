"""``make serve`` starts Ray with the same environment as the load-test server, the benchmark and the served tests
(``app.serving.local_ray.SERVE_ENV``); the Makefile spells it out, so the two must not drift apart."""

from __future__ import annotations

import re

from app.serving.config import REPO_ROOT
from app.serving.local_ray import SERVE_ENV


def test_make_serve_starts_ray_with_serve_env():
    makefile = (REPO_ROOT / "Makefile").read_text()
    spelled = re.search(r"^SERVE_ENV = (.*)$", makefile, re.MULTILINE)
    assert spelled, "Makefile: no SERVE_ENV line"
    assert dict(pair.split("=", 1) for pair in spelled.group(1).split()) == SERVE_ENV
    assert re.search(r"^serve:.*\n\t\$\(SERVE_ENV\) \$\(VENV\)/bin/serve run deployments/dspark.yaml$", makefile,
                     re.MULTILINE)
