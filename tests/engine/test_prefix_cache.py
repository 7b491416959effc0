"""Prefix caching (app/engine/prefix_cache.py): the longest-prefix match, the engine reusing a donor slot's keys/values
and features, and outputs unchanged by it (greedy and seeded sampled; the sampled-distribution tests of this
package run with it on as well, asserted here to hit).

Uses the session-scoped ``engine`` fixture of ``tests/conftest.py``; the engines built here share its weights.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.prefix_cache import PrefixCache
from app.engine.types import DraftBlock, NewRequest, SamplingParams
from app.loop import SpecLoop
from tests.engine.near_tie import check_same_or_near_tie, check_seeded_same_or_near_tie

GREEDY = SamplingParams(max_tokens=10)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, seed=77)


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def test_match_finds_the_longest_shared_prefix_and_leaves_the_last_token_to_compute():
    cache = PrefixCache(num_slots=4)
    feats = torch.arange(12.0).reshape(6, 2)
    cache.store(1, ids(5, 6, 7, 8, 9, 10), feats)
    cache.store(2, ids(5, 6, 7), feats[:3])
    hit = cache.match(ids(5, 6, 7, 8, 1))
    assert (hit.slot, hit.length, hit.whole) == (1, 4, False) and torch.equal(hit.features, feats[:4])
    same = cache.match(ids(5, 6, 7, 8, 9, 10))  # the whole prompt matches: its last token is recomputed
    assert (same.slot, same.length, same.whole) == (1, 5, True)
    assert cache.match(ids(5, 6)).length == 1
    assert cache.match(ids(4, 6, 7)).slot == -1 and cache.match(ids(5)).length == 0
    tie = cache.match(ids(5, 6, 7, 2))  # slots 1 and 2 share 3 tokens: slot 2's record is all in the prompt
    assert (tie.slot, tie.length, tie.whole) == (2, 3, True)
    assert (cache.match(ids(5, 6, 9)).slot, cache.match(ids(5, 6, 9)).whole) == (1, False)  # a tie: lowest slot
    cache.store(1, ids(5, 9), feats[:2])  # the slot is given a shorter prompt: nothing of the old one is left
    assert (cache.match(ids(5, 6, 7, 8, 1)).slot, cache.match(ids(5, 6, 7, 8, 1)).length) == (2, 3)
    cache.forget(2)
    assert cache.match(ids(5, 6, 7, 8, 1)).length == 1
    cache.store(0, torch.arange(40), torch.zeros(40, 2))  # longer than any record so far: the table grows
    assert cache.match(torch.arange(50)).length == 40


def test_slots_are_given_out_least_recently_used_first():
    cache = PrefixCache(num_slots=4)
    for slot in (2, 0, 1):
        cache.store(slot, ids(slot, 9), torch.zeros(2, 2))
    assert cache.least_recent([0, 1, 2, 3]) == 3  # no record: nothing is lost
    assert cache.least_recent([0, 1, 2]) == 2  # stored first
    cache.touch(2)  # a hit reused it
    assert cache.least_recent([0, 1, 2]) == 0
    cache.forget(1)
    assert cache.least_recent([0, 1, 2]) == 1


def test_batch_invariant_mode_turns_prefix_caching_off_and_refuses_it():
    assert EngineConfig().prefix_caching and not EngineConfig(batch_invariant=True).prefix_caching
    assert not EngineConfig(enable_prefix_caching=False).prefix_caching
    with pytest.raises(ValidationError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, enable_prefix_caching=True)


@pytest.fixture
def engines(engine) -> tuple[TargetEngine, TargetEngine]:
    """The real target with prefix caching on and off (6 slots each, no record yet)."""
    config = dict(max_num_seqs=6, max_model_len=512)
    return (TargetEngine(EngineConfig(**config), loaded=engine.target),
            TargetEngine(EngineConfig(**config, enable_prefix_caching=False), loaded=engine.target))


def decode(engine: TargetEngine, requests: list[NewRequest]) -> dict[str, tuple[list[int], int]]:
    """Plain decoding of ``requests`` admitted in one batch: per request its token ids and cached prompt tokens."""
    firsts = engine.add_requests(requests)
    out = {f.request_id: (list(f.new_token_ids), f.num_cached_tokens) for f in firsts}
    live = [f.request_id for f in firsts if not f.finished]
    while live:
        steps = engine.verify([DraftBlock(rid, torch.zeros(0, dtype=torch.long)) for rid in live])
        for s in steps:
            out[s.request_id][0].extend(s.new_token_ids)
        live = [s.request_id for s in steps if not s.finished]
    return out


def chat(engine: TargetEngine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def test_prompts_sharing_prefixes_reuse_them_and_decode_as_without_the_cache(engines):
    on, off = engines
    a, b = chat(on, "Name three rivers in Europe."), chat(on, "Why is the sky blue? Answer briefly.")
    system = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the chat template's system prompt
    assert system > 10
    on.add_requests([NewRequest("b", b, SamplingParams(max_tokens=40, ignore_eos=True))])  # slot 0, kept running
    assert decode(on, [NewRequest("a", a, GREEDY)])["a"][1] == system  # slot 1, finished: its slot keeps "a"
    kept = {slot: [t.clone() for t in on.cache.slot_tokens(slot, n)] for slot, n in ((0, len(b)), (1, len(a)))}
    # "p" reuses all of "b" (running) and takes a slot no record is in, not "a"'s: b's keys/values are copied there;
    # "q" reuses all of "a" and takes its slot, with nothing to copy
    p, q = b + chat(on, "And at sunset?")[1:], a + [28]
    requests = [NewRequest("p", p, GREEDY), NewRequest("q", q, SEEDED)]
    got = decode(on, requests)
    assert (got["p"][1], got["q"][1]) == (len(b), len(a))
    for slot, n, donor in ((2, len(b), 0), (1, len(a), 1)):
        for before, after in zip(kept[donor], on.cache.slot_tokens(slot, n)):
            assert torch.equal(before, after)
    expected = decode(off, requests)
    assert (expected["p"][1], expected["q"][1]) == (0, 0)
    check_same_or_near_tie(on, p, expected["p"][0], got["p"][0])
    check_seeded_same_or_near_tie(on, q, expected["q"][0], got["q"][0], SEEDED)
    on.release("b")


def test_reused_keys_values_and_features_are_the_donors(engines):
    on, _ = engines
    prompt = chat(on, "What is the capital of France?")
    (first,) = on.add_requests([NewRequest("donor", prompt, SamplingParams(max_tokens=4, ignore_eos=True))])
    donor = on._requests["donor"].slot
    (second,) = on.add_requests([NewRequest("reuser", prompt + [28], SamplingParams(max_tokens=4))])
    reuser = on._requests["reuser"].slot
    n = len(prompt)
    assert second.num_cached_tokens == n and reuser != donor
    assert torch.equal(second.features[:n], first.features)
    for donor_kv, reuser_kv in zip(on.cache.slot_tokens(donor, n), on.cache.slot_tokens(reuser, n)):
        assert torch.equal(donor_kv, reuser_kv)
    on.release("donor")
    on.release("reuser")
    (third,) = on.add_requests([NewRequest("again", prompt + [28, 29], SamplingParams(max_tokens=4))])
    assert third.num_cached_tokens == n + 1 and on._requests["again"].slot == reuser  # the donor's free slot
    on.release("again")


def test_a_prompt_that_shares_part_of_a_record_leaves_it_and_takes_the_least_recently_used_slot(engines):
    on, _ = engines  # 6 slots
    questions = [chat(on, f"Question {i}: what is {i} plus {i}? Explain the sum.") for i in range(6)]
    decode(on, [NewRequest(f"r{i}", q, SamplingParams(max_tokens=1)) for i, q in enumerate(questions)])
    def record(q: list[int]):  # the record q + one token would reuse
        return on._prefix.match(torch.tensor(q + [28]))

    assert [record(q).slot for q in questions] == list(range(6))  # a record per slot, slot 0's stored first
    decode(on, [NewRequest("again", questions[0] + [28], SamplingParams(max_tokens=1))])  # all of record 0: its slot
    # shares only the chat template with every record: takes slot 1 (least recently used), copying what it reuses
    (other,) = on.add_requests([NewRequest("other", chat(on, "Name a colour."), SamplingParams(max_tokens=4))])
    assert 10 < other.num_cached_tokens < 30 and on._requests["other"].slot == 1
    assert [record(q).length for q in questions[2:]] == [len(q) for q in questions[2:]]  # the others are kept
    on.release("other")


def test_the_admission_budget_counts_only_the_tokens_a_prefill_computes(engines):
    on, off = engines
    prompt = chat(on, "Describe the water cycle in two sentences.")
    decode(on, [NewRequest("seen", prompt, SamplingParams(max_tokens=1))])  # a finished slot keeps the prompt
    waiting = [prompt + [28 + i] for i in range(4)]  # each computes its last token with the cache, all without
    assert [on.prefill_tokens(w) for w in waiting] == [1] * 4 and off.prefill_tokens(waiting[0]) == len(prompt) + 1
    assert on.prefill_tokens([28]) == 1 and on.prefill_tokens(chat(on, "Hi")) < len(chat(on, "Hi"))  # template
    budget = len(prompt) + 8
    assert SpecLoop(on, gamma=None, speculates=False, max_prefill_tokens=budget).admission_size(waiting) == 4
    assert SpecLoop(off, gamma=None, speculates=False, max_prefill_tokens=budget).admission_size(waiting) == 1
    firsts = on.add_requests([NewRequest(f"w{i}", w, GREEDY) for i, w in enumerate(waiting)])
    assert [f.num_cached_tokens for f in firsts] == [len(prompt)] * 4
    for f in firsts:
        if not f.finished:
            on.release(f.request_id)


def test_prompts_sharing_a_long_prefix_in_one_batch_are_admitted_in_two_forwards(engines):
    on, off = engines
    system = on.encode("You are a terse assistant. " * 12)  # ~70 tokens no record holds
    waiting = [system + on.encode(f" Question {i}: name a colour.") for i in range(4)]
    assert [on.prefill_tokens(w) for w in waiting] == [len(w) for w in waiting]
    loop, plain = (SpecLoop(e, gamma=None, speculates=False) for e in engines)
    assert plain.admission_size(waiting) == 4  # without the cache nothing is gained by waiting
    assert loop.admission_size(waiting) == 1
    (first,) = [out for _, out in loop.admit([NewRequest("w0", waiting[0], GREEDY)])]
    assert loop.admission_size(waiting[1:]) == 3
    rest = [out for _, out in loop.admit([NewRequest(f"w{i}", w, GREEDY) for i, w in enumerate(waiting) if i])]
    assert first.num_cached_tokens == 0 and all(r.num_cached_tokens >= len(system) for r in rest)
    for rid in ["w0", "w1", "w2", "w3"]:
        if loop.active.get(rid):
            loop.cancel(rid)


def test_sampled_distribution_tests_run_on_prefix_hits(engine32):
    """The float32 chi-square tests admit hundreds of copies of one prompt: all but the first wave's reuse it."""
    assert engine32.config.prefix_caching
    prompt = engine32.encode("The best fruit is")
    params = SamplingParams(max_tokens=1, temperature=1.0)
    firsts = engine32.add_requests([NewRequest(f"p{i}", prompt, params) for i in range(2)])
    again = engine32.add_requests([NewRequest(f"q{i}", prompt, params) for i in range(2)])
    assert [f.num_cached_tokens for f in firsts + again][2:] == [len(prompt) - 1] * 2


