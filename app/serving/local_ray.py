"""The environment of the local Ray that serves the application: ``make serve``, the load-test server, the serving
benchmark and the served tests start it with ``SERVE_ENV`` (the Makefile spells the same variables out).

Only the environment of the process that starts Ray reaches the raylet, and through it every worker process: the
controller, the HTTP proxy, all replicas. A Serve YAML's ``runtime_env`` reaches the replicas only, so neither
variable can be set from ``deployments/*.yaml``; against a running cluster, set them where ``ray start`` runs.

- ``RAY_worker_niceness=0``: Ray starts worker processes at niceness 15, so on a machine shared with anything else
  the engine replicas lose the CPU to it.
- ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``: Serve's gRPC data plane for the proxy's and the replicas' handle calls
  instead of Ray actor calls: more plain-decoding throughput under load (docs/serving.md); in the proxy alone or the
  replicas alone it gained less or nothing. Drafter calls over 1 MiB still go by reference
  (``target.BY_REFERENCE_BYTES``).
"""

from __future__ import annotations

import os

SERVE_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}


def init_local_ray(**ray_init) -> None:
    """``ray.init`` a fresh local Ray (no dashboard, worker logs not forwarded) with ``SERVE_ENV`` in its processes'
    environment; a variable already set in this process's environment keeps its value.

    Args:
        ray_init: more ``ray.init`` arguments (``num_cpus``, ...).
    """
    import ray

    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **ray_init)
