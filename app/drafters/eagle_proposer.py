"""The drafting API of the autoregressive drafter (EAGLE-3-style, MTP-1): a ``Proposer`` for a batch of requests.

Owns per-request state: the decoder layer's keys/values over the request's context rows (computed once per
token from the true target features, in one batched causal pass per step for all requests), the output hidden
of the last context row (it gives draft 1), the request's temperature and its own random generator.
``propose`` drafts one token per forward for ``gamma`` steps and returns ``DraftBlock``s and, in
``last_proposal``, the per-position confidences (the confidence head, calibrated per position like DSpark's).

Context alignment (``eagle.py``): row j's input holds the token after it, x_{j+1}. After a prefill the rows are
the prompt's (0..P-1) and the next tokens are prompt[1:] plus the first generated token (the pending anchor);
after a verify step the rows are the pending token and the accepted drafts, and the next tokens are exactly the
step's committed tokens (accepted drafts + bonus/recovered), one per row.

Shape symbols: B requests, K gamma, V vocab, T context, C new rows, Dm hidden, Hkv, Dh as in ``eagle.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from app.drafters.eagle import EagleDrafter
from app.drafters.proposer import (
    RequestProposerBase,
    draw,
    make_proposal,
    request_generator,
    round_sampling,
)
from app.engine.types import DraftBlock, StepOutput


@dataclass
class _RequestState:
    temperature: float
    generator: torch.Generator
    seed: int | None = None  # a seeded sampled request: its blocks carry no probs (the target verifies by coupling)
    # [2, Hkv, capacity, Dh] keys (row 0) and values (row 1) of the context; columns [0, length) are valid
    kv: torch.Tensor | None = None
    length: int = 0  # T: context rows in ``kv``
    # [Dm] output hidden of row T-1 (predicts the first draft)
    last_hidden: torch.Tensor | None = None


@dataclass
class EagleProposer(RequestProposerBase):
    """Proposer hooks over an ``EagleDrafter`` (module docstring; settings in ``RequestProposerBase``; MTP-1
    has block size 1, so ``gamma`` 1). With ``prepack`` (default) the drafter is packed for inference in place
    (``EagleDrafter.prepack``); a drafter to be trained further must not be given to a proposer with ``prepack``."""

    drafter: EagleDrafter
    prepack: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prepack:
            self.drafter.prepack()

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        temperature, seed = self._take_params(request_id)
        state = _RequestState(temperature=temperature, generator=request_generator(self.seed, request_id), seed=seed)
        self._state[request_id] = state
        self._extend([state], [first.features], [list(prompt_ids[1:]) + [first.new_token_ids[-1]]], [request_id])

    def update(self, outputs: Sequence[StepOutput]) -> None:
        """Run every continuing request's new rows through the layer (one batched causal pass for the step).

        ``outputs`` may hold several consecutive steps of a request (rounds in which it was not drafted), in
        order: they are joined into one run of rows per request.

        Raises:
            ValueError: a step output whose feature rows and committed tokens differ in number.
        """
        steps: dict[str, list[StepOutput]] = {}
        for o in outputs:
            if not o.finished and o.request_id in self._state:
                steps.setdefault(o.request_id, []).append(o)
        if steps:
            runs = list(steps.values())
            self._extend([self._state[rid] for rid in steps], [torch.cat([o.features for o in r]) for r in runs],
                         [[t for o in r for t in o.new_token_ids] for r in runs], list(steps))

    @torch.inference_mode()
    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        """``gamma`` drafts per request, one decoder-layer forward per draft after the first."""
        if not request_ids:
            return self._no_requests()
        d = self.drafter
        states = [self._state[rid] for rid in request_ids]
        device = d.embed_weight.device
        past_k, past_v, valid = self._batch_context(states)
        lengths = torch.tensor([s.length for s in states], device=device)
        temps, rows, uniform = round_sampling(states, self.gamma, device)
        h = torch.stack([s.last_hidden for s in states])  # [B, Dm]
        ones = valid.new_ones(len(states), 1)
        tokens, probs, conf = [], [], []
        for i in range(self.gamma):
            logits, conf_logit = d.head(h)
            tok, q = draw(logits, temps, rows, uniform[:, i])
            tokens.append(tok)
            probs.append(q)
            conf.append(conf_logit)
            if i + 1 == self.gamma:
                break
            valid = torch.cat([valid, ones], dim=1)  # the step sees every earlier draft step of its request
            out, k_new, v_new = d.attend(d.inputs(h[:, None], tok[:, None]), positions=(lengths + i)[:, None],
                                         past_k=past_k, past_v=past_v, mask=valid[:, None])
            h = out[:, 0]
            past_k, past_v = torch.cat([past_k, k_new], 2), torch.cat([past_v, v_new], 2)
        self.last_proposal = make_proposal(request_ids, states, tokens, probs, conf, self.calibration)
        return self.last_proposal.blocks

    # ---------------------------------------------------------------- helpers

    @torch.inference_mode()
    def _extend(
        self, states: list[_RequestState], features: list[torch.Tensor], next_tokens: list[Sequence[int]],
        request_ids: list[str],
    ) -> None:
        """Causal pass of new rows (``features[i]`` [C_i, F] with next tokens [C_i]) over each request's cached
        context, padded to one batch; appends their keys/values and keeps each request's last output hidden."""
        for rid, f, nxt in zip(request_ids, features, next_tokens):
            if f.shape[0] != len(nxt):
                raise ValueError(f"request {rid}: {f.shape[0]} feature rows but {len(nxt)} next tokens")
        d = self.drafter
        device = d.embed_weight.device
        b, counts = len(states), [f.shape[0] for f in features]
        c_max = max(counts)
        feats = features[0].new_zeros(b, c_max, features[0].shape[1])
        toks = torch.zeros(b, c_max, dtype=torch.long)
        for i, (f, nxt) in enumerate(zip(features, next_tokens)):
            feats[i, : counts[i]] = f
            toks[i, : counts[i]] = torch.as_tensor(list(nxt), dtype=torch.long)
        x = d.inputs(d.fuse(feats.to(device)), toks.to(device))  # [B, C, Dm]
        past_k, past_v, valid = self._batch_context(states)
        lengths = torch.tensor([s.length for s in states], device=device)
        causal = torch.ones(c_max, c_max, dtype=torch.bool, device=device).tril().expand(b, c_max, c_max)
        mask = torch.cat([valid[:, None, :].expand(b, c_max, valid.shape[1]), causal], dim=2)
        positions = lengths[:, None] + torch.arange(c_max, device=device)
        out, k_new, v_new = d.attend(x, positions=positions, past_k=past_k, past_v=past_v, mask=mask)
        for i, (state, c) in enumerate(zip(states, counts)):
            new_len = state.length + c
            if state.kv is None or state.kv.shape[2] < new_len:
                grown = k_new.new_zeros(2, k_new.shape[1], max(2 * new_len, 64), k_new.shape[3])
                if state.kv is not None:
                    grown[:, :, : state.length] = state.kv[:, :, : state.length]
                state.kv = grown
            state.kv[0, :, state.length : new_len] = k_new[i, :, :c]
            state.kv[1, :, state.length : new_len] = v_new[i, :, :c]
            state.length, state.last_hidden = new_len, out[i, c - 1]

    def _batch_context(self, states: list[_RequestState]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded context keys and values [B, Hkv, Tmax, Dh] and the valid mask [B, Tmax] bool."""
        d = self.drafter
        c = d.config
        device = d.embed_weight.device
        t_max = max(s.length for s in states)
        lengths = torch.tensor([s.length for s in states], device=device)
        valid = torch.arange(t_max, device=device)[None] < lengths[:, None]
        kv = torch.zeros(2, len(states), c.num_kv_heads, t_max, c.head_dim, dtype=d.dtype,
                         device=device)
        for i, s in enumerate(states):
            if s.length:
                kv[:, i, :, : s.length] = s.kv[:, :, : s.length]
        return kv[0], kv[1], valid
