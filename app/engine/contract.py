"""The contracts of the decoding loop (``app/loop.py``): what it needs from a target engine (``Engine``) and from a
drafter (``Proposer``).

``TargetEngine`` (``engine.py``) implements it over a real model; ``MockEngine`` (``testing.py``) over a
deterministic rule, so the Serve layer is tested in seconds. Inputs and outputs are the typed records of
``types.py``: ``NewRequest`` in and ``StepOutput`` out at admission, ``DraftBlock`` in and ``StepOutput`` out at
verification. Errors are those of ``errors.py``, raised before any state changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence

import torch

from app.engine.types import ChatTemplateOptions, DraftBlock, NewRequest, SamplingParams, StepOutput


class Proposer(Protocol):
    """Per-method hooks of a drafter (DSpark, DFlash, EAGLE-3, MTP, n-gram, test doubles).

    The proposer keeps its own per-request context state, fed by ``start`` (prefill output: the first token
    and the prompt's target features) and ``update`` (each verify step's committed tokens and features). A drafter
    that drafts at each request's temperature also has ``set_params(request_id, params)``, called before ``start``.
    """

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None: ...

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]: ...

    def update(self, outputs: Sequence[StepOutput]) -> None: ...

    def finish(self, request_id: str) -> None: ...


class Engine(ABC):
    """A target engine. Not thread-safe: one caller drives it.

    Attributes:
        vocab_size: V.
        feature_dim: F, the width of ``StepOutput.features`` rows.
        tokenizer: has ``decode(token_ids) -> str``.
    """

    vocab_size: int
    feature_dim: int
    tokenizer: object

    @property
    @abstractmethod
    def max_num_seqs(self) -> int:
        """Requests it can hold at once."""

    @property
    @abstractmethod
    def num_active(self) -> int:
        """Requests held (admitted, not finished or released)."""

    @property
    @abstractmethod
    def num_free_slots(self) -> int:
        """Requests that can still be admitted."""

    @property
    def input_embeddings(self) -> torch.Tensor | None:
        """[V, Dm] the target's input embedding (a drafter in the same process shares it), or None without one."""
        return None

    @property
    def prefix_caching(self) -> bool:
        """Whether a prompt reuses the prefix an earlier prompt left in the cache (``prefill_tokens``)."""
        return False

    def prefill_tokens(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Prompt tokens an admission of ``prompt_ids`` with ``params`` computes now: all T of them, less any prefix
        the engine reuses from earlier prompts (prefix caching; none with ``prompt_logprobs``). The admission budget
        counts these."""
        return len(prompt_ids)

    @abstractmethod
    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is held."""

    @abstractmethod
    def encode_chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False,
                    options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        """Token ids of a chat prompt rendered as ``options`` say (the generation prompt appended, by default);
        ``add_special_tokens``: the tokenizer's own too (a Llama tokenizer's BOS) on the template's text, which
        usually writes them itself (vLLM's chat default: off).

        Raises:
            InvalidRequestError: the model's chat template refuses the messages or the options (``param`` names the
                request field).
        """

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a text; ``add_special_tokens``: with the tokenizer's own special tokens (a Llama
        tokenizer's BOS), as a raw completion prompt gets them by default (vLLM's and Hugging Face's rule)."""

    @abstractmethod
    def check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        """Check that a request of ``prompt_tokens`` prompt tokens and ``max_tokens`` fits the context (``add_requests``
        checks it again): a server answers one that does not before queuing it, so it never fails a batched prefill.

        Raises:
            ContextLengthError: it does not fit.
        """

    @abstractmethod
    def add_requests(self, requests: Sequence[NewRequest]) -> list[StepOutput]:
        """Validate every request, then admit them all and return each one's first token (with the prompt's
        features [T, F]).

        Raises:
            InvalidRequestError, ContextLengthError, CapacityError (``errors.py``): nothing is admitted.
        """

    @property
    def supports_chunked_prefill(self) -> bool:
        """Whether the engine prefills a prompt in pieces: its ``add_requests`` then also takes ``limits`` (per
        request the prompt tokens to compute now; a request not wholly prefilled gets None and holds its slot) and
        ``continue_prefill`` computes the next pieces (``TargetEngine``)."""
        return False

    def continue_prefill(self, limits: dict[str, int]) -> list[StepOutput | None]:
        """The next piece of each named chunked prefill, at most ``limits[r]`` tokens, in one forward; per request its
        first output once its prompt is wholly prefilled, else None.

        Raises:
            NotImplementedError: the engine does not prefill in pieces (``supports_chunked_prefill``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not prefill in pieces")

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> StepOutput:
        """``add_requests`` of one request."""
        return self.add_requests([NewRequest(request_id, prompt_ids, params)])[0]

    @abstractmethod
    def verify(self, blocks: Sequence[DraftBlock]) -> list[StepOutput]:
        """One verify step over a batch: each block's request's pending token and its drafts; an empty block is a
        plain decoding step. One StepOutput per block, in order; finished requests are released.

        Raises:
            UnknownRequestError, InvalidRequestError (``errors.py``): nothing is changed.
        """

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Free a request's state (client gone, or cleanup after an error).

        Raises:
            UnknownRequestError: the id is not held (never added, finished or already released).
        """
