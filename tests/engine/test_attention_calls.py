"""A ragged step's attention runs in one call or, where one request's context (or the slots between requests) would
pad every row far past its own, in several (``attention_chunks``); the split changes cost, never what a row sees."""

from __future__ import annotations

import random

import pytest
import torch

import app.engine.model as model_module
from app.engine.model import CHUNK_MAX_ROWS, KVCache, ModelArgs, StepLayout, TargetModel, attention_chunks
from app.engine.types import SamplingParams
from app.loop import generate
from tests.engine.near_tie import check_greedy_output, check_greedy_path, check_seeded_same_or_near_tie
from tests.engine.proposers import RandomProposer


def _cost(runs, slots, keys, queries, groups):
    return sum(model_module.CHUNK_CALL_COST + (slots[j - 1] - slots[i] + 1) * max(keys[i:j])
               * (1 + model_module.CHUNK_QUERY_COST * groups * (max(queries[i:j]) - 1)) for i, j in runs)


def test_near_even_contexts_keep_one_call():
    random.seed(0)
    keys = [random.randint(180, 260) for _ in range(16)]
    assert attention_chunks(list(range(16)), keys, [1] * 16, groups=3) == [(0, 16)]
    assert attention_chunks(list(range(16)), keys, [1, 4, 8, 2] * 4, groups=3) == [(0, 16)]


@pytest.mark.parametrize("at", [0, 7, 15])
def test_a_far_longer_context_gets_a_call_of_its_own(at):
    keys = [200] * 16
    keys[at] = 1700
    runs = attention_chunks(list(range(16)), keys, [1] * 16, groups=3)
    assert (at, at + 1) in runs and len(runs) == 2 + (0 < at < 15)


def test_slots_far_apart_are_not_spanned_by_one_call():
    slots = [0, 1, 2, 60, 61, 62]
    assert attention_chunks(slots, [300] * 6, [1] * 6, groups=3) == [(0, 3), (3, 6)]


def test_prompts_of_very_different_lengths_are_prefilled_apart():
    """Prefill: queries = keys; one call pads the short prompt's queries to the long one's."""
    assert attention_chunks([0, 1], [40, 400], [40, 400], groups=3) == [(0, 1), (1, 2)]


def test_runs_cover_the_requests_in_order_and_cost_no_more_than_one_call():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 70)
        slots = sorted(rng.sample(range(128), n))
        keys = [rng.choice([rng.randint(20, 300), rng.randint(20, 2000)]) for _ in range(n)]
        queries = [rng.randint(1, 8) for _ in range(n)]
        runs = attention_chunks(slots, keys, queries, groups=3)
        assert runs[0][0] == 0 and runs[-1][1] == n and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        if len(runs) > 1:
            assert all(j - i <= CHUNK_MAX_ROWS for i, j in runs)
            one = _cost([(0, n)], slots, keys, queries, 3)
            assert _cost(runs, slots, keys, queries, 3) <= (1 - model_module.CHUNK_MIN_SAVING) * one


ARGS = ModelArgs(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024,
                 tie_word_embeddings=True)


