"""The speculative-decoding loop, written once and free of Serve: the offline ``generate`` (evaluator, benches,
training data, tests) and the Target replica (``app/serving/target.py``) both drive a ``SpecLoop``.

Owns: the requests being decoded (prompt, sampling parameters, tokens committed, per-request statistics, whether
the request still speculates), admission into the engine (one batched prefill; a batch that raises is admitted
again one by one, so only the request at fault fails), and the round: the draft gate -> the drafter's hooks gathered
since the last call (``DraftCall``; the caller carries it to the drafter and back, so the transport is the
caller's) -> per request the drafter's block or the prompt-lookup draft, whichever expects more accepted tokens
(``prefer_lookup``) -> verify lengths under the policy over the drafted batch -> one ragged verify -> commit
(statistics, the lookup's histories, the drafter's next updates and finishes). Also: cancelling a request and
moving requests to plain decoding (fail-over).

Does not own: queues, threads, transports, streaming, metrics (the Target replica's), what to draft (a
``Proposer``, hosted by ``ProposerHost``), how much to verify (the scheduler passed in: ``should_draft``,
``schedule``, ``observe``, as ``app.scheduling.scheduler.VerifyScheduler`` provides). Not thread-safe: one caller
drives a loop, on the thread that runs the engine.

Shape symbols: B requests in a round, K block size (gamma).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, fields, replace
from typing import Protocol, Sequence

import torch

from app.drafters.lookup import PromptLookup, prefer_lookup
from app.engine.admission import first_deferred, prefill_batch_size
from app.engine.contract import Engine, Proposer
from app.engine.errors import CapacityError
from app.engine.types import (
    DraftBlock, FinishReason, NewRequest, SamplingParams, StepOutput, TokenLogprob, accepted_length,
)
from app.engine.wire import tensors_from_wire, tensors_to_wire

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- drafter hooks

@dataclass(frozen=True)
class DraftStart:
    """A request the drafter has not seen: its prompt and the prefill's output (first token, prompt features)."""

    request_id: str
    prompt_ids: list[int]
    first: StepOutput
    params: SamplingParams  # the drafter drafts at the request's temperature


@dataclass(frozen=True)
class DraftCall:
    """What the loop tells its drafter: at most one call per round, none in rounds the draft gate skips (the hooks
    of those rounds travel with the next call)."""

    starts: list[DraftStart] = field(default_factory=list)
    updates: list[StepOutput] = field(default_factory=list)  # outputs since the last call, in order (new features)
    finished: list[str] = field(default_factory=list)  # requests to forget (done, cancelled, failed over)
    propose: list[str] = field(default_factory=list)  # requests to draft this round, in batch order

    def __reduce__(self):
        """Pickled (to a Drafter replica) with every output's features in one buffer (``app.engine.wire``)."""
        outputs = [start.first for start in self.starts] + list(self.updates)
        meta, data = tensors_to_wire([out.features for out in outputs])
        bare = [replace(out, features=None) for out in outputs]
        starts = [replace(start, first=out) for start, out in zip(self.starts, bare)]
        return _call_from_wire, (_fields(self) | {"starts": starts, "updates": bare[len(starts):]}, meta, data)


@dataclass(frozen=True)
class DraftRound:
    """The drafter's answer: blocks and confidences for ``DraftCall.propose`` (minus ``missing``)."""

    blocks: list[DraftBlock]
    # [B, K] float32 calibrated per-position confidences, rows aligned with ``blocks``
    confidences: torch.Tensor
    missing: list[str] = field(default_factory=list)  # requests this drafter holds no state for
    drafter_ms: float = 0.0  # time inside the drafter for this call (hooks + drafting), without transport (ms)

    def __reduce__(self):
        """Pickled (back to the target) with every block's tensors and the confidences in one buffer
        (``app.engine.wire``)."""
        meta, data = tensors_to_wire([self.confidences] + [t for b in self.blocks
                                                           for t in (b.tokens, b.probs, b.prob_ids)])
        bare = [replace(b, tokens=None, probs=None, prob_ids=None) for b in self.blocks]
        return _round_from_wire, (_fields(self) | {"blocks": bare, "confidences": None}, meta, data)


def _fields(message) -> dict:
    """A message dataclass's fields by name (what its ``__reduce__`` sends, tensors replaced)."""
    return {f.name: getattr(message, f.name) for f in fields(message)}


