"""The target replica's round loop, driven in-process (mock engine, colocated mock drafter), outside Ray Serve.

- All its torch work runs on its torch thread, including copying features for the drafter: a prompt's feature
  rows are enough for torch to start an OpenMP parallel region, and started on the event loop thread that gives
  the process a second OpenMP pool and slowed every later engine step of the served ``dspark`` policy by ~25%
  (43 -> 56 ms per plain step on the 2-core machine; torch_thread.py).
- The drafter-call time the draft gate weighs comes from steady calls only, not from calls that also project
  a new prompt or catch up on rounds drafted without.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from ray import serve

from app.engine.types import SamplingParams
from app.serving import target as target_module
from app.serving.config import AppConfig
from app.serving.protocol import GenerateRequest


class _Router:
    """Stands in for the Router actor handle: accepts load reports."""

    class _Report:
        @staticmethod
        async def remote(load) -> None:
            return None

    report = _Report()


@pytest.fixture
def replica(monkeypatch):
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="target-0")))
    config = AppConfig(engine="mock", drafter="mock", drafter_placement="colocated", policy="dspark", gamma=4,
                       max_model_len=256, max_num_seqs=4, mock_step_ms=1, mock_vocab_size=512, torch_threads=1)
    return target_module.TargetReplica(config, drafter=None, router=_Router())


def run_requests(replica, max_tokens: list[int]) -> list[list]:
    """Send requests concurrently through ``replica.generate``; returns each one's items."""

    async def run(i: int, n: int) -> list:
        request = GenerateRequest(request_id=f"r{i}", messages=[{"role": "user", "content": "hi"}],
                                  params=SamplingParams(max_tokens=n, temperature=0.0))
        return [item async for item in replica.generate(request)]

    async def main() -> list[list]:
        try:
            return await asyncio.gather(*[run(i, n) for i, n in enumerate(max_tokens)])
        finally:
            for task in replica._tasks:
                task.cancel()

    return asyncio.run(main())


def test_features_for_the_drafter_are_copied_on_the_torch_thread(replica, monkeypatch):
    threads = []
    strip = target_module.strip_for_drafter

    def recording_strip(out):
        threads.append(threading.current_thread().name)
        return strip(out)

    monkeypatch.setattr(target_module, "strip_for_drafter", recording_strip)

    results = run_requests(replica, [12, 12])
    assert [sum(len(chunk.token_ids) for chunk in items) for items in results] == [12, 12]
    assert replica._stats["drafted_rounds"] > 0, "the colocated drafter never ran"
    assert len(threads) >= 2 + replica._stats["rounds"]  # two prefills, then every output of every round
    assert {name.split("_")[0] for name in threads} == {"engine"}, set(threads)


def test_draft_gate_weighs_steady_drafter_calls_only(replica, monkeypatch):
    slow_ms, steady_ms = 60.0, 5.0
    draft = replica.colocated.draft

    def timed_draft(call):
        rounds_behind = max((sum(u.request_id == rid for u in call.updates) for rid in call.propose), default=0)
        time.sleep((slow_ms if call.starts or rounds_behind > 1 else steady_ms) / 1000)
        return draft(call)

    monkeypatch.setattr(replica.colocated, "draft", timed_draft)
    run_requests(replica, [24])
    assert replica._stats["drafted_rounds"] >= 3
    # the first call also projects the prompt (slow): counted in the EMA it would still weigh ~30 ms
    assert replica._stats["draft_ms"] < 2 * steady_ms, replica._stats
