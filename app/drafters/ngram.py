"""Prompt-lookup n-gram drafter: a model-free ``Proposer`` (vLLM's ``ngram`` method is the reference behaviour).

Owns each request's token history (prompt + committed output). ``propose`` finds the longest suffix of the
history, n from ``max_ngram`` down to ``min_ngram`` tokens, that also occurs earlier in the history (the most
recent earlier occurrence), and drafts the tokens that followed it, up to ``gamma``; no match drafts nothing (a
plain decoding step for that request). Drafts are deterministic proposals (``probs=None``), which the engine's
acceptance treats losslessly at any temperature. Used by the serving layer (``drafter: ngram``) and the offline
comparison (``app/eval/compare.py``).

Confidences: the model-free drafter has no acceptance estimate; a matched position gets
``NGRAM_CONFIDENCE ** (1 / n)`` (longer matches are trusted more), unmatched positions 0, so the ``dspark`` and
``threshold`` verify policies cut blocks at the match end.

Shape symbols: B requests, K block size (gamma).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from app.drafters.proposer import DraftProposal
from app.engine.types import DraftBlock, StepOutput

NGRAM_CONFIDENCE = 0.6  # per-position acceptance guess of a unigram match; an n-gram match gets 0.6 ** (1/n)


def lookup(
    history: Sequence[int], *, max_ngram: int, gamma: int, min_ngram: int = 1, periodic: bool = False
) -> tuple[list[int], int]:
    """Tokens following the latest earlier occurrence of the longest matching suffix n-gram
    (``min_ngram`` <= n <= ``max_ngram``), and that n; ``([], 0)`` without a match.

    Fewer than ``gamma`` tokens follow an occurrence that ends less than ``gamma`` tokens before the end; with
    ``periodic`` the draft then continues the period (the token at t + j is drafted as the one at t + j - lag,
    drafts included), so a loop of period 2 still drafts ``gamma`` tokens.

    Vectorised over the earlier occurrences of the last token (a few numpy passes of length T, not a Python
    loop over T x n slices): a serving round calls it once per request.

    Raises:
        ValueError: ``min_ngram`` < 1 or > ``max_ngram``, or ``gamma`` < 1.
    """
    if not 1 <= min_ngram <= max_ngram or gamma < 1:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram and gamma >= 1, got {min_ngram}, {max_ngram}, {gamma}")
    h = np.asarray(history, dtype=np.int64)
    t = len(h)
    if t < 2:
        return [], 0
    # ends[i]: an earlier position whose token equals the last one (the end of a candidate occurrence)
    ends = np.flatnonzero(h[:-1] == h[-1])
    n = min(max_ngram, t - 1)
    match = np.ones(len(ends), dtype=np.int64)  # suffix length matched at each candidate, capped at n
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, n):
        back = ends - m
        alive &= back >= 0
        alive[alive] &= h[back[alive]] == h[t - 1 - m]
        match += alive
    if not len(ends) or match.max() < min_ngram:
        return [], 0
    best = int(match.max())
    end = int(ends[np.flatnonzero(match == best)[-1]])  # the most recent occurrence of the longest match
    follow = h[end + 1 : end + 1 + gamma].tolist()
    lag = t - 1 - end
    while periodic and len(follow) < gamma:
        follow.append(follow[len(follow) - lag])
    return follow, best


@dataclass
class NgramProposer:
    """Prompt-lookup drafting over each request's history (module docstring).

    Attributes:
        gamma: most draft tokens per round.
        max_ngram: longest suffix matched.
        min_ngram: shortest suffix matched (vLLM's prompt_lookup_min; 2 avoids single-token coincidences).
        periodic: continue a short loop's period to ``gamma`` tokens (``lookup``).
    """

    gamma: int
    max_ngram: int = 3
    min_ngram: int = 1
    periodic: bool = False
    last_proposal: DraftProposal | None = field(default=None, init=False)
    _history: dict[str, list[int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        lookup([], max_ngram=self.max_ngram, min_ngram=self.min_ngram, gamma=self.gamma)  # validates

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        self._history[request_id] = list(prompt_ids) + list(first.new_token_ids)

    def update(self, outputs: Sequence[StepOutput]) -> None:
        for out in outputs:
            if out.request_id in self._history:
                self._history[out.request_id].extend(out.new_token_ids)

    def finish(self, request_id: str) -> None:
        self._history.pop(request_id, None)

    @property
    def num_states(self) -> int:
        """Requests whose history this proposer holds (leak checks)."""
        return len(self._history)

    def match(self, request_id: str) -> tuple[list[int], int]:
        """The request's lookup draft (up to ``gamma`` tokens) and its match length n (``lookup``; ``([], 0)``
        without a match).

        Raises:
            KeyError: a request without ``start``.
        """
        return lookup(self._history[request_id], max_ngram=self.max_ngram, min_ngram=self.min_ngram,
                      gamma=self.gamma, periodic=self.periodic)

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        blocks, conf = [], torch.zeros(len(request_ids), self.gamma)
        for i, rid in enumerate(request_ids):
            follow, n = self.match(rid)
            if follow:
                conf[i, : len(follow)] = NGRAM_CONFIDENCE ** (1.0 / n)
            blocks.append(DraftBlock(rid, torch.tensor(follow, dtype=torch.long)))
        self.last_proposal = DraftProposal(blocks=blocks, confidences=conf, raw_confidences=conf.clone())
        return blocks