def _call_from_wire(kwargs: dict, meta: list, data) -> DraftCall:
    """``DraftCall.__reduce__``'s inverse."""
    starts, updates = kwargs["starts"], kwargs["updates"]
    features = tensors_from_wire(meta, data)
    outputs = [replace(out, features=f) for out, f in zip([s.first for s in starts] + updates, features, strict=True)]
    starts = [replace(start, first=out) for start, out in zip(starts, outputs)]
    return DraftCall(**kwargs | {"starts": starts, "updates": outputs[len(starts):]})


def _round_from_wire(kwargs: dict, meta: list, data) -> DraftRound:
    """``DraftRound.__reduce__``'s inverse."""
    confidences, *tensors = tensors_from_wire(meta, data)
    blocks = [replace(b, tokens=tensors[3 * i], probs=tensors[3 * i + 1], prob_ids=tensors[3 * i + 2])
              for i, b in enumerate(kwargs["blocks"])]
    return DraftRound(**kwargs | {"blocks": blocks, "confidences": confidences})


class ProposerHost:
    """A proposer and the set of requests it holds state for, applying ``DraftCall``s in order (the drafter side of
    a round, in this process or a Drafter replica's).

    Args:
        proposer: the drafter; it leaves the round's confidences ``[B, K]`` in ``last_proposal.confidences`` after
            ``propose`` (every trained drafter, n-gram and the mock do), else the round's confidences are ones.
        gamma: K, the width of the confidences of a call that proposes nothing.
    """

    def __init__(self, proposer: Proposer, *, gamma: int) -> None:
        self.proposer = proposer
        self.gamma = gamma
        self._live: set[str] = set()

    @property
    def num_states(self) -> int:
        """Requests this host holds drafter state for (leak checks)."""
        return len(self._live)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the state of these requests (finished, cancelled or failed over; unknown ids are ignored).

        An id stays counted in ``num_states`` until the proposer has dropped it, so a leak stays visible.
        """
        for rid in request_ids:
            if rid in self._live:
                self.proposer.finish(rid)
                self._live.discard(rid)

    def draft(self, call: DraftCall) -> DraftRound:
        """Apply the hooks gathered since the last call, then draft ``call.propose``.

        A call may carry several rounds (the draft gate skips the drafter some rounds), so a request can start, step
        and finish within one call: starts are applied first, then the steps in order, then the finishes; a request
        that starts and finishes in the same call is never started.

        Returns:
            blocks and confidences ``[B, K]`` for the proposed ids this host holds state for; the others are listed
            in ``missing``.
        Raises:
            Whatever the proposer raises.
        """
        t0 = time.perf_counter()
        finished = set(call.finished)
        for s in call.starts:
            if s.request_id in finished:
                continue
            self._live.add(s.request_id)  # before start: a start that raises half-way is still forgotten
            if hasattr(self.proposer, "set_params"):  # the trained drafters draft at each request's temperature
                self.proposer.set_params(s.request_id, s.params)
            self.proposer.start(s.request_id, s.prompt_ids, s.first)
        self.proposer.update([out for out in call.updates if out.request_id in self._live])
        self.forget(call.finished)
        missing = [rid for rid in call.propose if rid not in self._live]
        ids = [rid for rid in call.propose if rid in self._live]
        blocks = self.proposer.propose(ids) if ids else []
        proposal = getattr(self.proposer, "last_proposal", None)
        if not ids:
            confidences = torch.zeros(0, self.gamma)
        elif proposal is None:
            confidences = torch.ones(len(ids), max([int(b.tokens.shape[0]) for b in blocks] + [self.gamma]))
        else:
            confidences = proposal.confidences.float()
        return DraftRound(blocks=blocks, confidences=confidences, missing=missing,
                          drafter_ms=(time.perf_counter() - t0) * 1000)


# ---------------------------------------------------------------------------------------------------- the loop

class Scheduler(Protocol):
    """The draft gate and verify-length policy a loop consults (``app.scheduling.scheduler.VerifyScheduler``)."""

    def should_draft(self, requests: Sequence[str], *, draft_ms: float | None, verify_scale: float,
                     temperatures: Sequence[float], sampled: Sequence[bool]) -> bool: ...

    def schedule(self, *, confidences: torch.Tensor, min_len: torch.Tensor, max_len: torch.Tensor,
                 sampled: torch.Tensor | None, with_draft: bool) -> torch.Tensor: ...

    def observe(self, requests: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int]) -> None: ...


@dataclass
class RequestResult:
    """One request's output and statistics so far (the loop updates it every round)."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    rounds: int = 0  # verify steps (the prefill is not a round)
    num_draft: int = 0  # draft tokens verified
    num_accepted: int = 0  # draft tokens accepted
    lookup_rounds: int = 0  # rounds that verified a prompt-lookup draft
    accepted_per_round: list[int] = field(default_factory=list)  # accepted drafts in each round
    verified_per_round: list[int] = field(default_factory=list)  # l_r in each round
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when SamplingParams.logprobs is set
    # one per prompt_ids entry (the first None) when SamplingParams.prompt_logprobs is set (StepOutput's)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    speculates: bool = False  # its state lives on the drafter (and in the prompt lookup)
    fallback_cause: str | None = None  # why it was moved to plain decoding (``SpecLoop.fail_over``), or None
    error: str | None = None  # with FinishReason.ERROR: why the engine ended it (``StepOutput.error``)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (``StepOutput``'s)

    @property
    def accepted_length(self) -> float:
        """tau: tokens committed per round, accepted drafts plus the bonus token (0 before any round)."""
        return accepted_length(self.num_accepted, self.rounds)

    def record(self, out: StepOutput) -> None:
        """Append a step's committed output."""
        self.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(out.logprobs)
        self.text += out.text
        if out.finished:
            self.finish_reason, self.error, self.stop_reason = out.finish_reason, out.error, out.stop_reason


