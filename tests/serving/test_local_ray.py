"""``make serve`` starts Ray the way the load-test server, the benchmark and the served tests do
(``app.serving.local_ray.init_local_ray``, through ``app.serving.run``), and says when the application is ready."""

from __future__ import annotations

import re
import threading
import time

import pytest
import yaml

from app.serving.config import REPO_ROOT
from app.serving.local_ray import is_loopback
from app.serving.run import BUILDER, drain, http_host, ready_lines, shutdown


def test_make_serve_runs_the_launcher():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^serve:.*\n\t\$\(PY\) -m app\.serving\.run deployments/dspark\.yaml$", makefile, re.MULTILINE)


def test_ready_line_names_url_and_model_and_loopback_hosts():
    config = yaml.safe_load((REPO_ROOT / "deployments" / "dspark.yaml").read_text())
    assert http_host(config) == "127.0.0.1" and is_loopback(http_host(config))
    assert ready_lines(config) == ["ready: application 'dspark' serves model 'smollm2-135m' at "
                                   "http://127.0.0.1:8000/v1"]
    builder = "app.serving.builder:build_app"
    assert ready_lines({"applications": [{"name": "a", "route_prefix": "/x/", "import_path": builder,
                                          "args": {"served_model_name": "m"}}]}) \
        == ["ready: application 'a' serves model 'm' at http://127.0.0.1:8000/x/v1"]
    unnamed = {"name": "a", "import_path": builder, "args": {"engine": {"model": "/models/q"}, "drafter": "ngram"}}
    assert ready_lines({"applications": [unnamed]}) == [  # clients name the model as written
        "ready: application 'a' serves model '/models/q' at http://127.0.0.1:8000/v1"]
    assert [is_loopback(h) for h in ("localhost", "127.0.0.2", "::1", "0.0.0.0", "10.1.2.3", "example.org")] == \
        [True, True, True, False, False, False]


def test_the_launcher_shuts_serve_then_ray_down(monkeypatch):
    import ray
    from ray import serve

    calls = []
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray"))
    assert shutdown(timeout_s=5.0) is True
    assert calls == ["serve", "ray"]


def test_a_shutdown_that_hangs_is_given_up_after_its_timeout(monkeypatch):
    """Serve's shutdown waiting on Ray processes that are gone: the launcher stops waiting when its time is up."""
    import ray
    from ray import serve

    release, calls = threading.Event(), []
    monkeypatch.setattr(serve, "shutdown", lambda: release.wait(30))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray"))
    t0 = time.perf_counter()
    try:
        assert shutdown(timeout_s=0.3) is False
        assert time.perf_counter() - t0 < 5 and calls == []
    finally:  # let the abandoned thread end while ``ray.shutdown`` is still the stand-in
        release.set()
        for thread in threading.enumerate():
            if thread.name == "shutdown":
                thread.join(5)
    assert calls == ["ray"]


