"""Typed values passed between the engine, the drafters and the scheduler.

Shape symbols (used in every docstring and above every tensor field of this package):

    B  batch (requests in one verify step)
    T  context length (tokens already in a request's KV cache)
    N  total new tokens in one ragged verify step, N = sum_r (1 + l_r)
    K  gamma, the draft block size; l_r <= K is request r's verify length
    V  vocabulary size
    F  feature width = len(feature_layers) * hidden_size
    C  committed tokens of one request in one step (accepted + 1 bonus/recovered)

Vocabulary of speculative decoding (as in vLLM):
    *accepted*   a draft token the target agreed with;
    *recovered*  the token sampled from the residual distribution at the first rejection;
    *bonus*      the extra target token after a fully accepted verified prefix.
A round commits ``accepted + 1`` tokens (the recovered or bonus token), unless the request ends inside it.

This module owns data definitions only; it does no computation.
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.engine.errors import InvalidRequestError

if TYPE_CHECKING:  # tensors are made where needed: the HTTP ingress reads these types without torch
    import torch


class FinishReason(str, enum.Enum):
    """Why a request stopped (OpenAI's ``finish_reason`` values)."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens reached
    ERROR = "error"  # the request could not go on (``StepOutput.error`` says why); the others of its step do


GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily
GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")  # GuidedDecoding.kind
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How the model's chat template renders a chat (vLLM's chat request fields of the same names).

    Attributes:
        add_generation_prompt: end with the header that opens the assistant's turn (a chat request's default).
        continue_final_message: leave the final message open, without its end-of-turn tokens, so the model continues
            it (a reply the client started); excludes ``add_generation_prompt``.
        template_kwargs: more variables for the template (``chat_template_kwargs``: Qwen3's ``enable_thinking``, for
            one), JSON values by name.
        sanitize_control_tokens: the text of a control token (``<|im_start|>``) inside the messages or template
            variables is encoded as text, so only the template writes control tokens (a client cannot write turns of
            other roles); Hugging Face's ``sanitize_control_tokens``.
        tools: the functions the model may call, as OpenAI's ``tools`` entries (``{"type": "function", "function":
            {...}}``), for the template to show; None: no tools.

    Raises:
        InvalidRequestError: both ``add_generation_prompt`` and ``continue_final_message``.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, object] = field(default_factory=dict)
    sanitize_control_tokens: bool = False
    tools: tuple[dict[str, object], ...] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("continue_final_message leaves the final message open: it excludes "
                                      "add_generation_prompt (set that to false)", param="continue_final_message")