@dataclass(frozen=True)
class Round:
    """What one ``SpecLoop.step`` did.

    Attributes:
        outputs: one per request of the round, in batch order.
        committed / verified / accepted: tokens over the batch (accepted drafts + bonus) / drafts verified /
            drafts accepted.
        longest: the most drafts one request verified.
        drafted: draft tokens the round chose (drafter or lookup), before verify lengths cut them.
        lookup: requests that verified a prompt-lookup draft.
        verify_ms: the engine's verify call (ms).
        sampled: per output, whether its request samples (``SamplingParams.full_logits``): the throughput profile
            prices those rows apart (``ThroughputProfile.sampled_fraction``).
    """

    outputs: list[StepOutput]
    committed: int
    verified: int
    accepted: int
    longest: int
    drafted: int
    lookup: int
    verify_ms: float
    sampled: tuple[bool, ...]


class SpecLoop:
    """The requests on one engine and their rounds (module docstring).

    Args:
        engine: the target engine.
        gamma: K, the most draft tokens a request verifies per round (confidences are cut or padded to K); None
            (only without a scheduler and a lookup) verifies every block as proposed.
        speculates: whether admitted requests speculate (a drafter is reachable); False is plain decoding.
        scheduler: the draft gate and verify-length policy; None drafts every round and verifies whole blocks.
        lookup: prompt lookup (drafts from each request's own context, chosen per request against the drafter's
            block), or None.
        max_prefill_tokens: prompt tokens per admission forward.
        chunked_prefill: a prompt over what is left of ``max_prefill_tokens`` is prefilled in pieces of at most
            ``max_prefill_tokens`` tokens, one piece per ``continue_prefill`` (one prompt at a time, as vLLM's
            ``max_num_partial_prefills`` = 1); while requests are active one prefill forward runs between two rounds,
            so a round waits for at most one budget of prefill, and while a prompt is in pieces those forwards
            alternate between its next piece and admitting waiting prompts that fit the budget whole, so short
            requests do not wait for a long prompt's last piece. Without it a longer prompt is prefilled whole,
            alone, and admissions fill the free slots before the next round.
        strip: what an output becomes on its way to the drafter (the Target replica drops what the drafter does not
            read); default unchanged.

    Raises:
        ValueError: no ``gamma`` with a scheduler or a lookup; ``chunked_prefill`` on an engine without it
            (``Engine.supports_chunked_prefill``).
    """

    def __init__(self, engine: Engine, *, gamma: int | None, speculates: bool, scheduler: Scheduler | None = None,
                 lookup: PromptLookup | None = None, max_prefill_tokens: int = 2048, chunked_prefill: bool = False,
                 strip=None) -> None:
        if gamma is None and (scheduler is not None or lookup is not None):
            raise ValueError("a loop with a scheduler or a prompt lookup needs gamma")
        if chunked_prefill and not engine.supports_chunked_prefill:
            raise ValueError(f"chunked prefill needs an engine that supports it; {type(engine).__name__} here does "
                             "not (batch-invariant mode?)")
        self.engine = engine
        self.gamma = gamma
        self.speculates = speculates
        self.scheduler = scheduler
        self.lookup = lookup if speculates else None
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill = chunked_prefill
        self.strip = strip or (lambda out: out)
        self.active: dict[str, RequestResult] = {}
        self.prefilling: dict[str, NewRequest] = {}  # admitted, prompt not wholly prefilled yet (chunked prefill)
        self._prefilled = False  # a prefill forward ran since the last round
        self._piece_next = False  # while a prompt is in pieces: its piece, not an admission, is the next forward
        self._starts: list[DraftStart] = []
        self._updates: list[StepOutput] = []
        self._finished: list[str] = []

    # ------------------------------------------------------------------ admission

    def admission_size(self, prompts: Sequence[Sequence[int]], *, max_active: int | None = None,
                       params: Sequence[SamplingParams] | None = None) -> int:
        """How many of the waiting prompts (token ids, in queue order; ``params``: their settings, one per prompt at
        least as far as the free slots reach, where one may ask for ``prompt_logprobs``) the next ``admit`` takes: as
        many as fit the free KV slots (and ``max_active`` active requests, when given) and ``max_prefill_tokens``
        (0: none fits).
        The budget counts the tokens each prefill computes (``Engine.prefill_tokens``: a prefix reused from the
        prefix cache is free), as vLLM's ``max_num_batched_tokens`` does. With chunked prefill the last prompt taken
        may pass it (its first piece fills the budget); while requests are active none is taken after a prefill
        forward since the last round; while a prompt is in pieces, only prompts that fit the budget whole, and only
        on admission's turn (``piece_due``: the forwards alternate). With prefix caching, a prompt that would reuse
        a long prefix from an earlier prompt of the same batch waits for the next admission
        (``admission.first_deferred``), unless it asks for ``prompt_logprobs`` (computed whole anyway)."""
        free = self.engine.num_free_slots
        if max_active is not None:
            free = min(free, max_active - len(self.active) - len(self.prefilling))
        if free <= 0 or not prompts or (self.chunked_prefill and self._prefilled and self.active):
            return 0
        if self.prefilling and self._piece_next:
            return 0
        window = list(itertools.islice(prompts, free))
        lens = [self.engine.prefill_tokens(ids, params[i] if params is not None else None)
                for i, ids in enumerate(window)]
        n = prefill_batch_size(lens, max_tokens=self.max_prefill_tokens, max_requests=free)
        if self.prefilling:  # one prompt in pieces at a time: the others only whole
            n = n if sum(lens[:n]) <= self.max_prefill_tokens else 0
        elif self.chunked_prefill and n < len(window) and sum(lens[:n]) < self.max_prefill_tokens:
            n += 1  # the rest of the budget starts the next prompt
        if not (self.engine.prefix_caching and n):
            return n
        whole = [p.whole_prompt for p in params[:n]] if params is not None else ()
        return first_deferred(window[:n], lens[:n], whole=whole)

    @property
    def piece_due(self) -> bool:
        """Whether ``continue_prefill`` is the next prefill forward: a prompt is in pieces and, while requests are
        active, no prefill forward ran since the last round."""
        return bool(self.prefilling) and not (self._prefilled and self.active)

    def _limits(self, requests: Sequence[NewRequest]) -> list[int] | None:
        """Per request, the prompt tokens its admission computes now (chunked prefill), or None when every
        prompt is prefilled whole.

        Raises:
            ValueError: a request beyond the budget (the batch was not sized by ``admission_size``).
        """
        # a prompt computes at most its length: short batches need no prefix match (admission_size did one already)
        if not self.chunked_prefill or sum(len(r.prompt_ids) for r in requests) <= self.max_prefill_tokens:
            return None
        lens = [self.engine.prefill_tokens(r.prompt_ids, r.params) for r in requests]
        if sum(lens) <= self.max_prefill_tokens:
            return None
        before = sum(lens[:-1])
        if before >= self.max_prefill_tokens:
            raise ValueError(f"{len(requests)} prompts of {lens} tokens to prefill exceed max_prefill_tokens "
                             f"{self.max_prefill_tokens} before the last (size admissions with admission_size)")
        return lens[:-1] + [self.max_prefill_tokens - before]

    def admit(self, requests: Sequence[NewRequest]) -> list[tuple[RequestResult, StepOutput] | Exception | None]:
        """Prefill ``requests`` in one forward; per request its record and first output, the exception that
        refused it (an ``EngineError``, or a bug's), or None: a chunked prefill under way (``continue_prefill``
        goes on with it). A batch that raises is admitted again one by one (a failed ``add_requests`` holds no slot),
        so only the request at fault fails. Admitted requests that did not finish at once join ``active`` (and
        speculate when the loop does).

        Raises:
            ValueError: the batch was not sized by ``admission_size`` (over the budget, or a second prompt in pieces).
        """
        limits = self._limits(requests)
        if limits is not None and self.prefilling:
            raise ValueError(f"request {next(iter(self.prefilling))!r} is still being prefilled in pieces; admit "
                             "only prompts that fit the budget whole until it is done")
        self._prefilled, self._piece_next = True, bool(self.prefilling)
        try:
            results: list[StepOutput | Exception | None] = self._add(list(requests), limits)
        except Exception as err:
            if len(requests) == 1:
                return [err]
            log.warning("batched prefill of %d requests failed (%s: %s); admitting them one by one", len(requests),
                        type(err).__name__, err)
            results = []
            for i, r in enumerate(requests):
                try:
                    results.append(self._add([r], [limits[i]] if limits else None)[0])
                except Exception as one:
                    results.append(one)
        admitted: list[tuple[RequestResult, StepOutput] | Exception | None] = []
        for request, result in zip(requests, results):
            if result is None:
                self.prefilling[request.request_id] = request
            admitted.append(result if result is None or isinstance(result, Exception) else self._started(request,
                                                                                                         result))
        return admitted

    def _add(self, requests: list[NewRequest], limits: list[int] | None) -> list[StepOutput | None]:
        """``Engine.add_requests``, with ``limits`` only when given (an engine without chunked prefill takes none)."""
        return list(self.engine.add_requests(requests, limits=limits) if limits else self.engine.add_requests(requests))

    def continue_prefill(self) -> tuple[str, tuple[RequestResult, StepOutput] | Exception | None]:
        """The next piece (at most ``max_prefill_tokens`` tokens) of the prompt being prefilled in pieces.

        Returns:
            Its request id and, as ``admit`` gives it: its record and first output once the prompt is wholly
            prefilled, None while pieces are left, or the exception that ended it (its slot is free then).

        Raises:
            ValueError: no prompt is being prefilled.
        """
        if not self.prefilling:
            raise ValueError("no prompt is being prefilled")
        rid, request = next(iter(self.prefilling.items()))
        self._prefilled, self._piece_next = True, False
        try:
            out = self.engine.continue_prefill({rid: self.max_prefill_tokens})[0]
        except Exception as err:  # a bug: the request fails, its slot is freed
            self.cancel(rid)
            return rid, err
        if out is None:
            return rid, None
        del self.prefilling[rid]
        return rid, self._started(request, out)

    def _started(self, request: NewRequest, first: StepOutput) -> tuple[RequestResult, StepOutput]:
        """The record of a request whose prefill is done; unless it finished at once it joins ``active`` (and
        speculates when the loop does)."""
        res = RequestResult(request.request_id, list(request.prompt_ids), request.params)
        res.record(first)
        if not first.finished:
            self.active[request.request_id] = res
            if self.speculates:
                res.speculates = True
                self._starts.append(DraftStart(request.request_id, list(request.prompt_ids), self.strip(first),
                                               request.params))
                if self.lookup is not None:
                    self.lookup.start(request.request_id, request.prompt_ids, first)
        return res, first

    # ------------------------------------------------------------------ the round

    def speculating(self) -> list[str]:
        """Active requests that speculate, in batch order."""
        return [rid for rid, r in self.active.items() if r.speculates] if self.speculates else []

    def should_draft(self, request_ids: Sequence[str], *, draft_ms: float | None = None,
                     verify_scale: float = 1.0) -> bool:
        """The draft gate for a round of ``request_ids`` (the speculating ones; always open without a scheduler)."""
        if not request_ids:
            return False
        if self.scheduler is None:
            return True
        params = [self.active[rid].params for rid in request_ids]
        return self.scheduler.should_draft(request_ids, draft_ms=draft_ms, verify_scale=verify_scale,
                                           temperatures=[p.temperature for p in params],
                                           sampled=[p.full_logits for p in params])

    def take_call(self, propose: Sequence[str] = ()) -> DraftCall:
        """The drafter call carrying every hook gathered since the last one, proposing ``propose``."""
        call = DraftCall(starts=self._starts, updates=self._updates, finished=self._finished, propose=list(propose))
        self._starts, self._updates, self._finished = [], [], []
        return call

    @property
    def has_pending_finishes(self) -> bool:
        """Whether the drafter still has state to forget (a call without proposals delivers it)."""
        return bool(self._finished)

    def step(self, drafted: DraftRound | None, *, speculate: bool = True) -> Round:
        """One round over every active request: choose drafts (``drafted``: the drafter's answer this round, None
        when it was not called), cut them to verify lengths, verify, commit. ``speculate`` False: a plain round (no
        draft verified, prompt lookup's included; ``drafted`` must be None), as the speculation guard asks.

        Raises:
            ValueError: a drafter answer for a plain round.
            The engine's errors (a bug: every request was validated at admission).
        """
        if not speculate and drafted is not None:
            raise ValueError("a plain round (speculate=False) takes no drafter answer")
        ids = list(self.active)
        blocks = {rid: DraftBlock(rid, torch.zeros(0, dtype=torch.long)) for rid in ids}
        drafts, confidences, from_lookup = self._choose(self.speculating() if speculate else [], drafted)
        sampled = tuple(self.active[rid].params.full_logits for rid in ids)
        if drafts:
            blocks.update(self._lengths(drafts, confidences, sampled=sampled,
                                        with_draft=drafted is not None and bool(drafted.blocks)))
        t0 = time.perf_counter()
        outputs = self.engine.verify([blocks[rid] for rid in ids])
        verify_ms = (time.perf_counter() - t0) * 1000
        self._prefilled = False
        if self.scheduler is not None:  # the draft gate weighs the drafter call: it learns from its blocks only
            observed = [o for o in outputs if blocks[o.request_id].tokens.numel() and o.request_id not in from_lookup]
            if observed:
                self.scheduler.observe([o.request_id for o in observed], [o.num_draft for o in observed],
                                       [o.num_accepted for o in observed])
        committed = verified = accepted = lookup = 0
        speculated = []
        for out in outputs:
            res = self.active[out.request_id]
            by_lookup = int(out.num_draft > 0 and out.request_id in from_lookup)
            res.record(out)
            res.rounds += 1
            res.num_draft += out.num_draft
            res.num_accepted += out.num_accepted
            res.lookup_rounds += by_lookup
            res.accepted_per_round.append(out.num_accepted)
            res.verified_per_round.append(out.num_draft)
            committed += len(out.new_token_ids)
            verified += out.num_draft
            accepted += out.num_accepted
            lookup += by_lookup
            if res.speculates:
                self._updates.append(self.strip(out))
                if not out.finished:  # a finished request's lookup history is dropped below
                    speculated.append(out)
            if out.finished:
                del self.active[out.request_id]
                self._forget(res)
        if self.lookup is not None and speculated:
            self.lookup.update(speculated)
        return Round(outputs=outputs, committed=committed, verified=verified, accepted=accepted,
                     longest=max((out.num_draft for out in outputs), default=0),
                     drafted=sum(int(b.tokens.shape[0]) for b in drafts), lookup=lookup, verify_ms=verify_ms,
                     sampled=sampled)

    def _choose(self, speculative: list[str], drafted: DraftRound | None
                ) -> tuple[list[DraftBlock], torch.Tensor, set[str]]:
        """This round's draft per speculating request: the drafter's block or the prompt-lookup draft, whichever
        expects more accepted tokens (``prefer_lookup``); without a drafter answer, the lookup draft.

        Returns:
            the chosen blocks in batch order, their confidences ``[n, K]``, and the ids whose block is a lookup draft.
        """
        k = self.gamma
        chosen: dict[str, tuple[DraftBlock, torch.Tensor]] = {}
        if drafted is not None and drafted.blocks:
            conf = drafted.confidences
            if k is not None:
                conf = torch.nn.functional.pad(conf[:, :k], (0, k - min(k, conf.shape[1])))
            chosen = {b.request_id: (b, conf[i]) for i, b in enumerate(drafted.blocks)
                      if b.request_id in self.active and self.active[b.request_id].speculates}
        from_lookup: set[str] = set()
        if self.lookup is not None and speculative:
            found, found_conf = self.lookup.drafts(speculative,
                                                   [self.active[rid].params.greedy for rid in speculative])
            drafter_conf = torch.stack([chosen[rid][1] if rid in chosen else torch.zeros(k) for rid in speculative])
            drawn = torch.tensor([rid in chosen and chosen[rid][0].verified_against_probs(self.active[rid].params)
                                  for rid in speculative], dtype=torch.bool)
            lengths = torch.tensor([len(chosen[rid][0].tokens) if rid in chosen else 0 for rid in speculative])
            for i in prefer_lookup(drafter_conf, found_conf, drawn=drawn, lengths=lengths).nonzero().flatten().tolist():
                chosen[speculative[i]] = (found[i], found_conf[i])
                from_lookup.add(speculative[i])
        if not chosen:
            return [], torch.zeros(0, k or 0), from_lookup
        order = [rid for rid in self.active if rid in chosen]
        return [chosen[rid][0] for rid in order], torch.stack([chosen[rid][1] for rid in order]), from_lookup

    def _lengths(self, drafts: list[DraftBlock], confidences: torch.Tensor, *, sampled: tuple[bool, ...],
                 with_draft: bool) -> dict[str, DraftBlock]:
        """Verify lengths for the drafted requests under the policy, each capped by K and the request's max_tokens
        left; without a scheduler the blocks as proposed. The policy sees the whole verify step: every active
        request (one without a draft: confidences 0, max_len 0), which are sampled, and whether the drafter ran this
        round (``with_draft``).

        Args:
            drafts: one block per drafted request, in the order of ``self.active``; confidences: [n, K] theirs.
            sampled: [B] per active request, in order, ``SamplingParams.full_logits``.
        """
        if self.scheduler is None:
            return {b.request_id: b for b in drafts}
        ids = list(self.active)
        position = {rid: i for i, rid in enumerate(ids)}
        rows = torch.tensor([position[b.request_id] for b in drafts], dtype=torch.long)
        conf = torch.zeros(len(ids), confidences.shape[1])
        conf[rows] = confidences.clamp(0, 1)
        max_len = torch.zeros(len(ids), dtype=torch.long)
        max_len[rows] = torch.tensor([
            min(b.tokens.shape[0], self.gamma,
                self.active[b.request_id].params.max_tokens - len(self.active[b.request_id].token_ids) - 1)
            for b in drafts
        ], dtype=torch.long).clamp(min=0)
        lengths = self.scheduler.schedule(confidences=conf, min_len=torch.zeros_like(max_len), max_len=max_len,
                                          sampled=torch.tensor(sampled, dtype=torch.bool), with_draft=with_draft)
        return {b.request_id: replace(b, verify_len=int(lengths[r])) for b, r in zip(drafts, rows.tolist())}

    # ------------------------------------------------------------------ ending requests early

    def cancel(self, request_id: str) -> RequestResult | None:
        """End a request before it finished (a chunked prefill under way included): its KV slot is freed now, its
        drafter state with the next call.

        Returns:
            the request's record, or None when it is not active.
        """
        self.prefilling.pop(request_id, None)
        res = self.active.pop(request_id, None)
        if res is not None:
            self._forget(res)
        if self.engine.has_request(request_id):
            self.engine.release(request_id)
        return res

    def fail_over(self, request_ids: Sequence[str], cause: str) -> list[str]:
        """Move speculating requests to plain decoding for the rest of their life (their lookup history and the
        drafter hooks not yet sent for them are dropped now; drafter state that calls already made is not touched:
        the caller knows whether the drafter still holds it).

        Returns:
            the ids moved (active and speculating, each once).
        """
        moved = []
        for rid in dict.fromkeys(request_ids):
            res = self.active.get(rid)
            if res is not None and res.speculates:
                res.speculates = False
                res.fallback_cause = cause
                if self.lookup is not None:
                    self.lookup.finish(rid)
                moved.append(rid)
        if moved:
            gone = set(moved)
            self._starts = [s for s in self._starts if s.request_id not in gone]
            self._updates = [out for out in self._updates if out.request_id not in gone]
        return moved

    def forget_later(self, request_ids: Sequence[str]) -> None:
        """Have the next drafter call drop these requests' state (a failed call may have left it there)."""
        self._finished.extend(request_ids)

    def stop_speculating(self) -> None:
        """No request speculates from now on (the drafter is gone for good); pending hooks are dropped."""
        self.speculates = False
        self._starts, self._updates, self._finished = [], [], []

    def _forget(self, res: RequestResult) -> None:
        if res.speculates:
            self._finished.append(res.request_id)
            if self.lookup is not None:
                self.lookup.finish(res.request_id)


