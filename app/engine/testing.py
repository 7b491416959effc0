"""A deterministic, weight-free ``Engine`` (``contract.py``) so the decoding loop and the Serve layer are tested on CPU
in seconds (``mock_engine: true`` in an application config).

``MockEngine`` implements the engine contract with the same errors as ``TargetEngine``. Its "model" continues any
token ``t`` with ``next_token(t) = (7 t + 3) mod V``, and token ``t`` reads as ``" w<t>"``. Greedy acceptance is
exact: a draft token is accepted while it equals the rule (``app/serving/mock.py``'s ``MockProposer`` drafts it with
planted errors).

Logprobs (``SamplingParams.logprobs``): the mock's distribution after token ``t`` gives rank ``r`` (0-based) the token
``(next_token(t) + r) mod V`` with log-probability ``-(r + 1) ln 2``, so every output token has logprob ``-ln 2``
(``mock_logprobs``); a prompt token ``u`` after ``t`` has the logprob of its rank there (``mock_prompt_logprobs``).
It refuses every other sampling control (``SamplingParams.controls``) with an
``InvalidRequestError`` naming them.

Shape symbols: B batch, K block size, C committed tokens, F = 4 (mock feature width).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from app.engine.contract import Engine
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.errors import CapacityError, ContextLengthError, InvalidRequestError, UnknownRequestError
from app.engine.types import (ChatTemplateOptions, DraftBlock, FinishReason, NewRequest, SamplingParams, StepOutput,
                              TokenLogprob)

MOCK_FEATURE_DIM = 4


def next_token(token: int, vocab_size: int) -> int:
    return (7 * token + 3) % vocab_size


def token_text(token: int) -> str:
    return f" w{token}"


def mock_logprobs(previous: int, k: int, vocab_size: int) -> TokenLogprob:
    """The logprob of the token the mock emits after ``previous`` and its ``k`` top alternatives (module docstring)."""
    first = next_token(previous, vocab_size)
    top = tuple(((first + r) % vocab_size, -(r + 1) * math.log(2)) for r in range(k))
    return TokenLogprob(token_id=first, logprob=-math.log(2), top=top)


def mock_prompt_logprobs(prompt: Sequence[int], k: int, vocab_size: int) -> list[TokenLogprob | None]:
    """``StepOutput.prompt_logprobs`` of ``prompt`` under the mock's distribution (module docstring): None, then
    token j at its rank after token j - 1, with that position's ``k`` top alternatives."""
    out: list[TokenLogprob | None] = [None]
    for previous, token in zip(prompt, prompt[1:]):
        rank = (token - next_token(previous, vocab_size)) % vocab_size
        top = mock_logprobs(previous, k, vocab_size).top
        out.append(TokenLogprob(token_id=token, logprob=-(rank + 1) * math.log(2), top=top, rank=rank + 1))
    return out


