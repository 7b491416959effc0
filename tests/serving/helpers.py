"""Shared helpers for the serving tests: a local Ray + Serve on a free loopback port, HTTP and SSE utilities."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings

import httpx
import psutil

from app.serving.local_ray import init_local_ray


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_serial() -> None:
    """RuntimeError in a pytest-xdist worker: a test that starts Ray must be marked ``serial`` (``tests/conftest.py``),
    so that it runs alone, after the parallel phase, not beside another worker's Ray or CPU-bound tests."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        raise RuntimeError("this test starts Ray: mark its module `pytestmark = pytest.mark.serial` "
                           "(tests/conftest.py)")


def _start_serve(**ray_init) -> str:
    """A fresh local Ray (CPU only, no dashboard) the way ``make serve`` starts it (``SERVE_ENV``) and Serve on a free
    loopback port; returns the base URL."""
    import ray
    from ray import serve

    require_serial()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        init_local_ray(**ray_init)
    except Exception as e:  # Ray's fixed waits for its raylet to register or its GCS to write its port; both seen
        # right after the previous Ray's shutdown
        if not any(m in str(e) for m in ("timed out during startup", "Timed out waiting for file")):
            raise
        warnings.warn(f"local Ray did not start ({e}); starting it once more", stacklevel=2)
        # the failed start's processes (GCS, dashboard, monitors) are no node's that ray.shutdown could stop
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        for process in started:
            process.kill()
        psutil.wait_procs(started, timeout=10)
        ray.shutdown()
        init_local_ray(**ray_init)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def _stop_serve() -> None:
    """Shut the local Ray down with Serve in it, without ``serve.shutdown``'s graceful wait for every replica
    (seconds per application); a later ``serve.start`` on a new Ray connects afresh."""
    import ray

    ray.shutdown()


@contextlib.contextmanager
def local_serve(**ray_init):
    """``_start_serve`` for one test (the shared session ends first: ``end_shared_serve``); yields the base URL."""
    end_shared_serve()
    url = _start_serve(**ray_init)
    try:
        yield url
    finally:
        _stop_serve()


_shared_url: str | None = None


def shared_serve() -> str:
    """The base URL of a local Ray (2 CPUs) and Serve as ``local_serve`` starts them, shared by the test modules that
    deploy an application and delete it when done: started on first use, ended by ``end_shared_serve`` (at the end
    of the session, or before a test that needs a Ray of its own). A test that reads Ray's own metrics export starts
    its own: the export may still carry an earlier module's replicas."""
    global _shared_url
    if _shared_url is None:
        _shared_url = _start_serve(num_cpus=2)
    return _shared_url


def end_shared_serve() -> None:
    """Shut the shared Ray + Serve down, if it runs."""
    global _shared_url
    if _shared_url is not None:
        _shared_url = None
        _stop_serve()


def delete_in_background(app: str) -> None:
    """``serve.delete`` without waiting for the replicas' graceful shutdown (seconds per application); for an
    application whose name and route prefix are not deployed again."""
    from ray import serve

    serve.delete(app, _blocking=False)


def sse_events(response: httpx.Response) -> list[dict]:
    """Parsed ``data:`` events of a streamed response (``[DONE]`` excluded; asserts it came last)."""
    events, done = [], False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        assert not done, "event after [DONE]"
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        events.append(json.loads(payload))
    assert done, "stream did not end with [DONE]"
    return events


def stream_text(events: list[dict], *, chat: bool = True) -> str:
    if chat:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value; return it (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"condition not met within {timeout_s} s"
        time.sleep(interval_s)
