"""The local Ray that serves the application: ``make serve`` (``app/serving/run.py``), the load-test server, the
serving benchmark and the served tests start it with ``init_local_ray``: the environment ``SERVE_ENV``, and, when the
HTTP host is a loopback address (the default), Ray's single-machine mode (``LOOPBACK_ENV``), so Ray's node address
is 127.0.0.1 and its metrics export endpoint listens there instead of on every interface (Ray binds that endpoint
to the node address only when the address is loopback, and takes a loopback node address only in that mode).

Only the environment of the process that starts Ray reaches the raylet, and through it every worker process: the
controller, the HTTP proxy, all replicas. A Serve YAML's ``runtime_env`` reaches the replicas only, so neither
variable can be set from ``deployments/*.yaml``; against a running cluster, set them where ``ray start`` runs.

- ``RAY_worker_niceness=0``: Ray starts worker processes at niceness 15, so on a machine shared with anything else
  the engine replicas lose the CPU to it.
- ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``: Serve's gRPC data plane for the proxy's and the replicas' handle calls
  instead of Ray actor calls: more plain-decoding throughput under load (docs/serving.md); in the proxy alone or the
  replicas alone it gained less or nothing. Drafter calls over 1 MiB still go by reference
  (``drafter_client.BY_REFERENCE_BYTES``).
- ``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH``: that data plane's largest message, 4 MiB by default, which a scored
  prompt's response passes (``prompt_logprobs`` 20: ~1.7 kB of JSON a prompt token, per choice): raised to gRPC's
  own limit, as Ray's actor calls have none.
"""

from __future__ import annotations

import ipaddress
import os

SERVE_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
}


# Ray's single-machine mode (its default on Windows and macOS): the node address is 127.0.0.1, no other node can join.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def init_local_ray(*, http_host: str = "127.0.0.1", **ray_init) -> None:
    """``ray.init`` a fresh local Ray (by default no dashboard, worker logs not forwarded) with ``SERVE_ENV`` in its
    processes' environment; a variable already set in this process's environment keeps its value.

    Args:
        http_host: the host Serve's HTTP proxy will listen on; a loopback one starts Ray in its single-machine mode
            (``LOOPBACK_ENV``, unless the environment sets the variable): node address and metrics export endpoint on
            127.0.0.1. Any other host leaves Ray's own choice (metrics on every interface).
        ray_init: more ``ray.init`` arguments (``num_cpus``, ``include_dashboard``, ``log_to_driver``,
            ``_metrics_export_port`` (default: a free port), ...).
    """
    import ray

    from ray._private import ray_constants

    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)
    if is_loopback(http_host):
        for name, value in LOOPBACK_ENV.items():
            os.environ.setdefault(name, value)
        # read once, when ray is imported: this process may have imported it before the variable was set
        ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"].lower() in ("1", "true")
    ray_init.setdefault("include_dashboard", False)
    ray_init.setdefault("log_to_driver", False)
    ray.init(address="local", **ray_init)
