"""A target replica does all its torch work on its torch thread, including copying features for the drafter.

A prompt's feature rows are enough for torch to start an OpenMP parallel region; started on the replica's event
loop thread, that gives the process a second OpenMP pool and slowed every later engine step of the served
``dspark`` policy by ~25% (43 -> 56 ms per plain step on the 2-core machine; torch_thread.py).
The replica is driven in-process here (mock engine, colocated mock drafter), outside Ray Serve.
"""

from __future__ import annotations

import asyncio
import threading
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


def test_features_for_the_drafter_are_copied_on_the_torch_thread(replica, monkeypatch):
    threads = []
    strip = target_module.strip_for_drafter

    def recording_strip(out):
        threads.append(threading.current_thread().name)
        return strip(out)

    monkeypatch.setattr(target_module, "strip_for_drafter", recording_strip)

    async def run(rid: str) -> list:
        request = GenerateRequest(request_id=rid, messages=[{"role": "user", "content": "hi"}],
                                  params=SamplingParams(max_tokens=12, temperature=0.0))
        return [item async for item in replica.generate(request)]

    async def main() -> list[list]:
        try:
            return await asyncio.gather(run("a"), run("b"))
        finally:
            for task in replica._tasks:
                task.cancel()

    results = asyncio.run(main())
    assert [sum(len(chunk.token_ids) for chunk in items) for items in results] == [12, 12]
    assert replica._stats["drafted_rounds"] > 0, "the colocated drafter never ran"
    assert len(threads) >= 2 + replica._stats["rounds"]  # two prefills, then every output of every round
    assert {name.split("_")[0] for name in threads} == {"engine"}, set(threads)
