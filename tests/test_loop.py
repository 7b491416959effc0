"""The decoding loop (app/loop.py) on the mock engine: the drafter's hooks as generate and the Target replica drive
them, verify lengths under a scheduler, prompt lookup chosen per request, cancel and fail-over."""

from __future__ import annotations

import pytest
import torch

from app.engine.errors import CapacityError, ContextLengthError
from app.engine.testing import MockEngine, MockEngineConfig, next_token
from app.engine.types import NewRequest, SamplingParams
from app.loop import DraftCall, DraftRound, DraftStart, ProposerHost, SpecLoop, generate
from app.scheduling.policies import make_policy
from app.scheduling.profile import load_profile
from app.scheduling.scheduler import VerifyScheduler
from app.serving.config import AppConfig
from app.serving.mock import MockProposer

GAMMA = 4


class HookLog(MockProposer):
    """The mock drafter, recording every hook call."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size, gamma=GAMMA)
        self.calls: list[tuple[str, str]] = []
        self.updated: dict[str, list[int]] = {}

    def start(self, request_id, prompt_ids, first):
        self.calls.append(("start", request_id))
        self.updated[request_id] = list(first.new_token_ids)
        super().start(request_id, prompt_ids, first)

    def update(self, outputs):
        for out in outputs:
            self.calls.append(("update", out.request_id))
            self.updated[out.request_id] += out.new_token_ids
        super().update(outputs)

    def propose(self, request_ids):
        self.calls.extend(("propose", rid) for rid in request_ids)
        return super().propose(request_ids)

    def finish(self, request_id):
        self.calls.append(("finish", request_id))
        super().finish(request_id)


class FlatRates:
    """A prompt-lookup acceptance table with one rate at every match length and position."""

    max_ngram = 3

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def confidences(self, n, length, mode, gamma):
        return torch.full((gamma,), self.rate) * (torch.arange(gamma) < length)


def mock_engine(**kw) -> MockEngine:
    return MockEngine(MockEngineConfig(max_draft_len=GAMMA, **kw))


def expected_tokens(last: int, n: int, vocab_size: int) -> list[int]:
    out = []
    for _ in range(n):
        last = next_token(last, vocab_size)
        out.append(last)
    return out


def test_generate_drives_the_hooks_as_a_drafter_replica_sees_them():
    """Each request starts before it is proposed, every committed token reaches the drafter (the last output too:
    training data records it), and each request finishes once, after its last update; the output is the rule's."""
    engine = mock_engine(max_num_seqs=2)
    log = HookLog(engine.vocab_size)
    prompts = [[5, 6], [9], [1, 2, 3]]
    results, stats = generate(engine, prompts, SamplingParams(max_tokens=10, ignore_eos=True), proposer=log)
    for prompt, res in zip(prompts, results):
        rid = res.request_id
        assert res.token_ids == expected_tokens(prompt[-1], 10, engine.vocab_size)
        assert log.updated[rid] == res.token_ids
        mine = [kind for kind, r in log.calls if r == rid]
        assert mine[0] == "start" and mine[-1] == "finish" and mine.count("finish") == 1
        assert mine[-2] == "update" and "propose" in mine
        assert res.rounds == len(res.accepted_per_round) and res.num_accepted == sum(res.accepted_per_round)
    assert stats.rounds > 0 and engine.num_active == 0 and not log._anchor


def test_a_refused_prompt_raises_and_leaves_no_request_in_the_engine():
    engine = mock_engine()
    with pytest.raises(ContextLengthError):
        generate(engine, [[1], [2] * 10_000, [3]], SamplingParams(max_tokens=4), proposer=HookLog(engine.vocab_size))
    assert engine.num_active == 0


