"""The target replica's round loop, driven in-process (mock engine, colocated mock drafter), outside Ray Serve.

- All its torch work runs on its torch thread, including copying features for the drafter: a prompt's feature
  rows are enough for torch to start an OpenMP parallel region, and started on the event loop thread that gives
  the process a second OpenMP pool, which slows every later engine step (torch_thread.py).
- Drafting runs with ``drafter_threads`` torch threads, verify with ``torch_threads``.
- The drafter-call time the draft gate weighs comes from steady calls only, not from calls that also project
  a new prompt or catch up on rounds drafted without.
- Prompt lookup runs on the replica: it drafts in rounds whose gate skips the drafter, exactly (greedy output
  unchanged), and the gate does not learn from its drafts.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from ray import serve

from app.drafters.lookup import LookupRates, PromptLookup
from app.engine.testing import MockEngine, MockEngineConfig
from app.engine.types import DraftBlock, NewRequest, SamplingParams
from app.scheduling.guard import SpeculationGuard
from app.serving import drafter_client
from app.serving import target as target_module
from app.serving.channel import ChannelAddress
from app.serving.config import AppConfig
from app.serving.drafter import DrafterReplica
from app.loop import DraftCall, DraftRound, DraftStart
from app.serving.protocol import (
    DraftReplyTooLargeError, ErrorItem, GenerateRequest, TextChunk, call_bytes, check_reply, reply_bytes_bound,
)

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase


class _Router:
    """Stands in for the Router actor handle: accepts load reports."""

    class _Report:
        @staticmethod
        async def remote(load) -> None:
            return None

    report = _Report()


# the replicas' default config: the colocated mock drafter, dspark, gamma 4, 4 slots, vocabulary 512, 1 torch thread
MOCK_FIELDS = dict(mock_engine=True, drafter="mock", drafter_placement="colocated", policy="dspark", gamma=4,
                   max_model_len=256, max_num_seqs=4, mock_step_ms=1, mock_vocab_size=512, torch_threads=1)


def make_replica(monkeypatch, handle=None, **overrides) -> target_module.TargetReplica:
    """A target replica outside Serve on the mock engine; ``handle`` stands in for the Drafter deployment's handle,
    ``overrides`` replace fields of ``MOCK_FIELDS``."""
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="target-0")))
    return target_module.TargetReplica(AppConfig(**{**MOCK_FIELDS, **overrides}), drafter=handle, router=_Router())


@pytest.fixture
def replica(monkeypatch):
    return make_replica(monkeypatch)


def run_requests(replica, max_tokens: list[int], delays_s: list[float] | None = None) -> list[list]:
    """Send requests concurrently through ``replica.generate`` (request i after ``delays_s[i]`` seconds); returns
    each one's items. The replica's health check must pass at the end."""

    async def run(i: int, n: int, delay_s: float) -> list:
        await asyncio.sleep(delay_s)
        request = GenerateRequest(request_id=f"r{i}", messages=[{"role": "user", "content": "hi"}],
                                  params=SamplingParams(max_tokens=n, temperature=0.0))
        return [item async for item in replica.generate(request)]

    async def main() -> list[list]:
        try:
            delays = delays_s or [0.0] * len(max_tokens)
            results = await asyncio.wait_for(  # a dead step loop leaves requests waiting for ever
                asyncio.gather(*[run(i, n, d) for i, (n, d) in enumerate(zip(max_tokens, delays))]), timeout=30)
            replica.check_health()
            return results
        finally:
            for task in replica._tasks:
                task.cancel()

    return asyncio.run(main())


def num_tokens(items: list) -> int:
    assert all(isinstance(item, TextChunk) for item in items), items
    return sum(len(item.token_ids) for item in items)


def test_features_for_the_drafter_are_copied_on_the_torch_thread(replica, monkeypatch):
    threads = []
    strip = replica.loop.strip

    def recording_strip(out):
        threads.append(threading.current_thread().name)
        return strip(out)

    monkeypatch.setattr(replica.loop, "strip", recording_strip)

    results = run_requests(replica, [12, 12])
    assert [sum(len(chunk.token_ids) for chunk in items) for items in results] == [12, 12]
    assert replica.stats.drafted_rounds > 0, "the colocated drafter never ran"
    assert len(threads) >= 2 + replica.stats.rounds  # two prefills, then every output of every round
    assert {name.split("_")[0] for name in threads} == {"engine"}, set(threads)


def test_draft_gate_weighs_steady_drafter_calls_only(replica, monkeypatch):
    """Slow calls: the first, a second request's first (mid-way) and one catching up on two skipped rounds."""
    slow_ms, steady_ms = 150.0, 5.0
    draft, should_draft = replica.colocated.draft, replica.scheduler.should_draft
    estimates, rounds = [], iter(range(10**6))

    def timed_draft(call):
        estimates.append(replica.stats.draft_ms)  # the EMA after every earlier call
        rounds_behind = max((sum(u.request_id == rid for u in call.updates) for rid in call.propose), default=0)
        time.sleep((slow_ms if call.starts or rounds_behind > 1 else steady_ms) / 1000)
        return draft(call)

    def scripted_gate(requests, **kwargs):  # the gate closes for rounds 6 and 7, so round 8's call catches up
        should_draft(requests, **kwargs)
        return next(rounds) not in (6, 7)

    monkeypatch.setattr(replica.colocated, "draft", timed_draft)
    monkeypatch.setattr(replica.scheduler, "should_draft", scripted_gate)
    run_requests(replica, [80, 40], delays_s=[0.0, 0.15])
    assert replica.stats.drafted_rounds >= 8
    estimates.append(replica.stats.draft_ms)
    # any slow call counted would lift the EMA to >= 0.2 x 150 + 0.8 x 5 = 34 ms for at least one call; steady calls
    # measure a few ms above their 5 ms sleep on a loaded 2-core machine
    assert max(estimates) < 4 * steady_ms, estimates
    # the sleep is outside the drafter: every steady call waited >= 5 ms longer than the drafter worked
    assert replica.stats.draft_ms - replica.stats.drafter_ms >= steady_ms, replica.stats


def test_one_slow_drafter_call_does_not_keep_the_draft_gate_closed():
    """A steady call that waited seconds (a replica being replaced) lifts the estimate; a closed gate then makes only
    catch-up calls, which never move the EMA: a catch-up call faster than the estimate caps it."""
    stats = target_module.ReplicaStats()
    for ms in (10.0, 10.0, 4000.0):
        stats.drafted(ms, 5.0, steady=True)
    assert stats.draft_ms > 500
    stats.drafted(30.0, 5.0, steady=False)  # a probe after closed rounds: catches up, costs more than steady
    assert stats.draft_ms == 30.0
    stats.drafted(60.0, 5.0, steady=False)  # slower than the estimate: no evidence about a steady call
    assert stats.draft_ms == 30.0 and stats.drafted_rounds == 5


