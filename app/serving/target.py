"""The Target deployment: a ``SpecLoop`` (``app/loop.py``: admission, the round, commit) under a Serve shell.

Owns: the replica's waiting queue (bounded: beyond ``max_queued_requests`` a request answers 503), when to admit
and when to run a round, the drafter call of a round whose draft gate is open (through ``DrafterClient``: a Drafter
replica or, with ``drafter_placement: colocated``, a ``DrafterCore`` on this replica's torch thread), streaming each
request's committed text back, cancellation (a client that goes away frees its KV slot at once and its drafter
state with the next drafter call), drafter fail-over (a failed or slow drafter call moves the affected requests to
plain decoding for the rest of their life, counted by cause; the call itself, its transport and its failure causes
are ``drafter_client.py``'s), the running figures (``ReplicaStats``), metrics and load reports to the Router, off
the per-token path. The round itself (the drafter's block or the prompt-lookup draft, verify lengths, the verify,
the drafter's next hooks) is the loop's, the same code the offline ``generate`` runs; prompt lookup (``prompt_lookup``)
runs in the loop on this replica, on the tokens it commits, so it drafts in every round, also those that skip the
drafter.

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
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from app.drafters.lookup import PromptLookup, read_lookup_rates
from app.engine.contract import Engine
from app.engine.detokenizer import IncrementalDetokenizer, TokenBytes, TokenTexts
from app.engine.errors import CapacityError, ContextLengthError, InvalidRequestError
from app.engine.types import ChatTemplateOptions, FinishReason, NewRequest, StepOutput, TokenLogprob
from app.loop import DraftCall, DraftRound, RequestResult, Round, SpecLoop
from app.scheduling.guard import SpeculationGuard
from app.scheduling.policies import make_policy
from app.scheduling.profile import ThroughputProfile, load_profile
from app.scheduling.scheduler import VerifyScheduler
from app.serving.channel import ChannelClosedError, node_id
from app.serving.config import AppConfig
from app.serving.profiles import serving_profile
from app.serving.drafter import DrafterCore
from app.serving.drafter_client import (
    DRAFTER_FAILURES, ColocatedDrafterError, DrafterClient, RemoteDrafterError, failure_text, fallback_cause,
)
from app.serving.protocol import (
    ErrorItem, GenerateRequest, SpecStats, TextChunk, TokenizeCall, TokenLogprobText, openai_param, strip_for_drafter,
)
from app.serving.router import TargetLoad
from app.serving.telemetry import TargetTelemetry
from app.serving.torch_thread import TorchThread, stuck_thread, thread_cpu_ms

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
        """Count a round that called the drafter; a steady call (``TargetReplica._round``) moves the EMAs, and any
        call faster than ``draft_ms`` caps it: a steady call costs no more than one that also catches up, so an
        estimate above it is stale (one slow call, e.g. to a replica being replaced, would otherwise keep the draft
        gate closed for good: a closed gate makes no steady call)."""
        self.drafted_rounds += 1
        if steady:
            self.draft_ms, self.drafter_ms = _ema(draft_ms, self.draft_ms), _ema(drafter_ms, self.drafter_ms)
        elif self.draft_ms and draft_ms < self.draft_ms:
            self.draft_ms = draft_ms

    def failed_over(self, cause: str, requests: int) -> bool:
        """Count ``requests`` moved to plain decoding for ``cause``; True the first time that cause is seen."""
        first = cause not in self.fallbacks
        self.fallbacks[cause] = self.fallbacks.get(cause, 0) + requests
        return first

    @property
    def drafter_failures(self) -> int:
        """Requests failed over to plain decoding since start, every cause."""
        return sum(self.fallbacks.values())


def logprob_texts(text: TokenTexts, logprobs: list[TokenLogprob] | None,
                  token_bytes: TokenBytes) -> list[TokenLogprobText] | None:
    """The engine's logprobs with each token (and alternative) decoded alone by ``text``, and its bytes by
    ``token_bytes`` (the same tokenizer's)."""
    if logprobs is None:
        return None
    return [TokenLogprobText(text(lp.token_id), lp.logprob, tuple((text(t), v) for t, v in lp.top),
                             token_bytes=token_bytes(lp.token_id), top_bytes=tuple(token_bytes(t) for t, _ in lp.top),
                             token_id=lp.token_id, top_ids=tuple(t for t, _ in lp.top), rank=lp.rank)
            for lp in logprobs]


def prompt_text(tokenizer, prompt_ids: list[int]) -> tuple[str, list[int]]:
    """A prompt's text, decoded as an answer is (incrementally; special tokens kept, as an echo shows them), and the
    characters of it each token brings (``IncrementalDetokenizer.release``)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    for token in prompt_ids:
        detok.add(token, check_stop=False)
    return detok.release(final=True)


def lens_within(text: str, lens: list[int], shown: str) -> list[int]:
    """``lens`` (the characters of ``text`` each prompt token brings, ``prompt_text``) counted within ``shown``, the
    prompt text a response echoes: where the tokenizer added special tokens around a text prompt (a Llama tokenizer's
    BOS), ``text`` holds their text and ``shown`` does not, so the characters before and after ``shown`` are taken
    off the tokens that bring them. ``lens`` as they are where ``shown`` is not inside ``text``."""
    if len(shown) == len(text):
        return lens
    # a prefix added (BOS), a suffix added, or both: the occurrence of ``shown`` between token boundaries (added
    # tokens bring whole texts), else the one at the end or the start (a SentencePiece BOS decodes with a space
    # after it that the next token brings)
    bounds = set(itertools.accumulate(lens, initial=0))
    starts = list(_occurrences(text, shown))
    start = next((i for i in starts if i in bounds and i + len(shown) in bounds),
                 len(text) - len(shown) if text.endswith(shown) else starts[0] if starts else -1)
    if start < 0:
        return lens
    out, drop = list(lens), start
    for i in range(len(out)):  # the leading surplus
        take = min(out[i], drop)
        out[i], drop = out[i] - take, drop - take
    drop = len(text) - start - len(shown)
    for i in reversed(range(len(out))):  # the trailing surplus
        take = min(out[i], drop)
        out[i], drop = out[i] - take, drop - take
    return out


def _occurrences(text: str, part: str):
    """Where ``part`` starts in ``text``, each position."""
    at = text.find(part)
    while at >= 0:
        yield at
        at = text.find(part, at + 1)


def prompt_logprob_texts(text: TokenTexts, prompt_ids: list[int], logprobs: list[TokenLogprob | None] | None,
                         token_bytes: TokenBytes, text_lens: list[int] | None) -> list[TokenLogprobText] | None:
    """``StepOutput.prompt_logprobs`` as ``logprob_texts`` gives an output's, each entry with the characters of the
    echoed prompt's text its token brings (``text_lens``, from ``prompt_text``; None: not echoed, no ``text_len``);
    the first prompt token (None there) with its text and a logprob of None."""
    if logprobs is None:
        return None
    first = TokenLogprobText(text(prompt_ids[0]), None, token_bytes=token_bytes(prompt_ids[0]),
                             token_id=prompt_ids[0])
    entries = [first] + logprob_texts(text, logprobs[1:], token_bytes)
    if text_lens is None:
        return entries
    return [replace(entry, text_len=chars) for entry, chars in zip(entries, text_lens, strict=True)]


def invalid_request(request: GenerateRequest, err: InvalidRequestError) -> ErrorItem:
    """The 400 answer of a request the engine refused, ``param`` the OpenAI field (``code: context_length_exceeded``
    for one over the context)."""
    if isinstance(err, ContextLengthError):
        return ErrorItem(400, err.describe(request.max_tokens_param, max_tokens_default=request.max_tokens_default),
                         param=request.api_param(err.param), code="context_length_exceeded")
    return ErrorItem(400, str(err), param=request.api_param(err.param))


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
    arrived_at: float  # when it reached the replica (``TargetTelemetry.clock``)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    record: RequestResult | None = None  # the loop's record of it, once admitted
    done: bool = False
    held: TextChunk | None = None  # committed output not sent yet (``stream_interval``)
    # committed tokens whose text the engine has not released yet (``StepOutput.text_lens``), with their logprobs
    unreleased: list[int] = field(default_factory=list)
    unreleased_logprobs: list[TokenLogprobText] = field(default_factory=list)

    @property
    def spec(self) -> SpecStats:
        """Its speculative statistics so far."""
        r = self.record
        if r is None:
            return SpecStats()
        return SpecStats(rounds=r.rounds, draft_tokens=r.num_draft, accepted_tokens=r.num_accepted,
                         lookup_rounds=r.lookup_rounds, fallback=r.fallback_cause is not None,
                         fallback_cause=r.fallback_cause)


class TargetReplica:
    """The Target deployment class (bound undecorated by ``builder.py``)."""

    def __init__(self, config: AppConfig, drafter, router) -> None:
        self.config = config
        self._torch = TorchThread("engine", config.torch_threads)
        self.engine = self._torch.call(make_engine, config)
        self._token_bytes = TokenBytes(self.engine.tokenizer)  # logprobs' bytes, each token's worked out once
        self._token_texts = TokenTexts(self.engine.tokenizer)  # and their texts
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        speculates = config.speculates
        self.stats = ReplicaStats()
        colocated = self._torch.call(self._colocated_drafter, config) \
            if speculates and config.drafter_placement == "colocated" else None
        self.drafter = DrafterClient(
            handle=drafter if speculates and colocated is None else None, colocated=colocated,
            run=self._run, replica_id=self.replica_id, gamma=config.gamma, timeout_s=config.drafter_timeout_s,
            stats=self.stats, on_reachable=self._wake, channel=config.drafter_channel, node_id=node_id(),
        ) if speculates else None
        self.lookup = self._torch.call(make_prompt_lookup, config) if speculates else None
        self.router = router
        self.policy = make_policy(config.policy)
        self.scheduler = VerifyScheduler(
            self.policy, self._torch.call(self._profile, config), max_batch=config.max_num_seqs, gamma=config.gamma,
            draft_gate=config.draft_gate,
        ) if speculates else None
        self.guard = SpeculationGuard(step_ms=self._plain_step_ms) \
            if speculates and config.speculation_guard and self.policy.adaptive else None
        # speculation stops for good on this replica if a colocated drafter cannot drop its state
        self.loop = SpecLoop(self.engine, gamma=config.gamma, speculates=speculates, scheduler=self.scheduler,
                             lookup=self.lookup, max_prefill_tokens=config.max_prefill_tokens,
                             chunked_prefill=config.chunked_prefill, strip=strip_for_drafter)
        self.telemetry = TargetTelemetry(slo=config.autoscaling, policy=config.policy, replica=self.replica_id,
                                         gamma=config.gamma, max_num_seqs=config.max_num_seqs)
        self._waiting: collections.deque[_Stream] = collections.deque()
        self._active: dict[str, _Stream] = {}  # decoding
        self._prefilling: dict[str, _Stream] = {}  # admitted, prompt prefilled in pieces (chunked prefill)
        self._cancelled: set[str] = set()
        self._drafted_last_round = False
        self._guarded_last_round = False  # the guard ran the last round of speculating requests plain
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._reporting = False
        self._start_reports()

    @property
    def colocated(self) -> DrafterCore | None:
        """The drafter on this replica's torch thread (``drafter_placement: colocated``), else None."""
        return self.drafter.colocated if self.drafter is not None else None

    def _profile(self, config: AppConfig) -> ThroughputProfile:
        """The profile to schedule with (runs on the torch thread: it may time the engine, ``profiles.py``)."""
        if config.mock_engine:
            return load_profile(config.profile_path())
        return serving_profile(config, self.engine)

    def _plain_step_ms(self, batch: int) -> float:
        """The profile's plain step for ``batch`` requests (ms): the speculation guard's unit of round time."""
        return float(self.scheduler.profile.verify_time_ms(batch, batch=batch))

    def _colocated_drafter(self, config: AppConfig) -> DrafterCore:
        """The colocated drafter, sharing the engine's input embedding (runs on the torch thread)."""
        return DrafterCore(config, replica=self.replica_id, embed_weight=self.engine.input_embeddings)

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest, replica_key: str | None = None) -> AsyncIterator:
        """Stream ``TextChunk``s for ``request`` (or one ``ErrorItem``); ``replica_key`` only steers routing."""
        self._ensure_running()
        arrived_at = self.telemetry.clock()
        try:
            request, prompt_ids = await self._run(self._encode, request)
        except InvalidRequestError as err:
            yield invalid_request(request, err)
            return
        except asyncio.CancelledError:  # the client went away while the engine thread was busy (a long prefill)
            self.telemetry.cancelled()
            raise
        if len(self._waiting) + self._running >= self.config.max_num_seqs + self.config.max_queued_requests:
            yield ErrorItem(503, f"server overloaded: {self._running} requests running and {len(self._waiting)} "
                            f"queued on this replica (limit {self.config.max_num_seqs} + "
                            f"{self.config.max_queued_requests} queued)", type="server_overloaded", code="overloaded")
            return
        stream = _Stream(request=request, prompt_ids=prompt_ids, arrived_at=arrived_at)
        self._enqueue(stream)
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

    async def check(self, request: GenerateRequest) -> ErrorItem | None:
        """The 400 that ``generate`` would answer at once for ``request`` (a prompt that does not fit the context with
        its max_tokens, messages the chat template refuses), or None; nothing is queued. The ingress checks every
        prompt of a request with several before it starts any, so that a refused one costs the others no work."""
        try:
            await self._run(self._encode, request)
        except InvalidRequestError as err:
            return invalid_request(request, err)
        return None

    async def tokenize(self, call: TokenizeCall) -> tuple[list[int], list[str] | None] | ErrorItem:
        """A prompt's token ids as ``generate`` takes them (``POST /tokenize``) and, with ``call.token_strs``, each
        token's vocabulary string; a 400 naming ``messages`` where the chat template refuses them."""
        try:
            return await self._run(self._tokenize, call)
        except InvalidRequestError as err:
            return ErrorItem(400, str(err), param=openai_param(err.param, chat=call.messages is not None))

    def _tokenize(self, call: TokenizeCall) -> tuple[list[int], list[str] | None]:
        ids = self._prompt_ids(call.prompt, call.messages, add_special_tokens=call.add_special_tokens,
                               template=call.template)
        return ids, self.engine.tokenizer.convert_ids_to_tokens(ids) if call.token_strs else None

    async def detokenize(self, ids: list[int]) -> str | ErrorItem:
        """Token ids as text (``POST /detokenize``; special tokens kept, as vLLM decodes them); a 400 naming
        ``tokens`` for an id outside the vocabulary."""
        try:
            self._check_vocabulary(ids, "tokens")
        except InvalidRequestError as err:
            return ErrorItem(400, str(err), param=err.param)
        return await self._run(lambda: self.engine.tokenizer.decode(ids, skip_special_tokens=False))

    def _check_vocabulary(self, ids: list[int], param: str) -> None:
        """Raises: InvalidRequestError (``param``): an id outside the vocabulary."""
        if (bad := next((t for t in ids if not 0 <= t < self.engine.vocab_size), None)) is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.engine.vocab_size})",
                                      param=param)

    def _prompt_ids(self, prompt: str | list[int] | None, messages: list[dict[str, str]] | None, *,
                    add_special_tokens: bool, template: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        """The token ids of chat ``messages`` through the template (rendered as ``template`` says), a text prompt, or
        token ids as sent (checked against the vocabulary).

        Raises:
            InvalidRequestError: the chat template refuses the messages or ``template``; a token id outside the
                vocabulary.
        """
        if messages is not None:
            return self.engine.encode_chat(messages, add_special_tokens=add_special_tokens, options=template)
        if isinstance(prompt, list):
            self._check_vocabulary(prompt, "prompt")
            return list(prompt)
        return self.engine.encode(prompt, add_special_tokens=add_special_tokens)

    def _encode(self, request: GenerateRequest) -> tuple[GenerateRequest, list[int]]:
        """The request, its default max_tokens lowered to what the context leaves its prompt (vLLM's rule for a
        request that sets none), and its prompt token ids, once they are known to fit the context.

        ``truncate_prompt_tokens`` keeps the last tokens of the prompt (vLLM's rule) before the context is checked.

        Raises:
            InvalidRequestError: the chat template refuses the messages, a prompt token id is outside the
                vocabulary, ``truncate_prompt_tokens`` exceeds the context, or ``min_tokens`` exceeds the lowered
                max_tokens; ContextLengthError: the request does not fit (answered before it is queued: in an
                admission batch it would fail the batched prefill of the others).
        """
        ids = self._prompt_ids(request.prompt, request.messages, add_special_tokens=request.add_special_tokens,
                               template=request.template)
        if (keep := request.truncate_prompt_tokens) is not None:
            keep = self.config.max_model_len if keep == -1 else keep
            if keep > self.config.max_model_len:
                raise InvalidRequestError(f"truncate_prompt_tokens {keep} is more than the context length of "
                                          f"{self.config.max_model_len} tokens", param="truncate_prompt_tokens")
            ids = ids[-keep:]
        room = self.config.max_model_len - len(ids)
        if request.max_tokens_default and 1 <= room < request.params.max_tokens:
            if request.params.min_tokens > room:
                raise InvalidRequestError(f"min_tokens {request.params.min_tokens} exceeds the {room} tokens the "
                                          f"context leaves the prompt of {len(ids)} tokens", param="min_tokens")
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, max_tokens=room))
        self.engine.check_context(len(ids), request.params.max_tokens)
        return request, ids

    @property
    def _running(self) -> int:
        """Requests holding a KV slot: decoding, or being prefilled in pieces."""
        return len(self._active) + len(self._prefilling)

    def debug_state(self) -> dict:
        """Counts of held request state (leak checks and the autoscaler)."""
        return {"active": len(self._active), "prefilling": len(self._prefilling), "waiting": len(self._waiting),
                "engine_active": self.engine.num_active,
                "colocated_drafter_states": None if self.colocated is None else self.colocated.num_states,
                "lookup_states": None if self.lookup is None else self.lookup.num_states,
                "cancelled_pending": len(self._cancelled), "node_id": node_id(),
                "guard": None if self.guard is None else self.guard.state(),
                "drafter_backoff": None if self.drafter is None else self.drafter.backoff_cause,
                "drafter_transport": None if self.drafter is None else self.drafter.transport,
                **dataclasses.asdict(self.stats), "drafter_failures": self.stats.drafter_failures}

    def record_autoscaling_stats(self) -> dict:
        """Custom autoscaling metrics (Ray Serve polls this; used by the autoscaling policy)."""
        return {"active": float(self._running), "waiting": float(len(self._waiting)),
                "step_ms": self.stats.step_ms,
                **self.telemetry.autoscaling_stats(active=self._running, queued=len(self._waiting))}

    # ------------------------------------------------------------------ loop

    def _start_reports(self) -> None:
        """Start pushing load reports, on the running event loop (Serve runs a replica's constructor on it). The
        Router chooses only among replicas it has heard from, so a replica must report before its first request:
        one the autoscaler adds would otherwise never get one. Built outside Serve with no loop running, the
        replica starts them with its first request."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._reporting = True
        self._tasks.append(loop.create_task(self._report_loop(), context=contextvars.Context()))

    def _ensure_running(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
            # started by the first request, in an empty context: Serve's request context (its id) would stick to
            # every later round (and load report, when they start here)
            self._tasks.append(asyncio.create_task(self._loop(), context=contextvars.Context()))
            if not self._reporting:
                self._start_reports()

    async def _run(self, fn, *args):
        return await self._torch.run(fn, *args)

    def _enqueue(self, stream: _Stream) -> None:
        """Queue a request behind those of its priority or a lower one (``scheduling_policy`` "priority"; "fcfs":
        the end of the queue). The front of the queue is admitted first."""
        if self.config.scheduling_policy == "fcfs":
            self._waiting.append(stream)
            return
        priority = stream.request.priority
        at = next((i for i, queued in enumerate(self._waiting) if queued.request.priority > priority),
                  len(self._waiting))
        self._waiting.insert(at, stream)

    async def _loop(self) -> None:
        while True:
            if not (self._waiting or self._running or self._cancelled or self._finishes_due):
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                await self._drop_cancelled()
                await self._admit()
                if self._active:
                    await self._round()
                elif self._finishes_due:
                    await self._call_drafter(self.loop.take_call())  # tell the drafter to forget cancelled requests
                elif self._waiting and not self._prefilling and not self.engine.num_free_slots:
                    # nothing running, yet no slot free: a slot is lost (with a free slot the waiting are admitted
                    # next time round: a prompt's last piece just ended its request, say)
                    err = RuntimeError(f"no free KV slot with no request running ({len(self._waiting)} waiting)")
                    log.error("target step loop: %s; failing the waiting requests", err)
                    waiting, self._waiting = list(self._waiting), collections.deque()
                    await self._fail(waiting, err)
            except Exception as err:  # a bug must cost the requests it touched, not the replica's step loop
                log.exception("target step loop: unexpected error; failing the running requests")
                await self._fail(list(self._active.values()) + list(self._prefilling.values()), err)

    @property
    def _finishes_due(self) -> bool:
        """Whether a drafter call of finishes only is due (held back while the drafter client backs off)."""
        return self.loop.has_pending_finishes and self.loop.speculates and self.drafter.reachable

    def _wake(self) -> None:
        """Wake the step loop (the drafter answers again: finishes held back may be due)."""
        if self._wakeup is not None:
            self._wakeup.set()

    async def _fail(self, streams: list[_Stream], err: Exception) -> None:
        """End these requests with a 500 error and free their state (the step loop goes on)."""
        for stream in streams:
            self._active.pop(stream.request.request_id, None)
            self._prefilling.pop(stream.request.request_id, None)
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
        await self._run(self.loop.cancel, rid)

    def check_health(self) -> None:
        """Serve's health check: unhealthy (the replica is replaced) once the step loop or load reports stopped, or
        the torch thread is stuck (``stuck``).

        Raises:
            RuntimeError: a background task ended, or the torch thread is stuck.
        """
        for task in self._tasks:
            if task.done():
                cause = "cancelled" if task.cancelled() else repr(task.exception())
                raise RuntimeError(f"target background task {task.get_coro().__name__} stopped: {cause}")
        if (stuck := self.stuck()) is not None:
            raise RuntimeError(stuck)

    def stuck(self) -> str | None:
        """Why the replica is stuck (its torch thread has been in one call longer than ``step_timeout_s``), or None."""
        return stuck_thread(self._torch, "engine", self.config.step_timeout_s)

    async def _drop_cancelled(self) -> None:
        for rid in list(self._cancelled):
            self._cancelled.discard(rid)
            self.telemetry.cancelled()
            stream = self._active.pop(rid, None) or self._prefilling.pop(rid, None)
            if stream is None:
                self.telemetry.dropped(rid)
                self._waiting = collections.deque(s for s in self._waiting if s.request.request_id != rid)
                continue
            await self._free(stream)

    async def _admit(self) -> None:
        """Move waiting requests into free KV slots, prefilling those admitted together in one forward
        (``max_prefill_tokens`` per forward), then, with chunked prefill, the next piece of a prompt prefilled in
        pieces. How many forwards run before the next round is the loop's rule (``SpecLoop.admission_size``,
        ``SpecLoop.piece_due``)."""
        # Sizing and admission run on the torch thread: the prefix cache's match (sizing) and the loop's copy of
        # features for the drafter (``strip_for_drafter``) are enough for torch to start an OpenMP parallel region;
        # started on the event loop thread, that gives the process a second pool and slows every later engine step
        # (torch_thread.py).
        await self._admit_waiting()
        if self.loop.piece_due:
            try:
                rid, result = await self._run(self.loop.continue_prefill)
            except Exception as err:  # a bug in the loop itself: the request being prefilled fails
                await self._fail(list(self._prefilling.values()), err)
                return
            if result is not None:
                self._admitted(self._prefilling.pop(rid), result)

    async def _admit_waiting(self) -> None:
        """Admissions from the front of the queue, as many forwards as ``SpecLoop.admission_size`` allows."""
        while self._waiting and self.engine.num_free_slots:
            queued = list(self._waiting)  # requests arriving while it is sized may go ahead (priority scheduling)
            prompts, params = [s.prompt_ids for s in queued], [s.request.params for s in queued]
            n = await self._run(lambda: self.loop.admission_size(prompts, params=params))
            if n == 0:
                return
            streams = queued[:n]  # the batch that was sized
            self._waiting = collections.deque(s for s in self._waiting if all(s is not t for t in streams))
            admitted_at = self.telemetry.clock()
            try:
                results = await self._run(self.loop.admit, [NewRequest(s.request.request_id, s.prompt_ids,
                                                                      s.request.params) for s in streams])
            except Exception as err:  # not one of them may be lost: each gets the error
                results = [err] * len(streams)
            deferred = [stream for stream, result in zip(streams, results) if isinstance(result, CapacityError)]
            for stream, result in zip(streams, results):
                if stream in deferred:
                    continue
                self.telemetry.admitted(arrived_at=stream.arrived_at, at=admitted_at)
                if result is None:  # its prompt goes on in pieces (chunked prefill)
                    self._prefilling[stream.request.request_id] = stream
                else:
                    self._admitted(stream, result)
            if deferred:  # back to the front of the queue, in order
                log.warning("admission deferred: %s", next(r for r in results if isinstance(r, CapacityError)))
                self._waiting.extendleft(reversed(deferred))
                return

    def _admitted(self, stream: _Stream, result: tuple[RequestResult, StepOutput] | Exception) -> None:
        """Start streaming an admitted request, or answer its admission error."""
        req = stream.request
        if isinstance(result, InvalidRequestError):
            stream.done = True
            stream.queue.put_nowait(invalid_request(req, result))
            return
        if isinstance(result, Exception):  # a bug in prefill or sampling: this request fails, its slot is free
            log.error("admission of %s failed", req.request_id, exc_info=result)
            stream.done = True
            stream.queue.put_nowait(internal_error(result))
            return
        stream.record, first = result
        self.telemetry.prefilled(len(stream.prompt_ids), first.num_cached_tokens, arrived_at=stream.arrived_at)
        self._emit(stream, first)
        if not stream.done:
            self._active[req.request_id] = stream

    def _step(self, drafted: DraftRound | None, speculate: bool) -> tuple[Round, tuple[float, float] | None]:
        """The loop's round (runs on the torch thread; ``speculate`` False: a plain round); returns it and the engine
        thread's (ms on a CPU, ms waiting for one) during it (None where the kernel does not tell)."""
        before = thread_cpu_ms()
        result = self.loop.step(drafted, speculate=speculate)
        after = thread_cpu_ms()
        return result, None if before is None or after is None else (after[0] - before[0], after[1] - before[1])

    async def _round(self) -> None:
        t0 = time.perf_counter()
        batch = len(self._active)
        speculative = self.loop.speculating()
        if speculative and not self.drafter.reachable:  # new requests since the drafter stopped answering
            backoff = RuntimeError(f"backing off the Drafter replica ({self.drafter.backoff_cause})")
            self._fail_over(speculative, backoff, cause="drafter_backoff")
            speculative = []
        draft_ms, drafted, drafter_called = 0.0, None, False
        speculate = bool(speculative) and (self.guard is None or self.guard.speculate(batch))
        steady = True  # no drafter call, or one that carries a single round of context
        if speculate and self.loop.should_draft(speculative, draft_ms=self.stats.draft_ms or None,
                                                verify_scale=self.stats.verify_scale):
            call = self.loop.take_call(speculative)
            # Right after a drafted round and with no new request, a call carries one round of context: what
            # drafting every round costs, the figure the draft gate weighs. A probe after rounds without drafting
            # also catches up on their context, and a new request's prompt is projected: both cost more once.
            steady = self._drafted_last_round and not call.starts
            t_draft, drafter_called = time.perf_counter(), True
            drafted = await self._call_drafter(call)
            draft_ms = (time.perf_counter() - t_draft) * 1000
            if drafted is not None:  # an answer without some requests' state came from a replaced replica: not steady
                self.stats.drafted(draft_ms, drafted.drafter_ms, steady=steady and not drafted.missing)
        self._drafted_last_round = drafter_called
        result, verify_cpu = await self._run(self._step, drafted, speculate)
        for out in result.outputs:
            stream = self._active[out.request_id]
            self._emit(stream, out)
            if stream.done:
                del self._active[out.request_id]
        round_ms = (time.perf_counter() - t0) * 1000
        self.stats.round(round_ms, committed=result.committed, verified=result.verified, accepted=result.accepted)
        if self.guard is not None and speculative:
            # The guard weighs speculation as the draft gate and the verify-length policy run it, catch-up calls after
            # closed-gate rounds included; only the first speculative round after its own plain rounds catches up
            # on context that they left behind.
            self.guard.observe(batch, speculative=speculate, committed=result.committed, round_ms=round_ms,
                               steady=not self._guarded_last_round)
            self._guarded_last_round = not speculate
        if self.scheduler is not None and self.scheduler.gate is not None:  # only the draft gate reads it
            self._observe_verify_scale(round_ms - draft_ms, result, batch=batch)
        self.telemetry.round(round_ms=round_ms, verify_ms=result.verify_ms, drafter_wait_ms=draft_ms,
                             drafter_called=drafter_called, drafted=result.drafted, lookup=result.lookup,
                             outputs=result.outputs, verify_cpu=verify_cpu, guarded=bool(speculative) and not speculate)

    async def _call_drafter(self, call: DraftCall) -> DraftRound | None:
        """One drafter call (``SpecLoop.take_call``); on failure the involved requests fall back to plain."""
        try:
            result = await self.drafter.draft(call)
        except DRAFTER_FAILURES as err:
            moved = self._fail_over(call.propose + [s.request_id for s in call.starts], err)
            if isinstance(err, ColocatedDrafterError):  # the call may have raised half-way: drop their state now
                await self._forget_colocated(call.finished + moved, err)
            elif isinstance(err, (asyncio.TimeoutError, ChannelClosedError)):
                # the replica may still hold their state (alive, or replaced by then): forget it next call
                self.loop.forget_later(call.finished + moved)
            elif isinstance(err, (RayTaskError, RemoteDrafterError)) and (call.starts or call.updates or call.propose):
                # it raised half-way, maybe before applying the finishes: the next call drops the state (a call
                # of finishes only that raises is not retried, so a broken drafter cannot loop)
                self.loop.forget_later(call.finished + moved)
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
            self._fail_over(self.loop.speculating(), cause)
            self.loop.stop_speculating()

    def _fail_over(self, request_ids: list[str], err: BaseException, *, cause: str | None = None) -> list[str]:
        """Move active requests to plain decoding, counted under ``cause`` (default ``fallback_cause(err)``) in
        ``dspark_fallbacks``, ``debug_state()["fallbacks"]`` and their ``spec_stats``; the first failure of each cause
        is logged with its error. Returns the ids moved."""
        cause = cause or fallback_cause(err)
        moved = self.loop.fail_over(request_ids, cause)
        first = self.stats.failed_over(cause, len(moved))
        self.telemetry.metrics.fallback(cause, len(moved))
        if first:  # later failures of the same cause are counted, not logged again
            # a colocated drafter's exception is a bug in this process: keep its traceback in the log
            trace = err if isinstance(err, ColocatedDrafterError) else None
            log.warning("%d requests continue with plain decoding (cause %s: %s; later fallbacks of this cause are "
                        "counted in dspark_fallbacks, not logged)", len(moved), cause,
                        failure_text(err, timeout_s=self.config.drafter_timeout_s), exc_info=trace)
        return moved

    def _emit(self, stream: _Stream, out: StepOutput) -> None:
        """Stream a committed output (its tokens are already in ``stream.record``)."""
        stream.done = out.finished
        spec = stream.spec
        if out.finish_reason is FinishReason.ERROR:  # the engine ended this request alone (its grammar failed)
            self.telemetry.dropped(stream.request.request_id)  # not a finished request: no latency sample
            if stream.held is not None:
                stream.queue.put_nowait(stream.held)
            stream.queue.put_nowait(ErrorItem(500, f"the request could not go on: {out.error}", type="server_error",
                                              code="request_failed"))
            return
        self.telemetry.tokens(stream.request.request_id, len(out.new_token_ids), finished=out.finished, spec=spec,
                              length=out.finish_reason is FinishReason.LENGTH, arrived_at=stream.arrived_at)
        # a chunk carries the tokens whose text it carries, each logprob with the characters its token brings
        stream.unreleased += out.new_token_ids
        n = len(out.text_lens)
        token_ids, stream.unreleased = stream.unreleased[:n], stream.unreleased[n:]
        first = len(stream.record.token_ids) == len(out.new_token_ids)
        logprobs = None
        if out.logprobs is not None:
            stream.unreleased_logprobs += logprob_texts(self._token_texts, out.logprobs, self._token_bytes)
            logprobs = [replace(entry, text_len=chars)
                        for entry, chars in zip(stream.unreleased_logprobs[:n], out.text_lens, strict=True)]
            stream.unreleased_logprobs = stream.unreleased_logprobs[n:]
        echo, echo_text, echo_lens = stream.request.echo, None, None
        if first and echo != "no":
            echo_text, echo_lens = prompt_text(self.engine.tokenizer, stream.prompt_ids)
            if echo == "sent":
                echo_lens = lens_within(echo_text, echo_lens, stream.request.prompt)
        chunk = TextChunk(
            text=out.text, token_ids=token_ids, prompt_tokens=len(stream.prompt_ids),
            finish_reason=out.finish_reason.value if out.finished else None, stop_reason=out.stop_reason,
            spec=spec if out.finished else None, logprobs=logprobs, cached_tokens=out.num_cached_tokens,
            prompt_logprobs=prompt_logprob_texts(self._token_texts, stream.prompt_ids, out.prompt_logprobs,
                                                 self._token_bytes, echo_lens),
            prompt_text=echo_text if echo == "tokens" else None,
        )
        if stream.held is not None:
            chunk = stream.held.then(chunk)
        if out.finished or first or chunk.num_tokens >= self.config.stream_interval:
            stream.queue.put_nowait(chunk)
            stream.held = None
        else:
            stream.held = chunk

    def _observe_verify_scale(self, ms: float, result: Round, *, batch: int) -> None:
        """EMA of this round's time without the drafter call over the profile's verify time for the same step.

        A served round also pays the step loop and streaming; the draft gate compares the measured drafter
        call time with verify times scaled by this factor, so both sides of its trade-off are measured alike.
        """
        profile = self.scheduler.profile
        b = min(batch, profile.max_batch_size)
        tokens = profile.step_tokens(batch=batch, verified=result.verified, longest=result.longest)
        sampled = profile.sampled_fraction(result.sampled, [out.num_draft for out in result.outputs])
        profiled = float(profile.verify_time_ms(tokens * b / batch, batch=b, sampled=sampled))
        self.stats.verify_scale = _ema(ms / profiled, self.stats.verify_scale, seed_with_first=False)

    def load(self) -> TargetLoad:
        """This replica's load report now (a copy: later rounds do not change it)."""
        return TargetLoad(
            replica_id=self.replica_id, active=self._running, waiting=len(self._waiting),
            max_num_seqs=self.config.max_num_seqs, step_ms=self.stats.step_ms,
            tokens_per_step=self.stats.tokens_per_step, acceptance=self.stats.acceptance,
            counters=replace(copy.deepcopy(self.telemetry.counters), fallbacks=dict(self.stats.fallbacks)),
        )

    async def _report_loop(self) -> None:
        """Push this replica's load to the Router every ``stats_interval_s`` (never on the token path)."""
        silent = False  # stuck: no reports, so that the Router stops sending requests here
        while True:
            load = self.load()
            self.telemetry.report(active=load.active, queued=load.waiting)
            stuck = self.stuck()
            if stuck is not None and not silent:
                log.error("%s: no more load reports to the Router until it moves again", stuck)
            silent = stuck is not None
            try:
                if not silent:
                    await self.router.report.remote(load)
            except (RayActorError, RayTaskError) as err:
                log.warning("load report to the Router failed: %s", err)
            await asyncio.sleep(self.config.stats_interval_s)
