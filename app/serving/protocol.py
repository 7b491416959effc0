"""Typed messages between the serving deployments (ingress -> target -> drafter), all plain picklable dataclasses.

Owns the wire format inside the application (the drafter call's records, ``DraftCall`` and ``DraftRound``, are the
loop's, ``app/loop.py``; their size bounds are here); the OpenAI HTTP schemas live in ``openai_api.py``. Errors travel
as values (``ErrorItem`` with an HTTP status), never as exceptions across replicas, so the ingress can answer
with a structured 4xx / 503 before it sends any byte of a response.

Shape symbols: B requests in a drafter call, K block size (gamma), C committed tokens of one request in one step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal

from app.engine.types import DRAFT_TOP_K, ChatTemplateOptions, SamplingParams, StepOutput, accepted_length

if TYPE_CHECKING:  # the drafter call's own types (app/loop.py) need torch; the ingress reads this module without it
    from app.loop import DraftCall, DraftRound

# Serialisation overhead of one pickled tensor / message object beyond its data (bytes; a pickled 1-element tensor
# takes about 400 bytes): the bounds below add it per tensor so they stay upper bounds for small batches.
PICKLE_OVERHEAD = 1024

# The Router's answer to ``choose_target`` once a graceful shutdown drains the server (never a replica id).
DRAINING = "<draining>"

# Why a request was moved to plain decoding for the rest of its life (``drafter_client.fallback_cause`` for a failed
# drafter call; ``missing_state``: the drafter answered without the request's state, e.g. after a restart;
# ``drafter_backoff``: it would have speculated while the target backed off from a Drafter replica that stopped
# answering, ``drafter_client.BACKOFF_CAUSES``).
FALLBACK_CAUSES = ("transport", "timeout", "drafter_unavailable", "drafter_overloaded", "cancelled", "reply_too_large",
                   "drafter_error", "missing_state", "drafter_backoff")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation for a target replica: chat messages or a raw prompt (text or token ids), and its sampling
    settings."""

    request_id: str
    params: SamplingParams
    messages: list[dict[str, str]] | None = None
    template: ChatTemplateOptions = ChatTemplateOptions()  # how the chat template renders ``messages``
    prompt: str | list[int] | None = None
    # completions' echo: the response shows the prompt as sent (a text prompt), or as the model takes it ("tokens": a
    # token-id or truncated prompt, whose text the first chunk then brings: TextChunk.prompt_text); scored prompt
    # tokens then carry the characters each brings to the echoed text (TokenLogprobText.text_len)
    echo: Literal["no", "sent", "tokens"] = "no"
    # vLLM's: keep only the prompt's last k token ids (-1: the context length), after tokenization
    truncate_prompt_tokens: int | None = None
    # vLLM's: the target replica's queue admits lower values first (AppConfig.scheduling_policy "priority")
    priority: int = 0
    # a text prompt or chat template's text tokenized with the tokenizer's own special tokens (a Llama tokenizer's
    # BOS): completions' default, as in vLLM (a chat template writes them itself); token-id prompts are taken as sent
    add_special_tokens: bool = False
    # the field that set params.max_tokens, which errors about it name (a chat request may send max_completion_tokens)
    max_tokens_param: str = "max_tokens"
    # the field that set params.guided, which errors about it name (vLLM's structured_outputs, or response_format)
    guided_param: str = "response_format"
    # params.max_tokens is not the request's: the API's default (the request set none), lowered to what the context
    # leaves the prompt, or the 1 token of completions' max_tokens 0 (CompletionRequest.prompt_only)
    max_tokens_default: bool = False

    def api_param(self, param: str | None) -> str | None:
        """The field of this request's OpenAI body that an engine error's ``param`` names (``openai_param``)."""
        return openai_param(param, chat=self.messages is not None, max_tokens_param=self.max_tokens_param,
                            guided_param=self.guided_param)


def openai_param(param: str | None, *, chat: bool, max_tokens_param: str = "max_tokens",
                 guided_param: str = "response_format") -> str | None:
    """The OpenAI request field for an engine error's ``param`` (a ``SamplingParams`` field, or ``prompt``): the
    prompt is a chat's ``messages``, ``max_tokens`` and ``guided`` the fields that set them, ``logprobs`` a chat's
    ``top_logprobs``; other fields keep their names (None stays None)."""
    return {"prompt": "messages" if chat else "prompt", "max_tokens": max_tokens_param,
            "logprobs": "top_logprobs" if chat else "logprobs", "guided": guided_param}.get(param, param)


