"""Grafana provisioning against a local stub of Grafana's HTTP API (checks the calls and the payload), and the
dashboard JSON against the metric definitions."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.serving.metrics import DrafterMetrics, RouterMetrics, TargetMetrics
from dashboards.provision import DASHBOARD, load_dashboard, main

EXISTING = {"uid": "f-existing", "title": "Existing"}


class StubGrafana(BaseHTTPRequestHandler):
    """Answers the three endpoints the CLI may call; records every request on the server."""

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.calls.append({"method": self.command, "path": self.path.split("?")[0], "body": body,
                                  "auth": self.headers.get("Authorization")})
        return body

    def do_GET(self):
        self._record()
        if self.path.startswith("/api/folders"):
            return self._answer(200, [EXISTING])
        self._answer(404, {"message": "not found"})

    def do_POST(self):
        body = self._record()
        if self.path == "/api/folders":
            return self._answer(200, {"uid": "f-new", "title": body["title"]})
        if self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            return self._answer(200, {"uid": uid, "url": f"/d/{uid}/dspark-serving", "version": 3,
                                      "status": "success"})
        self._answer(404, {"message": "not found"})

    def log_message(self, *args):
        pass


@pytest.fixture
def grafana():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubGrafana)
    server.calls = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def dashboard_call(calls: list[dict]) -> dict:
    (call,) = [c for c in calls if c["path"] == "/api/dashboards/db"]
    assert call["method"] == "POST"
    return call["body"]


def test_new_folder_is_created_and_dashboard_overwritten(grafana, capsys):
    server, url = grafana
    main(["--url", url, "--token", "secret", "--folder", "DSpark"])
    assert [(c["method"], c["path"]) for c in server.calls] == [
        ("GET", "/api/folders"), ("POST", "/api/folders"), ("POST", "/api/dashboards/db")]
    assert all(c["auth"] == "Bearer secret" for c in server.calls)
    assert server.calls[1]["body"] == {"title": "DSpark"}
    payload = dashboard_call(server.calls)
    assert payload["overwrite"] is True and payload["folderUid"] == "f-new"
    sent = payload["dashboard"]
    assert (sent["uid"], sent["title"], sent["id"]) == ("dspark-serve", "DSpark serving", None)
    assert sent["panels"] == load_dashboard(DASHBOARD)["panels"]
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"uid": "dspark-serve", "url": "/d/dspark-serve/dspark-serving", "version": 3,
                       "folder": "DSpark"}


def test_existing_folder_is_reused_and_no_folder_means_general(grafana, monkeypatch):
    server, url = grafana
    main(["--url", url, "--token", "t1", "--folder", "Existing"])
    assert [c["path"] for c in server.calls] == ["/api/folders", "/api/dashboards/db"]
    assert dashboard_call(server.calls)["folderUid"] == "f-existing"
    server.calls.clear()
    monkeypatch.setenv("GRAFANA_TOKEN", "from-env")
    main(["--url", url])
    assert [c["path"] for c in server.calls] == ["/api/dashboards/db"]
    assert "folderUid" not in dashboard_call(server.calls) and server.calls[0]["auth"] == "Bearer from-env"


def test_bad_input_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:9"])
    assert "--token is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--url", "http://127.0.0.1:9", "--token", "t", "--dashboard", str(tmp_path / "missing.json")])
    assert exit_.value.code == 2 and "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # nothing listens on port 9: one line naming the URL, no traceback
        main(["--url", "http://127.0.0.1:9", "--token", "t"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.startswith("error: could not provision the dashboard at http://127.0.0.1:9")
    assert "Traceback" not in err
    bad = tmp_path / "d.json"
    bad.write_text(json.dumps({"title": "x", "panels": [{}]}))
    with pytest.raises(ValueError, match="no 'uid'"):
        load_dashboard(bad)
    bad.write_text("[]")
    with pytest.raises(ValueError, match="JSON object"):
        load_dashboard(bad)


def defined_metric_names() -> set[str]:
    recorders = [TargetMetrics(policy="p", replica="r", gamma=4), DrafterMetrics(policy="p", replica="r"),
                 RouterMetrics(policy="p")]
    names = set()
    for recorder in recorders:
        for value in vars(recorder).values():
            for metric in value.values() if isinstance(value, dict) else [value]:
                if hasattr(metric, "info"):
                    names.add(metric.info["name"])
    return names


def test_dashboard_queries_only_defined_metrics():
    defined = defined_metric_names()
    exprs = [t["expr"] for p in load_dashboard(DASHBOARD)["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"ray_(dspark_\w+)", e)}
    assert used and used <= defined, used - defined
    assert {"dspark_accepted_length", "dspark_wasted_tokens", "dspark_tpot_ms", "dspark_ttft_ms",
            "dspark_verify_step_ms",
            "dspark_verify_capacity", "dspark_fallbacks"} <= used
    assert any("ray_serve_autoscaling_target_replicas" in e for e in exprs)