@dataclass(frozen=True)
class GuidedDecoding:
    """Structured output a request must follow (OpenAI's ``response_format``, vLLM's ``structured_outputs``).

    Attributes:
        kind: one of ``GUIDED_KINDS``: ``json_object`` (any JSON object), ``json_schema`` (JSON matching ``spec``),
            ``regex`` (text ``spec`` matches whole), ``choice`` (exactly one of ``spec``'s strings) or ``grammar``
            (text the context-free grammar ``spec`` derives).
        spec: the JSON schema as a JSON string (``json_schema``), the regular expression (``regex``), the choices as
            a JSON list of strings (``choice``) or the grammar, in llguidance's Lark syntax or in GBNF (``root ::=
            ...``; ``grammar``); None for ``json_object``.

    Raises:
        InvalidRequestError: (a ValueError; ``param`` "guided") an unknown kind, or a spec missing / given where it
            does not belong.
    """

    kind: str
    spec: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise InvalidRequestError(f"guided decoding kind must be one of {', '.join(GUIDED_KINDS)}, got "
                                      f"{self.kind!r}", param="guided")
        if (self.kind != "json_object") != (self.spec is not None):
            raise InvalidRequestError(f"a spec goes with every kind but json_object (kind {self.kind!r})",
                                      param="guided")
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequestError(f"choice: the choices must be one or more non-empty strings (spec "
                                          f"{self.spec!r}, a JSON list)", param="guided")


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one output token and its most likely alternatives (``logprobs``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first, len = SamplingParams.logprobs
    rank: int | None = None  # a prompt token's: 1 + the vocabulary's tokens more likely than it (vLLM's rank)


_REAL_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_INT_FIELDS = ("max_tokens", "seed", "top_k", "min_tokens", "logprobs", "prompt_logprobs")
_OPTIONAL = ("seed", "logprobs", "prompt_logprobs")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, validated on construction.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 selects greedy (argmax) decoding; > 0 samples. Values below ``GREEDY_TEMPERATURE``
            (1e-5, vLLM's threshold) are greedy too: dividing logits by them overflows float32.
        top_p: nucleus mass in (0, 1]; the target distribution is truncated to it before sampling and
            before speculative acceptance, so acceptance stays lossless against the truncated target.
        seed: a signed 64-bit integer that makes a sampled request reproducible: it is verified by Gumbel-max coupling
            with noise keyed to (seed, token position) (``app/engine/coupling.py``), so the same seed gives the same
            tokens whatever the batch, the drafts, the verify lengths or the placement (exactly with
            ``batch_invariant``; otherwise up to near-ties of the logits). None: unseeded, verified by rejection
            sampling with a generator seeded from the OS.
        stop: stop strings (one string: that one); the output ends before the first occurrence (excluded, as
            OpenAI does, unless ``include_stop_str_in_output``); with several, the first token that completes one
            ends the output at the one of those that starts first in the text (at one position, the first listed).
        include_stop_str_in_output: the text ends after the stop string, EOS or stop token that ended it (vLLM's
            option).
        skip_special_tokens: special tokens (``<|im_end|>``) read as no text (vLLM's default); False: as their
            text. Neither option changes the tokens.
        ignore_eos: keep generating past EOS (benchmarks).
        presence_penalty: subtracted once from the logit of every token already in the output, in [-2, 2]
            (OpenAI's definition; the prompt does not count).
        frequency_penalty: subtracted from a token's logit once per earlier occurrence in the output, in [-2, 2].
        repetition_penalty: > 0; a logit of a token seen in the prompt or the output is divided by it when positive,
            multiplied by it when negative (CTRL, Keskar et al. 2019; vLLM's and transformers' definition); 1 = off.
        logit_bias: (token id, bias) pairs added to the logits, bias in [-100, 100] (OpenAI's ``logit_bias``).
        top_k: keep only the k most likely tokens before sampling; 0 = off.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely token's, in [0, 1]; 0 = off.
        min_tokens: EOS and ``stop_token_ids`` cannot end the request before this many tokens (their logits are
            masked), as in vLLM; stop strings are not checked before it either.
        stop_token_ids: extra token ids that end the request (the token is included in the output's ids, like EOS;
            its text, like EOS's, only with ``include_stop_str_in_output``, as vLLM does).
        allowed_token_ids: None = every token; else the only token ids that may be generated, every other logit -inf
            (vLLM's option; a sorted tuple of distinct ids >= 0). As in vLLM, EOS is not added: without it in the set
            the request ends at ``max_tokens``, a stop string or a ``stop_token_ids`` token. The engine refuses end
            tokens only under ``min_tokens`` (which masks them) and, with ``guided``, a set without an EOS.
        bad_words: words that may not be generated (vLLM's option): the engine tokenizes each word, alone and after a
            space, and masks a word's last token wherever the output so far ends with its other tokens (a one-token
            word everywhere). Only the output is matched, not the prompt. Not with ``guided`` or
            ``allowed_token_ids`` (a row could lose every token).
        logprobs: None = off; k >= 0 = return the log-probability of each output token under the target and
            the k most likely alternatives (k <= ``MAX_LOGPROBS``).
        prompt_logprobs: None = off; k >= 0 = return the log-probability under the target of each prompt token
            after the first (``StepOutput.prompt_logprobs``) and its k most likely alternatives (vLLM's
            ``prompt_logprobs``; OpenAI completions' ``echo`` with ``logprobs``). The prompt is then computed whole:
            the prefix cache gives it no keys/values (they would come without the logits of their rows).
        guided: structured output (``GuidedDecoding``) the output must follow, or None.

    Raises:
        InvalidRequestError: (a ValueError) on a value of the wrong type or out of range, naming it; its ``param``
            is the field.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        for name in _REAL_FIELDS:  # type first: a string or a bool here would fail deep in a step, or pass as 0/1
            value = getattr(self, name)
            if not _is_number(value):
                raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {getattr(self, name)!r}", param=name)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not (_is_int(value) or value is None and name in _OPTIONAL):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not self.temperature >= 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}", param="temperature")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be a signed 64-bit integer, got {self.seed!r}", param="seed")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if isinstance(self.stop, str):  # one stop string, as the OpenAI API takes it (not its characters)
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {self.stop!r}", param="stop")
        object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", param=name)
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
                                      param="repetition_penalty")
        bias = tuple(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        if any(not _is_int(t) or t < 0 or not _is_number(b) or not -100.0 <= b <= 100.0 for t, b in bias):
            raise InvalidRequestError("logit_bias needs token ids >= 0 and biases in [-100, 100], "
                                      f"got {self.logit_bias!r}", param="logit_bias")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}", param="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}",
                                      param="min_tokens")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}",
                                      param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, (list, tuple)) or not allowed or any(not _is_int(t) or t < 0 for t in allowed):
                raise InvalidRequestError(f"allowed_token_ids must be one or more token ids >= 0 (None: every token), "
                                          f"got {allowed!r}", param="allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be words (non-blank strings), got {self.bad_words!r}",
                                      param="bad_words")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}",
                                          param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def whole_prompt(self) -> bool:
        """Whether the prefill computes the whole prompt, whatever prefix the prefix cache holds: prompt logprobs
        need the logits of every prompt row, which a reused prefix does not have. The engine's admission and the
        loop's prefill budget and in-batch prefix reuse all follow this."""
        return self.prompt_logprobs is not None

    @functools.cached_property
    def full_logits(self) -> bool:
        """Whether the target computes this request's logits over the whole vocabulary (float32 LM head): sampled,
        or greedy with a control or logprobs. Plain greedy rows take the greedy screen instead
        (``app/engine/greedy_head.py``), and a verify step prices the two apart (``ThroughputProfile``). Read for
        every request of every step: computed once (``controls`` compares every field with its neutral value)."""
        return not self.greedy or bool(self.controls())

    def controls(self) -> list[str]:
        """Names of the sampling controls set away from their neutral value (penalties, biases, truncations,
        ``min_tokens``, ``stop_token_ids``, ``allowed_token_ids``, ``bad_words``, ``logprobs``, ``guided``)."""
        neutral = SamplingParams()
        names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "top_k", "min_p",
                 "min_tokens", "stop_token_ids", "allowed_token_ids", "bad_words", "logprobs", "guided")
        return [n for n in names if getattr(self, n) != getattr(neutral, n)]