def test_a_failed_round_raises_and_leaves_no_request_in_the_engine():
    """A drafter that fails mid-run: the call's requests are released by the engine and the drafter, and the engine
    serves the next call."""

    class FailsOnThirdPropose(HookLog):
        def propose(self, request_ids):
            if sum(kind == "propose" for kind, _ in self.calls) >= 2 * len(request_ids):
                raise RuntimeError("drafter failed")
            return super().propose(request_ids)

    engine = mock_engine(max_num_seqs=2)
    proposer = FailsOnThirdPropose(engine.vocab_size)
    with pytest.raises(RuntimeError, match="drafter failed"):
        generate(engine, [[1], [2], [3]], SamplingParams(max_tokens=12, ignore_eos=True), proposer=proposer)
    assert engine.num_active == 0 and not proposer._anchor  # the proposer holds no state of the call either
    results, _ = generate(engine, [[4], [5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [r.token_ids for r in results] == [expected_tokens(t, 3, engine.vocab_size) for t in (4, 5)]


def test_generate_refuses_to_wait_for_slots_that_other_callers_hold():
    engine = mock_engine(max_num_seqs=2)
    for rid in ("a", "b"):
        engine.add_request(rid, [1], SamplingParams(max_tokens=8))
    with pytest.raises(CapacityError, match="1 prompts wait for a KV cache slot, and the engine's 2 slots are held"):
        generate(engine, [[3]], SamplingParams(max_tokens=4))
    assert engine.num_active == 2


def test_a_request_ending_with_its_last_prefill_piece_frees_its_slot_for_the_next_prompt():
    """One slot, chunked prefill: the long prompt's last piece gives its only token and frees the slot while the
    short prompt waits; the short one is admitted then (not refused as if other callers held the slot)."""
    engine = mock_engine(max_num_seqs=1)
    results, _ = generate(engine, [list(range(1, 40)), [5]], SamplingParams(max_tokens=1), chunked_prefill=True,
                          max_prefill_tokens=16)
    assert [r.token_ids for r in results] == [expected_tokens(39, 1, engine.vocab_size),
                                              expected_tokens(5, 1, engine.vocab_size)]


def test_a_request_that_starts_and_finishes_within_one_call_is_never_started():
    engine = mock_engine()
    host = ProposerHost(HookLog(engine.vocab_size), gamma=GAMMA)
    (first,) = engine.add_requests([NewRequest("a", [3], SamplingParams(max_tokens=5))])
    reply = host.draft(DraftCall(starts=[DraftStart("a", [3], first, SamplingParams(max_tokens=5))],
                                 finished=["a"], propose=["a", "b"]))
    assert host.proposer.calls == [] and host.num_states == 0
    assert reply.blocks == [] and reply.missing == ["a", "b"] and reply.confidences.shape == (0, GAMMA)


def scheduler(policy: str) -> VerifyScheduler:
    config = AppConfig(mock_engine=True, drafter="mock", policy=policy, gamma=GAMMA)
    return VerifyScheduler(make_policy(policy), load_profile(config.profile_path()), max_batch=4, gamma=GAMMA)


def run(loop: SpecLoop, host: ProposerHost | None, prompts, params) -> list:
    records = [r for r, _ in loop.admit([NewRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])]
    while loop.active:
        ids = loop.speculating()
        drafted = host.draft(loop.take_call(ids)) if host is not None and loop.should_draft(ids) else None
        loop.step(drafted)
    return records


@pytest.mark.parametrize("policy", ["fixed-2", "dspark"])
def test_verify_lengths_follow_the_policy_and_stop_at_max_tokens(policy):
    engine = mock_engine()
    host = ProposerHost(MockProposer(vocab_size=engine.vocab_size, gamma=GAMMA), gamma=GAMMA)
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True, scheduler=scheduler(policy))
    records = run(loop, host, [[5], [8, 9]], SamplingParams(max_tokens=9, ignore_eos=True))
    for prompt, res in zip([[5], [8, 9]], records):
        assert res.token_ids == expected_tokens(prompt[-1], 9, engine.vocab_size)
        assert all(v <= (2 if policy == "fixed-2" else GAMMA) for v in res.verified_per_round)
        committed = 1  # the prefill's token
        for verified, accepted in zip(res.verified_per_round, res.accepted_per_round):
            assert verified <= 9 - committed - 1  # never a draft past max_tokens
            committed += accepted + 1
    assert sum(r.num_accepted for r in records) > 0


def test_cancel_frees_the_slot_and_tells_the_drafter_fail_over_stops_speculation():
    engine = mock_engine()
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True)
    loop.admit([NewRequest(rid, [4], SamplingParams(max_tokens=20)) for rid in ("a", "b", "c")])
    assert [s.request_id for s in loop.take_call().starts] == ["a", "b", "c"]
    assert loop.cancel("a").request_id == "a" and not engine.has_request("a")
    assert loop.fail_over(["b", "b", "zzz"], "timeout") == ["b"]
    assert loop.speculating() == ["c"] and loop.active["b"].fallback_cause == "timeout"
    assert loop.has_pending_finishes
    call = loop.take_call(["c"])
    assert call.finished == ["a"] and call.propose == ["c"] and not loop.has_pending_finishes
    out = loop.step(None)  # no drafter answer: nobody drafts, everybody commits a token
    assert [o.num_draft for o in out.outputs] == [0, 0] and out.committed == 2
    assert [o.request_id for o in loop.take_call().updates] == ["c"]  # b no longer speculates


def test_fail_over_drops_the_hooks_not_yet_sent_for_the_moved_requests():
    """A request moved to plain decoding before its start reached the drafter (the target backs off from a drafter
    that stopped answering) leaves nothing behind to send: its prompt features are not kept for a later call."""
    engine = mock_engine()
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True)
    loop.admit([NewRequest(rid, [4], SamplingParams(max_tokens=20)) for rid in ("a", "b")])
    loop.step(None)
    assert loop.fail_over(["a"], "drafter_backoff") == ["a"]
    call = loop.take_call()
    assert [s.request_id for s in call.starts] == ["b"] and [o.request_id for o in call.updates] == ["b"]
    assert call.finished == []  # the drafter never saw "a"


