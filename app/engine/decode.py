"""The offline speculative-decoding loop: a batch of prompts through the engine with a pluggable proposer.

Owns: driving an ``Engine`` (``contract.py``) round by round for a fixed set of requests until all finish, calling the
proposer's hooks (``start``, ``propose``, ``update``, ``finish``) and an optional verify-length policy, and
collecting per-request outputs and statistics. Used by tests, benchmarks, the offline evaluator and training
data generation. The online path (Ray Serve) drives the same engine calls from its own step loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import torch

from app.engine.admission import prefill_batch_size
from app.engine.contract import Engine
from app.engine.types import (
    DraftBlock, FinishReason, NewRequest, SamplingParams, StepOutput, TokenLogprob, accepted_length,
)


class Proposer(Protocol):
    """Per-method hooks of a drafter (DSpark, DFlash, EAGLE-3, MTP, n-gram, test doubles).

    The proposer keeps its own per-request context state, fed by ``start`` (prefill output: the first token
    and the prompt's target features) and ``update`` (each verify step's committed tokens and features).
    """

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None: ...

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]: ...

    def update(self, outputs: Sequence[StepOutput]) -> None: ...

    def finish(self, request_id: str) -> None: ...


# (request_ids, proposals) -> verify length per request; None verifies every proposed token.
LengthPolicy = Callable[[Sequence[str], Sequence[DraftBlock]], Sequence[int]]


@dataclass
class RequestResult:
    """Everything one request produced in ``generate``."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    rounds: int = 0  # verify steps (the prefill is not a round)
    num_draft: int = 0  # draft tokens verified
    num_accepted: int = 0  # draft tokens accepted
    accepted_per_round: list[int] = field(default_factory=list)  # accepted drafts in each round
    verified_per_round: list[int] = field(default_factory=list)  # l_r in each round
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when SamplingParams.logprobs is set

    @property
    def accepted_length(self) -> float:
        """tau: tokens committed per round, accepted drafts plus the bonus token (0 before any round)."""
        return accepted_length(self.num_accepted, self.rounds)


@dataclass
class GenerateStats:
    """Timing of one ``generate`` call (seconds)."""

    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    proposer: Proposer | None = None,
    policy: LengthPolicy | None = None,
    max_batch: int | None = None,
    max_prefill_tokens: int = 2048,
    id_prefix: str = "req",
) -> tuple[list[RequestResult], GenerateStats]:
    """Decode ``prompts`` to completion with continuous batching (at most ``max_batch`` active at once); waiting
    prompts are prefilled together, up to ``max_prefill_tokens`` prompt tokens per forward (``add_requests``).

    With ``proposer=None`` this is plain decoding (every round verifies 0 drafts).

    Returns:
        Per-prompt results in input order, and timing stats.

    Raises:
        The engine's errors for bad prompts or params.
    """
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(params_list)} params for {len(prompts)} prompts")
    limit = min(max_batch or engine.max_num_seqs, engine.max_num_seqs)
    results = [RequestResult(request_id=f"{id_prefix}-{i}") for i in range(len(prompts))]
    by_id = {r.request_id: r for r in results}
    waiting = list(range(len(prompts)))
    active: list[str] = []
    stats = GenerateStats()
    start = time.perf_counter()
    while waiting or active:
        while waiting and len(active) < limit:
            n = prefill_batch_size([len(prompts[i]) for i in waiting], max_tokens=max_prefill_tokens,
                                   max_requests=limit - len(active))
            admitted, waiting = waiting[:n], waiting[n:]
            firsts = engine.add_requests(
                [NewRequest(results[i].request_id, prompts[i], params_list[i]) for i in admitted]
            )
            for i, first in zip(admitted, firsts):
                _record(results[i], first)
                if first.finished:
                    continue
                active.append(results[i].request_id)
                if proposer is not None:
                    proposer.start(results[i].request_id, prompts[i], first)
        t0 = time.perf_counter()
        if proposer is None:
            blocks = [DraftBlock(rid, torch.zeros(0, dtype=torch.long)) for rid in active]
        else:
            blocks = proposer.propose(active)
            if policy is not None:
                lengths = policy(active, blocks)
                blocks = [replace(b, verify_len=int(n)) for b, n in zip(blocks, lengths)]
        t1 = time.perf_counter()
        outputs = engine.verify(blocks)
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.rounds += 1
        for out in outputs:
            res = by_id[out.request_id]
            _record(res, out)
            res.rounds += 1
            res.num_draft += out.num_draft
            res.num_accepted += out.num_accepted
            res.accepted_per_round.append(out.num_accepted)
            res.verified_per_round.append(out.num_draft)
        if proposer is not None:
            proposer.update(outputs)
        for out in outputs:
            if out.finished:
                active.remove(out.request_id)
                if proposer is not None:
                    proposer.finish(out.request_id)
    stats.wall_s = time.perf_counter() - start
    return results, stats


def _record(res: RequestResult, out: StepOutput) -> None:
    res.token_ids.extend(out.new_token_ids)
    if out.logprobs is not None:
        if res.logprobs is None:
            res.logprobs = []
        res.logprobs.extend(out.logprobs)
    res.text += out.text
    if out.finished:
        res.finish_reason = out.finish_reason
