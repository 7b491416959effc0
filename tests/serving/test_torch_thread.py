"""The engine thread's scheduler times (``thread_cpu_ms``), read around every served verify step."""

from __future__ import annotations

import os
import platform
import sys
import threading
import time

import pytest

from app.serving import torch_thread
from app.serving.torch_thread import HeapTrimmer, TorchThread, stuck_thread, thread_cpu_ms

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")
def test_thread_cpu_ms_counts_this_threads_cpu_time_only():
    def busy_then_asleep() -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        start = thread_cpu_ms()
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:  # 50 ms of work
            pass
        busy = thread_cpu_ms()
        time.sleep(0.05)  # 50 ms off the CPU, not waiting for one
        return start, busy, thread_cpu_ms()

    start, busy, asleep = TorchThread("test-cpu").call(busy_then_asleep)
    assert all(v >= 0 for v in start + busy + asleep)
    on_cpu, waited = busy[0] - start[0], busy[1] - start[1]
    assert on_cpu + waited >= 45  # the busy loop's 50 ms were spent on a CPU or waiting for one
    assert on_cpu > waited  # mostly on one: the fields are in schedstat's order
    assert (asleep[0] - busy[0]) + (asleep[1] - busy[1]) < 25  # the 50 ms asleep are neither (bar the wake-up)


def test_thread_cpu_ms_is_none_without_schedstat(monkeypatch, tmp_path):
    monkeypatch.setattr(torch_thread, "SCHEDSTAT", str(tmp_path / "missing"))
    assert thread_cpu_ms() is None
    bad = tmp_path / "schedstat"
    bad.write_text("not numbers\n")
    monkeypatch.setattr(torch_thread, "SCHEDSTAT", str(bad))
    assert thread_cpu_ms() is None


def test_busy_s_times_the_call_now_running_and_stuck_thread_names_the_limit():
    thread, release = TorchThread("t"), threading.Event()
    assert thread.busy_s() == 0.0 and stuck_thread(thread, "engine", 0.05) is None
    future = thread._executor.submit(thread._timed, release.wait, 10)
    time.sleep(0.15)
    assert thread.busy_s() >= 0.1
    assert stuck_thread(thread, "engine", 0.05).startswith("the engine thread has been in one call for 0.")
    assert stuck_thread(thread, "engine", 0.05).endswith(" s (step_timeout_s 0.05)")
    release.set()
    assert future.result() is True and thread.busy_s() == 0.0
    assert thread.call(lambda: 7) == 7 and thread.busy_s() == 0.0


def test_bound_onednn_caches_refuses_a_capacity_below_one_and_keeps_what_the_environment_sets(monkeypatch):
    for name in (torch_thread.ONEDNN_CACHE_ENV, torch_thread.ONEDNN_OLD_CACHE_ENV, torch_thread.IDEEP_CACHE_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        torch_thread.bound_onednn_caches(0)
    monkeypatch.setenv(torch_thread.ONEDNN_OLD_CACHE_ENV, "64")  # oneDNN's older name: it still decides
    monkeypatch.setenv(torch_thread.IDEEP_CACHE_ENV, "32")
    torch_thread.bound_onednn_caches(256)
    assert torch_thread.ONEDNN_CACHE_ENV not in os.environ and os.environ[torch_thread.IDEEP_CACHE_ENV] == "32"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_heap_trimmer_trims_at_most_once_an_interval(monkeypatch):
    every_time, hourly = HeapTrimmer(interval_s=0.0), HeapTrimmer(interval_s=3600.0)
    assert every_time.maybe_trim() and every_time.maybe_trim() and every_time.trims == 2
    assert not hourly.maybe_trim() and hourly.trims == 0  # the interval runs from construction
    monkeypatch.setattr(torch_thread.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    not_glibc = HeapTrimmer(interval_s=0.0)
    assert not not_glibc.maybe_trim() and not_glibc.trims == 0


SHAPES_SCRIPT = """
import sys
import torch
from app.engine.prepack import PrepackedLinear, prepack_supported
from app.serving.torch_thread import bound_onednn_caches
if sys.argv[1] != "default":
    bound_onednn_caches(int(sys.argv[1]))  # after torch is imported, before its first oneDNN operation
if not prepack_supported(torch.device("cpu"), torch.float32):
    sys.exit(3)
torch.set_num_threads(1)
def rss_mib():
    return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
linear = PrepackedLinear(torch.randn(1536, 576))  # on oneDNN with any vector ISA, float32 as on an AVX2 CPU
start = rss_mib()
with torch.inference_mode():
    for rows in range(1, 301):  # a new matmul shape each time, as a drafter's prompt projections
        linear(torch.randn(rows, 576))
print(rss_mib() - start)
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/status")
def test_bounded_onednn_caches_hold_less_memory_over_many_shapes():
    """300 matmul shapes in a fresh process: at the default capacities oneDNN's primitive cache and PyTorch's in
    front of it keep a kernel and its buffers for each; both bounded at 16 entries the process grows far less."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in (
        torch_thread.ONEDNN_CACHE_ENV, torch_thread.ONEDNN_OLD_CACHE_ENV, torch_thread.IDEEP_CACHE_ENV)}
    runs = {cap: subprocess.run([sys.executable, "-c", SHAPES_SCRIPT, cap], env=env, capture_output=True, text=True,
                                timeout=120) for cap in ("default", "16")}
    if any(run.returncode == 3 for run in runs.values()):
        pytest.skip("no oneDNN float32 prepacked linear layers in this torch build")
    assert all(run.returncode == 0 for run in runs.values()), [run.stderr[-2000:] for run in runs.values()]
    growth = {cap: int(run.stdout) for cap, run in runs.items()}
    if growth["default"] < 60:  # the default run does not call bound_onednn_caches: nothing to bound here
        pytest.skip(f"the default caches grew only {growth['default']} MiB over 300 shapes here")
    assert growth["16"] < growth["default"] - 40, growth