def test_lookup_draft_is_chosen_where_it_expects_more():
    """A request whose own context repeats drafts by prompt lookup when the drafter's block is weaker."""
    from app.drafters.lookup import PromptLookup

    engine = mock_engine()
    lookup = PromptLookup(FlatRates(0.99), GAMMA)
    proposer = MockProposer(vocab_size=engine.vocab_size, gamma=GAMMA, miss_at=0)  # every block wrong at once
    host = ProposerHost(proposer, gamma=GAMMA)
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True, lookup=lookup)
    cycle = expected_tokens(1, 6, engine.vocab_size)  # the prompt holds the continuation the rule produces
    (res,) = run(loop, host, [[1] + cycle + [1]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert res.token_ids == cycle
    assert res.lookup_rounds > 0 and res.num_accepted > 0 and lookup.num_states == 0


def test_a_drawn_drafter_block_is_weighed_against_lookup_from_its_first_confidence():
    """The same drafter confidences (0.5, 1, 1, 1) beat a lookup draft of 0.6 per position on a deterministic block,
    and lose to it on a block drawn from draft probabilities: that one is valued from c_1 alone (app/drafters/lookup.py:
    its later confidences depend on its own draws)."""
    from app.drafters.lookup import PromptLookup
    from app.engine.types import DraftBlock

    engine = mock_engine()
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True, lookup=PromptLookup(FlatRates(0.6), GAMMA))
    cycle = expected_tokens(1, 6, engine.vocab_size)
    loop.admit([NewRequest(rid, [1] + cycle + [1], SamplingParams(max_tokens=6, temperature=1.0))
                for rid in ("det", "drawn")])
    tokens = torch.tensor(expected_tokens(1, GAMMA, engine.vocab_size))
    q = torch.full((GAMMA, engine.vocab_size), 1.0 / engine.vocab_size)
    drafted = DraftRound([DraftBlock("det", tokens), DraftBlock("drawn", tokens, q)],
                         torch.tensor([[0.5, 1.0, 1.0, 1.0]] * 2))
    _, _, from_lookup = loop._choose(["det", "drawn"], drafted)
    assert from_lookup == {"drawn"}


def test_a_plain_round_verifies_no_draft_not_even_a_lookup_one():
    """``step(None, speculate=False)`` (the speculation guard's plain round) commits one token per request, keeps the
    lookup history and the drafter's updates current, and refuses a drafter answer."""
    from app.drafters.lookup import PromptLookup

    engine = mock_engine()
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True, lookup=PromptLookup(FlatRates(0.99), GAMMA))
    cycle = expected_tokens(1, 8, engine.vocab_size)
    ((record, _),) = loop.admit([NewRequest("r", [1] + cycle + [1], SamplingParams(max_tokens=8, ignore_eos=True))])
    loop.take_call()
    rounds = [loop.step(None, speculate=False) for _ in range(3)]
    assert [(r.committed, r.verified, r.lookup) for r in rounds] == [(1, 0, 0)] * 3
    assert len(loop.take_call(["r"]).updates) == 3  # the drafter still hears of every round
    assert loop.step(None).lookup == 1  # a speculative round drafts by lookup again at once
    with pytest.raises(ValueError, match="takes no drafter answer"):
        loop.step(DraftRound(blocks=[], confidences=torch.zeros(0, GAMMA)), speculate=False)
    assert record.token_ids == cycle  # plain and lookup rounds: the mock model's own sequence


