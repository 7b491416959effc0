"""Chunked prefill (``TargetEngine.add_requests`` with ``limits``, ``continue_prefill``): a prompt prefilled in pieces
gives the first token, the features and the decoding of a prefill in one piece (float32: to rounding; greedy and
seeded sampled outputs the same, plain and speculative), a prefix from the prefix cache included; a request being
prefilled cannot be verified, frees its slot when released and leaves no prefix record behind."""

from __future__ import annotations

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.errors import InvalidRequestError, UnknownRequestError
from app.engine.types import DraftBlock, NewRequest, SamplingParams
from app.loop import generate
from tests.engine.near_tie import check_same_or_near_tie, check_seeded_same_or_near_tie
from tests.engine.proposers import OracleProposer, RandomProposer

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def whole(engine32):
    """A float32 engine without prefix caching on ``engine32``'s weights: the prefill-in-one-piece reference."""
    config = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=512, enable_prefix_caching=False)
    return TargetEngine(config, loaded=engine32.target)


@pytest.fixture(scope="module")
def long_prompt(engine32, eval_prompts) -> list[int]:
    """300 tokens of a chat prompt."""
    ids = engine32.encode_chat([{"role": "user", "content": "\n\n".join(eval_prompts[:8])}])
    assert len(ids) >= 300, len(ids)
    return ids[:300]


def decode(engine, rid: str, first) -> list[int]:
    """The first token, then plain verify steps to the end."""
    tokens, out = list(first.new_token_ids), first
    while not out.finished:
        out = engine.verify([DraftBlock(rid, torch.zeros(0, dtype=torch.long))])[0]
        tokens += out.new_token_ids
    return tokens


def prefill_in_pieces(engine, rid: str, prompt: list[int], params, pieces: list[int]):
    """Admit ``prompt`` computing ``pieces[0]`` tokens, then ``pieces[1]``, ... per ``continue_prefill`` (the last
    piece repeated); returns the first output and the number of calls."""
    out = engine.add_requests([NewRequest(rid, prompt, params)], limits=[pieces[0]])[0]
    calls = 1
    while out is None:
        out = engine.continue_prefill({rid: pieces[min(calls, len(pieces) - 1)]})[0]
        calls += 1
    return out, calls


@pytest.mark.parametrize("pieces", [[64], [1, 299]])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prompt_prefilled_in_pieces_decodes_as_one_prefill(whole, long_prompt, pieces, params):
    one = whole.add_request("one", long_prompt, params)
    reference = decode(whole, "one", one)
    out, calls = prefill_in_pieces(whole, "pieces", long_prompt, params, pieces)
    assert calls > 1 and out.num_cached_tokens == 0
    assert out.features.shape == one.features.shape == (len(long_prompt), whole.feature_dim)
    scale = one.features.abs().max()
    assert (out.features - one.features).abs().max() <= 1e-5 * scale
    got = decode(whole, "pieces", out)
    if params.greedy:
        check_same_or_near_tie(whole, long_prompt, reference, got)
    else:
        check_seeded_same_or_near_tie(whole, long_prompt, reference, got, params)
    assert whole.num_active == 0


def test_pieces_after_a_reused_prefix_and_the_prompt_kept_for_the_next(engine32, whole, long_prompt):
    """With prefix caching: the first 200 tokens come from the cache, the rest in pieces; once done, the slot's record
    holds the whole prompt (the next copy computes one token), as after a prefill in one piece."""
    head = long_prompt[:200]
    engine32.add_request("head", head, SamplingParams(max_tokens=1))  # finishes at once: its record stays
    assert engine32.prefill_tokens(long_prompt) == len(long_prompt) - 200
    out, calls = prefill_in_pieces(engine32, "rest", long_prompt, GREEDY, [40])
    assert calls == 3 and out.num_cached_tokens == 200  # 40 + 40 + 20 tokens
    one = whole.add_request("one", long_prompt, GREEDY)
    assert (out.features - one.features).abs().max() <= 1e-5 * one.features.abs().max()
    assert engine32.prefill_tokens(long_prompt) == 1
    check_same_or_near_tie(whole, long_prompt, decode(whole, "one", one), decode(engine32, "rest", out))


