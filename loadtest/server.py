"""Start the Serve application with one verify policy, in a child process, for a sweep (or by hand).

Owns: reading a ``deployments/*.yaml`` application, applying overrides (``--set policy=mtp1``, dotted keys
for nested fields: ``--set target.num_cpus=0.5``), and serving it on a chosen HTTP port::

    python -m loadtest.server --config deployments/dspark.yaml --port 8123 --set policy=mtp1

runs a fresh local Ray (never joins a running one), ``serve.run(build_app(args))``, prints ``READY <url>``
and serves until SIGTERM or SIGINT, then shuts Serve and Ray down. ``ManagedServer`` does the same from a
parent process that must not import Ray or torch (the sweep, which also runs gevent-patched Locust
processes): it starts the child, waits for ``/health`` and ``/v1/models``, and stops it (SIGTERM, then the
child's process group after a grace period).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import httpx
import yaml

from app.argtypes import port_number, positive_float
from app.serving.run import refusal

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "deployments" / "dspark.yaml"


def check_server_flags(ap: argparse.ArgumentParser, args: argparse.Namespace, *, started: str) -> None:
    """The checks of a tool that runs against ``--url`` or a server it starts (``started`` names that server in the
    message): with ``--url`` the flags that shape a started server (``--config``, ``--set``, ``--num-cpus``,
    ``--port``, where the tool has them) would do nothing, so they are a usage error; ``--config`` counts when
    given at all (its default is None, read as ``DEFAULT_CONFIG``, which this sets); without ``--url`` the config
    file must exist."""
    named = {"--config": "config", "--set": "overrides", "--num-cpus": "num_cpus", "--port": "port"}
    if args.url and (unused := [flag for flag, field in named.items() if getattr(args, field, None) not in (None, [])]):
        ap.error(f"{', '.join(unused)}: for {started} only; with --url none is started")
    args.config = args.config or DEFAULT_CONFIG
    if not args.url and not args.config.is_file():
        ap.error(f"--config {args.config}: no such file")


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_overrides(items: list[str]) -> dict:
    """``["a=1", "b.c=x"]`` -> ``{"a": 1, "b": {"c": "x"}}`` (values parsed as YAML scalars).

    Raises:
        ValueError: an item without ``=`` or with an empty key.
    """
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def _deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _deep_merge(base[key], value) if isinstance(value, dict) and isinstance(
            base.get(key), dict) else value
    return merged


def load_application(config: Path, app_name: str | None = None) -> dict:
    """One application entry of a Serve config YAML (the first, or the one named ``app_name``).

    Raises:
        ValueError: no such application, or it is not built by ``app.serving.builder:build_app``.
    """
    data = yaml.safe_load(Path(config).read_text())
    apps = data.get("applications") or []
    chosen = next((a for a in apps if app_name in (None, a.get("name"))), None)
    if chosen is None:
        raise ValueError(f"{config}: no application {app_name!r} (has {[a.get('name') for a in apps]})")
    if chosen.get("import_path") != "app.serving.builder:build_app":
        raise ValueError(f"{config}: application {chosen.get('name')!r} is not app.serving.builder:build_app")
    return chosen


def app_args(config: Path, overrides: dict, app_name: str | None = None) -> dict:
    """The application's ``args`` with ``overrides`` merged in (nested dicts merge key by key)."""
    return _deep_merge(load_application(config, app_name).get("args") or {}, overrides)


class ManagedServer:
    """The application in a child process: ``with ManagedServer(...) as server: server.url``."""

    def __init__(
        self, *, config: Path = DEFAULT_CONFIG, overrides: list[str] = (), host: str = "127.0.0.1",
        port: int | None = None, num_cpus: float | None = None, log_path: Path | None = None,
        ready_timeout_s: float = 600.0, api_key: str | None = None,
    ) -> None:
        self.config, self.overrides, self.host = Path(config), list(overrides), host
        self.port = port or free_port(host)
        self.num_cpus, self.log_path, self.ready_timeout_s = num_cpus, log_path, ready_timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = app_args(self.config, parse_overrides(self.overrides)).get("served_model_name", "smollm2-135m")
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "loadtest.server", "--config", str(self.config), "--host", self.host,
               "--port", str(self.port)]
        cmd += [a for o in self.overrides for a in ("--set", o)]
        if self.num_cpus is not None:
            cmd += ["--num-cpus", str(self.num_cpus)]
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log or subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> None:
        """Until the server answers (see ``wait_ready``); fails early if the child exits.

        Raises:
            RuntimeError: the child exited or was not ready in time (with the tail of its log).
        """
        try:
            wait_ready(self.url, headers=self.headers, timeout_s=self.ready_timeout_s, check=self._check_alive)
        except RuntimeError as err:
            if self.process.poll() is not None:
                raise
            raise RuntimeError(f"{err}:\n{self.log_tail()}") from err

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM (the child shuts Serve and Ray down), then SIGKILL to what is left of its process group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        # Whatever is left of the child's own process group (it was started in a new session): Ray helpers
        # orphaned by a child that did not shut down cleanly.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None


