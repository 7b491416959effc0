"""``python -m app.serving.run deployments/dspark.yaml``: serve a Serve YAML on a fresh local Ray (``make serve``).

What ``serve run`` does (Ray's CLI, run in this process), plus: Ray starts the way this project needs it
(``local_ray.init_local_ray``: ``SERVE_ENV``; node address and metrics export endpoint on 127.0.0.1 when the YAML's
HTTP host is a loopback address, on a fixed port), one log line per application says when it is ready to serve,
with its URL and model, and Ctrl-C (or SIGTERM) drains, then shuts Serve and Ray down, waiting at most
``SHUTDOWN_TIMEOUT_S``. The drain (``drain``, at most ``--drain-timeout`` seconds; a second Ctrl-C ends it): new
requests answer 503 and ``/health`` 503 ``draining`` while the requests in flight finish. Exit status 1 when an
application fails to deploy or the shutdown does not end in time. The applications this
project builds (``BUILDER``) have their args checked before Ray starts: a bad field fails at once, once, naming it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import yaml

from app.argtypes import non_negative_float, port_number
from app.serving.local_ray import init_local_ray, is_loopback

log = logging.getLogger("dspark.serve")

DEFAULT_METRICS_PORT = 8080  # Ray's metrics export port (Prometheus scrapes it; the port Ray's docs use)
READY_POLL_S = 1.0  # how often the deployment's status is read until every application runs
SERVE_DEFAULT_HOST, SERVE_DEFAULT_PORT = "127.0.0.1", 8000  # Serve's http_options defaults
BUILDER = "app.serving.builder:build_app"  # the import path of this project's applications
# Serve's shutdown (each replica waits for up to its graceful_shutdown_timeout_s, 20 s by default, though the
# proxies' client connections close at once; Serve gives its controller 30 s), then Ray's
SHUTDOWN_TIMEOUT_S = 60.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # Kubernetes' default grace period between SIGTERM and SIGKILL
DRAIN_POLL_S = 0.25  # how often a drain reads the requests still in flight
DRAIN_CALL_TIMEOUT_S = 5.0  # a drain's wait for one answer from Serve


def http_host(config: dict) -> str:
    """The HTTP host of a Serve YAML (``http_options.host``, else Serve's default)."""
    return (config.get("http_options") or {}).get("host", SERVE_DEFAULT_HOST)


def http_port(config: dict) -> int:
    """The HTTP port of a Serve YAML (``http_options.port``, else Serve's default)."""
    return (config.get("http_options") or {}).get("port", SERVE_DEFAULT_PORT)


def port_errors(config: dict, metrics_port: int) -> str | None:
    """What is wrong with the ports a Serve YAML and ``--metrics-port`` ask for (None: nothing): an HTTP port that
    is not one, or the same port for both."""
    port = http_port(config)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        return f"http_options.port must be a port number 1-65535, got {port!r}"
    if port == metrics_port:
        return f"http_options.port and --metrics-port are both {port}: pick two ports"
    return None


def busy_ports(config: dict, metrics_port: int) -> list[str]:
    """The ports the launcher needs that something already listens on, each as ``host:port (what)``: the HTTP port
    (``http_options``) and Ray's metrics port (on the HTTP host when that is loopback, as ``init_local_ray`` binds it;
    0: a free one, never busy). Ray itself reports a taken port only as a node that "timed out during startup"."""
    host = http_host(config)
    wanted = [(host, http_port(config), "http_options.port")]
    if metrics_port:
        wanted.append((host if is_loopback(host) else "0.0.0.0", metrics_port, "--metrics-port"))
    busy = []
    for addr, port, what in wanted:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                probe.bind((addr, port))
            except OSError:
                busy.append(f"{addr}:{port} ({what})")
    return busy


def ready_lines(config: dict) -> list[str]:
    """One line per application of a Serve YAML: its URL and the model clients name (``AppConfig.served_model_name``
    for an application this project builds: unset, ``engine.model``)."""
    from app.serving.config import AppConfig

    lines = []
    for app in config.get("applications", []):
        args = app.get("args") or {}
        model = AppConfig.model_validate(args).served_model_name if app.get("import_path") == BUILDER else \
            args.get("served_model_name", "?")
        prefix = (app.get("route_prefix") or "/").rstrip("/")
        lines.append(f"ready: application {app['name']!r} serves model {model!r} at "
                     f"http://{http_host(config)}:{http_port(config)}{prefix}/v1")
    return lines


def refusal(args: dict) -> str | None:
    """What ``builder.checked_config`` refuses in an application's ``args``, in one line (each field a pydantic error
    names: ``field: message``); None when it accepts them. Imports Ray (through the builder)."""
    from pydantic import ValidationError

    from app.serving.builder import checked_config

    try:
        checked_config(args)
    except ValidationError as err:
        return "ValidationError: " + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'args'}: {e['msg']}"
                                               for e in err.errors())
    except (ValueError, OSError) as err:  # the files checked, a profile or drafter that does not fit the target
        return f"{type(err).__name__}: {err}"
    return None


