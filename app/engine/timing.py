"""Timing primitives shared by the engine benchmark and the throughput profiler.

Owns: timing one verify step of a given shape on a live engine, with warm-up and medians. Requests used
for timing are created with a synthetic prompt of ``context`` tokens and released afterwards.
"""

from __future__ import annotations

import statistics
import time

import torch

from app.engine.engine import TargetEngine
from app.engine.types import DraftBlock, SamplingParams


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

    Drafts are random tokens, so the step is timed including acceptance; the cache length is reset between
    repeats by re-adding the requests only when it would overflow.

    Raises:
        ValueError: ``tokens_per_request - 1`` exceeds the engine's max_draft_len, or batch exceeds its slots.
    """
    draft_len = tokens_per_request - 1
    if draft_len > engine.config.max_draft_len or batch > engine.num_free_slots:
        raise ValueError(
            f"cannot time batch {batch} x {tokens_per_request} tokens: max_draft_len "
            f"{engine.config.max_draft_len}, free slots {engine.num_free_slots}"
        )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(engine.vocab_size, (context,), generator=gen).tolist()
    params = SamplingParams(max_tokens=(warmup + repeats) * (draft_len + 1) + 2, ignore_eos=True)
    ids = [f"timing-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompt, params)
    times = []
    try:
        for i in range(warmup + repeats):
            blocks = [DraftBlock(rid, torch.randint(engine.vocab_size, (draft_len,), generator=gen)) for rid in ids]
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.verify(blocks)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1000.0)
    finally:
        for rid in ids:
            if engine.has_request(rid):
                engine.release(rid)
    return statistics.median(times)