def test_an_extended_record_is_matched_through_its_answer():
    cache = PrefixCache(num_slots=2)
    cache.store(0, ids(5, 6, 7), torch.zeros(3, 2))
    cache.extend(0, ids(8, 9), torch.ones(2, 2))
    hit = cache.match(ids(5, 6, 7, 8, 9, 4))
    assert (hit.slot, hit.length, hit.whole) == (0, 5, True) and torch.equal(hit.features[3:], torch.ones(2, 2))
    with pytest.raises(ValueError, match="slot 1 holds no record"):
        cache.extend(1, ids(8), torch.ones(1, 2))
    with pytest.raises(ValueError, match="3 feature rows for 2 tokens"):
        cache.extend(0, ids(1, 2), torch.ones(3, 2))


def run(engine: TargetEngine, rid: str, prompt: list[int], params: SamplingParams, drafts: list[list[int]] = ()):
    """Decode one request, verifying ``drafts[i]`` in round i (none after the list); returns its outputs in order."""
    outputs = engine.add_requests([NewRequest(rid, prompt, params)])
    while not outputs[-1].finished:
        draft = drafts[len(outputs) - 1] if len(outputs) - 1 < len(drafts) else []
        outputs += engine.verify([DraftBlock(rid, torch.tensor(draft, dtype=torch.long))])
    return outputs