@dataclass(frozen=True)
class SpecStats:
    """Speculative statistics of one request (opt-in response field)."""

    rounds: int = 0  # verify steps
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # draft tokens accepted
    lookup_rounds: int = 0  # rounds whose draft came from prompt lookup (the others: the drafter's, or none)
    fallback: bool = False  # the drafter failed and the request finished with plain decoding
    fallback_cause: str | None = None  # why (``drafter_client.fallback_cause``), when ``fallback``

    @property
    def mean_accepted_length(self) -> float:
        """tau: committed tokens per round (accepted drafts + the bonus/recovered token)."""
        return accepted_length(self.accepted_tokens, self.rounds)

    def to_json(self) -> dict:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "lookup_rounds": self.lookup_rounds,
            "fallback": self.fallback,
            "fallback_cause": self.fallback_cause,
        }

    @staticmethod
    def total(stats: list["SpecStats"]) -> "SpecStats":
        """The statistics of several choices of one HTTP request, summed (``fallback``: any of them; its cause: the
        first fallen-back choice's)."""
        causes = [s.fallback_cause for s in stats if s.fallback]
        return SpecStats(rounds=sum(s.rounds for s in stats), draft_tokens=sum(s.draft_tokens for s in stats),
                         accepted_tokens=sum(s.accepted_tokens for s in stats),
                         lookup_rounds=sum(s.lookup_rounds for s in stats), fallback=bool(causes),
                         fallback_cause=causes[0] if causes else None)


# vLLM's bucket edges for its request histograms (``vllm/v1/metrics/loggers.py``), so that a vLLM dashboard's quantiles
# read the same resolution from this server: time to first token, inter-token latency, and end-to-end / queue time (s).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0)
# Tokens per request, 1-2-5 per decade (vLLM's pattern, here to a million tokens whatever the context length, so that
# every replica's counts add up).
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5)) + (1e6,)


