"""Timing primitives shared by the engine benchmark and the throughput profiler.

Owns: timing one verify step of a given shape, one prefill with part of its prompt in the prefix cache, and one
drafter step on a live engine, with warm-up and medians. Requests used for timing get a prompt of ``context`` tokens of natural text (``TIMING_TEXT`` repeated)
and are released afterwards; draft tokens continue that text.

Why natural text: random token ids give the target flat next-token distributions, and on CPU the greedy screen
(``app/engine/greedy_head.py``) sends a flat row to the float32 LM head over the whole vocabulary. Timed with random
prompts and drafts, a multi-token verify step of SmolLM2-135M on CPU looked about 25-35% dearer than on a real chat
prompt with the target's own continuation as the draft (no flat rows): the profile overstated multi-token
verification, so the scheduler verified too little.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from app.engine.contract import Proposer
from app.engine.engine import TargetEngine
from app.engine.types import DraftBlock, SamplingParams, StepOutput

TIMING_TEXT = (
    "A baker sells muffins in boxes of six. On Monday she baked 84 muffins and sold 9 boxes before noon. "
    "In the afternoon she baked 30 more muffins and sold 7 more boxes. How many muffins were left at the end "
    "of the day? First, she baked 84 + 30 = 114 muffins in total. She sold 9 + 7 = 16 boxes, which is "
    "16 x 6 = 96 muffins. So 114 - 96 = 18 muffins were left. The answer is 18.\n"
)


def timing_tokens(engine: TargetEngine, length: int) -> list[int]:
    """The first ``length`` token ids of ``TIMING_TEXT`` repeated (tokenized once, then tiled)."""
    ids = engine.encode(TIMING_TEXT)
    return (ids * (length // len(ids) + 1))[:length]


@contextmanager
def timing_requests(
    engine: TargetEngine, *, contexts: list[int], max_tokens: int, prefix: str, temperature: float = 0.0
) -> Iterator[list[tuple[list[int], StepOutput]]]:
    """Add one request per entry of ``contexts``, request i with the prompt ``timing_tokens(engine, contexts[i])``,
    one at a time, greedy or sampled at ``temperature`` (unseeded, no other control); release whatever is left on
    exit.

    Yields:
        Each request's prompt and prefill output (request ids are ``f"{prefix}-{i}"``).
    """
    text = timing_tokens(engine, max(contexts))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
    ids = [f"{prefix}-{i}" for i in range(len(contexts))]
    try:
        yield [(text[:c], engine.add_request(rid, text[:c], params)) for rid, c in zip(ids, contexts)]
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
    temperature: float = 0.0,
) -> float:
    """Median wall time (ms) of one verify step: ``batch`` requests, each its pending token plus
    ``tokens_per_request - 1`` draft tokens, over a KV cache of ``context`` tokens per request, greedy or sampled at
    ``temperature`` (the drafts are deterministic proposals, as prompt lookup's).

    Drafts continue the prompt's text (module docstring), so the step is timed including acceptance; the cache
    grows by at most ``tokens_per_request`` tokens per repeat (``max_tokens`` is sized so no request ends early).

    Raises:
        ValueError: ``tokens_per_request - 1`` exceeds the engine's max_draft_len, or batch exceeds its slots.
    """
    return time_mixed_step(engine, contexts=[context] * batch, tokens=[tokens_per_request] * batch, repeats=repeats,
                           warmup=warmup, temperature=temperature)


def time_mixed_step(
    engine: TargetEngine, *, contexts: list[int], tokens: list[int], repeats: int = 7, warmup: int = 2,
    temperature: float = 0.0,
) -> float:
    """Median wall time (ms) of one verify step of requests with different contexts and verify lengths: request i
    holds ``contexts[i]`` tokens of cache and brings its pending token plus ``tokens[i] - 1`` drafts (continuing its
    prompt's text, as ``time_verify_step``), prefilled by ``timing_requests``, greedy or sampled at ``temperature``.

    Raises:
        ValueError: the lists differ in length, a verify length is outside [1, max_draft_len + 1], more requests
            than free slots, or a context too long for the engine.
    """
    if len(contexts) != len(tokens) or not all(1 <= t <= engine.config.max_draft_len + 1 for t in tokens):
        raise ValueError(f"need one verify length in [1, {engine.config.max_draft_len + 1}] per context, got "
                         f"{len(contexts)} contexts and lengths {tokens}")
    if len(contexts) > engine.num_free_slots:
        raise ValueError(f"{len(contexts)} requests for {engine.num_free_slots} free slots")
    step = max(tokens)
    max_tokens = (warmup + repeats) * step + 2
    text = timing_tokens(engine, max(contexts) + max_tokens)  # each prompt is its first contexts[i] tokens
    times = []
    with timing_requests(engine, contexts=contexts, max_tokens=max_tokens, prefix="timing",
                         temperature=temperature) as added:
        ids = [first.request_id for _, first in added]
        for i in range(warmup + repeats):
            blocks = [DraftBlock(rid, torch.tensor(text[c + 1 + i * step : c + i * step + t], dtype=torch.long))
                      for rid, c, t in zip(ids, contexts, tokens)]
            _synchronize(engine)
            t0 = time.perf_counter()
            engine.verify(blocks)
            _synchronize(engine)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


PREFILL_MARKERS = " zero one two three four five six seven eight nine"  # a distinct token per timed prefill


def time_prefill(engine: TargetEngine, *, context: int, shared: int, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time (ms) of admitting one greedy request (its prefill and first token) with a ``context``-token
    prompt whose first ``shared`` tokens another prompt in the engine's prefix cache holds (``prefix_cache.py``), so
    only ``context - shared`` are computed; 0 <= shared < context. Each prompt is ``TIMING_TEXT``'s tokens with a
    distinct marker token at position ``shared``, so consecutive prompts share exactly ``shared`` tokens (the first
    one, a warm-up, puts them in the cache).

    Raises:
        ValueError: ``shared`` outside [0, context), more prompts than markers, no free slot, or ``shared > 0`` on an
            engine without prefix caching.
    """
    markers = engine.encode(PREFILL_MARKERS)
    if not 0 <= shared < context or warmup + repeats > len(markers) or engine.num_free_slots == 0:
        raise ValueError(f"need 0 <= shared < context ({shared}, {context}), at most {len(markers)} prompts "
                         f"(got {warmup + repeats}) and a free slot ({engine.num_free_slots})")
    if shared and not engine.config.prefix_caching:
        raise ValueError("shared > 0 needs an engine with prefix caching (EngineConfig.enable_prefix_caching)")
    text = timing_tokens(engine, context)
    params = SamplingParams(max_tokens=1)
    times = []
    for i, marker in enumerate(markers[: warmup + repeats]):
        prompt = text[:shared] + [marker] + text[shared + 1 :]
        _synchronize(engine)
        t0 = time.perf_counter()
        first = engine.add_request(f"prefill-timing-{i}", prompt, params)  # one token: finished at once
        _synchronize(engine)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000.0)
            assert first.num_cached_tokens == shared, (first.num_cached_tokens, shared)
    return statistics.median(times)


def time_draft_step(engine: TargetEngine, proposer: Proposer, *, batch: int, context: int, repeats: int = 5) -> float:
    """Median wall time (ms) of one ``proposer.propose`` for ``batch`` requests with ``context``-token prompts."""
    times = []
    with timing_requests(engine, contexts=[context] * batch, max_tokens=4, prefix="draft-timing") as added:
        ids = [first.request_id for _, first in added]
        for prompt, first in added:
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