def test_prompt_lookup_drafts_in_rounds_that_skip_the_drafter(monkeypatch):
    """Vocabulary 16: the mock model's sequence from token 1 loops with period 4 (1, 10, 9, 2), so lookup matches
    once a loop has been committed; the gate stays closed, so every draft is a lookup draft."""
    rates = LookupRates({"greedy": [[0.95] * 4] * 3})
    monkeypatch.setattr(target_module, "make_prompt_lookup", lambda config: PromptLookup(rates, gamma=config.gamma))
    replica = make_replica(monkeypatch, mock_vocab_size=16)
    observed = []
    monkeypatch.setattr(replica.scheduler, "should_draft", lambda requests, **kwargs: False)
    monkeypatch.setattr(replica.scheduler, "observe", lambda *args: observed.append(args))
    draft, proposed = replica.colocated.draft, []
    monkeypatch.setattr(replica.colocated, "draft", lambda call: proposed.extend(call.propose) or draft(call))
    results = run_requests(replica, [40, 24])
    for items, n in zip(results, [40, 24]):
        tokens = [t for item in items for t in item.token_ids]
        expected = [10]
        while len(expected) < n:
            expected.append((7 * expected[-1] + 3) % 16)
        assert tokens == expected  # exactly plain decoding of the mock model
        spec = items[-1].spec
        assert spec.lookup_rounds > 0 and spec.accepted_tokens > 0 and spec.rounds < n - 1, spec
    assert proposed == [] and observed == []  # the drafter drafted nothing: nothing for the gate to learn
    assert replica.lookup.num_states == 0  # not debug_state(): it asks Ray for the node id, starting a local Ray


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(replica, monkeypatch):
    verify = replica.engine.verify
    calls = iter(range(10**6))

    def verify_failing_once(blocks):
        if next(calls) == 0:
            raise RuntimeError("injected verify failure")
        return verify(blocks)

    monkeypatch.setattr(replica.engine, "verify", verify_failing_once)
    first, later = run_requests(replica, [12, 12], delays_s=[0.0, 0.2])
    assert len(first) == 2 and isinstance(first[-1], ErrorItem) and first[-1].status == 500, first
    assert "injected verify failure" in first[-1].message
    assert num_tokens(later) == 12
    assert replica.engine.num_free_slots == replica.config.max_num_seqs and not replica._active


def test_a_failing_prefill_fails_that_request_only(replica, monkeypatch):
    add_requests, batches = replica.engine.add_requests, []

    def add_requests_failing_with_r0(requests):
        batches.append([r.request_id for r in requests])
        if "r0" in batches[-1]:
            raise ValueError("injected prefill failure")
        return add_requests(requests)

    monkeypatch.setattr(replica.engine, "add_requests", add_requests_failing_with_r0)
    failed, served = run_requests(replica, [12, 12])
    assert batches[-1] == ["r1"]  # r1 was admitted on its own after the failed batch (or after r0 alone)
    assert [type(item) for item in failed] == [ErrorItem] and failed[0].status == 500
    assert num_tokens(served) == 12


