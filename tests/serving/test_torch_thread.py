"""The engine thread's scheduler times (``thread_cpu_ms``), read around every served verify step."""

from __future__ import annotations

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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_heap_trimmer_trims_at_most_once_an_interval(monkeypatch):
    every_time, hourly = HeapTrimmer(interval_s=0.0), HeapTrimmer(interval_s=3600.0)
    assert every_time.maybe_trim() and every_time.maybe_trim() and every_time.trims == 2
    assert not hourly.maybe_trim() and hourly.trims == 0  # the interval runs from construction
    monkeypatch.setattr(torch_thread.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    not_glibc = HeapTrimmer(interval_s=0.0)
    assert not not_glibc.maybe_trim() and not_glibc.trims == 0