def test_the_next_turn_reuses_the_answer_and_decodes_as_without_the_cache(engines):
    on, off = engines
    turn = [{"role": "user", "content": "Name three rivers in Europe."}]
    first = run(on, "t1", on.encode_chat(turn), SamplingParams(max_tokens=12))
    answer = [t for out in first for t in out.new_token_ids]
    text = on.tokenizer.decode(answer, skip_special_tokens=True)
    turn += [{"role": "assistant", "content": text}, {"role": "user", "content": "And in Asia?"}]
    prompt = on.encode_chat(turn)
    p = len(on.encode_chat(turn[:1]))
    assert prompt[: p + len(answer)] == on.encode_chat(turn[:1]) + answer  # the template gives the answer back
    # every answer token but the last (committed, never run through the target) is in the slot, with its features
    second = run(on, "t2", prompt, GREEDY)
    assert second[0].num_cached_tokens == p + len(answer) - 1
    assert torch.equal(second[0].features[: p + len(answer) - 1], torch.cat([out.features for out in first]))
    got = [t for out in second for t in out.new_token_ids]
    expected = run(off, "t2", prompt, GREEDY)
    assert expected[0].num_cached_tokens == 0
    check_same_or_near_tie(on, prompt, [t for out in expected for t in out.new_token_ids], got)
    seeded = run(on, "t2-seeded", prompt, SEEDED)
    assert seeded[0].num_cached_tokens == len(prompt) - 1  # t2's prompt and answer are in the cache now
    check_seeded_same_or_near_tie(on, prompt, [t for out in run(off, "s", prompt, SEEDED) for t in out.new_token_ids],
                                  [t for out in seeded for t in out.new_token_ids], SEEDED)