def test_messages_the_chat_template_refuses_answer_400_naming_messages(replica, monkeypatch):
    encode_chat, calls = replica.engine.encode_chat, []

    def refusing_the_first(messages, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise target_module.InvalidRequestError("the model's chat template refuses these messages", param="prompt")
        return encode_chat(messages, **kwargs)

    monkeypatch.setattr(replica.engine, "encode_chat", refusing_the_first)
    refused, served = run_requests(replica, [4, 4], delays_s=[0.0, 0.2])
    assert [(type(i), i.status, i.param) for i in refused] == [(ErrorItem, 400, "messages")], refused
    assert num_tokens(served) == 4  # the replica serves on


def test_text_prompts_are_tokenized_with_special_tokens_as_the_request_says(replica, monkeypatch):
    """``GenerateRequest.add_special_tokens`` (completions' default, vLLM's) reaches the tokenizer for a text prompt
    and a chat template's text; a token-id prompt is taken as sent."""
    seen, encode, encode_chat = [], replica.engine.encode, replica.engine.encode_chat
    monkeypatch.setattr(replica.engine, "encode", lambda text, **kw: seen.append(("text", kw)) or encode(text, **kw))
    monkeypatch.setattr(replica.engine, "encode_chat",
                        lambda messages, **kw: seen.append(("chat", kw)) or encode_chat(messages, **kw))
    params = SamplingParams(max_tokens=2)
    for request, first_call in ((GenerateRequest("a", params, prompt="hi", add_special_tokens=True), ("text", True)),
                                (GenerateRequest("b", params, messages=[{"role": "user", "content": "hi"}]),
                                 ("chat", False)),
                                (GenerateRequest("c", params, prompt=[5, 6], add_special_tokens=True), None)):
        seen.clear()
        replica._encode(request)
        assert (seen[0][0], seen[0][1]["add_special_tokens"]) == first_call if first_call else not seen


def test_truncate_prompt_tokens_keeps_the_last_tokens_before_the_context_is_checked(replica):
    """vLLM's ``truncate_prompt_tokens``: the last k prompt ids (-1: the context length); more than the context is a
    400 naming the field, and the context check sees the kept prompt."""
    limit = replica.config.max_model_len
    params = SamplingParams(max_tokens=2)
    long = list(range(3, 3 + limit + 5))
    assert replica._encode(GenerateRequest("a", params, prompt=[5, 6, 7], truncate_prompt_tokens=2))[1] == [6, 7]
    assert replica._encode(GenerateRequest("b", params, prompt=[5, 6], truncate_prompt_tokens=4))[1] == [5, 6]
    with pytest.raises(target_module.InvalidRequestError) as err:
        replica._encode(GenerateRequest("c", params, prompt=long))
    assert err.value.param == "prompt"
    assert replica._encode(GenerateRequest("d", params, prompt=long, truncate_prompt_tokens=limit - 2))[1] == \
        long[-(limit - 2):]
    with pytest.raises(target_module.InvalidRequestError) as err:
        replica._encode(GenerateRequest("e", params, prompt=[5], truncate_prompt_tokens=limit + 1))
    assert err.value.param == "truncate_prompt_tokens" and str(limit) in str(err.value)
    with pytest.raises(target_module.InvalidRequestError) as err:  # the whole context: no room left (as in vLLM)
        replica._encode(GenerateRequest("f", params, prompt=long, truncate_prompt_tokens=-1, max_tokens_default=True))
    assert err.value.param == "prompt" and f"prompt of {limit} tokens" in str(err.value)


def _stream(rid: str, max_tokens: int) -> target_module._Stream:
    request = GenerateRequest(request_id=rid, prompt="x", params=SamplingParams(max_tokens=max_tokens))
    return target_module._Stream(request=request, prompt_ids=[1, 2, 3], arrived_at=time.monotonic())


def _new(rid: str, max_tokens: int) -> NewRequest:
    return NewRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def test_requests_admitted_together_share_one_prefill_and_a_bad_one_fails_alone(replica, monkeypatch):
    add_requests, batches = replica.engine.add_requests, []

    def recording(requests):
        batches.append([r.request_id for r in requests])
        return add_requests(requests)

    monkeypatch.setattr(replica.engine, "add_requests", recording)
    good = replica._torch.call(replica.loop.admit, [_new("a", 8), _new("b", 8)])
    assert batches == [["a", "b"]] and [first.request_id for _, first in good] == ["a", "b"]
    mixed = replica._torch.call(replica.loop.admit, [_new("c", 8), _new("long", 10**4), _new("d", 8)])
    assert batches[1:] == [["c", "long", "d"], ["c"], ["long"], ["d"]]
    assert isinstance(mixed[1], target_module.ContextLengthError)
    assert [mixed[0][1].request_id, mixed[2][1].request_id] == ["c", "d"]
    assert {"a", "b", "c", "d"} == {rid for rid in "abcd" if replica.engine.has_request(rid)}


def test_requests_over_the_context_are_answered_before_queuing_and_never_split_a_prefill(replica, monkeypatch):
    """Over-long requests arriving with others get their 400 (``context_length_exceeded``, ``param`` max_tokens) at
    once; the others are admitted in one batched prefill that does not fail."""
    add_requests, batches = replica.engine.add_requests, []

    def recording(requests):
        batches.append(sorted(r.request_id for r in requests))
        return add_requests(requests)

    monkeypatch.setattr(replica.engine, "add_requests", recording)
    admit = replica._admit

    async def admit_once_both_valid_ones_wait() -> None:  # they arrive together, whatever the thread timing
        while not batches and len(replica._waiting) < 2:
            await asyncio.sleep(0.001)
        await admit()

    monkeypatch.setattr(replica, "_admit", admit_once_both_valid_ones_wait)
    limit = replica.config.max_model_len
    items = run_requests(replica, [8, limit, 8, limit * 2])
    for bad in (items[1], items[3]):
        assert [(type(i), i.status, i.code, i.param) for i in bad] == [
            (ErrorItem, 400, "context_length_exceeded", "max_tokens")], bad
    assert num_tokens(items[0]) == num_tokens(items[2]) == 8
    assert batches == [["r0", "r2"]]


def test_an_admission_error_answers_400_naming_the_engines_field(replica):
    stream = _stream("bad-bias", 8)
    replica._admitted(stream, target_module.InvalidRequestError("logit_bias: token ids [99999] are outside [0, 512)",
                                                                param="logit_bias"))
    item = stream.queue.get_nowait()
    assert stream.done and (item.status, item.param) == (400, "logit_bias") and "99999" in item.message


def test_requests_the_engine_has_no_slot_for_go_back_to_the_front_of_the_queue_in_order(replica, monkeypatch):
    monkeypatch.setattr(replica.loop, "admit",
                        lambda requests: [target_module.CapacityError("no slot")] * len(requests))
    replica._waiting.extend([_stream("a", 8), _stream("b", 8), _stream("c", 8)])
    asyncio.run(replica._admit())
    assert [s.request.request_id for s in replica._waiting] == ["a", "b", "c"] and not replica._active
    assert replica.telemetry.counters.queue_s.count == 0  # still waiting: no queue time yet


def test_finished_requests_are_counted_with_those_that_reached_max_tokens(replica):
    (items,) = run_requests(replica, [4])
    assert items[-1].finish_reason == "length"
    assert (replica.telemetry.counters.requests_finished, replica.telemetry.counters.requests_length) == (1, 1)
    assert replica.telemetry.counters.queue_s.count == replica.telemetry.counters.e2e_s.count == 1


def test_health_check_fails_once_the_step_loop_stopped(replica):
    assert num_tokens(run_requests(replica, [4])[0]) == 4  # cancels the loop at the end
    with pytest.raises(RuntimeError, match="_loop stopped: cancelled"):
        replica.check_health()


def test_a_replica_started_by_serve_reports_its_load_before_its_first_request(monkeypatch):
    # The Router chooses only among replicas that reported: one the autoscaler adds must report while still idle.
    reports = []

    class Router:
        class _Report:
            @staticmethod
            async def remote(load) -> None:
                reports.append(load)

        report = _Report()

    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="target-new")))

    async def main() -> None:  # Serve runs a replica's constructor on the replica's event loop
        replica = target_module.TargetReplica(AppConfig(**MOCK_FIELDS, stats_interval_s=0.05), drafter=None,
                                              router=Router())
        try:
            await asyncio.sleep(0.2)
            replica.check_health()
        finally:
            for task in replica._tasks:
                task.cancel()

    asyncio.run(main())
    assert len(reports) >= 2 and {(r.replica_id, r.active, r.waiting) for r in reports} == {("target-new", 0, 0)}


def test_a_stuck_step_fails_the_health_check_and_stops_load_reports_until_it_moves(monkeypatch):
    """A step that never returns (a hung kernel, a deadlock) leaves the step loop alive: the health check must see the
    torch thread stuck, so Serve replaces the replica, and the Router must stop hearing from it."""
    reports, release = [], threading.Event()

    class Router:
        class _Report:
            @staticmethod
            async def remote(load) -> None:
                reports.append(time.monotonic())

        report = _Report()

    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="target-0")))

    async def main() -> None:
        config = AppConfig(**MOCK_FIELDS, stats_interval_s=0.02).model_copy(update={"step_timeout_s": 0.3})
        replica = target_module.TargetReplica(config, drafter=None, router=Router())  # (a floor of 1 s in YAML)
        verify = replica.engine.verify
        monkeypatch.setattr(replica.engine, "verify", lambda blocks: release.wait(10) and verify(blocks))
        request = GenerateRequest(request_id="r0", messages=[{"role": "user", "content": "hi"}],
                                  params=SamplingParams(max_tokens=4, temperature=0.0))
        stream = asyncio.ensure_future(_items(replica.generate(request)))
        try:
            await asyncio.sleep(0.2)
            replica.check_health()  # slow, not yet stuck
            await asyncio.sleep(0.4)
            stuck = r"engine thread has been in one call for \d+\.\d s \(step_timeout_s 0.3\)"
            with pytest.raises(RuntimeError, match=stuck):
                replica.check_health()
            stuck_at = time.monotonic()
            await asyncio.sleep(0.2)
            assert not [t for t in reports if t > stuck_at]
            release.set()
            assert num_tokens(await asyncio.wait_for(stream, 10)) == 4
            replica.check_health()
            await asyncio.sleep(0.1)
            assert [t for t in reports if t > stuck_at]  # reports again once it moves
        finally:
            release.set()
            for task in replica._tasks:
                task.cancel()

    asyncio.run(main())


async def _items(stream) -> list:
    return [item async for item in stream]


def test_drafting_runs_with_drafter_threads_and_verify_with_torch_threads(monkeypatch):
    replica = make_replica(monkeypatch, torch_threads=2, drafter_threads=1, draft_gate=False)
    seen = {"propose": set(), "verify": set()}
    propose, verify = replica.colocated.proposer.propose, replica.engine.verify

    def recording(name, fn):
        def wrapped(*args):
            seen[name].add(torch.get_num_threads())
            return fn(*args)
        return wrapped

    monkeypatch.setattr(replica.colocated.proposer, "propose", recording("propose", propose))
    monkeypatch.setattr(replica.engine, "verify", recording("verify", verify))
    assert [num_tokens(items) for items in run_requests(replica, [12, 12])] == [12, 12]
    assert seen == {"propose": {1}, "verify": {2}}, seen


