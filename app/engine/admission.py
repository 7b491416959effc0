"""Admission batching: how many waiting requests to prefill together in one forward.

Owns the pure rules the decoding loop (``app/loop.py``, served and offline) admits by; ``TargetEngine.add_requests``
runs the batched prefill itself.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# A waiting prompt is held back to the next admission forward when it would reuse at least this many more tokens
# from an earlier prompt of the same batch (prefilled first, then found in the prefix cache) than the cache gives it
# now. The extra forward costs about what prefilling a few dozen tokens does; SGLang's in-batch prefix caching holds
# requests back from 32 shared tokens on.
IN_BATCH_REUSE_MIN_TOKENS = 64


def prefill_batch_size(prompt_lens: Sequence[int], *, max_tokens: int, max_requests: int) -> int:
    """How many requests from the front of a queue to prefill together: as many as fit in ``max_tokens`` prompt
    tokens and ``max_requests`` slots, and at least one (a prompt longer than the budget is prefilled alone).

    Args:
        prompt_lens: prompt lengths (tokens) of the waiting requests, in queue order.
        max_tokens: prompt tokens of one batched prefill (>= 1).
        max_requests: free KV cache slots.
    """
    n, total = 0, 0
    for length in prompt_lens[:max_requests]:
        total += length
        if n and total > max_tokens:
            break
        n += 1
    return n


def first_deferred(prompts: Sequence[Sequence[int]], computed: Sequence[int], *,
                   min_tokens: int = IN_BATCH_REUSE_MIN_TOKENS, whole: Sequence[bool] = ()) -> int:
    """In-batch prefix reuse: the index of the first prompt that shares at least ``min_tokens`` more tokens with an
    earlier prompt of the batch than the prefix cache gives it now, or ``len(prompts)``. Admitting the prompts before
    it first lets it (n > 1 copies of one prompt, a burst behind one long system prompt) prefill only what it adds.

    Args:
        prompts: token ids of the batch, in admission order.
        computed: per prompt, the tokens its prefill computes with the prefix cache as it is
            (``Engine.prefill_tokens``).
        whole: per prompt (or none: all False), whether it is computed whole whatever the cache holds (a request
            with ``prompt_logprobs``): such a prompt gains nothing by waiting and is never deferred.
    """
    arrays = [np.asarray(p) for p in prompts]
    for i in range(1, len(arrays)):
        if i < len(whole) and whole[i]:
            continue
        cached = len(arrays[i]) - computed[i]
        reusable = len(arrays[i]) - 1  # the last prompt token is always computed
        if reusable - cached < min_tokens:
            continue
        for earlier in arrays[:i]:
            n = min(reusable, len(earlier))
            differ = np.flatnonzero(arrays[i][:n] != earlier[:n])
            shared = int(differ[0]) if len(differ) else n
            if shared - cached >= min_tokens:
                return i
    return len(arrays)