def _step(model, cache, slots, starts, lengths, *, one_call: bool, seed: int):
    tokens = torch.randint(0, ARGS.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    needed = max(s + n for s, n in zip(starts, lengths))
    layout = StepLayout.build(slots=slots, starts=starts, lengths=lengths, groups=2, device=torch.device("cpu"),
                              dtype=torch.float32, key_len=needed if one_call else None)
    with torch.inference_mode():
        hidden, _ = model.hidden_states(tokens, cache=cache, layout=layout, index=None)
    return layout, hidden


def test_a_split_step_computes_what_one_call_does():
    """Float32 toy target, requests in slots with gaps, one context far longer than the rest: the prefill and a
    ragged verify step, split into calls, give the hidden states and cache contents of the same steps in one call
    (requests given out of slot order, as the engine does)."""
    torch.manual_seed(0)
    model = TargetModel(ARGS, feature_layers=(1,)).eval()
    slots, contexts = [6, 0, 2, 1, 7], [30, 20, 25, 700, 22]
    runs = {}
    for one_call in (False, True):
        cache = KVCache(ARGS, num_slots=8, max_len=1024, dtype=torch.float32, device="cpu")
        prefill, h1 = _step(model, cache, slots, [0] * 5, contexts, one_call=one_call, seed=1)
        verify, h2 = _step(model, cache, slots, contexts, [1, 4, 2, 8, 1], one_call=one_call, seed=2)
        runs[one_call] = (prefill, verify, h1, h2, cache)
    split, single = runs[False], runs[True]
    assert len(split[0].calls) > 1 and len(split[1].calls) > 1
    assert len(single[0].calls) == 1 and len(single[1].calls) == 1
    torch.testing.assert_close(split[2], single[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[3], single[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[4].k, single[4].k, rtol=1e-5, atol=1e-5)


@pytest.fixture
def split_steps(monkeypatch):
    """Counts the engine's steps whose attention was split into several calls."""
    counted = {"split": 0}

    def counting(slots, key_lens, query_lens, *, groups):
        runs = attention_chunks(slots, key_lens, query_lens, groups=groups)
        counted["split"] += len(runs) > 1
        return runs

    monkeypatch.setattr(model_module, "attention_chunks", counting)
    return counted


@pytest.fixture(scope="module")
def long_and_short(engine, eval_prompts):
    """Five chat prompts and one of ~700 tokens (the others repeated), in one batch."""
    short = [engine.encode_chat([{"role": "user", "content": p}]) for p in eval_prompts[:5]]
    text = " ".join(eval_prompts[:12])
    long = engine.encode_chat([{"role": "user", "content": (text + " ") * 8}])[:700]
    return short[:2] + [long] + short[2:]


def test_greedy_speculation_over_split_steps_is_lossless(engine, long_and_short, split_steps):
    """Plain and speculative greedy decoding of the batch (both split): the same output up to a near-tie, and each a
    greedy path of the target as one request alone computes it (one call)."""
    params = SamplingParams(max_tokens=32)
    plain, _ = generate(engine, long_and_short, params)
    spec, _ = generate(engine, long_and_short, params, proposer=RandomProposer(engine.vocab_size, [0, 1, 3, 5, 7, 2],
                                                                                seed=3))
    assert split_steps["split"] > 0
    for prompt, p, s in zip(long_and_short, plain, spec):
        check_greedy_path(engine, prompt, p.token_ids)
        check_greedy_output(engine, prompt, p.token_ids, s.token_ids)


def test_a_seeded_request_beside_a_long_context_samples_as_alone(engine, long_and_short, split_steps):
    """A seeded sampled request decoded alone, and with speculation in the long-and-short batch (split steps): the
    same tokens, or a first difference at a near-tie of the target's logits."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5)
    prompt = long_and_short[0]
    (alone,), _ = generate(engine, [prompt], params)
    batch, _ = generate(engine, long_and_short, [params] + [SamplingParams(max_tokens=24)] * 5,
                        proposer=RandomProposer(engine.vocab_size, [2, 0, 5, 1, 7, 3], seed=4))
    assert split_steps["split"] > 0
    check_seeded_same_or_near_tie(engine, prompt, alone.token_ids, batch[0].token_ids, params)


def test_the_engine_bench_turns_the_split_off_and_back_on():
    """``app.engine.bench``'s comparison column: inside ``one_attention_call(True)`` every step is one call."""
    from app.engine.bench import one_attention_call

    slots, key_lens, query_lens = [0, 1, 2], [200, 1700, 200], [1, 1, 1]
    split = attention_chunks(slots, key_lens, query_lens, groups=3)
    assert len(split) > 1  # the long context gets a call of its own
    with one_attention_call(True):
        assert model_module.attention_chunks(slots, key_lens, query_lens, groups=3) == [(0, 3)]
    with one_attention_call(False):
        assert model_module.attention_chunks(slots, key_lens, query_lens, groups=3) == split
    assert model_module.attention_chunks(slots, key_lens, query_lens, groups=3) == split