def check_applications(config: dict) -> dict[str, str]:
    """``refusal`` of each application of a Serve YAML that this project builds (``BUILDER``); returns {name: error}
    for those whose args are refused (other import paths are not checked here)."""
    errors = {}
    for app in config.get("applications", []):
        if app.get("import_path") == BUILDER and (why := refusal(app.get("args") or {})) is not None:
            errors[app.get("name", "?")] = why
    return errors


def failure_reason(app) -> str:
    """An application's failure as Serve reports it (``ApplicationStatusOverview``), with, for each deployment that
    failed, the last line of its error: the exception a replica's constructor raised (Serve's own message ends with
    the replica's traceback, and the application's only names the deployments)."""
    lines = [app.message]
    for name, deployment in app.deployments.items():
        if deployment.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            last = [line for line in (deployment.message or "").splitlines() if line.strip()]
            lines.append(f"{name}: {last[-1].strip() if last else deployment.status}")
    return "\n".join(lines)


def wait_until_running(names: list[str]) -> dict[str, str]:
    """Block until every named application runs; returns {name: failure reason} (``failure_reason``) for those that
    failed instead."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    failed_states = (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY)
    while True:
        apps = serve.status().applications
        failed = {n: failure_reason(apps[n]) for n in names if n in apps and apps[n].status in failed_states}
        if failed or all(n in apps and apps[n].status == ApplicationStatus.RUNNING for n in names):
            return failed
        time.sleep(READY_POLL_S)


def shutdown(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
    """Shut Serve, then Ray, down, waiting at most ``timeout_s`` seconds. Returns False when the wait ran out: the
    shutdown goes on in a daemon thread, which a process exiting does not wait for (seen when a signal to the whole
    process group took Ray's own processes, raylet and dashboard, down with this one)."""
    import ray
    from ray import serve

    def run() -> None:
        serve.shutdown()
        ray.shutdown()

    thread = threading.Thread(target=run, name="shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def _answer(fn, timeout_s: float):
    """``fn()`` run on a daemon thread, waited for at most ``timeout_s`` seconds (Ray calls that have no timeout of
    their own block for a minute once Ray's processes are gone).

    Raises:
        TimeoutError: no answer in time (the thread is left behind).
        Whatever ``fn`` raises.
    """
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as err:  # handed to the caller
            result.append((False, err))

    thread = threading.Thread(target=run, name="drain-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise TimeoutError(f"no answer from Serve within {timeout_s:g} s (Ray's processes gone?)")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def drain(config: dict, timeout_s: float) -> bool:
    """Drain the applications this project builds (``BUILDER``): their Routers refuse new requests (the Ingress
    answers 503, ``/health`` 503), then wait, at most ``timeout_s`` seconds, until no request is in flight: the
    Routers' ``in_flight`` reads 0 over two load-report intervals (a report may miss a request sent just before it).
    Every poll tells the Routers to drain again (a Router that Serve restarted starts without the flag). A
    KeyboardInterrupt (a second Ctrl-C or SIGTERM) ends the wait; Serve not answering within ``DRAIN_CALL_TIMEOUT_S``
    ends the drain. Returns whether every request finished."""
    from ray import serve
    from ray.exceptions import RayError

    from app.serving.config import AppConfig

    apps = [app for app in config.get("applications", []) if app.get("import_path") == BUILDER]
    if timeout_s <= 0 or not apps:
        return False
    default_interval = AppConfig.model_fields["stats_interval_s"].default  # the args were checked at start
    settle_s = 2 * max(float((app.get("args") or {}).get("stats_interval_s", default_interval)) for app in apps)

    def poll(routers) -> int:
        for router in routers:
            router.drain.remote().result(timeout_s=DRAIN_CALL_TIMEOUT_S)
        return sum(router.in_flight.remote().result(timeout_s=DRAIN_CALL_TIMEOUT_S) for router in routers)

    left = None
    try:
        routers = _answer(lambda: [serve.get_deployment_handle("Router", app["name"]) for app in apps],
                          DRAIN_CALL_TIMEOUT_S)
        deadline, idle_since = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            left = _answer(lambda: poll(routers), 2 * DRAIN_CALL_TIMEOUT_S)
            now = time.monotonic()
            if left:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= settle_s:
                log.info("drained: no request in flight")
                return True
            time.sleep(DRAIN_POLL_S)
        log.warning("drain: %s requests still in flight after %g s (--drain-timeout) lose their connection",
                    left, timeout_s)
    except KeyboardInterrupt:
        log.warning("drain interrupted: %s requests in flight lose their connection", left)
    except (RayError, TimeoutError) as err:
        log.warning("drain failed, shutting down without it: %s", err)
    return False


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM shuts down like Ctrl-C (a background job started by a script ignores SIGINT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a Serve YAML on a fresh local Ray.")
    parser.add_argument("config", type=Path, help="Serve YAML (deployments/*.yaml)")
    parser.add_argument("--metrics-port", type=port_number, default=DEFAULT_METRICS_PORT,
                        help=f"Ray's Prometheus metrics export port (default {DEFAULT_METRICS_PORT}; 0: a free one)")
    parser.add_argument("--drain-timeout", type=non_negative_float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="on Ctrl-C or SIGTERM, refuse new requests and wait at most this many seconds for those "
                             f"in flight before shutting down (default {DEFAULT_DRAIN_TIMEOUT_S:g}; 0: no drain)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = yaml.safe_load(args.config.read_text())
    refused = check_applications(config)
    for name, error in refused.items():
        log.error("application %r: bad args in %s (nothing started):\n%s", name, args.config, error)
    if refused:
        return 1
    if (bad := port_errors(config, args.metrics_port)):
        log.error("%s (nothing started)", bad)
        return 1
    busy = busy_ports(config, args.metrics_port)
    if busy:
        log.error("port in use, nothing started: %s (another server running? stop it, or pick other ports: "
                  "http_options.port in the YAML, --metrics-port here)", ", ".join(busy))
        return 1

    import click
    import ray
    from ray.serve.scripts import cli

    # as `serve run` starts Ray: the replicas' logs in this terminal, Ray's default dashboard (it writes the metrics
    # service discovery file Prometheus reads, docs/observability.md)
    init_local_ray(http_host=http_host(config), include_dashboard=None, log_to_driver=True,
                   _metrics_export_port=args.metrics_port or None)
    signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, whose core worker installs its own handler
    ready = False
    try:
        cli.main(["run", "--non-blocking", str(args.config)], standalone_mode=False)
        failed = wait_until_running([app["name"] for app in config.get("applications", [])])
        for name, message in failed.items():
            log.error("application %r failed to deploy:\n%s", name, message)
        if failed:
            return 1
        for line in ready_lines(config):
            log.info(line)
        log.info("Ray: this server's cluster is at %s (RAY_AUTH_MODE=token; README)",
                 ray.get_runtime_context().gcs_address)
        ready = True
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, click.exceptions.Abort):  # Serve's CLI turns one during its start into an Abort
        if ready and args.drain_timeout > 0:
            log.info("draining: new requests answer 503 while those in flight finish (at most %g s; Ctrl-C or "
                     "SIGTERM again to stop now)", args.drain_timeout)
            drain(config, args.drain_timeout)
        elif ready:
            log.info("no drain (--drain-timeout 0): requests in flight lose their connection")
        log.info("shutting down%s", "" if ready else " (stopped before the application was ready)")
        return 0
    finally:
        if not shutdown():
            log.error("Serve and Ray did not shut down within %.0f s (were Ray's own processes signalled too?): "
                      "exiting without waiting for them", SHUTDOWN_TIMEOUT_S)
            logging.shutdown()
            os._exit(1)  # Ray's exit handler would wait for the same shutdown


if __name__ == "__main__":
    sys.exit(main())
