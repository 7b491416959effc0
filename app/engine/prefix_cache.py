"""Prefix caching over the slot KV cache: a new prompt reuses the keys/values, and the features, of the longest
prefix it shares with what another slot still holds: a running request's prompt, or a finished request's prompt
and answer (the next turn of a chat reuses both).

A slot's positions [0, P) hold its request's prompt (P tokens) from the prefill on: decoding writes only at later
positions, and a freed slot keeps them until a new request takes it. Each verify step then writes the tokens it
runs (the pending token and the drafts) at the next positions, and those it accepts stay: when the request ends,
positions [P, P + A) hold the A answer tokens the target has run (all but the last token, which is committed
without being run, unless the answer ended at a stop inside accepted drafts: then all of them, and the drafts after
the stop stay out of the record). So every slot is a cache entry for what it was last given, live (its prompt) or
finished (``extend``: its prompt and answer), with no memory beyond the KV cache itself except the tokens' features
(the drafter's conditioning input, ``StepOutput.features``), which the engine keeps with the record: F values per
token. A prompt that shares L tokens with a record starts its prefill at position L after
copying the donor slot's first L positions (nothing to copy when it takes the donor's free slot), and gets the
donor's first L feature rows. At least the prompt's last token is always computed (its logits give the first token).

Matching is exact and token-granular: the new prompt against every record in one tensor comparison (no hashes, no
blocks: slots are contiguous, so any shared length can be reused).

A request that cannot take its donor's slot takes the free slot whose record was used least recently (stored, or
reused by a hit; a slot with no record first), so the prefixes in use survive, as vLLM evicts its least recently
used free blocks first.

Owns: the records (slot -> token ids, their features), the longest-prefix match and the eviction order. Does not
own: the free slots, the copy and the prefill (``engine.py``; ``KVCache.copy_prefixes``).

Shape symbols as in ``app/engine/types.py``; S slots, P a prompt's length, A the answer tokens a finished request
left in its slot, W the longest record.
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
    """Records of what the slots hold, and the longest-prefix match against them (module docstring).

    Args:
        num_slots: S, the KV cache's slots.
    """

    def __init__(self, num_slots: int) -> None:
        self._ids = torch.full((num_slots, 0), -1, dtype=torch.int32)  # [S, W] token ids, -1 past each record
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

    def store(self, slot: int, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """Record that ``slot`` holds ``tokens`` ([P] int64, a prompt) at positions [0, P), with their feature rows
        [P, F] (kept by reference: not to be modified)."""
        p = len(tokens)
        if p > self._ids.shape[1]:
            grown = torch.full((self._ids.shape[0], max(p, 2 * self._ids.shape[1])), -1, dtype=torch.int32)
            grown[:, : self._ids.shape[1]] = self._ids
            self._ids = grown
        self._ids[slot] = -1
        self._ids[slot, :p] = tokens.to(torch.int32)
        self._lengths[slot] = p
        self._features[slot] = features
        self.touch(slot)

    def length(self, slot: int) -> int:
        """Tokens ``slot``'s record holds (0: no record)."""
        return int(self._lengths[slot])

    def extend(self, slot: int, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """Record that ``slot`` also holds ``tokens`` ([A] int64) right after its record, with their feature rows
        [A, F] (a finished request's answer after its prompt): the record becomes [P + A] tokens, used now.

        Raises:
            ValueError: ``slot`` holds no record, or ``features`` is not one row per token.
        """
        p, a = self.length(slot), len(tokens)
        if p == 0:
            raise ValueError(f"slot {slot} holds no record to extend")
        if features.shape[0] != a:
            raise ValueError(f"{features.shape[0]} feature rows for {a} tokens")
        ids = torch.cat([self._ids[slot, :p].long(), tokens.to(torch.long)])
        self.store(slot, ids, torch.cat([self._features[slot], features]))

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
