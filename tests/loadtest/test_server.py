"""``python -m loadtest.server`` refuses bad application args before it starts Ray."""

from __future__ import annotations

import re

import pytest

from loadtest import server


@pytest.mark.parametrize("override, message", [
    ("engine.model=/no/such/model", r"bad args for .*dspark.yaml with \['engine.model=/no/such/model'\] \(nothing "
                                    r"started\): FileNotFoundError: engine.model: model '/no/such/model'"),
    ("gamma=0", r"ValidationError: .*gamma"),
])
def test_bad_args_exit_with_one_line_before_ray_starts(monkeypatch, override, message):
    def ray_starts(*args, **kwargs):
        raise AssertionError("Ray would start with args the builder refuses")

    monkeypatch.setattr(server, "serve_until_signalled", ray_starts)
    with pytest.raises(SystemExit) as exited:
        server.main(["--set", override, "--port", "8399"])
    assert isinstance(exited.value.code, str) and re.search(message, exited.value.code, re.S), exited.value.code
