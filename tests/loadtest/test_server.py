"""``python -m loadtest.server`` refuses bad application args before it starts Ray."""

from __future__ import annotations

import re

import pytest

from app.argtypes import base_url
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


@pytest.mark.parametrize("given", ["http://127.0.0.1:8300", "http://127.0.0.1:8300/", "http://127.0.0.1:8300/v1",
                                   "http://127.0.0.1:8300/v1/", " http://127.0.0.1:8300/v1 "])
def test_base_url_drops_a_trailing_slash_and_v1(given):
    assert base_url(given) == "http://127.0.0.1:8300"


def test_wait_ready_names_the_urls_it_waited_for():
    url = f"http://127.0.0.1:{server.free_port()}"  # nothing listens there
    with pytest.raises(RuntimeError, match=re.escape(f"({url}/health and {url}/v1/models must answer 200)")):
        server.wait_ready(url, timeout_s=0)
