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
from dataclasses import dataclass, field

import torch


class FinishReason(str, enum.Enum):
    """Why a request stopped (OpenAI's ``finish_reason`` values)."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens reached


GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, validated on construction.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 selects greedy (argmax) decoding; > 0 samples. Values below ``GREEDY_TEMPERATURE``
            (1e-5, vLLM's threshold) are greedy too: dividing logits by them overflows float32.
        top_p: nucleus mass in (0, 1]; the target distribution is truncated to it before sampling and
            before speculative acceptance, so acceptance stays lossless against the truncated target.
        seed: seed of this request's own random generator, a signed 64-bit integer (None: drawn from the OS).
        stop: stop strings; the output ends before the first occurrence (excluded, as OpenAI does).
        ignore_eos: keep generating past EOS (benchmarks).

    Raises:
        ValueError: on any out-of-range value, naming it.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.seed is not None and not (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class NewRequest:
    """A request to admit: its id, prompt token ids and decoding settings (``TargetEngine.add_requests``)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))


@dataclass(frozen=True)
class DraftBlock:
    """Draft tokens proposed for one request, to be verified in the next step.

    ``tokens`` may be longer than what the scheduler decides to verify; the engine verifies
    ``tokens[:verify_len]``. ``probs`` are the drafter's probabilities of the proposed tokens
    (full distributions, needed for lossless rejection sampling when temperature > 0); greedy
    requests and model-free drafters (n-gram) may pass None, which is treated as a point mass on each
    draft token (a deterministic proposal, still lossless).
    """

    request_id: str
    # [K] int64 draft token ids
    tokens: torch.Tensor
    # [K, V] float32 draft distributions, or None for a deterministic proposal
    probs: torch.Tensor | None = None
    verify_len: int | None = None

    @property
    def length(self) -> int:
        """The number of draft tokens the engine will verify (l_r)."""
        n = int(self.tokens.shape[0])
        return n if self.verify_len is None else min(self.verify_len, n)

    @classmethod
    def make_dummy(cls, request_id: str, length: int) -> "DraftBlock":
        """A block of ``length`` token-0 drafts, for tests and warm-up."""
        return cls(request_id=request_id, tokens=torch.zeros(length, dtype=torch.long))


@dataclass(frozen=True)
class StepOutput:
    """What one request got from a prefill or a verify step.

    Attributes:
        request_id: the request.
        new_token_ids: committed tokens of this step (accepted drafts + recovered/bonus), truncated at
            EOS, a stop string or max_tokens; the EOS token itself is included, stop strings are not
            (their tokens are withheld from ``new_token_ids`` and ``text`` alike).
        num_draft: draft tokens verified this step (l_r).
        num_accepted: draft tokens accepted this step (<= num_draft).
        finished: whether the request ended in this step; its cache is released by the engine.
        finish_reason: set when finished.
        text: detokenised text of ``new_token_ids`` (incremental, safe across UTF-8 splits).
        features: target hidden states, at the engine's feature layers, of the tokens that entered the KV
            cache in this step (the drafter's conditioning input): after a prefill the prompt tokens
            (row j predicted prompt token j+1, the last row predicted ``new_token_ids[0]``); after a verify
            step the pending token and the accepted drafts (row i predicted the i-th committed token).
    """

    request_id: str
    new_token_ids: list[int]
    num_draft: int = 0
    num_accepted: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    text: str = ""
    # [T_new, F] features of the tokens that entered the cache this step (dtype of the model)
    features: torch.Tensor | None = field(default=None, repr=False)
