"""The DSpark drafting API: a ``Proposer`` (``app/engine/decode.py``) for a batch of requests.

Owns per-request drafter state: the injected keys/values of the request's context (projected once per token:
each round projects only the newly committed tokens' features), the anchor (the engine's pending token), the
context length, the request's temperature and its own random generator. ``propose`` runs one batched backbone
forward and the sequential head left to right, and returns ``DraftBlock``s (tokens, and the draft
distributions for sampled requests); the same round's per-position confidences are kept in ``last_proposal``.

Context alignment (matches training exactly): after a prefill the engine returns the prompt's features (rows
0..P-1) and the first token, which is pending (not yet in the target's cache); after a verify step it returns
the rows of the pending token and the accepted drafts. So the context always covers tokens 0..T-1 and the anchor
is token T, at position T.

Shape symbols: B requests, K block size, V vocab, T context, Hkv, Dh as in ``dspark.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from app.drafters.calibration import Calibration, survival
from app.drafters.dspark import ContextKV, DSparkDrafter
from app.engine.types import DraftBlock, SamplingParams, StepOutput


@dataclass(frozen=True)
class DraftProposal:
    """One round's drafts for a batch and their confidences."""

    blocks: list[DraftBlock]
    # [B, K] float32 calibrated per-position confidences c_k: P(draft k accepted | drafts < k accepted)
    confidences: torch.Tensor
    # [B, K] float32 the same before calibration
    raw_confidences: torch.Tensor

    @property
    def survival(self) -> torch.Tensor:
        """[B, K] calibrated probability that drafts 1..k are all accepted (non-increasing in k)."""
        return survival(self.confidences)

    @classmethod
    def make_dummy(cls, request_ids: Sequence[str], block_size: int) -> "DraftProposal":
        """Token-0 drafts with confidence 0.5, for tests and warm-up."""
        blocks = [DraftBlock.make_dummy(rid, block_size) for rid in request_ids]
        half = torch.full((len(request_ids), block_size), 0.5)
        return cls(blocks=blocks, confidences=half, raw_confidences=half.clone())


@dataclass
class _RequestState:
    temperature: float
    generator: torch.Generator
    keys: list[torch.Tensor]  # per layer [Hkv, T, Dh]
    values: list[torch.Tensor]  # per layer [Hkv, T, Dh]
    length: int = 0  # T: tokens whose features are in the context
    anchor: int = -1  # the pending token