@dataclass
class BucketCounts:
    """A cumulative histogram that travels in load reports and adds up over replicas: per bucket the number of
    observations ``<= bounds[i]`` and above the previous edge (``counts[-1]``: above the last edge), their sum and
    count; ``GET /metrics`` writes it as a Prometheus histogram (cumulative ``le`` buckets).

    Raises:
        ValueError: adding counts over other bucket edges.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # [len(bounds) + 1]
    total: float = 0.0  # sum of the observations

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def __add__(self, other: "BucketCounts") -> "BucketCounts":
        if self.bounds != other.bounds:
            raise ValueError(f"bucket edges differ: {self.bounds} and {other.bounds}")
        return BucketCounts(self.bounds, [a + b for a, b in zip(self.counts, other.counts)], self.total + other.total)


def _buckets(bounds: tuple[float, ...]):
    return field(default_factory=lambda: BucketCounts(bounds))


@dataclass
class SpecCounters:
    """A target replica's cumulative counts since it started (``GET /metrics``; the Router sums the replicas').

    Words as in vLLM: a *draft* is one request's verified block in one round (a round verifying no draft token for
    the request is none).
    """

    drafts: int = 0
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [K] accepted tokens at block position k (0-based)
    rounds: int = 0
    round_requests: int = 0  # requests in each round, summed over rounds (/ rounds: the mean batch)
    round_seconds: float = 0.0  # whole rounds: drafter call, scheduling, verify step, streaming
    verify_seconds: float = 0.0  # of which the verify steps
    drafter_wait_seconds: float = 0.0  # of which waiting for drafter calls
    verify_cpu_wait_seconds: float = 0.0  # in verify steps, the engine thread ready to run but waiting for a CPU
    output_tokens: int = 0  # tokens streamed to clients (prefill first tokens included)
    requests_finished: int = 0
    requests_length: int = 0  # of them, those that reached max_tokens (finish reason length; the rest: stop)
    requests_cancelled: int = 0  # requests whose client went away before they finished
    guard_plain_rounds: int = 0  # rounds the speculation guard ran plain although requests speculate
    prefix_cache_queries: int = 0  # prompt tokens admitted
    prefix_cache_hits: int = 0  # prompt tokens of them reused from the prefix cache
    # cause (``FALLBACK_CAUSES``) -> requests moved to plain decoding; a load report copies the replica's own count
    # (``ReplicaStats.fallbacks``) here
    fallbacks: dict[str, int] = field(default_factory=dict)
    # per request, as vLLM measures them (from its arrival at the target replica; s): waiting for a KV slot, to its
    # first token, between its token emissions (one per round it commits tokens in), to its last token; and its
    # prompt and output tokens
    queue_s: BucketCounts = _buckets(REQUEST_BUCKETS_S)
    ttft_s: BucketCounts = _buckets(TTFT_BUCKETS_S)
    itl_s: BucketCounts = _buckets(ITL_BUCKETS_S)
    e2e_s: BucketCounts = _buckets(REQUEST_BUCKETS_S)
    prompt_len: BucketCounts = _buckets(TOKEN_BUCKETS)
    output_len: BucketCounts = _buckets(TOKEN_BUCKETS)

    def add_round(self, num_draft: list[int], num_accepted: list[int], *, round_ms: float = 0.0,
                  verify_ms: float = 0.0, drafter_wait_ms: float = 0.0, verify_cpu_wait_ms: float = 0.0) -> None:
        """One round: per request in the batch its verified and accepted draft tokens; the round's time, its verify
        step's, its wait for the drafter and the verify step's wait for a CPU (ms)."""
        self.rounds += 1
        self.round_requests += len(num_draft)
        self.round_seconds += round_ms / 1000
        self.verify_seconds += verify_ms / 1000
        self.drafter_wait_seconds += drafter_wait_ms / 1000
        self.verify_cpu_wait_seconds += verify_cpu_wait_ms / 1000
        for n, a in zip(num_draft, num_accepted):
            self.drafts += int(n > 0)
            self.draft_tokens += n
            self.accepted_tokens += a
            if a > len(self.accepted_per_pos):
                self.accepted_per_pos += [0] * (a - len(self.accepted_per_pos))
            for k in range(a):
                self.accepted_per_pos[k] += 1

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = [0] * width
        per_pos = [x + y for x, y in zip((self.accepted_per_pos + pad)[:width], (other.accepted_per_pos + pad)[:width])]
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                  if f.name not in ("accepted_per_pos", "fallbacks")}
        return SpecCounters(**summed, accepted_per_pos=per_pos,
                            fallbacks={cause: self.fallbacks.get(cause, 0) + other.fallbacks.get(cause, 0)
                                       for cause in self.fallbacks.keys() | other.fallbacks.keys()})


@dataclass(frozen=True)
class TokenLogprobText:
    """The target's log-probability of one output token and of its top alternatives, with their texts (each token
    decoded alone: a token that ends inside a UTF-8 character reads as U+FFFD, as in vLLM) and their own bytes
    (``detokenizer.TokenBytes``; None: the text's UTF-8)."""

    token: str
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: tuple[tuple[str, float], ...] = ()  # (token text, logprob), most likely first
    token_bytes: bytes | None = None
    top_bytes: tuple[bytes, ...] | None = None  # one per ``top`` entry
    # characters of the response text this token brings (``StepOutput.text_lens``); None: ``len(token)``
    text_len: int | None = None
    token_id: int | None = None
    top_ids: tuple[int, ...] = ()  # one per ``top`` entry
    rank: int | None = None  # a prompt token's (``TokenLogprob.rank``)


@dataclass(frozen=True)
class TextChunk:
    """Committed output of one request in one step (prefill or round)."""

    text: str  # detokenised delta, safe to stream
    token_ids: list[int]  # tokens committed in this step
    prompt_tokens: int
    finish_reason: str | None = None  # 'stop' | 'length' on the last chunk
    stop_reason: str | int | None = None  # on the last chunk: StepOutput's (the stop string or stop token id)
    cached_tokens: int = 0  # on the first chunk: prompt tokens reused from the prefix cache
    spec: SpecStats | None = None  # on the last chunk
    logprobs: list[TokenLogprobText] | None = None  # one per token id when the request asked for logprobs
    # on the first chunk, with SamplingParams.prompt_logprobs: one per prompt token (the first one's logprob None)
    prompt_logprobs: list[TokenLogprobText] | None = None
    prompt_text: str | None = None  # on the first chunk, with GenerateRequest.echo_ids: the prompt decoded

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def then(self, later: "TextChunk") -> "TextChunk":
        """This chunk followed by ``later`` of the same request, as one chunk."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return TextChunk(text=self.text + later.text, token_ids=self.token_ids + later.token_ids,
                         prompt_tokens=later.prompt_tokens, finish_reason=later.finish_reason,
                         stop_reason=later.stop_reason, spec=later.spec,
                         logprobs=logprobs, cached_tokens=self.cached_tokens + later.cached_tokens,
                         prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
                         prompt_text=self.prompt_text if self.prompt_text is not None else later.prompt_text)


@dataclass(frozen=True)
class TokenizeCall:
    """A prompt for a target replica to tokenize as ``generate`` would (``POST /tokenize``): a text or chat messages."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    add_special_tokens: bool = False  # GenerateRequest.add_special_tokens
    template: ChatTemplateOptions = ChatTemplateOptions()  # messages only
    token_strs: bool = False  # also each token's vocabulary string


@dataclass(frozen=True)
class ErrorItem:
    """A failure the ingress turns into an OpenAI-style JSON error with this HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


def call_bytes(call: DraftCall) -> int:
    """An upper bound of a drafter call's size on the wire (bytes): its tensors (prompt features of the starts, new
    features of the updates) plus 8 bytes a token id and ``PICKLE_OVERHEAD`` per message object."""
    outputs = [start.first for start in call.starts] + call.updates
    tensors = sum(out.features.nbytes for out in outputs if out.features is not None)
    ids = sum(len(s.prompt_ids) for s in call.starts) + sum(len(o.new_token_ids) for o in outputs)
    objects = len(outputs) + len(call.starts) + len(call.finished) + len(call.propose) + 1
    return tensors + 8 * ids + PICKLE_OVERHEAD * objects


def reply_bytes_bound(num_proposed: int, gamma: int) -> int:
    """An upper bound of the size of the ``DraftRound`` answering a call that proposes ``num_proposed`` requests with
    blocks of ``gamma`` tokens (bytes): per block its tokens [K] int64, sparse draft probabilities [K, S] float32 and
    their ids [K, S] int64 with S <= ``DRAFT_TOP_K``, its confidences [K] float32, three tensors' overhead."""
    per_block = gamma * (8 + DRAFT_TOP_K * (4 + 8) + 4) + 3 * PICKLE_OVERHEAD
    return num_proposed * per_block + PICKLE_OVERHEAD


