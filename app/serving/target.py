"""The Target deployment: one engine, a continuous-batching step loop, one drafter call and one verify per round.

Owns: the replica's waiting queue (bounded: beyond ``max_queued_requests`` a request answers 503), admission between
rounds (requests admitted together share one batched prefill into free KV slots), the round (drafter call when the
draft gate is open -> per request the drafter's block or the prompt-lookup draft, whichever expects more accepted
tokens -> verify-length policy over the whole batch -> one ragged verify; the drafter is a Drafter replica or, with
``drafter_placement: colocated``, a ``DrafterCore`` on this replica's torch thread), prompt lookup
(``prompt_lookup``: it runs here, on the tokens this replica commits, so it drafts in every round, also those that
skip the drafter), streaming each request's committed text back, cancellation (a client that goes away frees its KV
slot at once and its drafter state with the next drafter call), drafter fail-over (a failed or slow drafter call
moves the affected requests to plain decoding for the rest of their life, counted in ``drafter_failures``; the call
itself, its transport and its failure causes are ``drafter_client.py``'s) and load reports to the Router, off the
per-token path.

The engine is built and driven on one dedicated thread (``TorchThread``: it is not thread-safe, and torch work
spread over several threads is slower, see ``torch_thread.py``), so the replica's event loop stays free to
accept requests and stream chunks while a round runs. Errors reach the ingress as ``ErrorItem`` values.

Shape symbols: B requests in the round, K block size (gamma).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import ray
import torch
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from app.drafters.lookup import PromptLookup, prefer_lookup, read_lookup_rates
from app.engine.admission import prefill_batch_size
from app.engine.contract import Engine
from app.engine.errors import CapacityError, ContextLengthError, InvalidRequestError
from app.engine.types import DraftBlock, NewRequest, StepOutput, TokenLogprob
from app.scheduling.policies import make_policy
from app.scheduling.profile import ThroughputProfile, load_profile
from app.scheduling.scheduler import VerifyScheduler
from app.serving.config import AppConfig
from app.serving.profiles import serving_profile
from app.serving.drafter import DrafterCore
from app.serving.drafter_client import (
    DRAFTER_FAILURES, ColocatedDrafterError, DrafterClient, RemoteDrafterError, fallback_cause,
)
from app.serving.protocol import (
    DraftCall, DraftRound, DraftStart, ErrorItem, GenerateRequest, SpecStats, TextChunk, TokenLogprobText,
    strip_for_drafter,
)
from app.serving.router import TargetLoad
from app.serving.telemetry import TargetTelemetry
from app.serving.torch_thread import TorchThread, thread_cpu_ms

log = logging.getLogger("ray.serve")

STATS_EMA = 0.2  # weight of the newest round in the step-time / tokens / acceptance EMAs


def _ema(new: float, old: float, *, seed_with_first: bool = True) -> float:
    """STATS_EMA-weighted average; the first figure (``old`` still 0) is taken as it is when ``seed_with_first``."""
    return new if seed_with_first and not old else STATS_EMA * new + (1 - STATS_EMA) * old


@dataclass
class ReplicaStats:
    """The replica's running figures, kept once: the Router's load report, the draft gate's inputs and
    ``debug_state`` all read them here (Prometheus counts the same events in ``TargetTelemetry``)."""

    step_ms: float = 0.0  # EMA of one round (draft + verify), ms
    tokens_per_step: float = 0.0  # EMA of tokens committed per round, whole batch
    acceptance: float = 0.0  # EMA of accepted / verified draft tokens, over rounds that verified any
    rounds: int = 0
    drafted_rounds: int = 0  # rounds that called the drafter
    draft_ms: float = 0.0  # EMA of a steady drafter call as the target waits for it, ms (0: none yet)
    drafter_ms: float = 0.0  # EMA of the time inside the drafter in those calls, ms
    verify_scale: float = 1.0  # EMA of a round's time without the drafter call over the profile's verify time
    drafter_failures: int = 0  # requests failed over to plain decoding since start
    fallbacks: dict[str, int] = field(default_factory=dict)  # cause -> requests failed over
    by_reference_calls: int = 0  # drafter calls whose payload went through the object store

    def round(self, step_ms: float, *, committed: int, verified: int, accepted: int) -> None:
        """Count one round: its time, the tokens it committed, the drafts it verified and accepted."""
        self.step_ms = _ema(step_ms, self.step_ms)
        self.tokens_per_step = _ema(committed, self.tokens_per_step, seed_with_first=False)
        self.rounds += 1
        if verified:
            self.acceptance = _ema(accepted / verified, self.acceptance, seed_with_first=False)

    def drafted(self, draft_ms: float, drafter_ms: float, *, steady: bool) -> None:
        """Count a round that called the drafter; only a steady call (``TargetReplica._round``) moves the EMAs."""
        self.drafted_rounds += 1
        if steady:
            self.draft_ms, self.drafter_ms = _ema(draft_ms, self.draft_ms), _ema(drafter_ms, self.drafter_ms)

    def failed_over(self, cause: str, requests: int) -> bool:
        """Count ``requests`` moved to plain decoding for ``cause``; True the first time that cause is seen."""
        first = cause not in self.fallbacks
        self.drafter_failures += requests
        self.fallbacks[cause] = self.fallbacks.get(cause, 0) + requests
        return first


def logprob_texts(tokenizer, logprobs: list[TokenLogprob] | None) -> list[TokenLogprobText] | None:
    """The engine's logprobs with each token (and alternative) decoded alone by ``tokenizer.decode``."""
    if logprobs is None:
        return None

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return [TokenLogprobText(text(lp.token_id), lp.logprob, tuple((text(t), v) for t, v in lp.top))
            for lp in logprobs]