class _VirtualClock:
    """Stands in for ``time`` in the target module: a round lasts what the mocks say its verify step and drafter call
    cost, not what a shared machine's wall clock says (a one-second stall among the few plain rounds a guard test
    measures decided it)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def perf_counter(self) -> float:
        self.now_s += 1e-6  # strictly increasing: a round's time is > 0 (the guard refuses 0)
        return self.now_s

    def spend(self, ms: float) -> None:
        self.now_s += ms / 1000


def _virtual_time(monkeypatch, replica, *, step_ms: float) -> _VirtualClock:
    """Times ``replica``'s rounds on a virtual clock on which each verify step costs ``step_ms``."""
    clock, verify = _VirtualClock(), replica.engine.verify

    def timed(blocks):
        clock.spend(step_ms)
        return verify(blocks)

    monkeypatch.setattr(target_module, "time", clock)
    monkeypatch.setattr(replica.engine, "verify", timed)
    return clock


def test_the_speculation_guard_runs_plain_where_drafting_is_slower_and_output_is_unchanged(monkeypatch):
    """A drafter call of 150 ms against a 1 ms verify step: speculative rounds commit fewer tokens per ms than plain
    ones, whatever they accept, so the guard pauses speculation (probing it now and then); the text is plain
    decoding's either way."""
    replica = make_replica(monkeypatch, draft_gate=False)
    assert isinstance(replica.guard, SpeculationGuard)  # round time in the profile's plain steps of each batch
    assert replica.guard.step_ms(3) == float(replica.scheduler.profile.verify_time_ms(3, batch=3)) > 0
    replica.guard = SpeculationGuard(probe_every=8, min_samples=4)  # decides within these short requests
    plain = make_replica(monkeypatch, policy="none")
    draft, calls, clock = replica.colocated.draft, [], _virtual_time(monkeypatch, replica, step_ms=1)

    def slow_draft(call):
        calls.append(len(call.propose))
        clock.spend(150)
        return draft(call)

    monkeypatch.setattr(replica.colocated, "draft", slow_draft)
    # one request: the guard decides per batch size, and two requests admitted in different rounds on a loaded
    # machine end at different rounds, leaving a tail of batch-1 rounds that the guard has not judged yet
    results, expected = run_requests(replica, [240]), run_requests(plain, [240])
    for items, reference in zip(results, expected):
        assert [t for item in items for t in item.token_ids] == [t for item in reference for t in item.token_ids]
    state = replica.guard.state()[1]
    assert state["paused"] and state["plain_rate"] > state["spec_rate"], state
    assert replica.guard.plain_rounds > replica.stats.rounds / 2, (replica.guard.plain_rounds, replica.stats.rounds)
    assert replica.telemetry.counters.guard_plain_rounds == replica.guard.plain_rounds  # GET /metrics counts them
    assert 1 <= len(calls) < replica.stats.rounds / 2
    assert plain.guard is None and make_replica(monkeypatch, speculation_guard=False).guard is None


def test_the_speculation_guard_counts_the_catch_up_calls_after_a_closed_gate(monkeypatch):
    """The draft gate opens every other round and each call then catches up on the round drafted without, at 20 ms
    against a 1 ms step: every drafter call is a catch-up, none is steady, yet they are what speculation costs here;
    the guard weighs them and pauses."""
    replica = make_replica(monkeypatch)
    replica.guard = SpeculationGuard(probe_every=8, min_samples=4)  # decides within these short requests
    draft, should_draft = replica.colocated.draft, replica.scheduler.should_draft
    rounds, behind, clock = iter(range(10**6)), [], _virtual_time(monkeypatch, replica, step_ms=1)

    def catching_up(call):
        behind.append(max((sum(u.request_id == rid for u in call.updates) for rid in call.propose), default=0))
        clock.spend(20)
        return draft(call)

    def alternating_gate(requests, **kwargs):
        should_draft(requests, **kwargs)
        return next(rounds) % 2 == 0

    monkeypatch.setattr(replica.colocated, "draft", catching_up)
    monkeypatch.setattr(replica.scheduler, "should_draft", alternating_gate)
    run_requests(replica, [240, 240])
    assert sum(n > 1 for n in behind) >= len(behind) // 2  # calls carried a skipped round's context
    state = replica.guard.state()[2]
    assert state["paused"] and state["plain_rate"] > state["spec_rate"], state
    assert replica.guard.plain_rounds > replica.stats.rounds / 2, (replica.guard.plain_rounds, replica.stats.rounds)


def test_the_speculation_guard_keeps_drafting_that_pays(monkeypatch):
    """A verify step of 20 ms and a free drafter whose blocks are all accepted: speculation commits up to 5 tokens
    a round, and the guard leaves it on but for its rare plain probes."""
    replica = make_replica(monkeypatch, draft_gate=False, mock_step_ms=20)
    _virtual_time(monkeypatch, replica, step_ms=20)
    results = run_requests(replica, [120])
    assert num_tokens(results[0]) == 120 and results[0][-1].spec.accepted_tokens > 60
    state = replica.guard.state()[1]
    assert not state["paused"] and state["spec_rate"] > state["plain_rate"], state
    assert replica.guard.plain_rounds <= 3 and replica.stats.drafted_rounds >= replica.stats.rounds - 3


class _UnwrappedFailingDrafter:
    """Stands in for the Drafter handle over Serve's gRPC data plane, where the drafter's own exception reaches the
    caller as itself (over Ray's default transport it arrives wrapped in a ``RayTaskError``)."""

    def __init__(self) -> None:
        self.draft, self.calls, self.cancelled = self, 0, 0

    def options(self, _by_reference: bool) -> "_UnwrappedFailingDrafter":
        return self  # fails either way

    def remote(self, call, replica_key=None):
        self.calls += 1
        drafter = self

        class _Response:
            def __await__(self):
                raise RuntimeError("drafter failure")
                yield  # a generator: awaiting it raises

            def cancel(self) -> None:
                drafter.cancelled += 1

        return _Response()


def test_a_drafter_exception_that_arrives_unwrapped_falls_back_to_plain_decoding(monkeypatch):
    drafter = _UnwrappedFailingDrafter()
    replica = make_replica(monkeypatch, drafter, drafter_placement="separate", drafter_channel=False)
    plain = make_replica(monkeypatch, drafter_placement="separate", policy="none")
    (items,), (expected,) = run_requests(replica, [12]), run_requests(plain, [12])
    assert num_tokens(items) == 12 and items[-1].spec.fallback  # served, by plain decoding
    assert items[-1].spec.fallback_cause == "drafter_error"
    assert [t for item in items for t in item.token_ids] == [t for item in expected for t in item.token_ids]
    assert drafter.calls >= 1 and drafter.cancelled == drafter.calls
    assert replica.stats.drafter_failures == 1 and replica.stats.fallbacks == {"drafter_error": 1}
    load = replica.load()  # what the Router hears (its drafter_failures gauge, GET /metrics)
    assert load.counters.fallbacks == {"drafter_error": 1} and load.drafter_failures == 1


