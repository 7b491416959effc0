"""Greedy speculative decoding is token-identical to plain greedy decoding (up to documented near-ties)."""

from __future__ import annotations

import pytest

from app.loop import generate
from app.engine.types import SamplingParams
from tests.engine.near_tie import check_greedy_output, check_same_or_near_tie
from tests.engine.proposers import OracleProposer, RandomProposer

PARAMS = SamplingParams(max_tokens=48)
RAGGED = [0, 1, 3, 5, 7, 2]  # per-request draft lengths sharing one batch, including plain decoding


@pytest.fixture(scope="module")
def prompt_ids(engine, eval_prompts):
    return [engine.encode_chat([{"role": "user", "content": p}]) for p in eval_prompts]


@pytest.fixture(scope="module")
def reference(engine, prompt_ids):
    results, _ = generate(engine, prompt_ids, PARAMS)
    return [r.token_ids for r in results]


def _check_all(engine, prompt_ids, reference, results) -> list[str]:
    ties = []
    for prompt, ref, res in zip(prompt_ids, reference, results):
        tie = check_greedy_output(engine, prompt, ref, res.token_ids)
        if tie:
            ties.append(tie)
    return ties


def test_single_stream_matches_batched_plain(engine, prompt_ids, reference):
    for prompt, ref in zip(prompt_ids[:4], reference[:4]):
        (res,), _ = generate(engine, [prompt], PARAMS)
        check_same_or_near_tie(engine, prompt, ref, res.token_ids)


def test_random_drafts_in_ragged_batch_are_lossless(engine, prompt_ids, reference):
    proposer = RandomProposer(engine.vocab_size, RAGGED, seed=1)
    results, stats = generate(engine, prompt_ids, PARAMS, proposer=proposer)
    _check_all(engine, prompt_ids, reference, results)
    assert sum(r.num_draft for r in results) > 0


def test_perfect_drafts_in_ragged_batch_are_lossless_and_accepted(engine, prompt_ids, reference):
    refs = {f"req-{i}": ref for i, ref in enumerate(reference)}
    proposer = OracleProposer(refs, gamma=7, lengths=RAGGED)
    results, _ = generate(engine, prompt_ids, PARAMS, proposer=proposer)
    ties = _check_all(engine, prompt_ids, reference, results)
    exact = [r for r, ref in zip(results, reference) if r.token_ids == ref]
    assert len(exact) == len(reference) - len(ties)
    # Perfect drafts are accepted in full wherever the output did not drift at a near-tie.
    for r in exact:  # every round but the last (whose block may run past the reference's end)
        assert r.accepted_per_round[:-1] == r.verified_per_round[:-1]
    assert max(r.accepted_length for r in exact) >= 4.0