def test_speculation_over_chunked_prefills_is_lossless(whole, long_prompt, eval_prompts):
    """``generate`` with chunked prefill (a 48-token budget: every prompt in pieces, rounds between them), greedy and
    seeded, random and perfect drafts: the outputs of plain decoding with prefills in one piece."""
    prompts = [long_prompt] + [whole.encode_chat([{"role": "user", "content": p}]) for p in eval_prompts[4:6]]
    for params in (GREEDY, SEEDED):
        reference = [r.token_ids for r in generate(whole, prompts, params)[0]]
        oracle = OracleProposer({f"req-{i}": r for i, r in enumerate(reference)}, gamma=4, lengths=[4, 2])
        for proposer in (RandomProposer(whole.vocab_size, [3, 0, 5]), oracle):
            results, _ = generate(whole, prompts, params, proposer=proposer, max_prefill_tokens=48,
                                  chunked_prefill=True)
            for prompt, ref, res in zip(prompts, reference, results):
                if params.greedy:
                    check_same_or_near_tie(whole, prompt, ref, res.token_ids)
                else:
                    check_seeded_same_or_near_tie(whole, prompt, ref, res.token_ids, params)
        assert whole.num_active == 0


def test_a_request_being_prefilled_is_refused_by_verify_and_freed_by_release(engine32, long_prompt):
    prompt = long_prompt[::-1]  # not in the prefix cache
    free = engine32.num_free_slots
    assert engine32.add_requests([NewRequest("p", prompt, GREEDY)], limits=[100]) == [None]
    assert engine32.num_free_slots == free - 1
    with pytest.raises(InvalidRequestError, match="still being prefilled"):
        engine32.verify([DraftBlock("p", torch.zeros(0, dtype=torch.long))])
    with pytest.raises(UnknownRequestError, match="'nope'"):
        engine32.continue_prefill({"nope": 10})
    with pytest.raises(ValueError, match="at least 1 token"):
        engine32.continue_prefill({"p": 0})
    assert engine32.continue_prefill({"p": 50}) == [None]  # nothing changed by the refusals
    engine32.release("p")
    assert engine32.num_free_slots == free and not engine32.has_request("p")
    assert engine32.prefill_tokens(prompt[:150]) == 150  # a half-prefilled prompt leaves no record
    done = engine32.add_request("q", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="no prefill left"):
        engine32.continue_prefill({"q": 10})
    engine32.release(done.request_id)


def test_limits_are_checked_and_refused_in_batch_invariant_mode(whole, long_prompt):
    with pytest.raises(ValueError, match="one count >= 1 per request"):
        whole.add_requests([NewRequest("a", long_prompt, GREEDY)], limits=[10, 10])
    with pytest.raises(ValueError, match="one count >= 1 per request"):
        whole.add_requests([NewRequest("a", long_prompt, GREEDY)], limits=[0])
    assert whole.num_active == 0
    invariant = TargetEngine(EngineConfig(dtype="float32", max_num_seqs=1, max_model_len=512, batch_invariant=True),
                             loaded=whole.target)
    assert whole.supports_chunked_prefill and not invariant.supports_chunked_prefill
    with pytest.raises(ValueError, match="batch-invariant"):
        invariant.add_requests([NewRequest("a", long_prompt, GREEDY)], limits=[10])
    from app.loop import SpecLoop

    with pytest.raises(ValueError, match="chunked prefill"):
        SpecLoop(invariant, gamma=None, speculates=False, chunked_prefill=True)


def test_the_prefill_benchmark_runs_both_ways(engine):
    """``app.engine.bench_prefill``'s run, small: whole and in pieces, greedy and sampled."""
    from app.engine.bench_prefill import LONG, run_once

    prompt = engine.encode_chat([{"role": "user", "content": LONG}])[:100]
    for chunked, temperature in [(False, 0.0), (True, 0.7)]:
        result = run_once(engine, chunked=chunked, budget=48, long_prompt=prompt, tokens=4, arrive_after=2,
                          temperature=temperature)
        assert 0 < result["p99_gap_ms"] <= result["max_gap_ms"] and result["ttft_ms"] > 0 and result["tok_s"] > 0
    assert engine.num_active == 0
