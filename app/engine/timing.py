"""Timing primitives shared by the engine benchmark and the throughput profiler.

Owns: timing one verify step of a given shape and one drafter step on a live engine, with warm-up and
medians. Requests used for timing get a synthetic prompt of ``context`` tokens and are released afterwards.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from app.engine.decode import Proposer
from app.engine.engine import TargetEngine
from app.engine.types import DraftBlock, SamplingParams, StepOutput


@contextmanager
def timing_requests(
    engine: TargetEngine, *, batch: int, context: int, max_tokens: int, prefix: str
) -> Iterator[tuple[list[int], list[StepOutput]]]:
    """Add ``batch`` requests with one random ``context``-token prompt; release whatever is left on exit.

    Yields:
        The prompt and each request's prefill output (request ids are ``f"{prefix}-{i}"``).
    """
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(engine.vocab_size, (context,), generator=gen).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{prefix}-{i}" for i in range(batch)]
    try:
        yield prompt, [engine.add_request(rid, prompt, params) for rid in ids]
    finally:
        for rid in ids:
            if engine.has_request(rid):
                engine.release(rid)


def time_verify_step(
    engine: TargetEngine,
    *,
    batch: int,
    tokens_per_request: int,
    context: int = 200,
    repeats: int = 7,
    warmup: int = 2,
) -> float:
    """Median wall time (ms) of one verify step: ``batch`` requests, each its pending token plus
    ``tokens_per_request - 1`` draft tokens, over a KV cache of ``context`` tokens per request.

    Drafts are random tokens, so the step is timed including acceptance; the cache grows by at most
    ``tokens_per_request`` tokens per repeat (``max_tokens`` is sized so no request ends early).

    Raises:
        ValueError: ``tokens_per_request - 1`` exceeds the engine's max_draft_len, or batch exceeds its slots.
    """
    draft_len = tokens_per_request - 1
    if draft_len > engine.config.max_draft_len or batch > engine.num_free_slots:
        raise ValueError(
            f"cannot time batch {batch} x {tokens_per_request} tokens: max_draft_len "
            f"{engine.config.max_draft_len}, free slots {engine.num_free_slots}"
        )
    gen = torch.Generator().manual_seed(1)
    times = []
    max_tokens = (warmup + repeats) * (draft_len + 1) + 2
    with timing_requests(engine, batch=batch, context=context, max_tokens=max_tokens, prefix="timing") as (_, firsts):
        for i in range(warmup + repeats):
            blocks = [DraftBlock(f.request_id, torch.randint(engine.vocab_size, (draft_len,), generator=gen))
                      for f in firsts]
            _synchronize(engine)
            t0 = time.perf_counter()
            engine.verify(blocks)
            _synchronize(engine)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def time_draft_step(engine: TargetEngine, proposer: Proposer, *, batch: int, context: int, repeats: int = 5) -> float:
    """Median wall time (ms) of one ``proposer.propose`` for ``batch`` requests with ``context``-token prompts."""
    times = []
    with timing_requests(engine, batch=batch, context=context, max_tokens=4, prefix="draft-timing") as (prompt, firsts):
        ids = [f.request_id for f in firsts]
        for first in firsts:
            proposer.start(first.request_id, prompt, first)
        try:
            proposer.propose(ids)  # warm-up
            for _ in range(repeats):
                _synchronize(engine)
                t0 = time.perf_counter()
                proposer.propose(ids)
                _synchronize(engine)
                times.append((time.perf_counter() - t0) * 1000.0)
        finally:
            for rid in ids:
                proposer.finish(rid)
    return statistics.median(times)


def _synchronize(engine: TargetEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
