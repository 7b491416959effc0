"""Test doubles implementing the ``Proposer`` protocol: random, perfect (oracle) and table-driven drafts."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from app.engine.types import DraftBlock, StepOutput


class _Tracking:
    def __init__(self) -> None:
        self.committed: dict[str, list[int]] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        self.committed[request_id] = list(first.new_token_ids)

    def update(self, outputs: Sequence[StepOutput]) -> None:
        for out in outputs:
            self.committed[out.request_id].extend(out.new_token_ids)

    def finish(self, request_id: str) -> None:
        del self.committed[request_id]


class RandomProposer(_Tracking):
    """Uniformly random draft tokens; request i drafts ``lengths[i % len(lengths)]`` tokens (0 allowed)."""

    def __init__(self, vocab_size: int, lengths: Sequence[int], seed: int = 0) -> None:
        super().__init__()
        self.vocab_size, self.lengths = vocab_size, list(lengths)
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        blocks = []
        for rid in request_ids:
            n = self.lengths[int(rid.rsplit("-", 1)[1]) % len(self.lengths)]
            blocks.append(DraftBlock(rid, torch.randint(self.vocab_size, (n,), generator=self.gen)))
        return blocks


class OracleProposer(_Tracking):
    """Drafts the next tokens of a known reference continuation (perfect drafts).

    Request i drafts ``lengths[i % len(lengths)]`` tokens (default ``gamma`` for all), padded with
    ``pad_token`` past the reference's end.
    """

    def __init__(
        self, references: dict[str, list[int]], gamma: int, lengths: Sequence[int] | None = None, pad_token: int = 0
    ) -> None:
        super().__init__()
        self.references, self.pad = references, pad_token
        self.lengths = list(lengths) if lengths else [gamma]

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        blocks = []
        for rid in request_ids:
            n = len(self.committed[rid])
            k = self.lengths[int(rid.rsplit("-", 1)[1]) % len(self.lengths)]
            nxt = self.references[rid][n : n + k]
            nxt += [self.pad] * (k - len(nxt))
            blocks.append(DraftBlock(rid, torch.tensor(nxt, dtype=torch.long)))
        return blocks


class TableProposer(_Tracking):
    """Drafts ``table[committed tuple]`` (one deterministic token) when the table has it, else nothing."""

    def __init__(self, table: dict[tuple[int, ...], int]) -> None:
        super().__init__()
        self.table = table

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        blocks = []
        for rid in request_ids:
            tok = self.table.get(tuple(self.committed[rid]))
            blocks.append(DraftBlock(rid, torch.tensor([tok] if tok is not None else [], dtype=torch.long)))
        return blocks


def check_greedy_speculation(engine, prompts: list[list[int]], reference: list[list[int]], params, lengths: list[int]
                             ) -> list:
    """Decode ``prompts`` on ``engine`` with no drafts, random drafts and perfect drafts (per-request draft lengths
    ``lengths``): each output is ``reference``'s except at near-ties of the target's logits (``check_greedy_output``
    raises otherwise), at most half the prompts diverging, and perfect drafts are accepted in whole blocks
    (``check_whole_blocks``).

    Returns:
        The perfect-draft run's results.
    """
    from app.loop import generate
    from tests.engine.near_tie import check_greedy_output

    oracle = OracleProposer({f"req-{i}": r for i, r in enumerate(reference)}, gamma=7, lengths=lengths)
    for proposer in (None, RandomProposer(engine.vocab_size, lengths, seed=1), oracle):
        results, _ = generate(engine, prompts, params, proposer=proposer)
        ties = [t for p, ref, r in zip(prompts, reference, results)
                if (t := check_greedy_output(engine, p, ref, r.token_ids))]
        assert len(ties) <= len(prompts) // 2, ties
    check_whole_blocks(reference, results, lengths)
    return results


def check_whole_blocks(reference: list[list[int]], results, lengths: list[int], *, min_draft: int = 3) -> None:
    """Perfect drafts (``OracleProposer`` of ``reference``, per-request draft lengths ``lengths``) are accepted in
    whole blocks: each request of ``results`` whose output is its reference commits 3/4 or more of the tokens a round
    that whole blocks of its draft length k give (n tokens after prefill in ceil(n / (k + 1)) rounds; a near-tie
    divergence leaves the rest of a reference behind, so those requests are not counted), one of them drafting
    ``min_draft`` tokens or more."""
    drafted = [(r.accepted_length, len(ref) - 1, k) for i, (ref, r) in enumerate(zip(reference, results))
               if r.token_ids == ref and len(ref) > 1 and (k := lengths[i % len(lengths)]) > 0]  # k = 0: no drafts
    assert max((k for _, _, k in drafted), default=0) >= min_draft, drafted
    assert all(tau >= 0.75 * n / math.ceil(n / (k + 1)) for tau, n, k in drafted), drafted