class _InProcessDrafter:
    """Stands in for the Drafter handle: an in-process ``DrafterReplica`` serves the calls, over the handle or its
    channel; ``calls`` records each call through the handle: its transport (``options(_by_reference=...)``), its size
    bound and its answer's."""

    def __init__(self, config: AppConfig) -> None:
        self.replica, self.calls, self.by_reference, self.draft = DrafterReplica(config), [], False, self
        self.channel = SimpleNamespace(remote=lambda replica_key=None: self._answer("channel", replica_key))
        self.ping = SimpleNamespace(remote=lambda replica_key=None: self._answer("ping", replica_key))

    def _answer(self, method: str, replica_key: str | None) -> asyncio.Future:
        return asyncio.ensure_future(getattr(self.replica, method)(replica_key))

    def options(self, _by_reference: bool) -> "_InProcessDrafter":
        clone = copy.copy(self)
        clone.by_reference, clone.draft = _by_reference, clone
        return clone

    def remote(self, call, replica_key=None) -> asyncio.Future:
        self.calls.append((self.by_reference, call_bytes(call), reply_bytes_bound(len(call.propose), 4)))
        return asyncio.ensure_future(self.replica.draft(call))


def _separate_drafter(monkeypatch, **overrides) -> _InProcessDrafter:
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="drafter-0")))
    return _InProcessDrafter(AppConfig(**{**MOCK_FIELDS, "drafter_placement": "separate", **overrides}))


def _token_ids(results: list[list]) -> list[list[int]]:
    return [[t for item in items for t in item.token_ids] for items in results]


class _RestartingDrafter(_InProcessDrafter):
    """An in-process Drafter handle whose replica answers nothing, calls nor probes, until ``up_at``
    (``time.monotonic()``), like a replica being replaced; ``hung`` counts the calls and the probes that got none."""

    def __init__(self, config: AppConfig, up_at: float) -> None:
        super().__init__(config)
        self.up_at, self.hung = up_at, {"draft": 0, "channel": 0, "ping": 0}

    def _down(self, method: str) -> asyncio.Future | None:
        if time.monotonic() >= self.up_at:
            return None
        self.hung[method] += 1
        return asyncio.get_running_loop().create_future()  # never answered

    def remote(self, call, replica_key=None) -> asyncio.Future:
        return self._down("draft") or super().remote(call, replica_key)

    def _answer(self, method: str, replica_key: str | None) -> asyncio.Future:
        return self._down(method) or super()._answer(method, replica_key)


@pytest.mark.parametrize("channel", [False, True])
def test_a_drafter_that_stops_answering_is_backed_off_and_probed_until_it_answers(monkeypatch, channel):
    """One call waits out the timeout; requests that arrive while the replica does not answer decode plain at once
    (``drafter_backoff``) instead of each stalling the batch for a timeout; once a probe gets an answer, new requests
    speculate again. Output is plain decoding's throughout. Over the channel, the first call's ask for the channel's
    path is what goes unanswered."""
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="drafter-0")))
    monkeypatch.setattr(drafter_client, "PROBE_FIRST_S", 0.05)
    monkeypatch.setattr(drafter_client, "PROBE_MAX_S", 0.1)
    config = AppConfig(**{**MOCK_FIELDS, "drafter_placement": "separate"})
    drafter = _RestartingDrafter(config, up_at=time.monotonic() + 1.0)
    replica = make_replica(monkeypatch, drafter, drafter_placement="separate", drafter_timeout_s=0.3,
                           drafter_channel=channel)
    plain = make_replica(monkeypatch, drafter_placement="separate", policy="none")
    lengths, delays = [40, 8, 8, 8, 12], [0.0, 0.4, 0.5, 0.6, 2.0]
    results, expected = run_requests(replica, lengths, delays), run_requests(plain, lengths)
    assert _token_ids(results) == _token_ids(expected)
    causes = [items[-1].spec.fallback_cause for items in results]
    assert causes == ["timeout", "drafter_backoff", "drafter_backoff", "drafter_backoff", None], causes
    assert replica.stats.fallbacks == {"timeout": 1, "drafter_backoff": 3}
    hung = drafter.hung["channel" if channel else "draft"]
    assert hung == 1 and 1 <= drafter.hung["ping"] <= 4, drafter.hung  # not a call per request
    assert replica.drafter.reachable and results[-1][-1].spec.accepted_tokens > 0
    assert replica.drafter.transport == ("channel" if channel else "handle")
    assert (drafter.calls == []) == channel  # over the channel, no draft call goes through the handle


def test_a_drafter_replica_drops_the_state_of_a_target_it_no_longer_hears_from(monkeypatch):
    """A target that dies cannot send the finishes of its requests: their state would stay on the Drafter replica for
    good. Past ``drafter_state_ttl_s`` without a call or probe from that target, it is dropped, and only its."""
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="drafter-0")))
    drafter = DrafterReplica(AppConfig(**{**MOCK_FIELDS, "drafter_placement": "separate"}, drafter_state_ttl_s=0.5))
    engine = MockEngine(MockEngineConfig(max_num_seqs=8))
    params = SamplingParams(max_tokens=8)

    def starts(*ids: str) -> list[DraftStart]:
        firsts = engine.add_requests([NewRequest(rid, [3], params) for rid in ids])
        return [DraftStart(rid, [3], first, params) for rid, first in zip(ids, firsts)]

    async def main() -> None:
        await drafter.draft(DraftCall(starts=starts("a1", "a2", "a3")), replica_key="target:a")
        await drafter.draft(DraftCall(starts=starts("b1", "b2"), finished=[]), replica_key="target:b")
        await drafter.draft(DraftCall(finished=["a3"]), replica_key="target:a")
        assert drafter.core.num_states == 4
        await asyncio.sleep(0.3)
        assert await drafter.ping(replica_key="target:b") == 4  # b is heard from; a not for 0.3 s
        await asyncio.sleep(0.3)
        await drafter.draft(DraftCall(propose=["b1"]), replica_key="target:b")  # a: silent for 0.6 s
        assert drafter.core.num_states == 2 and drafter.core.host._live == {"b1", "b2"}

    asyncio.run(main())