@dataclass(frozen=True)
class NewRequest:
    """A request to admit: its id, prompt token ids and decoding settings (``TargetEngine.add_requests``)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))


# A sampled request's drafts are drawn from the drafter's distribution (app/drafters/proposer.py) truncated to its
# DRAFT_TOP_K most likely tokens (renormalised). Speculative sampling is lossless for any draft distribution the
# drafts really follow, so the engine verifies against exactly this sparse q, and a block's probabilities take
# K x 64 x (4 + 8) bytes whatever the vocabulary (5.4 kB at K = 7, against 1.4 MB for a dense [K, V] float32 on
# SmolLM2's V = 49,152). The mass the truncation drops bounds the acceptance lost at a position; measured on 112
# draft positions of 8 gsm8k-eval prompts with the committed checkpoint: mean 0.5 % (max 6 %) at T = 0.7, mean 6 %
# (max 36 %) at T = 1.0; 256 tokens would drop 0.1 % / 3 % (docs/serving.md).
DRAFT_TOP_K = 64


@dataclass(frozen=True)
class DraftBlock:
    """Draft tokens proposed for one request, to be verified in the next step.

    ``tokens`` may be longer than what the scheduler decides to verify; the engine verifies
    ``tokens[:verify_len]``. ``probs`` are the drafter's distributions the drafts were sampled from (needed for
    lossless rejection sampling when temperature > 0), in one of two forms:

    * sparse (``prob_ids`` set): row k gives q_k(prob_ids[k, j]) = probs[k, j] and q_k = 0 for every token not in
      ``prob_ids[k]``. Exact whenever the drafter sampled from that same sparse q (the trained drafters sample from
      their top ``DRAFT_TOP_K`` tokens), and its size does not grow with V: this is
      the form that crosses process boundaries;
    * dense (``prob_ids`` None): q over the whole vocabulary, [K, V].

    Greedy requests, seeded requests (verified by Gumbel-max coupling, which needs no q) and model-free drafters
    (n-gram, prompt lookup) pass ``probs=None``, which is treated as a point mass on each draft token (a
    deterministic proposal, still lossless).
    """

    request_id: str
    # [K] int64 draft token ids
    tokens: torch.Tensor
    # [K, S] float32 sparse draft probabilities (with prob_ids), [K, V] dense, or None for a deterministic proposal
    probs: torch.Tensor | None = None
    verify_len: int | None = None
    # [K, S] int64 token ids of the columns of ``probs`` (distinct within a row), or None when ``probs`` is dense
    prob_ids: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """The number of draft tokens the engine will verify (l_r)."""
        n = int(self.tokens.shape[0])
        return n if self.verify_len is None else min(self.verify_len, n)

    def dense_probs(self, vocab_size: int) -> torch.Tensor | None:
        """The draft distributions as [K, V] float32 (zero outside ``prob_ids`` in the sparse form), or None."""
        if self.probs is None or self.prob_ids is None:
            return None if self.probs is None else self.probs.float()
        import torch

        dense = torch.zeros(self.probs.shape[0], vocab_size, dtype=torch.float32, device=self.probs.device)
        return dense.scatter_(1, self.prob_ids.long(), self.probs.float())

    def verified_against_probs(self, params: SamplingParams) -> bool:
        """Whether the engine verifies this block of a request with ``params`` by rejection sampling against its
        ``probs``: an unseeded sampled request's block that carries them (greedy takes the argmax; a seeded request
        Gumbel-max coupling, whose output does not depend on the draft). Then a choice about the block must not
        depend on its drafted tokens (``app/drafters/lookup.py``, ``app/engine/grammar.py``)."""
        return self.probs is not None and not params.greedy and params.seed is None

    @classmethod
    def make_dummy(cls, request_id: str, length: int) -> "DraftBlock":
        """A block of ``length`` token-0 drafts, for tests and warm-up."""
        import torch

        return cls(request_id=request_id, tokens=torch.zeros(length, dtype=torch.long))


@dataclass(frozen=True)
class StepOutput:
    """What one request got from a prefill or a verify step.

    Attributes:
        request_id: the request.
        new_token_ids: committed tokens of this step (accepted drafts + recovered/bonus), truncated at
            EOS, a stop string or max_tokens; the EOS token and the token that completes a stop string are
            included (as in vLLM), the stop string's text is not (``text`` ends where it starts).
        num_draft: draft tokens verified this step (l_r).
        num_accepted: draft tokens accepted this step (<= num_draft).
        finished: whether the request ended in this step; its cache is released by the engine.
        finish_reason: set when finished.
        text: the request's detokenised text released this step (incremental, safe across UTF-8 splits): the text
            of the tokens ``text_lens`` counts.
        text_lens: the characters of ``text`` each token it releases brings, in order: the request's output tokens
            from the first whose text was not released yet (the text of the last tokens of a step is held back while
            it could be the start of a stop string, or ends inside a UTF-8 character), so ``len(text_lens)`` need
            not be ``len(new_token_ids)``; every token is released by the step that finishes the request. A token
            inside an unfinished UTF-8 character brings 0 (the one that finishes it the character).
        features: target hidden states, at the engine's feature layers, of the tokens that entered the KV
            cache in this step (the drafter's conditioning input): after a prefill the prompt tokens
            (row j predicted prompt token j+1, the last row predicted ``new_token_ids[0]``); after a verify
            step the pending token and the accepted drafts (row i predicted the i-th committed token). Shared with
            the engine's prefix cache after a prefill: read, never modify.
        num_cached_tokens: after a prefill, the prompt tokens whose keys/values (and features) came from the prefix
            cache instead of the forward (OpenAI's ``usage.prompt_tokens_details.cached_tokens``); 0 after a verify
            step.
    """

    request_id: str
    new_token_ids: list[int]
    num_draft: int = 0
    num_accepted: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    text: str = ""
    text_lens: list[int] = field(default_factory=list)
    # [T_new, F] features of the tokens that entered the cache this step (dtype of the model)
    features: torch.Tensor | None = field(default=None, repr=False)
    logprobs: list[TokenLogprob] | None = None  # one per new_token_ids entry when SamplingParams.logprobs is set
    num_cached_tokens: int = 0
    # after the prefill that completes a prompt of T tokens, when SamplingParams.prompt_logprobs is set: T entries,
    # None for the first token (nothing predicts it), then token j's logprob given tokens 0..j-1
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # with FinishReason.ERROR: why the request could not go on
    # vLLM's ``stop_reason`` once finished: the stop string, or the ``stop_token_ids`` id, that ended the request;
    # None when EOS, max_tokens or an error ended it
    stop_reason: str | int | None = None


def accepted_length(accepted: int, rounds: int) -> float:
    """tau, the mean accepted length: tokens committed per verify round, accepted drafts plus the bonus (or
    recovered) token each round: (accepted + rounds) / rounds; 0 before any round."""
    return (accepted + rounds) / rounds if rounds else 0.0


def batch_accepted_length(results) -> float:
    """tau over decoded requests (``RequestResult``s, or anything with ``num_accepted`` and ``rounds``)."""
    return accepted_length(sum(r.num_accepted for r in results), sum(r.rounds for r in results))
