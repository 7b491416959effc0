"""One dedicated thread per replica for all of its torch work: loading the model and every step after it.

Why one thread. PyTorch's CPU kernels run their parallel regions on GNU OpenMP (libgomp), which keeps a worker
pool per thread that starts parallel regions. Once a second thread of the process has started one, the pools'
threads outnumber a small machine's cores and libgomp stops spin-waiting between regions: every region then
wakes its workers through the kernel. On a machine with few cores that can double the cost of the small
per-token kernels (a bf16 ``[1, 576] x [576, 1536]`` matmul) and makes a served step slower than the same engine
driven from one thread. A Serve replica's
constructor runs on Serve's user-code thread, synchronous methods on a thread pool and ``run_in_executor``
calls on yet another thread, so a replica must route all torch work through one ``TorchThread`` itself, tensor
copies included: a copy of a prompt's drafter features on the event loop thread was enough (target.py).

Does not own: what the work is (the replicas' engine and proposer calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

SCHEDSTAT = "/proc/thread-self/schedstat"  # Linux: ns on a CPU, ns runnable but waiting for one, timeslices


def thread_cpu_ms() -> tuple[float, float] | None:
    """The calling thread's scheduler times so far, from Linux's ``schedstat``: (ms on a CPU, ms runnable but waiting
    for a CPU). The second is what other processes (or threads) on the same cores cost this one. None where the
    kernel does not provide it (not Linux, or built without schedstats)."""
    try:
        with open(SCHEDSTAT) as f:
            on_cpu_ns, waiting_ns, _ = f.read().split()
        return int(on_cpu_ns) / 1e6, int(waiting_ns) / 1e6
    except (OSError, ValueError):
        return None


class TorchThread:
    """A single worker thread; ``call`` blocks on it (constructors), ``run`` awaits it (the event loop stays free)."""

    def __init__(self, name: str, num_threads: int | None = None) -> None:
        """``num_threads``: torch intra-op threads, set on the worker thread itself (None: torch's default)."""
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name,
            initializer=torch.set_num_threads if num_threads else None,
            initargs=(num_threads,) if num_threads else (),
        )
        self._busy_since: float | None = None  # time.monotonic() when the call now running started

    def call(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the worker thread, blocking the caller; its exception is re-raised here."""
        return self._executor.submit(self._timed, fn, *args).result()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the worker thread without blocking the running event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn, *args)

    def busy_s(self) -> float:
        """Seconds the call now running on the worker has taken so far (0.0 when none runs): a replica's health check
        reads it to tell a stuck step from a slow one."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _timed(self, fn: Callable[..., T], *args) -> T:
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._busy_since = None


def stuck_thread(thread: TorchThread, name: str, timeout_s: float) -> str | None:
    """Why ``thread`` is stuck (one call has run longer than ``timeout_s`` seconds), or None: a replica's health check
    and load reports ask this."""
    busy = thread.busy_s()
    if busy <= timeout_s:
        return None
    return f"the {name} thread has been in one call for {busy:.1f} s (step_timeout_s {timeout_s:g})"


@contextlib.contextmanager
def intra_op_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with ``num_threads`` torch intra-op threads, then restore the previous count (None: leave it).

    Meant for a ``TorchThread``'s worker: OpenMP's thread count is per calling thread, and that worker is the only
    one that starts parallel regions, so switching the count does not start a second pool.
    """
    before = torch.get_num_threads()
    if num_threads is None or num_threads == before:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# oneDNN's primitive cache (per process; its older name DNNL_PRIMITIVE_CACHE_CAPACITY is read too) and the cache of
# primitive descriptors in front of it that PyTorch's oneDNN layer (ideep) keeps per thread and kind of operation
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_OLD_CACHE_ENV = "DNNL_PRIMITIVE_CACHE_CAPACITY"
IDEEP_CACHE_ENV = "LRU_CACHE_CAPACITY"


def bound_onednn_caches(capacity: int) -> None:
    """Cap this process's caches of oneDNN primitives at ``capacity`` entries each unless the environment sets them:
    oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, default 1024) and, on x86-64, PyTorch's in front of it
    (``LRU_CACHE_CAPACITY``, default 1024 there; elsewhere its default is 1 and stays). Takes effect only when called
    before the process's first oneDNN operation.

    oneDNN compiles a kernel, with its buffers, for each matrix shape it meets (PyTorch's bfloat16 CPU matmuls, where
    the CPU has bfloat16 instructions, and the prepacked linear layers of any dtype run on it). Each cache keeps
    what it holds alive (oneDNN's: primitives; PyTorch's: primitive descriptors, with the kernels they lead to), so
    both must be bounded (``tests/serving/test_torch_thread.py``). A drafter meets a new shape with nearly every
    request: projecting a prompt's features into its context is a matmul with one row per prompt token. At the
    defaults a drafter process's resident memory grew by hundreds of MiB under mixed prompt lengths; a few hundred
    entries hold the shapes that recur (the drafting block's for each batch size, those of the per-round context
    updates).

    Raises:
        ValueError: ``capacity`` < 1 (PyTorch's cache refuses 0, where oneDNN's would be switched off).
    """
    if capacity < 1:
        raise ValueError(f"oneDNN cache capacity must be >= 1, got {capacity}")
    if ONEDNN_OLD_CACHE_ENV not in os.environ:
        os.environ.setdefault(ONEDNN_CACHE_ENV, str(capacity))
    if platform.machine().lower() in ("x86_64", "amd64"):
        os.environ.setdefault(IDEEP_CACHE_ENV, str(capacity))


class HeapTrimmer:
    """Hands the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``, every arena) at most once per
    ``interval_s``; a no-op where the C library is not glibc.

    Tensors of many sizes allocated and freed round after round (a drafter's per-request context buffers and padded
    batch contexts, call payloads unpickled on another thread than the one that frees them) leave glibc's arenas
    fragmented: freed, the memory stays resident. Under a long mixed load a Drafter replica's resident memory grew by
    hundreds of MiB while it held no request state; trimming after requests end keeps it near its working set. A trim
    takes about a millisecond.
    """

    def __init__(self, interval_s: float = 10.0) -> None:
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim with
            self._trim = None
        self.interval_s, self._last, self.trims = interval_s, time.monotonic(), 0

    def maybe_trim(self) -> bool:
        """Trim if ``interval_s`` has passed since the last trim (or construction); returns whether it did."""
        if self._trim is None or time.monotonic() - self._last < self.interval_s:
            return False
        self._trim(0)
        self._last, self.trims = time.monotonic(), self.trims + 1
        return True
