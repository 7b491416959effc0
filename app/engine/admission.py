"""Admission batching: how many waiting requests to prefill together in one forward.

Owns the pure rule the decoding loop (``app/loop.py``, served and offline) admits by; ``TargetEngine.add_requests``
runs the batched prefill itself.
"""

from __future__ import annotations

from typing import Sequence


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