def wait_ready(url: str, *, headers: dict | None = None, timeout_s: float = 600.0, check=lambda: None) -> None:
    """Poll until ``/health`` answers 200 and ``/v1/models`` answers 200 (Serve answers 404 while deploying;
    vLLM needs minutes to start); ``check()`` runs between polls and may raise.

    Raises:
        RuntimeError: not ready within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        with contextlib.suppress(httpx.HTTPError):
            healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
            if healthy and httpx.get(f"{url}/v1/models", headers=headers or {}, timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s ({url}/health and {url}/v1/models must "
                               "answer 200)")
        time.sleep(0.5)


def serve_until_signalled(
    args: dict, *, host: str, port: int, num_cpus: float | None, name: str = "dspark", route_prefix: str = "/"
) -> None:
    """Run the application on a fresh local Ray until SIGTERM or SIGINT."""
    import ray
    from ray import serve

    from app.serving.builder import build_app
    from app.serving.local_ray import init_local_ray

    init_local_ray(http_host=host, num_cpus=num_cpus)  # Ray's metrics endpoint on loopback when the host is
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, whose own SIGTERM handler exits at once
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(args), name=name, route_prefix=route_prefix)
        print(f"READY http://{host}:{port} policy={args.get('policy')}", flush=True)
        stop.wait()
    finally:  # this Ray is the server's own: shutting it down ends Serve too, without a graceful wait per replica
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="Serve config YAML (deployments/*.yaml)")
    ap.add_argument("--app", default=None, help="application name inside the config (default: the first)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override an args field (repeatable; dotted keys for nested fields)")
    ap.add_argument("--host", default=None, help="HTTP host (default: the config's http_options.host)")
    ap.add_argument("--port", type=port_number, default=None,
                    help="HTTP port (default: $DSPARK_SERVE_PORT, else the config's http_options.port)")
    ap.add_argument("--num-cpus", type=positive_float, default=None, help="CPUs of the local Ray (default: all)")
    ap.add_argument("--check", default=None, metavar="POLICY,...",
                    help="start nothing: check the args with each of these policies (as the sweep does before it "
                    "starts a server); a line for each refused one, exit 1")
    opts = ap.parse_args(argv)
    if not opts.config.is_file():
        ap.error(f"--config {opts.config}: no such file")
    try:
        overrides = parse_overrides(opts.overrides)
    except ValueError as err:
        ap.error(f"--set: {err}")
    try:
        http = (yaml.safe_load(opts.config.read_text()).get("http_options") or {})
        application = load_application(opts.config, opts.app)
        args = app_args(opts.config, overrides, opts.app)
    except (ValueError, AttributeError, yaml.YAMLError) as err:
        ap.error(f"--config {opts.config}: {err}")
    port = opts.port or int(os.environ.get("DSPARK_SERVE_PORT", http.get("port", 8000)))
    if opts.check is not None:
        refused = [f"policy {p}: {why}" for p in opts.check.split(",") if (why := refusal({**args, "policy": p}))]
        sys.exit("\n".join(refused) or None)
    # what build_app checks, before Ray starts: a bad --set is one line, not tracebacks from inside Ray
    if why := refusal(args):
        sys.exit(f"loadtest.server: bad args for {opts.config} with {opts.overrides or 'no --set'} (nothing "
                 f"started): {why}")
    serve_until_signalled(args, host=opts.host or http.get("host", "127.0.0.1"), port=port, num_cpus=opts.num_cpus,
                          name=application.get("name", "dspark"), route_prefix=application.get("route_prefix", "/"))


if __name__ == "__main__":
    main()