def test_drafter_calls_whose_message_or_answer_may_be_large_go_by_reference(monkeypatch):
    """Over Serve's gRPC data plane a message past 4 MiB fails, in either direction: a long prompt's features alone
    are 6 MB on SmolLM2, and an answer's size grows with the requests it drafts."""
    drafter = _separate_drafter(monkeypatch)
    # the answer for two drafted requests passes the bound, for one it does not (the mock's calls are tiny)
    limit = reply_bytes_bound(1, 4) * 3 // 2
    monkeypatch.setattr(drafter_client, "BY_REFERENCE_BYTES", limit)
    replica = make_replica(monkeypatch, drafter, drafter_placement="separate", drafter_channel=False)
    plain = make_replica(monkeypatch, drafter_placement="separate", policy="none")
    results, expected = run_requests(replica, [16, 6]), run_requests(plain, [16, 6])
    assert _token_ids(results) == _token_ids(expected)
    assert replica.stats.drafter_failures == 0 and replica.stats.drafted_rounds > 0
    assert all(by_ref == (size > limit or answer > limit) for by_ref, size, answer in drafter.calls), drafter.calls
    assert {by_ref for by_ref, _, _ in drafter.calls} == {True, False}, drafter.calls
    assert replica.stats.by_reference_calls == sum(by_ref for by_ref, _, _ in drafter.calls)


@pytest.mark.parametrize("channel", [False, True])
def test_an_answer_over_its_bound_is_refused_and_counted_by_cause(monkeypatch, channel):
    """A proposer sending dense [K, V] draft probabilities breaks the answer's bound: the Drafter replica refuses to
    send it, and the target moves the requests to plain decoding under the cause ``reply_too_large``, whether the
    refusal comes through the handle or the channel."""
    drafter = _separate_drafter(monkeypatch)
    propose = drafter.replica.core.proposer.propose

    def dense(request_ids):
        return [replace(b, probs=torch.full((b.tokens.shape[0], 50_000), 2e-5)) for b in propose(request_ids)]

    monkeypatch.setattr(drafter.replica.core.proposer, "propose", dense)
    replica = make_replica(monkeypatch, drafter, drafter_placement="separate", drafter_channel=channel)
    (items,) = run_requests(replica, [10])
    assert num_tokens(items) == 10 and items[-1].spec.fallback_cause == "reply_too_large"
    assert replica.stats.fallbacks == {"reply_too_large": 1}
    with pytest.raises(DraftReplyTooLargeError, match="exceeds its bound"):
        check_reply(DraftRound(blocks=[DraftBlock("x", torch.zeros(4, dtype=torch.long), torch.ones(4, 49152))],
                               confidences=torch.ones(1, 4)), gamma=4)


def test_drafter_calls_go_over_the_replicas_channel_and_one_that_closes_is_reopened(monkeypatch):
    """With ``drafter_channel`` the handle only answers where the channel listens: every draft call goes over the
    Unix socket. The Drafter replica going away mid-request (its connections close) fails that request over as
    ``drafter_unavailable``; after the backoff's probe, the next request speculates over a new channel."""
    monkeypatch.setattr(drafter_client, "PROBE_FIRST_S", 0.05)
    drafter = _separate_drafter(monkeypatch)
    server, calls = drafter.replica._channel, []
    handler = server._handler

    async def closing(call, replica_key):
        calls.append(call)
        if len(calls) == 3:
            server.close()  # the replica going away: listener and connections with it
        return await handler(call, replica_key)

    server._handler = closing
    replica = make_replica(monkeypatch, drafter, drafter_placement="separate")
    plain = make_replica(monkeypatch, drafter_placement="separate", policy="none")
    results, expected = run_requests(replica, [40, 16], [0.0, 1.0]), run_requests(plain, [40, 16])
    assert _token_ids(results) == _token_ids(expected)
    assert [items[-1].spec.fallback_cause for items in results] == ["drafter_unavailable", None]
    assert results[1][-1].spec.accepted_tokens > 0 and len(calls) > 3
    assert drafter.calls == [] and replica.drafter.transport == "channel" and replica.drafter.reachable
    assert server.path is not None  # listening again, on a new path
    assert "r0" not in drafter.replica.core.host._live  # applied before the channel closed, dropped by a later call


def _failed(err: Exception) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(err)
    return future


@pytest.mark.parametrize("answer", ["other_node", "cannot_open"])
def test_a_drafter_channel_out_of_reach_leaves_the_calls_to_the_handle(monkeypatch, caplog, answer):
    """A Drafter replica on another node (its socket is not reachable from here), or one that could not open a
    channel (an OSError making the socket, or a replica without ``channel`` mid-upgrade): the target says why once and
    sends its calls through Serve's handle, with no request failing over."""
    drafter = _separate_drafter(monkeypatch)
    drafter.channel = SimpleNamespace(remote=lambda replica_key=None: (
        _resolved(ChannelAddress(node_id="another-node", path="/nonexistent/channel.sock")) if answer == "other_node"
        else _failed(OSError(98, "AF_UNIX path too long"))))
    replica = make_replica(monkeypatch, drafter, drafter_placement="separate")
    plain = make_replica(monkeypatch, drafter_placement="separate", policy="none")
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        results, expected = run_requests(replica, [24, 24]), run_requests(plain, [24, 24])
    assert _token_ids(results) == _token_ids(expected) and replica.stats.fallbacks == {}
    assert replica.drafter.transport == "handle" and drafter.calls and replica.stats.drafted_rounds > 0
    said = [r.getMessage() for r in caplog.records if "drafter calls go through Serve's handle" in r.getMessage()]
    assert len(said) == 1 and ("another-node" if answer == "other_node" else "path too long") in said[0], said


def test_a_stale_channel_path_on_this_node_backs_off_and_asks_again(monkeypatch):
    """Nothing listens at the path a replica of this node gave (it stopped since): that call fails over as
    ``drafter_unavailable`` and the target backs off; after the probe, the next ask gets a live channel."""
    monkeypatch.setattr(drafter_client, "PROBE_FIRST_S", 0.05)
    drafter = _separate_drafter(monkeypatch)
    asks = []

    def channel(replica_key=None):
        asks.append(replica_key)
        if len(asks) == 1:
            return _resolved(ChannelAddress(node_id=None, path="/nonexistent/channel.sock"))
        return drafter._answer("channel", replica_key)

    drafter.channel = SimpleNamespace(remote=channel)
    replica = make_replica(monkeypatch, drafter, drafter_placement="separate")
    plain = make_replica(monkeypatch, drafter_placement="separate", policy="none")
    results, expected = run_requests(replica, [16, 16], [0.0, 0.5]), run_requests(plain, [16, 16])
    assert _token_ids(results) == _token_ids(expected)
    assert [items[-1].spec.fallback_cause for items in results] == ["drafter_unavailable", None]
    assert len(asks) == 2 and drafter.calls == [] and results[1][-1].spec.accepted_tokens > 0