def internal_error(err: Exception) -> ErrorItem:
    """The 500 answer of a request that a bug in this replica ended."""
    return ErrorItem(500, f"internal error: {type(err).__name__}: {err}", type="server_error", code="internal_error")


def make_prompt_lookup(config: AppConfig) -> PromptLookup | None:
    """Prompt lookup with the checkpoint's acceptance table when ``prompt_lookup`` applies (drafter 'dspark').

    Raises:
        FileNotFoundError / ValueError: no checkpoint, or one without a lookup table (``AppConfig.check_files``).
    """
    if config.drafter != "dspark" or not config.prompt_lookup:
        return None
    config.check_files()
    return PromptLookup(read_lookup_rates(config.drafter_checkpoint), gamma=config.gamma)


def make_engine(config: AppConfig) -> Engine:
    """The target engine of ``config``: the mock, or the real engine (``AppConfig.engine_config``: a trained drafter's
    checkpoint names the feature layers the engine returns)."""
    if config.mock_engine:
        from app.engine.testing import MockEngine, MockEngineConfig

        return MockEngine(MockEngineConfig(
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs, max_draft_len=config.gamma,
            vocab_size=config.mock_vocab_size, step_ms=config.mock_step_ms, fails_after=config.mock_verify_fails_after,
        ))
    from app.engine.engine import TargetEngine

    return TargetEngine(config.engine_config())


@dataclass
class _Stream:
    """One request on this replica."""

    request: GenerateRequest
    prompt_ids: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    on_drafter: bool = False  # it speculates: its state lives on the drafter (and in the prompt lookup)
    done: bool = False
    held: TextChunk | None = None  # committed output not sent yet (``stream_interval``)


