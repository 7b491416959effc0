"""Prompt-lookup n-gram drafter: a model-free ``Proposer`` for serving without a trained checkpoint.

Owns each request's token history (prompt + committed output). ``propose`` finds the most recent earlier
occurrence of the history's last n tokens (n from ``max_ngram`` down to 1) and drafts the tokens that followed
it, up to ``gamma``; no match drafts nothing (a plain decoding step for that request). Drafts are
deterministic proposals (``probs=None``), which the engine's acceptance treats losslessly.

Confidences: the model-free drafter has no acceptance estimate; a matched position gets
``NGRAM_CONFIDENCE ** (1 / n)`` scaled to prefer longer matches, unmatched positions 0, so ``dspark`` and
``threshold`` policies cut blocks at the match end and trust long-n matches more.

Shape symbols: B requests, K block size (gamma).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from app.engine.types import DraftBlock, StepOutput
from app.serving.protocol import DraftRound

NGRAM_CONFIDENCE = 0.6  # per-position acceptance guess of a unigram match; an n-gram match gets 0.6 ** (1/n)


def lookup(history: Sequence[int], *, max_ngram: int, gamma: int) -> tuple[list[int], int]:
    """Tokens following the latest earlier occurrence of the longest matching suffix n-gram, and that n."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        suffix = list(history[-n:])
        for start in range(len(history) - n - 1, -1, -1):
            if list(history[start : start + n]) == suffix:
                follow = list(history[start + n : start + n + gamma])
                if follow:
                    return follow, n
    return [], 0


@dataclass
class NgramProposer:
    """Prompt-lookup drafting over each request's history (module docstring)."""

    gamma: int
    max_ngram: int = 3
    last_proposal: DraftRound | None = field(default=None, init=False)
    _history: dict[str, list[int]] = field(default_factory=dict, init=False)

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
            follow, n = lookup(self._history[rid], max_ngram=self.max_ngram, gamma=self.gamma)
            if follow:
                conf[i, : len(follow)] = NGRAM_CONFIDENCE ** (1.0 / n)
            blocks.append(DraftBlock(rid, torch.tensor(follow, dtype=torch.long)))
        self.last_proposal = DraftRound(blocks=blocks, confidences=conf)
        return blocks
