"""A deterministic, weight-free drafter for the mock engine (``app/engine/testing.py``), so the Serve layer is tested on
CPU in seconds (``mock_drafter`` in an application config).

``MockProposer`` drafts the mock engine's rule but deliberately errs at one position of each block, so rounds accept
part of a block and the acceptance bookkeeping is exercised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from app.engine.testing import next_token
from app.engine.types import DraftBlock, StepOutput
from app.loop import DraftRound

MOCK_MISS_CONFIDENCE = 0.1  # mock drafter's confidence at and after its planted error
MOCK_HIT_CONFIDENCE = 0.9  # ... and before it


@dataclass
class MockProposer:
    """Drafts the mock rule with one planted error per block (at position ``miss_at``); see module docstring."""

    vocab_size: int
    gamma: int
    miss_at: int = 3
    fails: str = "none"  # 'propose': propose raises; 'all': start, propose and finish raise (fail-over tests)
    last_proposal: DraftRound | None = field(default=None, init=False)
    _anchor: dict[str, int] = field(default_factory=dict, init=False)

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        self._anchor[request_id] = first.new_token_ids[-1]
        self._fail("all")

    def update(self, outputs: Sequence[StepOutput]) -> None:
        for out in outputs:
            if out.request_id in self._anchor and not out.finished:
                self._anchor[out.request_id] = out.new_token_ids[-1]

    def finish(self, request_id: str) -> None:
        self._fail("all")
        self._anchor.pop(request_id, None)

    def _fail(self, *modes: str) -> None:
        if self.fails in modes:
            raise RuntimeError(f"mock drafter failure (mock_drafter_fails={self.fails!r})")

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        self._fail("propose", "all")
        blocks, conf = [], torch.full((len(request_ids), self.gamma), MOCK_HIT_CONFIDENCE)
        for i, rid in enumerate(request_ids):
            tok, draft = self._anchor[rid], []
            for k in range(self.gamma):
                tok = next_token(tok, self.vocab_size)
                draft.append((tok + 1) % self.vocab_size if k == self.miss_at else tok)
            conf[i, self.miss_at:] = MOCK_MISS_CONFIDENCE
            blocks.append(DraftBlock(rid, torch.tensor(draft, dtype=torch.long)))
        self.last_proposal = DraftRound(blocks=blocks, confidences=conf)
        return blocks