class _FakeRouter:
    """A Router handle whose ``in_flight`` reads ``counts`` one by one (then the last one for ever)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts, self.drained = list(counts), False

    def __getattr__(self, method: str):
        def remote():
            if method == "drain":
                self.drained = True
                value = None
            else:
                value = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
            return type("Response", (), {"result": lambda self, timeout_s=None: value})()
        return type("Method", (), {"remote": staticmethod(remote)})()


def test_a_drain_waits_until_nothing_is_in_flight_over_two_report_intervals(monkeypatch, caplog):
    from ray import serve

    routers = {"a": _FakeRouter([2, 1, 0, 0, 0]), "b": _FakeRouter([0])}
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app: routers[app])
    apps = {"applications": [{"name": "a", "import_path": BUILDER, "args": {"stats_interval_s": 0.1}},
                             {"name": "b", "import_path": BUILDER}, {"name": "other", "import_path": "x:y"}]}
    t0 = time.perf_counter()
    assert drain(apps, timeout_s=10) is True
    assert routers["a"].drained and routers["b"].drained
    assert 1.0 <= time.perf_counter() - t0 < 5  # 0 held for 2 x 0.5 s (the slower app's report interval)
    stuck = {"a": _FakeRouter([1])}
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app: stuck[app])
    t0 = time.perf_counter()
    assert drain({"applications": apps["applications"][:1]}, timeout_s=0.5) is False
    assert time.perf_counter() - t0 < 2 and "1 requests still in flight after 0.5 s" in caplog.text
    assert drain(apps, timeout_s=0) is False  # --drain-timeout 0: no drain


def test_a_deploy_failure_names_the_replicas_error():
    """Serve's application message only names the failed deployments; the launcher adds each one's last error line."""
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentStatus

    from app.serving.run import failure_reason

    target = SimpleNamespace(status=DeploymentStatus.DEPLOY_FAILED, message=(
        "The deployment failed to start 3 times in a row. See controller logs for details. Error:\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "ValueError: engine.model: unsupported target config {'mlp_bias': True}\n"))
    router = SimpleNamespace(status=DeploymentStatus.HEALTHY, message="")
    app = SimpleNamespace(message="Failed to update the deployments ['Target'].",
                          deployments={"Target": target, "Router": router})
    assert failure_reason(app) == ("Failed to update the deployments ['Target'].\n"
                                   "Target: ValueError: engine.model: unsupported target config {'mlp_bias': True}")


def test_the_launcher_refuses_bad_args_before_starting_ray(tmp_path, monkeypatch, caplog):
    """A bad field of an application this project builds fails at once, naming it, with nothing started."""
    from app.serving import run

    config = yaml.safe_load((REPO_ROOT / "deployments" / "dspark.yaml").read_text())
    assert run.check_applications(config) == {}
    config["applications"][0]["args"]["enable_chunked_prefill"] = True
    config["applications"][0]["args"]["engine"]["batch_invariant"] = True
    config["applications"].append({"name": "other", "import_path": "elsewhere:app", "args": {"anything": 1}})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(run, "init_local_ray", lambda **kw: pytest.fail("Ray started"))
    with caplog.at_level("ERROR", logger="dspark.serve"):
        assert run.main([str(path)]) == 1
    assert "application 'dspark': bad args" in caplog.text and "enable_chunked_prefill" in caplog.text
    assert "other" not in caplog.text


def test_the_launcher_names_a_port_in_use_before_starting_ray(tmp_path, monkeypatch, caplog):
    """A port something already listens on (another server) is named at once, with nothing started."""
    import socket

    from app.serving import run

    with socket.socket() as taken, socket.socket() as spare:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spare.bind(("127.0.0.1", 0))  # bound, not listening: a free port to name for the other one
        port, free = taken.getsockname()[1], spare.getsockname()[1]
        spare.close()
        config = yaml.safe_load((REPO_ROOT / "deployments" / "dspark.yaml").read_text())
        config["http_options"]["port"] = free
        assert run.busy_ports(config, 0) == []
        assert run.busy_ports(config, port) == [f"127.0.0.1:{port} (--metrics-port)"]
        config["http_options"]["port"] = port
        assert run.busy_ports(config, 0) == [f"127.0.0.1:{port} (http_options.port)"]
        path = tmp_path / "taken.yaml"
        path.write_text(yaml.safe_dump(config))
        monkeypatch.setattr(run, "init_local_ray", lambda **kw: pytest.fail("Ray started"))
        with caplog.at_level("ERROR", logger="dspark.serve"):
            assert run.main([str(path), "--metrics-port", "0"]) == 1
    assert f"127.0.0.1:{port} (http_options.port)" in caplog.text and "nothing started" in caplog.text


def test_the_launcher_refuses_ports_that_are_not_ports_or_collide(tmp_path, monkeypatch, caplog, capsys):
    from app.serving import run

    monkeypatch.setattr(run, "init_local_ray", lambda **kw: pytest.fail("Ray started"))
    config = yaml.safe_load((REPO_ROOT / "deployments" / "dspark.yaml").read_text())
    path = tmp_path / "ports.yaml"
    for port, metrics, message in ((70000, "0", "http_options.port must be a port number 1-65535, got 70000"),
                                   (8123, "8123", "http_options.port and --metrics-port are both 8123")):
        path.write_text(yaml.safe_dump({**config, "http_options": {**config["http_options"], "port": port}}))
        with caplog.at_level("ERROR", logger="dspark.serve"):
            assert run.main([str(path), "--metrics-port", metrics]) == 1
        assert message in caplog.text and "nothing started" in caplog.text
    for bad in ("-1", "70000", "x"):
        with pytest.raises(SystemExit) as exc:
            run.main([str(path), "--metrics-port", bad])
        assert exc.value.code == 2 and "expected a port number 0-65535" in capsys.readouterr().err


def test_a_drain_tells_a_restarted_router_again_and_gives_up_on_a_serve_that_does_not_answer(monkeypatch, caplog):
    """Serve may restart the Router mid-drain (it is soft state): every poll tells the Routers to drain again. With
    Ray's processes gone, handle lookups block for a minute: the drain stops waiting after DRAIN_CALL_TIMEOUT_S."""
    from ray import serve

    from app.serving import run

    router = _FakeRouter([1, 1, 0])
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app: router)
    apps = {"applications": [{"name": "a", "import_path": BUILDER, "args": {"stats_interval_s": 0.05}}]}
    drained = []
    original = _FakeRouter.__getattr__

    def counting(self, method):
        if method == "drain":
            drained.append(method)
        return original(self, method)

    monkeypatch.setattr(_FakeRouter, "__getattr__", counting)
    assert drain(apps, timeout_s=10) is True and len(drained) >= 3  # once per poll
    release = threading.Event()
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app: release.wait(30))
    monkeypatch.setattr(run, "DRAIN_CALL_TIMEOUT_S", 0.2)
    t0 = time.perf_counter()
    try:
        assert drain(apps, timeout_s=10) is False
        assert time.perf_counter() - t0 < 5 and "drain failed, shutting down without it: no answer from Serve" \
            in caplog.text
    finally:
        release.set()