def _resolved(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


@pytest.mark.parametrize("policy", ["none", "dspark"])
def test_stream_interval_gathers_tokens_but_never_delays_the_first_or_the_last(monkeypatch, policy):
    """The same text as one chunk a round; the first chunk holds the first token alone, every later chunk but the
    last at least ``stream_interval`` tokens, and the last carries the finish reason and spec stats."""
    plain = run_requests(make_replica(monkeypatch, policy=policy), [17, 5])
    gathered = run_requests(make_replica(monkeypatch, policy=policy, stream_interval=6), [17, 5])
    for items, reference in zip(gathered, plain):
        assert [t for i in items for t in i.token_ids] == [t for i in reference for t in i.token_ids]
        assert "".join(i.text for i in items) == "".join(i.text for i in reference)
        assert len(items[0].token_ids) == 1 and all(len(i.token_ids) >= 6 for i in items[1:-1])
        assert items[-1].finish_reason == "length" and items[-1].spec is not None
        assert all(i.finish_reason is None and i.spec is None for i in items[:-1])
    assert len(gathered[0]) < len(plain[0])


def _chat(rid: str, content: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, messages=[{"role": "user", "content": content}],
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_a_long_prompt_is_prefilled_in_pieces_while_the_others_decode(monkeypatch):
    """Chunked prefill (on by default): a 151-token prompt over a 40-token budget arrives while a request decodes; it
    is prefilled in pieces with a round of the running request between any two, and both answers are those of a
    replica that prefills it whole. Counted as running while prefilled."""

    def serve_pair(replica) -> tuple[list, list]:
        async def collect(request, delay_s: float) -> list:
            await asyncio.sleep(delay_s)
            return [item async for item in replica.generate(request)]

        async def main():
            try:
                return await asyncio.wait_for(asyncio.gather(
                    collect(_chat("short", "hi", 120), 0.0), collect(_chat("long", "x" * 150, 20), 0.05)), timeout=30)
            finally:
                for task in replica._tasks:
                    task.cancel()

        return asyncio.run(main())

    chunked = make_replica(monkeypatch, max_prefill_tokens=40, mock_step_ms=5)
    states, decoded = [], []
    continue_prefill = chunked.loop.continue_prefill

    def recording():
        # debug_state's counts, not debug_state(): it asks Ray for the node id, starting a local Ray
        states.append((len(chunked._prefilling), chunked._running, chunked.engine.num_active))
        decoded.append(len(chunked.loop.active["short"].token_ids))
        return continue_prefill()

    monkeypatch.setattr(chunked.loop, "continue_prefill", recording)
    got = serve_pair(chunked)
    whole = serve_pair(make_replica(monkeypatch, max_prefill_tokens=40, mock_step_ms=5, enable_chunked_prefill=False))
    assert len(decoded) == 3  # 40 tokens at admission, then 40, 40, 31
    assert all(a < b for a, b in zip(decoded, decoded[1:])), decoded  # rounds between the pieces
    assert all(state == (1, 2, 2) for state in states), states
    for items, reference in zip(got, whole):
        assert [t for i in items for t in i.token_ids] == [t for i in reference for t in i.token_ids]
        assert items[-1].finish_reason == "length"
    assert num_tokens(got[0]) == 120 and num_tokens(got[1]) == 20


def test_a_request_that_goes_away_while_prefilled_in_pieces_frees_its_slot(monkeypatch):
    replica = make_replica(monkeypatch, max_prefill_tokens=40, mock_step_ms=5)
    continue_prefill, piece = replica.loop.continue_prefill, asyncio.Event()

    def signalling():
        piece.set()
        return continue_prefill()

    monkeypatch.setattr(replica.loop, "continue_prefill", signalling)

    async def main():
        try:
            short = asyncio.create_task(_collect(replica, _chat("short", "hi", 100)))
            await asyncio.sleep(0.05)
            long = asyncio.create_task(_collect(replica, _chat("long", "x" * 150, 20)))
            await asyncio.wait_for(piece.wait(), timeout=10)
            long.cancel()  # the client goes away while its prompt is prefilled
            items = await asyncio.wait_for(short, timeout=30)
            replica.check_health()
            # debug_state's counts, not debug_state(): it asks Ray for the node id, starting a local Ray
            return items, (len(replica._prefilling), len(replica._active), replica.engine.num_active)
        finally:
            for task in replica._tasks:
                task.cancel()

    items, state = asyncio.run(main())
    assert num_tokens(items) == 100
    assert state == (0, 0, 0), state
    assert not replica.loop.prefilling and replica.engine.num_free_slots == replica.engine.max_num_seqs
    assert replica.telemetry.counters.requests_cancelled == 1  # dspark_requests_cancelled_total


async def _collect(replica, request) -> list:
    return [item async for item in replica.generate(request)]


def test_a_request_that_goes_away_while_its_prompt_waits_to_be_tokenized_is_counted_as_cancelled(monkeypatch):
    """Tokenizing waits for the engine thread, busy for hundreds of ms with a long prefill under load: a client that
    leaves then never reaches the queue, and it is still a request cancelled (dspark_requests_cancelled_total,
    vllm:request_success_total{finished_reason="abort"})."""
    replica = make_replica(monkeypatch)
    encode, encoding, release = replica._encode, threading.Event(), threading.Event()

    def slow_encode(request):
        encoding.set()
        release.wait(10)  # on the torch thread, until the client has gone
        return encode(request)

    monkeypatch.setattr(replica, "_encode", slow_encode)

    async def main():
        try:
            gone = asyncio.create_task(_collect(replica, _chat("gone", "hi", 5)))
            await asyncio.to_thread(encoding.wait, 10)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert replica.telemetry.counters.requests_cancelled == 1  # counted before it could reach the queue
            release.set()
            return await asyncio.wait_for(_collect(replica, _chat("next", "hi", 5)), timeout=30)
        finally:
            for task in replica._tasks:
                task.cancel()

    assert num_tokens(asyncio.run(main())) == 5
    assert replica.telemetry.counters.requests_cancelled == 1 and not replica._waiting


def test_a_request_waiting_while_the_last_piece_of_a_prompt_ends_its_request_is_admitted(monkeypatch):
    """A prompt prefilled in pieces whose request ends with its first token (max_tokens 1: a log-likelihood request)
    leaves nothing running, with a request queued while its last piece ran: that one is admitted next (it failed
    with a 500 as if a slot were lost)."""
    replica = make_replica(monkeypatch, max_prefill_tokens=40, mock_step_ms=5)
    admit, first_piece = replica.loop.admit, threading.Event()

    def slow_first_piece(requests):
        first_piece.set()
        time.sleep(0.2)  # on the torch thread: the next request arrives meanwhile, queued behind the last piece
        return admit(requests)

    monkeypatch.setattr(replica.loop, "admit", slow_first_piece)

    async def main():
        try:
            long = asyncio.create_task(_collect(replica, _chat("long", "x" * 59, 1)))  # 60 tokens: pieces 40, 20
            await asyncio.to_thread(first_piece.wait, 10)
            later = await asyncio.wait_for(_collect(replica, _chat("later", "hi", 5)), timeout=30)
            return await long, later
        finally:
            for task in replica._tasks:
                task.cancel()

    long, later = asyncio.run(main())
    assert num_tokens(long) == 1 and num_tokens(later) == 5


def test_waiting_requests_fail_when_every_slot_is_lost(replica):
    """Slots held with nothing running (a bug would leave them so): the waiting requests get a 500 naming it, not a
    wait for ever."""
    engine = replica.engine
    engine.add_requests([NewRequest(f"leaked-{i}", [5], SamplingParams(max_tokens=9)) for i in range(4)])
    assert engine.num_free_slots == 0
    (items,) = run_requests(replica, [3])
    assert len(items) == 1 and items[0].status == 500 and "no free KV slot with no request running" in items[0].message


def test_an_echoed_prompt_s_text_and_the_characters_each_token_brings():
    """``target.prompt_text``: the real tokenizer's prompt decoded incrementally, special tokens kept, a character
    split over several tokens counted once (by the token that ends it)."""
    from transformers import AutoTokenizer

    from app.engine.loader import local_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(local_checkpoint()))
    text = "Paris \U0001F31F \u6771\u4eac ok<|im_end|>x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded, lens = target_module.prompt_text(tokenizer, ids)
    assert decoded == text and sum(lens) == len(text) and len(lens) == len(ids)
    assert 0 in lens and max(lens) == len("<|im_end|>")


def test_an_echoed_text_prompt_s_offsets_leave_out_the_special_tokens_the_tokenizer_added():
    """A Llama tokenizer adds a BOS to a text prompt: its text is in the decoded prompt but not in the echoed text
    (the prompt as sent), so it brings no characters there, and every token's offset indexes the echo."""
    from transformers import AutoTokenizer

    from app.engine.loader import local_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(local_checkpoint()))
    prompt = "Paris \U0001F31F ok"
    bos, eos = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    for ids in ([bos] + tokenizer.encode(prompt), [bos] + tokenizer.encode(prompt) + [eos]):
        decoded, lens = target_module.prompt_text(tokenizer, ids)
        fitted = target_module.lens_within(decoded, lens, prompt)
        assert fitted[0] == 0 and sum(fitted) == len(prompt) and fitted[1:-1] == lens[1:-1]
    decoded, lens = target_module.prompt_text(tokenizer, tokenizer.encode(prompt))
    assert target_module.lens_within(decoded, lens, prompt) == lens  # nothing added: as they are
    assert target_module.lens_within("<s>s", [3, 1], "s") == [0, 1]  # the prompt inside the BOS's text
    assert target_module.lens_within("<s>s</s>", [3, 1, 4], "s") == [0, 1, 0]  # at token boundaries
    assert target_module.lens_within("<s> Hi", [3, 3], "Hi") == [0, 2]  # a SentencePiece BOS's space


