"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's; completions' ``echo`` with ``logprobs``): the raw
target's logprob of every prompt token after the first, scored in the prefill, as decoding scores the same tokens.

On ``engine32`` (tests/conftest.py: float32, so a prefill row and a decode row of one token agree to ~1e-5 logits).
"""

from __future__ import annotations

import math

import pytest

from app.engine.errors import InvalidRequestError
from app.engine.testing import MockEngine, MockEngineConfig, next_token
from app.engine.types import NewRequest, SamplingParams
from app.loop import SpecLoop, generate
from tests.engine.near_tie import check_same_or_near_tie, check_seeded_same_or_near_tie
from tests.engine.proposers import RandomProposer

TOLERANCE = 1e-3  # logprobs of one token in a prefill row and in a decode row (float32)


@pytest.fixture(scope="module")
def scored(engine32):
    """A question, its greedy answer (12 tokens, 3 alternatives each) and the prompt question + answer."""
    question = engine32.encode_chat([{"role": "user", "content": "Name three primary colours."}])
    answer = generate(engine32, [question], SamplingParams(max_tokens=12, logprobs=3, ignore_eos=True))[0][0]
    return question, answer, question + answer.token_ids


def check_same_logprobs(got, expected) -> None:
    """Same tokens, logprobs within ``TOLERANCE``, the same alternatives (but at a near-tie of two of them, which
    may swap places) with their logprobs."""
    assert [g.token_id for g in got] == [e.token_id for e in expected]
    for g, e in zip(got, expected):
        assert g.logprob == pytest.approx(e.logprob, abs=TOLERANCE)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in e.top], abs=TOLERANCE)
        swapped = [(a, b) for (a, va), (b, _) in zip(g.top, e.top) if a != b]
        assert all(abs(dict(g.top)[a] - dict(e.top)[b]) < TOLERANCE for a, b in swapped), (g.top, e.top)


def test_a_prompt_is_scored_as_decoding_scored_its_tokens(engine32, scored):
    """Prompt = question + greedy answer: its logprobs at the answer's positions are those the answer got while it
    was decoded, alternatives included; one entry per prompt token, None for the first; the output's own
    logprobs still come with ``logprobs``."""
    question, answer, prompt = scored
    result = generate(engine32, [prompt], SamplingParams(max_tokens=2, prompt_logprobs=3, logprobs=1))[0][0]
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    assert [e.token_id for e in result.prompt_logprobs[1:]] == prompt[1:]
    check_same_logprobs(result.prompt_logprobs[len(question):], answer.logprobs)
    assert len(result.logprobs) == 2 and all(len(e.top) == 1 for e in result.logprobs)
    assert all(e.logprob <= 0 and len(e.top) == 3 for e in result.prompt_logprobs[1:])
    assert math.fsum(math.exp(v) for _, v in result.prompt_logprobs[-1].top) <= 1 + 1e-6
    for e in result.prompt_logprobs[1:]:  # rank: 1 + the tokens more likely than the prompt's
        top = [t for t, _ in e.top]
        assert e.rank == top.index(e.token_id) + 1 if e.token_id in top else e.rank > len(top), (e, top)
    # the greedy answer's tokens are first (but at a near-tie, where the prefill row may order them otherwise)
    assert all(e.rank == 1 or e.top[0][1] - e.logprob < TOLERANCE for e in result.prompt_logprobs[len(question):])


def test_prompt_logprobs_in_pieces_after_a_cached_prefix_and_beside_other_requests(engine32, scored):
    """A chunked prefill scores each piece's rows (the last row of a piece predicts the next piece's first token);
    a prompt the prefix cache holds is computed whole anyway (no cached tokens); a request beside it in the same
    forward gets the tokens it gets alone; ``prompt_logprobs=0``: no alternatives."""
    question, _, prompt = scored
    params = SamplingParams(max_tokens=3, prompt_logprobs=0)
    whole = generate(engine32, [prompt], params)[0][0]
    assert engine32.prefix_caching  # the answer above left the question's record in a slot
    outs = engine32.add_requests([NewRequest("pieces", prompt, params), NewRequest("beside", question,
                                                                                    SamplingParams(max_tokens=3))],
                                 limits=[7, 64])
    assert outs[0] is None and outs[1].num_cached_tokens == len(question) - 1
    while (out := engine32.continue_prefill({"pieces": 9})[0]) is None:
        pass
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    check_same_logprobs(out.prompt_logprobs[1:], whole.prompt_logprobs[1:])
    assert all(e.top == () for e in out.prompt_logprobs[1:])
    for rid in ("pieces", "beside"):
        engine32.release(rid)
    alone = generate(engine32, [question], SamplingParams(max_tokens=1))[0][0]
    assert outs[1].new_token_ids == alone.token_ids


def test_admission_counts_the_whole_prompt_of_a_request_with_prompt_logprobs(engine32, scored):
    """The prefill budget counts what a prefill computes: a prompt the prefix cache holds costs one token, unless
    it asks for prompt logprobs (computed whole): then a budget of one prompt admits one such request, not two."""
    question, _, prompt = scored
    generate(engine32, [prompt], SamplingParams(max_tokens=1))  # the prompt's record is in a slot
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert engine32.prefill_tokens(prompt) == 1 and engine32.prefill_tokens(prompt, scoring) == len(prompt)
    loop = SpecLoop(engine32, gamma=None, speculates=False, max_prefill_tokens=len(prompt) + 1)
    assert loop.admission_size([prompt, prompt]) == 2
    assert loop.admission_size([prompt, prompt], params=[scoring, scoring]) == 1


def test_scored_prompts_sharing_a_prefix_are_admitted_together(engine32):
    """A prompt sharing 64 tokens or more with an earlier one of its admission batch waits for the next forward to
    reuse them (``admission.first_deferred``), unless it asks for prompt logprobs: computed whole anyway, it goes in
    the same forward (the n choices of an echoed request, the choices of a multiple-choice question)."""
    shared = engine32.encode("The quick brown fox jumps over the lazy dog. " * 12)
    assert len(shared) >= 64
    prompts = [shared + engine32.encode(" Yes"), shared + engine32.encode(" No")]
    loop = SpecLoop(engine32, gamma=None, speculates=False, max_prefill_tokens=4096)
    assert loop.admission_size(prompts) == 1
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1)
    assert loop.admission_size(prompts, params=[scoring, scoring]) == 2
    assert loop.admission_size(prompts, params=[SamplingParams(max_tokens=1), scoring]) == 2


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_scoring_the_prompt_leaves_the_answer_as_it_is(engine32, scored, sampled):
    """The same requests with and without prompt logprobs, with random drafts in every round (greedy, and sampled
    with a seed, top_p 0.95): the same tokens (up to a near-tie of the logits, as any two runs in other step shapes:
    a scored prompt is computed whole where the other may reuse its cached prefix)."""
    question, _, prompt = scored
    base = dict(max_tokens=10, ignore_eos=True) | (dict(temperature=0.8, top_p=0.95, seed=11) if sampled else {})
    plain, scoring = SamplingParams(**base), SamplingParams(**base, prompt_logprobs=1)
    prompts = [question, prompt]
    ref = generate(engine32, prompts, plain, proposer=RandomProposer(engine32.vocab_size, [3, 5], seed=4))[0]
    got = generate(engine32, prompts, scoring, proposer=RandomProposer(engine32.vocab_size, [5, 2], seed=9))[0]
    check = check_seeded_same_or_near_tie if sampled else check_same_or_near_tie
    for ids, r, g in zip(prompts, ref, got):
        assert len(g.prompt_logprobs) == len(ids) and r.prompt_logprobs is None
        check(engine32, ids, r.token_ids, g.token_ids, plain)
    assert sum(g.num_draft for g in got) > 0


@pytest.mark.parametrize("value", [-1, 21, 2.0, "3", True])
def test_prompt_logprobs_out_of_range_are_refused_by_name(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be an integer") as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.param == "prompt_logprobs"


def test_the_mock_engine_scores_a_prompt_by_its_rule():
    """Token u after t has logprob -(r + 1) ln 2, r its rank after t (app/engine/testing.py)."""
    engine = MockEngine(MockEngineConfig())
    second = next_token(40, engine.vocab_size)
    prompt = [40, second, next_token(second, engine.vocab_size) + 2]  # ranks 0 and 2
    out = engine.add_requests([NewRequest("m", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))])[0]
    assert out.prompt_logprobs[0] is None
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx([-math.log(2), -3 * math.log(2)])
    assert [e.rank for e in out.prompt_logprobs[1:]] == [1, 3]
    assert out.prompt_logprobs[2].top == ((next_token(prompt[1], engine.vocab_size), -math.log(2)),)


def test_the_lm_head_scores_prompts_in_a_few_row_counts(engine32, scored):
    """Prompt rows reach the LM head padded to a multiple of ``PROMPT_LOGPROB_BUCKET``, so prompts of every length
    meet a few row counts (a new one costs oneDNN a primitive), with the logprobs of unpadded rows."""
    from app.engine.engine import PROMPT_LOGPROB_BUCKET

    _, _, prompt = scored
    expected = generate(engine32, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0][0].prompt_logprobs
    seen: list[int] = []
    hook = engine32.model.lm_head.register_forward_pre_hook(lambda _, args: seen.append(len(args[0])))
    try:
        for n in (len(prompt), len(prompt) - 5, 9):
            result = generate(engine32, [prompt[:n]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0][0]
            check_same_logprobs(result.prompt_logprobs[1:], expected[1:n])
    finally:
        hook.remove()
    scoring = [rows for rows in seen if rows > 1]  # (a first token's row is the other call, if any)
    assert len(scoring) == 3 and all(rows % PROMPT_LOGPROB_BUCKET == 0 for rows in scoring), seen