def test_verify_lengths_are_priced_over_the_whole_step():
    """Only one of two requests has a draft (prompt lookup, no drafter call): the policy still sees both requests of
    the verify step (the other with nothing to verify), which of them sample, and that the drafter did not run."""
    from app.drafters.lookup import PromptLookup

    class Recording(VerifyScheduler):
        def schedule(self, **kw):
            calls.append(kw)
            return super().schedule(**kw)

    calls: list[dict] = []
    config = AppConfig(mock_engine=True, drafter="mock", policy="dspark", gamma=GAMMA)
    recording = Recording(make_policy("dspark"), load_profile(config.profile_path()), max_batch=4, gamma=GAMMA)
    engine = mock_engine()
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True, scheduler=recording,
                    lookup=PromptLookup(FlatRates(0.99), GAMMA))
    cycle = expected_tokens(1, 8, engine.vocab_size)
    loop.admit([NewRequest("rep", [1] + cycle + [1], SamplingParams(max_tokens=8, ignore_eos=True)),
                NewRequest("new", [7], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0))])
    loop.take_call()
    result = loop.step(None)
    assert result.lookup == 1
    (call,) = calls
    assert call["confidences"].shape == (2, GAMMA) and call["max_len"].tolist()[1] == 0
    assert call["sampled"].tolist() == [False, True] and call["with_draft"] is False
    assert result.sampled == (False, True)
    assert recording.profile.sampled_fraction(result.sampled, [o.num_draft for o in result.outputs]) == \
        pytest.approx(1 / (2 + result.verified))  # one sampled row of the step