def reply_bytes(reply: DraftRound) -> int:
    """Tensor bytes of a drafter's answer plus ``PICKLE_OVERHEAD`` per tensor (compared with ``reply_bytes_bound``)."""
    tensors = [reply.confidences] + [t for b in reply.blocks for t in (b.tokens, b.probs, b.prob_ids) if t is not None]
    return sum(t.nbytes + PICKLE_OVERHEAD for t in tensors)


class DraftReplyTooLargeError(RuntimeError):
    """A drafter's answer is larger than ``reply_bytes_bound`` promised the target (a proposer sending dense [K, V]
    draft probabilities): the target chose the transport from that bound, so the answer is refused, not sent."""


def check_reply(reply: DraftRound, *, gamma: int) -> DraftRound:
    """``reply`` when it fits ``reply_bytes_bound(len(reply.blocks), gamma)``.

    Raises:
        DraftReplyTooLargeError: it does not (the message names both sizes).
    """
    size, bound = reply_bytes(reply), reply_bytes_bound(len(reply.blocks), gamma)
    if size > bound:
        raise DraftReplyTooLargeError(
            f"draft reply of {size} bytes for {len(reply.blocks)} requests exceeds its bound of {bound} bytes "
            f"(sparse draft probabilities of at most {DRAFT_TOP_K} tokens a position)"
        )
    return reply


def strip_for_drafter(out: StepOutput) -> StepOutput:
    """The fields a drafter needs from a step output (drops text; keeps ids, counts and new features).

    The features ``[C, F]`` are copied: the engine hands out row views of the whole step's ``[sum C, F]``
    features, and a pickled view carries its entire storage, so a drafter call for a batch of B requests
    would ship the step's features B times (12 MB instead of 0.1 MB at B = 16, gamma 7 on SmolLM2-135M).
    """
    return StepOutput(
        request_id=out.request_id, new_token_ids=out.new_token_ids, num_draft=out.num_draft,
        num_accepted=out.num_accepted, finished=out.finished, finish_reason=out.finish_reason,
        features=None if out.features is None else out.features.clone(),
    )