@dataclass
class DSparkProposer:
    """Proposer hooks over a ``DSparkDrafter`` (module docstring).

    Attributes:
        drafter: the drafter (eval mode, on the engine's device, usually in the target's dtype).
        calibration: per-position confidence temperatures.
        temperature: drafting temperature of requests without ``set_params`` (0: greedy argmax drafts).
        seed: base seed of the per-request generators.
        gamma: draft tokens returned per request (<= the drafter's block size).
    """

    drafter: DSparkDrafter
    calibration: Calibration = field(default_factory=Calibration)
    temperature: float = 0.0
    seed: int = 0
    gamma: int | None = None
    last_proposal: DraftProposal | None = field(default=None, init=False)
    _params: dict[str, float] = field(default_factory=dict, init=False)
    _state: dict[str, _RequestState] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        k = self.drafter.config.block_size
        if self.gamma is None:
            self.gamma = k
        if not 1 <= self.gamma <= k:
            raise ValueError(f"gamma must be in [1, {k}] (the drafter's block size), got {self.gamma}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    # ---------------------------------------------------------------- Proposer hooks

    def set_params(self, request_id: str, params: SamplingParams) -> None:
        """Draft ``request_id`` at its own temperature (call before ``start``; the hook does not see params)."""
        self._params[request_id] = params.temperature

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        temperature = self._params.pop(request_id, self.temperature)
        digest = hashlib.sha256(f"{self.seed}:{request_id}".encode()).digest()
        state = _RequestState(
            temperature=temperature,
            generator=torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1),
            keys=[], values=[],
        )
        self._state[request_id] = state
        self._extend(state, first.features)
        state.anchor = first.new_token_ids[-1]

    def update(self, outputs: Sequence[StepOutput]) -> None:
        for out in outputs:
            state = self._state.get(out.request_id)
            if state is None or out.finished:
                continue
            self._extend(state, out.features)
            state.anchor = out.new_token_ids[-1]

    def finish(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        """``gamma`` drafts per request; the round's confidences are left in ``last_proposal``."""
        if not request_ids:
            self.last_proposal = DraftProposal(blocks=[], confidences=torch.zeros(0, self.gamma),
                                               raw_confidences=torch.zeros(0, self.gamma))
            return []
        d = self.drafter
        states = [self._state[rid] for rid in request_ids]
        device = d.embed_weight.device
        ctx, ctx_valid = self._batch_context(states)
        k = d.config.block_size
        lengths = torch.tensor([s.length for s in states], device=device)
        anchors = torch.tensor([[s.anchor] for s in states], device=device)
        positions = lengths[:, None] + torch.arange(k, device=device)
        mask = torch.cat([ctx_valid[:, None, :].expand(-1, k, -1),
                          torch.ones(len(states), k, k, dtype=torch.bool, device=device)], dim=2)
        hidden = d.backbone(d.block_inputs(anchors), positions=positions, ctx=ctx, mask=mask)
        base = d.base_logits(hidden[:, : self.gamma])  # [B, gamma, V]
        temps = torch.tensor([s.temperature for s in states], device=device)
        sampled = temps > 0
        prev, state = anchors[:, 0], None
        tokens, probs, conf = [], [], []
        for i in range(self.gamma):
            step = d.head_step(base[:, i], hidden[:, i], prev, state)
            state = step.state
            q = torch.softmax(step.logits / temps.clamp(min=1e-6)[:, None], dim=-1)  # [B, V]
            tok = step.logits.argmax(-1)
            for b in sampled.nonzero().flatten().tolist():
                tok[b] = torch.multinomial(q[b].cpu(), 1, generator=states[b].generator).to(device)[0]
            tokens.append(tok)
            probs.append(q)
            conf.append(step.conf_logit)
            prev = tok
        tokens_t = torch.stack(tokens, 1).cpu()
        probs_t = torch.stack(probs, 1)
        conf_logits = torch.stack(conf, 1).float().cpu()
        blocks = [
            DraftBlock(rid, tokens_t[b], probs_t[b].float().cpu() if s.temperature > 0 else None)
            for b, (rid, s) in enumerate(zip(request_ids, states))
        ]
        greedy = torch.tensor([s.temperature == 0 for s in states])[:, None]
        calibrated = torch.where(greedy, self.calibration.confidences(conf_logits, "greedy"),
                                 self.calibration.confidences(conf_logits, "sampled"))
        self.last_proposal = DraftProposal(blocks=blocks, confidences=calibrated,
                                           raw_confidences=torch.sigmoid(conf_logits))
        return blocks

    # ---------------------------------------------------------------- helpers

    @torch.inference_mode()
    def _extend(self, state: _RequestState, features: torch.Tensor) -> None:
        """Project the new context rows [C, F] into every layer's keys/values and append them."""
        d = self.drafter
        device = d.embed_weight.device
        feats = features.to(device)[None]
        positions = torch.arange(state.length, state.length + feats.shape[1], device=device)[None]
        kv = d.context_kv(feats, positions)
        if not state.keys:
            state.keys = [k[0] for k in kv.keys]
            state.values = [v[0] for v in kv.values]
        else:
            state.keys = [torch.cat([old, new[0]], dim=1) for old, new in zip(state.keys, kv.keys)]
            state.values = [torch.cat([old, new[0]], dim=1) for old, new in zip(state.values, kv.values)]
        state.length += feats.shape[1]

    def _batch_context(self, states: list[_RequestState]) -> tuple[ContextKV, torch.Tensor]:
        """Right-padded context keys/values [B, Hkv, Tmax, Dh] per layer and the valid mask [B, Tmax]."""
        t_max = max(s.length for s in states)
        device = self.drafter.embed_weight.device
        valid = torch.arange(t_max, device=device)[None] < torch.tensor([s.length for s in states], device=device)[:, None]
        keys, values = [], []
        for layer in range(len(self.drafter.layers)):
            keys.append(torch.stack([F.pad(s.keys[layer], (0, 0, 0, t_max - s.length)) for s in states]))
            values.append(torch.stack([F.pad(s.values[layer], (0, 0, 0, t_max - s.length)) for s in states]))
        return ContextKV(keys=tuple(keys), values=tuple(values)), valid