class MockTokenizer:
    """``decode`` for the mock vocabulary (``token_text``)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(token_text(t) for t in token_ids)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [token_text(t) for t in token_ids]


@dataclass(frozen=True)
class MockEngineConfig:
    max_model_len: int = 256
    max_num_seqs: int = 4
    max_draft_len: int = 4
    vocab_size: int = 512
    step_ms: float = 0.0  # sleep per verify step
    fails_after: int = 0  # verify raises once a request in the step has this many tokens (0: never)


@dataclass
class _MockRequest:
    params: SamplingParams
    prompt_len: int
    last: int
    detok: IncrementalDetokenizer
    generated: int = 0
    prefill_left: int = 0  # prompt tokens a chunked prefill has still to compute
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs, for the first output


class MockEngine(Engine):
    """Deterministic stand-in for ``TargetEngine`` (module docstring). Not thread-safe, like the real one."""

    def __init__(self, config: MockEngineConfig) -> None:
        self.config = config
        self.vocab_size = config.vocab_size
        self.feature_dim = MOCK_FEATURE_DIM
        self.tokenizer = MockTokenizer()
        self._requests: dict[str, _MockRequest] = {}

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def num_active(self) -> int:
        return len(self._requests)

    @property
    def num_free_slots(self) -> int:
        return self.config.max_num_seqs - len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def encode_chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False,
                    options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        """The messages' characters, then token 1 for the generation prompt (template variables are ignored)."""
        return self.encode("".join(m["content"] for m in messages)) + [1] * options.add_generation_prompt

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """One token per character (the mock tokenizer has no special tokens to add)."""
        return [ord(c) % self.vocab_size for c in text]

    @property
    def supports_chunked_prefill(self) -> bool:
        return True

    def add_requests(self, requests: Sequence[NewRequest], *, limits: Sequence[int] | None = None
                     ) -> list[StepOutput | None]:
        """All requests are validated before any is added, as ``TargetEngine.add_requests`` does; ``limits`` as
        there (chunked prefill: None for a request whose prompt is not wholly prefilled)."""
        for r in requests:
            self._check_new(r)
        if len({r.request_id for r in requests}) < len(requests):
            raise InvalidRequestError("the same request id appears twice in one admission batch")
        if len(requests) > self.num_free_slots:
            raise CapacityError(f"{len(requests)} requests for {self.num_free_slots} free KV cache slots")
        if limits is not None and (len(limits) != len(requests) or any(n < 1 for n in limits)):
            raise ValueError(f"limits must be one count >= 1 per request, got {list(limits)}")
        outputs: list[StepOutput | None] = []
        for i, r in enumerate(requests):
            req = _MockRequest(params=r.params, prompt_len=len(r.prompt_ids), last=int(r.prompt_ids[-1]),
                               detok=IncrementalDetokenizer.for_request(self.tokenizer, r.params))
            if r.params.prompt_logprobs is not None:
                req.prompt_logprobs = mock_prompt_logprobs(r.prompt_ids, r.params.prompt_logprobs, self.vocab_size)
            self._requests[r.request_id] = req
            req.prefill_left = len(r.prompt_ids)
            outputs.append(self._prefill(r.request_id, req, None if limits is None else limits[i]))
        return outputs

    def continue_prefill(self, limits: dict[str, int]) -> list[StepOutput | None]:
        for rid, n in limits.items():
            if rid not in self._requests:
                raise UnknownRequestError(f"unknown request {rid!r} (never added, finished or released)")
            if not self._requests[rid].prefill_left:
                raise InvalidRequestError(f"request {rid!r} has no prefill left to continue")
            if n < 1:
                raise ValueError(f"a prefill piece needs at least 1 token, got {n} for {rid!r}")
        return [self._prefill(rid, self._requests[rid], n) for rid, n in limits.items()]

    def _prefill(self, request_id: str, req: _MockRequest, limit: int | None) -> StepOutput | None:
        req.prefill_left = 0 if limit is None else max(0, req.prefill_left - limit)
        if req.prefill_left:
            return None
        out = self._commit(request_id, req, [next_token(req.last, self.vocab_size)], 0, 0, req.prompt_len)
        return dataclasses.replace(out, prompt_logprobs=req.prompt_logprobs)

    def _check_new(self, request: NewRequest) -> None:
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request {request.request_id!r} already exists")
        if len(request.prompt_ids) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        refused = [name for name in request.params.controls() if name != "logprobs"]
        if refused:
            raise InvalidRequestError(f"sampling controls not supported by this engine: {refused}", param=refused[0])
        self.check_context(len(request.prompt_ids), request.params.max_tokens)

    def check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        ContextLengthError.check(prompt_tokens=prompt_tokens, max_tokens=max_tokens, limit=self.config.max_model_len)

    def release(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, finished or released)")

    def verify(self, blocks: Sequence[DraftBlock]) -> list[StepOutput]:
        for b in blocks:
            if b.request_id not in self._requests:
                raise UnknownRequestError(f"unknown request {b.request_id!r} (never added, finished or released)")
            if self._requests[b.request_id].prefill_left:
                raise InvalidRequestError(f"request {b.request_id!r} is still being prefilled (continue_prefill)")
            if b.length > self.config.max_draft_len:
                raise InvalidRequestError(f"draft of {b.length} tokens exceeds max_draft_len")
        if self.config.step_ms:
            time.sleep(self.config.step_ms / 1000)
        if self.config.fails_after and any(self._requests[b.request_id].generated >= self.config.fails_after
                                           for b in blocks):
            raise RuntimeError(f"mock verify failure (a request reached {self.config.fails_after} tokens)")
        outputs = []
        for b in blocks:
            req = self._requests[b.request_id]
            draft = b.tokens[: b.length].tolist()[: max(req.params.max_tokens - req.generated - 1, 0)]
            tokens, expected = [], next_token(req.last, self.vocab_size)
            for d in draft:
                if d != expected:
                    break
                tokens.append(d)
                expected = next_token(d, self.vocab_size)
            accepted = len(tokens)
            tokens.append(expected)
            outputs.append(self._commit(b.request_id, req, tokens, len(draft), accepted, accepted + 1))
        return outputs

    def _commit(
        self, request_id: str, req: _MockRequest, tokens: list[int], num_draft: int, num_accepted: int, rows: int
    ) -> StepOutput:
        kept, reason, logprobs = [], None, []
        for tok in tokens:
            if req.params.logprobs is not None:
                logprobs.append(mock_logprobs(req.last, req.params.logprobs, self.vocab_size))
            kept.append(tok)
            req.generated += 1
            req.last = tok
            req.detok.add(tok, check_stop=req.generated >= req.params.min_tokens)
            if req.detok.stopped:
                reason = FinishReason.STOP
            elif req.generated >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if reason is not None:
            del self._requests[request_id]
        text, text_lens = req.detok.release(final=reason is not None)
        return StepOutput(
            request_id=request_id, new_token_ids=kept, num_draft=num_draft,
            num_accepted=min(num_accepted, len(kept)), finished=reason is not None, finish_reason=reason,
            text=text, text_lens=text_lens, features=torch.zeros(rows, MOCK_FEATURE_DIM),
            logprobs=logprobs if req.params.logprobs is not None else None, stop_reason=req.detok.stop_string,
        )
