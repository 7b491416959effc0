"""Greedy speculative decoding is token-identical to plain greedy decoding (up to documented near-ties), also for
requests moved to plain decoding mid-way (greedy, with a control, seeded)."""

from __future__ import annotations

import pytest

from app.loop import generate
from app.engine.types import SamplingParams
from tests.engine.near_tie import check_greedy_output, check_same_or_near_tie, check_seeded_same_or_near_tie
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


@pytest.mark.parametrize("params", [PARAMS, SamplingParams(max_tokens=48, presence_penalty=1.0),
                                    SamplingParams(max_tokens=48, temperature=0.8, seed=5)],
                         ids=["greedy", "penalty", "seeded"])
def test_fail_over_after_accepted_drafts_continues_as_plain_decoding(engine, prompt_ids, params):
    """Requests moved to plain decoding (``SpecLoop.fail_over``, as a failed drafter call does) after rounds that
    accepted drafts finish with plain decoding's tokens: the drafts' commits left the state a plain run has."""
    from app.loop import ProposerHost, SpecLoop
    from app.engine.types import NewRequest

    prompts = prompt_ids[:3]
    ref, _ = generate(engine, prompts, params)
    oracle = OracleProposer({f"req-{i}": r.token_ids for i, r in enumerate(ref)}, gamma=7, lengths=[3, 5, 7])
    host, loop = ProposerHost(oracle, gamma=7), SpecLoop(engine, gamma=None, speculates=True)
    records = [record for record, _ in loop.admit([NewRequest(f"req-{i}", p, params) for i, p in enumerate(prompts)])]
    for _ in range(3):
        loop.step(host.draft(loop.take_call(loop.speculating())))
    assert all(r.num_accepted > 0 for r in records)
    assert loop.fail_over([r.request_id for r in records], "test") == [r.request_id for r in records]
    while loop.active:
        loop.step(None)
    for prompt, r, record in zip(prompts, ref, records):
        assert record.fallback_cause == "test" and not record.speculates
        if params.greedy and not params.controls():
            check_greedy_output(engine, prompt, r.token_ids, record.token_ids)
        else:
            check_seeded_same_or_near_tie(engine, prompt, r.token_ids, record.token_ids, params)