class TargetReplica:
    """The Target deployment class (bound undecorated by ``builder.py``)."""

    def __init__(self, config: AppConfig, drafter, router) -> None:
        self.config = config
        self._torch = TorchThread("engine", config.torch_threads)
        self.engine = self._torch.call(make_engine, config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.speculates = config.speculates  # turned off for good if a colocated drafter cannot drop its state
        self.stats = ReplicaStats()
        colocated = self._torch.call(self._colocated_drafter, config) \
            if self.speculates and config.drafter_placement == "colocated" else None
        self.drafter = DrafterClient(
            handle=drafter if self.speculates and colocated is None else None, colocated=colocated,
            run=self._run, replica_id=self.replica_id, gamma=config.gamma, timeout_s=config.drafter_timeout_s,
            stats=self.stats,
        ) if self.speculates else None
        self.lookup = self._torch.call(make_prompt_lookup, config) if self.speculates else None
        self.router = router
        self.policy = make_policy(config.policy)
        self.scheduler = VerifyScheduler(
            self.policy, self._torch.call(self._profile, config), max_batch=config.max_num_seqs, gamma=config.gamma,
            draft_gate=config.draft_gate,
        ) if self.speculates else None
        self.telemetry = TargetTelemetry(slo=config.autoscaling, policy=config.policy, replica=self.replica_id,
                                         gamma=config.gamma, max_num_seqs=config.max_num_seqs)
        self._waiting: collections.deque[_Stream] = collections.deque()
        self._active: dict[str, _Stream] = {}
        self._cancelled: set[str] = set()
        self._draft_starts: list[DraftStart] = []
        self._draft_updates: list[StepOutput] = []
        self._draft_finished: list[str] = []
        self._drafted_last_round = False
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def colocated(self) -> DrafterCore | None:
        """The drafter on this replica's torch thread (``drafter_placement: colocated``), else None."""
        return self.drafter.colocated if self.drafter is not None else None

    def _profile(self, config: AppConfig) -> ThroughputProfile:
        """The profile to schedule with (runs on the torch thread: it may time the engine, ``profiles.py``)."""
        if config.mock_engine:
            return load_profile(config.profile_path())
        return serving_profile(config, self.engine)

    def _colocated_drafter(self, config: AppConfig) -> DrafterCore:
        """The colocated drafter, sharing the engine's input embedding (runs on the torch thread)."""
        return DrafterCore(config, replica=self.replica_id, embed_weight=self.engine.input_embeddings)

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest, replica_key: str | None = None) -> AsyncIterator:
        """Stream ``TextChunk``s for ``request`` (or one ``ErrorItem``); ``replica_key`` only steers routing."""
        self._ensure_running()
        try:
            prompt_ids = await self._run(self._encode, request)
        except InvalidRequestError as err:
            yield ErrorItem(400, str(err), param="messages" if request.messages is not None else "prompt")
            return
        if len(self._waiting) + len(self._active) >= self.config.max_num_seqs + self.config.max_queued_requests:
            yield ErrorItem(503, f"server overloaded: {len(self._active)} requests running and {len(self._waiting)} "
                            f"queued on this replica (limit {self.config.max_num_seqs} + "
                            f"{self.config.max_queued_requests} queued)", type="server_overloaded", code="overloaded")
            return
        stream = _Stream(request=request, prompt_ids=prompt_ids)
        self._waiting.append(stream)
        self._wakeup.set()
        try:
            while True:
                item = await stream.queue.get()
                yield item
                if isinstance(item, ErrorItem) or item.finish_reason is not None:
                    return
        finally:
            if not stream.done:  # client went away (or the ingress cancelled): free its state next round
                self._cancelled.add(request.request_id)
                self._wakeup.set()

    def _encode(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            return self.engine.encode_chat(request.messages)
        return self.engine.encode(request.prompt)

    def debug_state(self) -> dict:
        """Counts of held request state (leak checks and the autoscaler)."""
        return {"active": len(self._active), "waiting": len(self._waiting), "engine_active": self.engine.num_active,
                "colocated_drafter_states": None if self.colocated is None else self.colocated.num_states,
                "lookup_states": None if self.lookup is None else self.lookup.num_states,
                "cancelled_pending": len(self._cancelled), "node_id": ray.get_runtime_context().get_node_id(),
                **dataclasses.asdict(self.stats)}

    def record_autoscaling_stats(self) -> dict:
        """Custom autoscaling metrics (Ray Serve polls this; used by the autoscaling policy)."""
        return {"active": float(len(self._active)), "waiting": float(len(self._waiting)),
                "step_ms": self.stats.step_ms,
                **self.telemetry.autoscaling_stats(active=len(self._active), queued=len(self._waiting))}

    # ------------------------------------------------------------------ loop

    def _ensure_running(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
            # started by the first request: an empty context, or Serve's request context (its id) sticks to every
            # later round and load report
            self._tasks = [asyncio.create_task(self._loop(), context=contextvars.Context()),
                           asyncio.create_task(self._report_loop(), context=contextvars.Context())]

    async def _run(self, fn, *args):
        return await self._torch.run(fn, *args)

    async def _loop(self) -> None:
        while True:
            if not (self._waiting or self._active or self._cancelled or self._draft_finished):
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                await self._drop_cancelled()
                await self._admit()
                if self._active:
                    await self._round()
                elif self._draft_finished and self.speculates:
                    await self._call_drafter([])  # tell the drafter to forget cancelled requests
                elif self._waiting:  # nothing running, yet no slot free: the engine lost track of a slot
                    err = RuntimeError(f"no free KV slot with no request running ({len(self._waiting)} waiting)")
                    log.error("target step loop: %s; failing the waiting requests", err)
                    waiting, self._waiting = list(self._waiting), collections.deque()
                    await self._fail(waiting, err)
            except Exception as err:  # a bug must cost the requests it touched, not the replica's step loop
                log.exception("target step loop: unexpected error; failing the running requests")
                await self._fail(list(self._active.values()), err)

    async def _fail(self, streams: list[_Stream], err: Exception) -> None:
        """End these requests with a 500 error and free their state (the step loop goes on)."""
        for stream in streams:
            self._active.pop(stream.request.request_id, None)
        for stream in streams:
            stream.queue.put_nowait(internal_error(err))
            try:
                await self._free(stream)
            except Exception:
                log.exception("could not release request %s", stream.request.request_id)

    async def _free(self, stream: _Stream) -> None:
        """Forget a request that ended early (already out of ``_active``): its KV slot now, its drafter state with
        the next drafter call."""
        rid = stream.request.request_id
        stream.done = True
        self.telemetry.dropped(rid)
        if stream.on_drafter:
            self._draft_finished.append(rid)
            self._forget_lookup(rid)
        if self.engine.has_request(rid):
            await self._run(self.engine.release, rid)

    def check_health(self) -> None:
        """Serve's health check: unhealthy (the replica is replaced) once the step loop or load reports stopped.

        Raises:
            RuntimeError: a background task ended.
        """
        for task in self._tasks:
            if task.done():
                cause = "cancelled" if task.cancelled() else repr(task.exception())
                raise RuntimeError(f"target background task {task.get_coro().__name__} stopped: {cause}")

    async def _drop_cancelled(self) -> None:
        for rid in list(self._cancelled):
            self._cancelled.discard(rid)
            stream = self._active.pop(rid, None)
            if stream is None:
                self.telemetry.dropped(rid)
                self._waiting = collections.deque(s for s in self._waiting if s.request.request_id != rid)
                continue
            await self._free(stream)

    async def _admit(self) -> None:
        """Move waiting requests into free KV slots, prefilling those admitted together in one forward
        (``max_prefill_tokens`` per forward)."""
        while self._waiting and self.engine.num_free_slots > 0:
            n = prefill_batch_size([len(s.prompt_ids) for s in self._waiting],
                                   max_tokens=self.config.max_prefill_tokens, max_requests=self.engine.num_free_slots)
            streams = [self._waiting.popleft() for _ in range(n)]
            try:
                results = await self._run(self._add_requests, streams)
            except Exception as err:  # not one of them may be lost: each gets the error
                results = [err] * len(streams)
            deferred = [stream for stream, result in zip(streams, results) if isinstance(result, CapacityError)]
            for stream, result in zip(streams, results):
                if stream not in deferred:
                    self._admitted(stream, result)
            if deferred:  # back to the front of the queue, in order
                log.warning("admission deferred: %s", next(r for r in results if isinstance(r, CapacityError)))
                self._waiting.extendleft(reversed(deferred))
                return

    def _admitted(self, stream: _Stream, result: tuple[StepOutput, StepOutput | None] | Exception) -> None:
        """Start streaming an admitted request, or answer its admission error."""
        req = stream.request
        if isinstance(result, InvalidRequestError):
            stream.done = True
            code = "context_length_exceeded" if isinstance(result, ContextLengthError) else None
            stream.queue.put_nowait(ErrorItem(400, str(result), code=code))
            return
        if isinstance(result, Exception):  # a bug in prefill or sampling: this request fails, its slot is free
            log.error("admission of %s failed", req.request_id, exc_info=result)
            stream.done = True
            stream.queue.put_nowait(internal_error(result))
            return
        first, for_drafter = result
        self._emit(stream, first)
        if stream.done:
            return
        self._active[req.request_id] = stream
        if self.speculates:
            self._draft_starts.append(DraftStart(req.request_id, stream.prompt_ids, for_drafter, req.params))
            stream.on_drafter = True
            if self.lookup is not None:
                self.lookup.start(req.request_id, stream.prompt_ids, first)

    # The next two run on the torch thread: copying features for the drafter is torch work too, and a prompt's
    # rows are enough to start a parallel region. Started on the event loop thread, it gives the process a second
    # OpenMP pool and slows every later engine step (torch_thread.py; tests/serving/test_target_replica.py).

    def _add_requests(self, streams: list[_Stream]) -> list[tuple[StepOutput, StepOutput | None] | Exception]:
        """Prefill ``streams`` in one forward; per stream its first output and, when speculating, that output for the
        drafter, or the exception that refused it (an ``EngineError``, or a bug's). A batch that raises is admitted
        again one by one (a failed ``add_requests`` holds no slot), so only the request at fault fails."""
        def admitted(first: StepOutput) -> tuple[StepOutput, StepOutput | None]:
            return first, strip_for_drafter(first) if self.speculates else None

        try:
            firsts = self.engine.add_requests(
                [NewRequest(s.request.request_id, s.prompt_ids, s.request.params) for s in streams]
            )
            return [admitted(first) for first in firsts]
        except Exception as err:
            if len(streams) == 1:
                return [err]
            log.warning("batched prefill of %d requests failed (%s: %s); admitting them one by one", len(streams),
                        type(err).__name__, err)
        results: list[tuple[StepOutput, StepOutput | None] | Exception] = []
        for s in streams:
            try:
                results.append(admitted(self.engine.add_request(s.request.request_id, s.prompt_ids, s.request.params)))
            except Exception as err:
                results.append(err)
        return results

    def _verify(
        self, blocks: list[DraftBlock]
    ) -> tuple[list[StepOutput], list[StepOutput | None], tuple[float, float] | None]:
        """One verify step; returns the outputs, when speculating each output for the drafter, and the engine
        thread's (ms on a CPU, ms waiting for one) during the step (None where the kernel does not tell)."""
        before = thread_cpu_ms()
        outputs = self.engine.verify(blocks)
        after = thread_cpu_ms()
        cpu = None if before is None or after is None else (after[0] - before[0], after[1] - before[1])
        return outputs, [strip_for_drafter(out) if self.speculates else None for out in outputs], cpu

    async def _round(self) -> None:
        t0 = time.perf_counter()
        ids = list(self._active)
        blocks = {rid: DraftBlock(rid, torch.zeros(0, dtype=torch.long)) for rid in ids}
        drafter_called = False
        speculative = [rid for rid in ids if self._active[rid].on_drafter] if self.speculates else []
        draft_ms, drafted = 0.0, None
        temperatures = [self._active[rid].request.params.temperature for rid in speculative]
        if speculative and self.scheduler.should_draft(speculative, draft_ms=self.stats.draft_ms or None,
                                                       verify_scale=self.stats.verify_scale,
                                                       temperatures=temperatures):
            # Right after a drafted round and with no new request, a call carries one round of context: what
            # drafting every round costs, the figure the draft gate weighs. A probe after rounds without drafting
            # also catches up on their context, and a new request's prompt is projected: both cost more once.
            steady = self._drafted_last_round and not self._draft_starts
            t_draft, drafter_called = time.perf_counter(), True
            drafted = await self._call_drafter(speculative)
            draft_ms = (time.perf_counter() - t_draft) * 1000
            if drafted is not None:
                self.stats.drafted(draft_ms, drafted.drafter_ms, steady=steady)
        self._drafted_last_round = drafter_called
        drafts, confidences, from_lookup = self._choose_drafts(speculative, drafted)
        if drafts:
            blocks.update(self._schedule(drafts, confidences))
        t_verify = time.perf_counter()
        outputs, for_drafter, verify_cpu = await self._run(self._verify, [blocks[rid] for rid in ids])
        verify_ms = (time.perf_counter() - t_verify) * 1000
        # The draft gate weighs the drafter call, so it learns from the drafter's blocks only.
        drafted_outputs = [out for out in outputs
                           if blocks[out.request_id].tokens.numel() and out.request_id not in from_lookup]
        if drafted_outputs:
            self.scheduler.observe([o.request_id for o in drafted_outputs], [o.num_draft for o in drafted_outputs],
                                   [o.num_accepted for o in drafted_outputs])
        committed, verified, accepted, lookup_verified = 0, 0, 0, 0
        for out, stripped in zip(outputs, for_drafter):
            stream = self._active[out.request_id]
            by_lookup = int(out.num_draft > 0 and out.request_id in from_lookup)  # it verified a lookup draft
            lookup_verified += by_lookup
            stream.spec = replace(stream.spec, rounds=stream.spec.rounds + 1,
                                  draft_tokens=stream.spec.draft_tokens + out.num_draft,
                                  accepted_tokens=stream.spec.accepted_tokens + out.num_accepted,
                                  lookup_rounds=stream.spec.lookup_rounds + by_lookup)
            committed += len(out.new_token_ids)
            verified += out.num_draft
            accepted += out.num_accepted
            self._emit(stream, out)
            if stream.done:
                del self._active[out.request_id]
                if stream.on_drafter:
                    self._draft_finished.append(out.request_id)
                    self._forget_lookup(out.request_id)
            elif stream.on_drafter:
                self._draft_updates.append(stripped)
                if self.lookup is not None:
                    self.lookup.update([out])
        round_ms = (time.perf_counter() - t0) * 1000
        self.stats.round(round_ms, committed=committed, verified=verified, accepted=accepted)
        if self.scheduler is not None and self.scheduler.gate is not None:  # only the draft gate reads it
            self._observe_verify_scale(round_ms - draft_ms, tokens=len(ids) + verified, batch=len(ids))
        self.telemetry.round(round_ms=round_ms, verify_ms=verify_ms, drafter_called=drafter_called,
                             drafted=sum(b.tokens.shape[0] for b in drafts), lookup=lookup_verified, outputs=outputs,
                             verify_cpu=verify_cpu)

    def _choose_drafts(
        self, speculative: list[str], drafted: DraftRound | None
    ) -> tuple[list[DraftBlock], torch.Tensor, set[str]]:
        """This round's draft per speculating request: the drafter's block (when it was called) or the prompt-lookup
        draft, whichever expects more accepted tokens (``prefer_lookup``); without a drafter call, the lookup draft.

        Returns:
            the chosen blocks in batch order, their confidences ``[n, K]``, and the ids whose block is a lookup draft.
        """
        k = self.config.gamma
        chosen: dict[str, tuple[DraftBlock, torch.Tensor]] = {}
        if drafted is not None and drafted.blocks:
            conf = drafted.confidences[:, :k]
            conf = torch.nn.functional.pad(conf, (0, k - conf.shape[1]))
            chosen = {b.request_id: (b, conf[i]) for i, b in enumerate(drafted.blocks)}
        from_lookup: set[str] = set()
        ids = [rid for rid in speculative if self._active[rid].on_drafter] if self.lookup is not None else []
        if ids:
            found, found_conf = self.lookup.drafts(ids, [self._active[rid].request.params.greedy for rid in ids])
            drafter_conf = torch.stack([chosen[rid][1] if rid in chosen else torch.zeros(k) for rid in ids])
            for i in prefer_lookup(drafter_conf, found_conf).nonzero().flatten().tolist():
                chosen[ids[i]] = (found[i], found_conf[i])
                from_lookup.add(ids[i])
        if not chosen:
            return [], torch.zeros(0, k), from_lookup
        order = [rid for rid in speculative if rid in chosen]
        return [chosen[rid][0] for rid in order], torch.stack([chosen[rid][1] for rid in order]), from_lookup

    def _forget_lookup(self, request_id: str) -> None:
        if self.lookup is not None:
            self.lookup.finish(request_id)

    async def _call_drafter(self, propose: list[str]) -> DraftRound | None:
        """One drafter call with everything pending; on failure the involved requests fall back to plain."""
        call = DraftCall(starts=self._draft_starts, updates=self._draft_updates,
                         finished=self._draft_finished, propose=propose)
        self._draft_starts, self._draft_updates, self._draft_finished = [], [], []
        try:
            result = await self.drafter.draft(call)
        except DRAFTER_FAILURES as err:
            moved = self._fail_over(propose + [s.request_id for s in call.starts], err)
            if isinstance(err, ColocatedDrafterError):  # the call may have raised half-way: drop their state now
                await self._forget_colocated(call.finished + moved, err)
            elif isinstance(err, asyncio.TimeoutError):  # the replica may still hold their state: forget it next call
                self._draft_finished.extend(call.finished + moved)
            elif isinstance(err, (RayTaskError, RemoteDrafterError)) and (call.starts or call.updates or call.propose):
                # it raised half-way, maybe before applying the finishes: the next call drops the state (a call
                # of finishes only that raises is not retried, so a broken drafter cannot loop)
                self._draft_finished.extend(call.finished + moved)
            return None
        if result.missing:
            self._fail_over(result.missing, RuntimeError("drafter replica holds no state for them"),
                            cause="missing_state")
        return result

    async def _forget_colocated(self, request_ids: list[str], cause: ColocatedDrafterError) -> None:
        """Drop failed-over requests' state from the colocated drafter; if that raises too, stop drafting on this
        replica: every request continues with plain decoding (counted in ``drafter_failures``)."""
        try:
            await self.drafter.forget_colocated(request_ids)
        except Exception:
            log.exception("colocated drafter could not drop its state; this replica stops drafting")
            self._fail_over([rid for rid, s in self._active.items() if s.on_drafter], cause)
            self.speculates = False
            self._draft_starts, self._draft_updates, self._draft_finished = [], [], []

    def _fail_over(self, request_ids: list[str], err: BaseException, *, cause: str | None = None) -> list[str]:
        """Move active requests to plain decoding, counted under ``cause`` (default ``fallback_cause(err)``) in
        ``dspark_fallbacks``, ``debug_state()["fallbacks"]`` and their ``spec_stats``; the first failure of each cause
        is logged with its error. Returns the ids moved."""
        cause = cause or fallback_cause(err)
        moved = []
        for rid in dict.fromkeys(request_ids):
            stream = self._active.get(rid)
            if stream is not None and stream.on_drafter:
                stream.on_drafter = False
                stream.spec = replace(stream.spec, fallback=True, fallback_cause=cause)
                self._forget_lookup(rid)
                moved.append(rid)
        first = self.stats.failed_over(cause, len(moved))
        self.telemetry.metrics.fallback(cause, len(moved))
        if first:  # later failures of the same cause are counted, not logged again
            # a colocated drafter's exception is a bug in this process: keep its traceback in the log
            trace = err if isinstance(err, ColocatedDrafterError) else None
            log.warning("drafter call failed (cause %s: %s: %s); %d requests continue with plain decoding (later "
                        "failures of this cause are counted in dspark_fallbacks, not logged)", cause,
                        type(err).__name__, err, len(moved), exc_info=trace)
        return moved

    def _schedule(self, drafts: list[DraftBlock], confidences: torch.Tensor) -> dict[str, DraftBlock]:
        """Verify lengths for the drafted requests under the policy, over the whole drafted batch.

        Args:
            drafts: one block per drafted request; confidences: [n, K] their per-position confidences.
        """
        k = self.config.gamma
        max_len = torch.tensor([
            min(b.tokens.shape[0], k, self._active[b.request_id].request.params.max_tokens
                - self._active[b.request_id].generated - 1)
            for b in drafts
        ], dtype=torch.long).clamp(min=0)
        lengths = self.scheduler.schedule(confidences=confidences.clamp(0, 1), min_len=torch.zeros_like(max_len),
                                          max_len=max_len)
        return {b.request_id: replace(b, verify_len=int(n))
                for b, n in zip(drafts, lengths.tolist())}

    def _emit(self, stream: _Stream, out: StepOutput) -> None:
        stream.generated += len(out.new_token_ids)
        stream.done = out.finished
        self.telemetry.tokens(stream.request.request_id, len(out.new_token_ids), finished=out.finished,
                              spec=stream.spec)
        chunk = TextChunk(
            text=out.text, token_ids=list(out.new_token_ids), prompt_tokens=len(stream.prompt_ids),
            finish_reason=out.finish_reason.value if out.finished else None,
            spec=stream.spec if out.finished else None, logprobs=logprob_texts(self.engine.tokenizer, out.logprobs),
        )
        if stream.held is not None:
            chunk = stream.held.then(chunk)
        first = stream.generated == len(out.new_token_ids)
        if out.finished or first or chunk.num_tokens >= self.config.stream_interval:
            stream.queue.put_nowait(chunk)
            stream.held = None
        else:
            stream.held = chunk

    def _observe_verify_scale(self, ms: float, *, tokens: int, batch: int) -> None:
        """EMA of this round's time without the drafter call over the profile's verify time for the same step.

        A served round also pays the step loop and streaming; the draft gate compares the measured drafter
        call time with verify times scaled by this factor, so both sides of its trade-off are measured alike.
        """
        profile = self.scheduler.profile
        b = min(batch, profile.max_batch_size)
        profiled = float(profile.verify_time_ms(tokens * b / batch, batch=b))
        self.stats.verify_scale = _ema(ms / profiled, self.stats.verify_scale, seed_with_first=False)

    async def _report_loop(self) -> None:
        """Push this replica's load to the Router every ``stats_interval_s`` (never on the token path)."""
        while True:
            load = TargetLoad(
                replica_id=self.replica_id, active=len(self._active), waiting=len(self._waiting),
                max_num_seqs=self.config.max_num_seqs, step_ms=self.stats.step_ms,
                tokens_per_step=self.stats.tokens_per_step, acceptance=self.stats.acceptance,
                drafter_failures=self.stats.drafter_failures, counters=copy.deepcopy(self.telemetry.counters),
            )
            self.telemetry.report(active=load.active, queued=load.waiting)
            try:
                await self.router.report.remote(load)
            except (RayActorError, RayTaskError) as err:
                log.warning("load report to the Router failed: %s", err)
            await asyncio.sleep(self.config.stats_interval_s)