def test_an_answer_cut_by_a_stop_inside_accepted_drafts_is_recorded_as_far_as_it_is_output(engine32):
    """Accepted drafts past a stop token are in the slot but not in the output: the record ends at the stop token,
    its keys/values and features those of a prefill of the same tokens (float32: within rounding)."""
    config = dict(dtype="float32", max_model_len=256)
    on = TargetEngine(EngineConfig(**config, max_num_seqs=2), loaded=engine32.target)
    off = TargetEngine(EngineConfig(**config, max_num_seqs=1, enable_prefix_caching=False), loaded=engine32.target)
    prompt = on.encode("The three largest cities of France are")
    reference = [t for out in run(off, "ref", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
                 for t in out.new_token_ids]
    stop = next(i for i in range(3, 8) if reference[i] not in reference[:i])
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[reference[stop]])
    outputs = run(on, "cut", prompt, params, drafts=[reference[1:8]])  # one round: 7 perfect drafts, cut at the stop
    assert [t for out in outputs for t in out.new_token_ids] == reference[: stop + 1]
    assert len(outputs) == 2 and outputs[1].num_accepted == stop  # the drafts after the stop were accepted too
    n = len(prompt) + stop + 1
    record = on._prefix.match(torch.tensor(prompt + reference[: stop + 1] + [28]))
    assert (record.length, record.whole) == (n, True)
    prefilled = run(off, "prefilled", prompt + reference[: stop + 1], SamplingParams(max_tokens=1))
    for kept, fresh in zip(on.cache.slot_tokens(record.slot, n), off.cache.slot_tokens(0, n)):
        torch.testing.assert_close(kept, fresh, atol=1e-4, rtol=1e-4)
    # hidden states reach ~2e4: another float32 summation order than the prefill's moved an element near 0 by 1.1e-4
    torch.testing.assert_close(record.features, prefilled[0].features, atol=1e-3, rtol=1e-4)