def test_a_request_the_engine_ends_with_an_error_answers_a_500_naming_why(replica):
    """``FinishReason.ERROR`` (the engine ended that request alone: its grammar failed) reaches the client as a JSON
    500 with the engine's reason, after any text held back for the stream interval."""
    from app.engine.types import FinishReason, StepOutput

    stream = _stream("e", 8)
    stream.held = TextChunk(text="{", token_ids=[5], prompt_tokens=3)  # the stream interval held a token back
    finished = replica.telemetry.counters.requests_finished
    replica._emit(stream, StepOutput("e", [2], finished=True, finish_reason=FinishReason.ERROR, text="",
                                     text_lens=[0], error="structured output stopped: ParserTooComplex"))
    assert stream.queue.get_nowait() == stream.held
    item = stream.queue.get_nowait()
    assert isinstance(item, ErrorItem) and (item.status, item.code) == (500, "request_failed") and stream.done
    assert "ParserTooComplex" in item.message and stream.queue.empty()
    assert replica.telemetry.counters.requests_finished == finished  # not counted as a finished request


def test_prompt_logprobs_without_echo_leave_the_prompt_text_undecoded(replica, monkeypatch):
    """Scored prompt tokens need the prompt's text (each token's characters in it) only when the response echoes the
    prompt: vLLM's ``prompt_logprobs`` alone give each token's own text, without decoding the whole prompt."""
    from app.engine.types import StepOutput, TokenLogprob
    from app.loop import RequestResult

    decoded = []
    prompt_text = target_module.prompt_text
    monkeypatch.setattr(target_module, "prompt_text", lambda *a: decoded.append(1) or prompt_text(*a))
    scored = [None, TokenLogprob(2, -1.0, rank=1), TokenLogprob(3, -2.0, rank=4)]
    for echo, decodes in (("no", 0), ("tokens", 1)):
        stream = _stream("p", 8)
        stream.request, stream.record = replace(stream.request, echo=echo), RequestResult("p", token_ids=[4])
        decoded.clear()
        replica._emit(stream, StepOutput("p", [4], text=" w4", text_lens=[3], prompt_logprobs=scored))
        chunk = stream.queue.get_nowait()
        assert len(decoded) == decodes and [e.token_id for e in chunk.prompt_logprobs] == [1, 2, 3]
        assert all((e.text_len is None) == (echo == "no") for e in chunk.prompt_logprobs)


def test_priority_scheduling_queues_lower_priorities_first(monkeypatch):
    """``scheduling_policy: priority`` (vLLM's): a queued request goes ahead of those of a higher priority value,
    behind those of its own (arrival order among equals); ``fcfs``: arrival order whatever the priority."""
    for policy, order in (("fcfs", ["a", "b", "c", "d", "e"]), ("priority", ["d", "b", "e", "a", "c"])):
        replica = make_replica(monkeypatch, scheduling_policy=policy)
        for rid, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
            request = GenerateRequest(rid, SamplingParams(max_tokens=2), prompt="x", priority=priority)
            replica._enqueue(target_module._Stream(request=request, prompt_ids=[1], arrived_at=0.0))
        assert [s.request.request_id for s in replica._waiting] == order, policy


def test_a_request_queued_ahead_while_a_batch_is_sized_waits_for_the_next_admission(monkeypatch):
    """Priority scheduling puts an arriving request at the front of the queue, even while the loop sizes an admission
    batch on the torch thread: the batch admitted is the one sized (not the new front); the newcomer comes after."""
    replica = make_replica(monkeypatch, scheduling_policy="priority")

    def stream(rid: str, priority: int) -> target_module._Stream:
        request = GenerateRequest(rid, SamplingParams(max_tokens=2), prompt="x", priority=priority)
        return target_module._Stream(request=request, prompt_ids=[1, 2, 3], arrived_at=0.0)

    for rid in ("a", "b"):
        replica._enqueue(stream(rid, 0))
    late, size, admit, admitted = stream("late", -5), replica.loop.admission_size, replica.loop.admit, []

    def sizing(prompts, params):
        if late.request.request_id not in [s.request.request_id for s in replica._waiting] and not admitted:
            replica._enqueue(late)  # arrives while the first batch is sized
        return size(prompts, params=params)

    def admitting(requests):
        admitted.append([r.request_id for r in requests])
        return admit(requests)

    monkeypatch.setattr(replica.loop, "admission_size", sizing)
    monkeypatch.setattr(replica.loop, "admit", admitting)
    asyncio.run(replica._admit_waiting())
    assert admitted[0] == ["a", "b"] and ["late"] in admitted + [[s.request.request_id for s in replica._waiting]]
