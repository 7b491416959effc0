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

import torch

from app.drafters.proposer import DraftProposal
from app.engine.types import DraftBlock, StepOutput

NGRAM_CONFIDENCE = 0.6  # per-position acceptance guess of a unigram match; an n-gram match gets 0.6 ** (1/n)


def lookup(history: Sequence[int], *, max_ngram: int, gamma: int, min_ngram: int = 1) -> tuple[list[int], int]:
    """Tokens following the latest earlier occurrence of the longest matching suffix n-gram
    (``min_ngram`` <= n <= ``max_ngram``), and that n; ``([], 0)`` without a match.

    Raises:
        ValueError: ``min_ngram`` < 1 or > ``max_ngram``, or ``gamma`` < 1.
    """
    if not 1 <= min_ngram <= max_ngram or gamma < 1:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram and gamma >= 1, got {min_ngram}, {max_ngram}, {gamma}")
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = list(history[-n:])
        for start in range(len(history) - n - 1, -1, -1):
            if list(history[start : start + n]) == suffix:
                return list(history[start + n : start + n + gamma]), n
    return [], 0


@dataclass
class NgramProposer:
    """Prompt-lookup drafting over each request's history (module docstring).

    Attributes:
        gamma: most draft tokens per round.
        max_ngram: longest suffix matched.
        min_ngram: shortest suffix matched (vLLM's prompt_lookup_min; 2 avoids single-token coincidences).
    """

    gamma: int
    max_ngram: int = 3
    min_ngram: int = 1
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

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        blocks, conf = [], torch.zeros(len(request_ids), self.gamma)
        for i, rid in enumerate(request_ids):
            follow, n = lookup(self._history[rid], max_ngram=self.max_ngram, min_ngram=self.min_ngram,
                               gamma=self.gamma)
            if follow:
                conf[i, : len(follow)] = NGRAM_CONFIDENCE ** (1.0 / n)
            blocks.append(DraftBlock(rid, torch.tensor(follow, dtype=torch.long)))
        self.last_proposal = DraftProposal(blocks=blocks, confidences=conf, raw_confidences=conf.clone())
        return blocks
