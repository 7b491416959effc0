"""Prefix caching over the slot KV cache: a new prompt reuses the keys/values, and the features, of the longest
prefix it shares with a prompt another slot still holds.

A slot's positions [0, P) hold its request's prompt (P tokens) from the prefill on: decoding writes only at later
positions, and a freed slot keeps them until a new request takes it. So every slot is a cache entry for the prompt
it was last given, live or finished, with no memory beyond the KV cache itself except the prompt's features (the
drafter's conditioning input, ``StepOutput.features``), which the engine keeps with the record: F values per prompt
token. A prompt that shares L tokens with a record starts its prefill at position L after copying the donor slot's
first L positions (nothing to copy when it takes the donor's free slot), and gets the donor's first L feature rows.
At least the prompt's last token is always computed (its logits give the first token).

Matching is exact and token-granular: the new prompt against every record in one tensor comparison (no hashes, no
blocks: slots are contiguous, so any shared length can be reused).

A request that cannot take its donor's slot takes the free slot whose record was used least recently (stored, or
reused by a hit; a slot with no record first), so the prefixes in use survive, as vLLM evicts its least recently
used free blocks first.

Owns: the records (slot -> prompt ids, prompt features), the longest-prefix match and the eviction order. Does not
own: the free slots, the copy and the prefill (``engine.py``; ``KVCache.copy_prefixes``).

Shape symbols as in ``app/engine/types.py``; S slots, P a record's prompt length, W the longest record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixHit:
    """The longest prefix a prompt shares with a record.

    Attributes:
        slot: the donor slot (-1: no record shares a token).
        length: L, prompt tokens reused (0 <= L <= prompt length - 1).
        features: [L, F] the donor's feature rows of those tokens (None when L is 0).
        whole: the donor's whole record is a prefix of the prompt (the prompt's own record would hold all of it, so
            taking the donor's slot loses nothing).
    """

    slot: int = -1
    length: int = 0
    features: torch.Tensor | None = None
    whole: bool = False


MISS = PrefixHit()


class PrefixCache:
    """Records of the prompts the slots hold, and the longest-prefix match against them (module docstring).

    Args:
        num_slots: S, the KV cache's slots.
    """

    def __init__(self, num_slots: int) -> None:
        self._ids = torch.full((num_slots, 0), -1, dtype=torch.int32)  # [S, W] prompt ids, -1 past each record
        self._lengths = torch.zeros(num_slots, dtype=torch.long)  # [S] P per slot, 0 without a record
        self._features: list[torch.Tensor | None] = [None] * num_slots  # [P, F] per slot
        self._last_use = [-1] * num_slots  # per slot, the clock of its record's last store or hit; -1 without a record
        self._clock = 0

    def match(self, prompt: torch.Tensor) -> PrefixHit:
        """The record sharing the longest prefix with ``prompt`` ([T] int64), at most T - 1 tokens of it.

        Ties go to a whole record (``PrefixHit.whole``), then to the lowest slot. Returns ``MISS`` when no record
        shares the first token.
        """
        t = len(prompt)
        n = min(t, self._ids.shape[1])
        if t < 2 or n < 1:
            return MISS
        differ = self._ids[:, :n] != prompt[:n].to(torch.int32)  # [S, n]
        shared = torch.where(differ.any(1), differ.int().argmax(1), n)  # [S] first differing position, or n
        shared = torch.minimum(shared, self._lengths)
        whole = (shared == self._lengths) & (self._lengths > 0)  # [S]
        reusable = torch.clamp(shared, max=t - 1)  # [S] the last prompt token is always computed
        slot = int((2 * reusable + whole).argmax())
        length = int(reusable[slot])
        if length == 0:
            return MISS
        return PrefixHit(slot=slot, length=length, features=self._features[slot][:length], whole=bool(whole[slot]))

    def store(self, slot: int, prompt: torch.Tensor, features: torch.Tensor) -> None:
        """Record that ``slot`` holds ``prompt`` ([P] int64) at positions [0, P), with its feature rows [P, F] (kept
        by reference: not to be modified)."""
        p = len(prompt)
        if p > self._ids.shape[1]:
            grown = torch.full((self._ids.shape[0], max(p, 2 * self._ids.shape[1])), -1, dtype=torch.int32)
            grown[:, : self._ids.shape[1]] = self._ids
            self._ids = grown
        self._ids[slot] = -1
        self._ids[slot, :p] = prompt.to(torch.int32)
        self._lengths[slot] = p
        self._features[slot] = features
        self.touch(slot)

    def touch(self, slot: int) -> None:
        """``slot``'s record was just used (a hit reuses it): it is evicted after every record used earlier."""
        self._clock += 1
        self._last_use[slot] = self._clock

    def least_recent(self, slots: list[int]) -> int:
        """The slot of ``slots`` to give a request that reuses none of them: one without a record if any, else the
        least recently used record's; ties to the lowest slot."""
        return min(slots, key=lambda s: (self._last_use[s], s))

    def forget(self, slot: int) -> None:
        """Drop ``slot``'s record (it is about to be written from position 0, or its content is unknown)."""
        self._ids[slot] = -1
        self._lengths[slot] = 0
        self._features[slot] = None
        self._last_use[slot] = -1