# ---------------------------------------------------------------------------------------------------- offline driver

@dataclass
class GenerateStats:
    """Timing of one ``generate`` call (seconds)."""

    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    proposer: Proposer | None = None,
    max_batch: int | None = None,
    max_prefill_tokens: int = 2048,
    chunked_prefill: bool = False,
    id_prefix: str = "req",
) -> tuple[list[RequestResult], GenerateStats]:
    """Decode ``prompts`` to completion with continuous batching (at most ``max_batch`` active at once) through a
    ``SpecLoop`` whose drafter is hosted in this process; waiting prompts are prefilled together, up to
    ``max_prefill_tokens`` prompt tokens per forward (``chunked_prefill``: a longer prompt in pieces, one prefill
    forward before each round, ``SpecLoop``). Every round drafts, and verifies each block as proposed.

    With ``proposer=None`` this is plain decoding (every round verifies 0 drafts). The proposer's hooks run as a
    Drafter replica runs them (``ProposerHost``): ``start`` and the last round's ``update`` and ``finish`` before each
    ``propose``; every committed output reaches ``update``, each request's last one included.

    Returns:
        Per-prompt results in input order, and timing stats.

    Raises:
        ValueError: not one params per prompt, or ``max_batch`` / ``max_prefill_tokens`` below 1.
        CapacityError: the engine's slots are all held by requests that are not this call's.
        Whatever the engine or the proposer raise (bad prompts or params, a failed step): no request of the call is
            left in the engine nor in the proposer then.
    """
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(params_list)} params for {len(prompts)} prompts")
    for name, value in (("max_batch", max_batch), ("max_prefill_tokens", max_prefill_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    host = ProposerHost(proposer, gamma=int(getattr(proposer, "gamma", 0))) if proposer is not None else None
    loop = SpecLoop(engine, gamma=None, speculates=host is not None, max_prefill_tokens=max_prefill_tokens,
                    chunked_prefill=chunked_prefill)
    limit = min(max_batch or engine.max_num_seqs, engine.max_num_seqs)
    results: dict[str, RequestResult] = {}
    waiting = list(range(len(prompts)))
    stats = GenerateStats()
    start = time.perf_counter()

    def started(admissions: list) -> None:
        if refused := [a for a in admissions if isinstance(a, Exception)]:
            raise refused[0]
        results.update((a[0].request_id, a[0]) for a in admissions if a is not None)

    try:
        while waiting or loop.active or loop.prefilling:
            while n := loop.admission_size([prompts[i] for i in waiting], max_active=limit,
                                           params=[params_list[i] for i in waiting]):
                admitted, waiting = waiting[:n], waiting[n:]
                started(loop.admit([NewRequest(f"{id_prefix}-{i}", prompts[i], params_list[i]) for i in admitted]))
            if loop.piece_due:
                started([loop.continue_prefill()[1]])
            if not loop.active:
                if waiting and not loop.prefilling and not engine.num_free_slots:  # other callers hold every slot
                    raise CapacityError(f"{len(waiting)} prompts wait for a KV cache slot, and the engine's "
                                        f"{engine.max_num_seqs} slots are held by requests of other callers")
                continue
            t0 = time.perf_counter()
            ids = loop.speculating()
            drafted = host.draft(loop.take_call(ids)) if host is not None and loop.should_draft(ids) else None
            t1 = time.perf_counter()
            loop.step(drafted)
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
            stats.rounds += 1
    except BaseException:  # neither the engine nor the proposer keeps a request of this call: both may be reused
        for rid in list(loop.active) + list(loop.prefilling):
            loop.cancel(rid)
        if host is not None:
            host.forget(list(results))  # every request of the call the proposer can have started
        raise
    if host is not None:
        host.draft(loop.take_call())  # the last outputs and finishes reach the drafter
    stats.wall_s = time.perf_counter() - start
    return [results[f"{id_prefix}-{i}"] for i in range(len(prompts))], stats