def test_a_prompt_over_the_budget_is_prefilled_in_pieces_between_rounds():
    """Chunked prefill: the last prompt that passes ``max_prefill_tokens`` starts with what is left of the budget and
    goes on one budget per ``continue_prefill``; while requests run, one prefill forward between two rounds, turns
    alternating between admitting prompts that fit whole and the next piece (a second long prompt waits); the running
    request decodes between forwards; the long prompt's request starts on the drafter once, when it is done."""
    engine = mock_engine(max_model_len=1024)
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True, max_prefill_tokens=100, chunked_prefill=True)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert loop.admission_size([[7] * 60, [3] * 250, [5] * 10]) == 2  # 60 whole, then 40 of the 250
    first, second = loop.admit([NewRequest("a", [7] * 60, params), NewRequest("b", [3] * 250, params)])
    assert first[0].request_id == "a" and second is None and list(loop.prefilling) == ["b"]
    assert engine.has_request("b") and list(loop.active) == ["a"]
    assert loop.admission_size([[5] * 10]) == 0 and not loop.piece_due  # one prefill forward per round
    assert [s.request_id for s in loop.take_call().starts] == ["a"]
    waiting = [("c", [5] * 10), ("d", [6] * 150), ("e", [8] * 20)]
    forwards, done = [], None
    while loop.prefilling:
        loop.step(None)
        decoded = len(loop.active["a"].token_ids)
        if n := loop.admission_size([ids for _, ids in waiting]):
            loop.admit([NewRequest(rid, ids, params) for rid, ids in waiting[:n]])
            forwards.append(("admit", [rid for rid, _ in waiting[:n]], decoded))
            waiting = waiting[n:]
        if loop.piece_due:
            rid, done = loop.continue_prefill()
            forwards.append(("piece", rid, decoded))
    # c fits whole beside b's pieces; d (150 tokens, over the budget) waits for b; one forward a round
    assert [f[:2] for f in forwards] == [("admit", ["c"]), ("piece", "b"), ("piece", "b"), ("piece", "b")]
    assert [f[2] for f in forwards] == sorted({f[2] for f in forwards})
    record, out = done
    assert record.token_ids == out.new_token_ids == expected_tokens(3, 1, engine.vocab_size)
    assert list(loop.active) == ["a", "c", "b"]
    assert [s.request_id for s in loop.take_call().starts] == ["c", "b"]
    assert loop.admission_size([ids for _, ids in waiting]) == 0  # the piece was this round's forward
    loop.step(None)
    assert loop.admission_size([ids for _, ids in waiting]) == 1  # d now, its first piece the whole budget
    with pytest.raises(ValueError, match="no prompt"):
        loop.continue_prefill()


def test_a_request_cancelled_while_prefilled_in_pieces_frees_its_slot():
    engine = mock_engine(max_model_len=1024)
    loop = SpecLoop(engine, gamma=GAMMA, speculates=True, max_prefill_tokens=100, chunked_prefill=True)
    assert loop.admit([NewRequest("b", [3] * 250, SamplingParams(max_tokens=4))]) == [None]
    assert loop.cancel("b") is None
    assert not engine.has_request("b") and not loop.prefilling and not loop.take_call().starts
    assert loop.admission_size([[1] * 10]) == 1


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_generate_with_chunked_prefill_gives_the_same_results(budget):
    prompts = [[5] * 40, [9] * 3, [1, 2, 3] * 30, [4] * 200]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    whole, _ = generate(mock_engine(max_model_len=1024), prompts, params, proposer=HookLog(512))
    engine = mock_engine(max_model_len=1024)
    log = HookLog(engine.vocab_size)
    pieces, _ = generate(engine, prompts, params, proposer=log, max_prefill_tokens=budget, chunked_prefill=True)
    assert [r.token_ids for r in pieces] == [r.token_ids for r in whole]
    assert [r.request_id for r in pieces] == [r.request_id for r in whole]
    assert all(log.updated[r.request_id] == r.token_ids for r in pieces) and engine.num_active == 0


def test_generate_refuses_batch_limits_below_one_and_takes_a_stop_string_whole():
    """``max_batch=-1`` waited for ever (no request could start); ``stop="w5"`` was the stops "w" and "5"."""
    engine = mock_engine()
    for kwargs in ({"max_batch": -1}, {"max_batch": 0}, {"max_prefill_tokens": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be an integer >= 1"):
            generate(engine, [[3]], SamplingParams(max_tokens=4), **kwargs)
    assert SamplingParams(max_tokens=4, stop="three").stop == ("three",)
