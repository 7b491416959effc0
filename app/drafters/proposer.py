"""The DSpark drafting API: a ``Proposer`` (``app/engine/contract.py``) for a batch of requests.

Owns per-request drafter state: the injected keys/values of the request's context (projected once per token:
each round projects only the newly committed tokens' features), the anchor (the engine's pending token), the
context length, the request's temperature and its own random generator. ``propose`` runs one batched backbone
forward and the sequential head left to right, and returns ``DraftBlock``s (tokens, and the draft
distributions for sampled requests, sparse: ``DraftBlock``); the same round's per-position confidences are kept in
``last_proposal``.

Context alignment (matches training exactly): after a prefill the engine returns the prompt's features (rows
0..P-1) and the first token, which is pending (not yet in the target's cache); after a verify step it returns
the rows of the pending token and the accepted drafts. So the context always covers tokens 0..T-1 and the anchor
is token T, at position T.

With a draft vocabulary (``DSparkDrafter.set_draft_vocab``) the logits, argmax and sampling run over its V' ids
only; drafts and the columns of the sparse draft distributions (``draw``: the top ``DRAFT_TOP_K`` tokens) are mapped
back to token ids. The engine verifies against that sparse q, zero elsewhere (those tokens are never proposed, so
sampling stays lossless), and a block's size does not grow with V.

Shape symbols: B requests, K block size, V vocab, V' draft vocabulary, T context, Hkv, Dh as in ``dspark.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from app.drafters.calibration import Calibration, prefix_survival
from app.drafters.dspark import ContextKV, DSparkDrafter
from app.engine.coupling import NoiseRows
from app.engine.types import DRAFT_TOP_K, DraftBlock, SamplingParams, StepOutput


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
        return prefix_survival(self.confidences)

    @classmethod
    def make_dummy(cls, request_ids: Sequence[str], block_size: int) -> "DraftProposal":
        """Token-0 drafts with confidence 0.5, for tests and warm-up."""
        blocks = [DraftBlock.make_dummy(rid, block_size) for rid in request_ids]
        half = torch.full((len(request_ids), block_size), 0.5)
        return cls(blocks=blocks, confidences=half, raw_confidences=half.clone())


class SamplingState(Protocol):
    """What the drafting helpers need of a request's state."""

    temperature: float
    generator: torch.Generator
    seed: int | None  # a seeded sampled request: drafted with its coupling noise, verified by coupling (no probs)


def request_generator(seed: int, request_id: str) -> torch.Generator:
    """The request's own random generator, seeded from ``seed`` and the request id (order independent)."""
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def round_sampling(
    states: Sequence[SamplingState], gamma: int, device: torch.device, *, coupled: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's sampling inputs for ``draw``: temperatures [B], the sampled requests' rows [S] and one uniform per
    draft [S, gamma], each from its request's generator. With ``coupled`` the proposer drafts seeded requests by
    coupling (``coupled_draws``), so they get no row: ``draw`` does not sample a draft that would be replaced, nor
    build a distribution that their blocks do not carry."""
    temps = torch.tensor([s.temperature for s in states], device=device)
    sampled = [b for b, s in enumerate(states) if s.temperature > 0 and not (coupled and s.seed is not None)]
    rows = torch.tensor(sampled, dtype=torch.long, device=device)
    if not sampled:
        return temps, rows, torch.zeros(0, gamma, device=device)
    return temps, rows, torch.stack([torch.rand(gamma, generator=states[b].generator) for b in sampled]).to(device)


@dataclass(frozen=True)
class SparseDraw:
    """The truncated draft distributions of one draft position for a batch (``draw``)."""

    # [B, S] float32 probabilities of the S = min(DRAFT_TOP_K, V) kept columns (rows of greedy requests: zero)
    probs: torch.Tensor
    # [B, S] int64 column indices of ``logits`` (draft-vocabulary indices over a draft vocabulary)
    columns: torch.Tensor


def draw(
    logits: torch.Tensor, temps: torch.Tensor, rows: torch.Tensor, uniform: torch.Tensor, *, top_k: int = DRAFT_TOP_K
) -> tuple[torch.Tensor, SparseDraw | None]:
    """One draft per request: argmax of ``logits`` [B, V] for greedy rows; for the sampled ``rows`` [S_r], a draw
    from q = softmax(top-k(logits) / T) (the ``top_k`` largest logits, renormalised) by the inverse CDF at
    ``uniform`` [S_r] (the first kept token whose cumulative mass exceeds u * total). Over a draft vocabulary the
    logits are [B, V'] and the tokens are indices into it.

    Returns:
        tokens [B] int64 (column indices of ``logits``), and the sparse q of every row when any row samples
        (None otherwise).
    """
    tok = logits.argmax(-1)
    if rows.numel() == 0:
        return tok, None
    k = min(top_k, logits.shape[-1])
    top, cols = (logits[rows].float() / temps[rows].clamp(min=1e-6)[:, None]).topk(k, dim=-1)  # [S_r, k]
    q = torch.softmax(top, dim=-1)
    cdf = q.cumsum(-1)
    pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).clamp(max=k - 1)  # [S_r, 1]
    tok[rows] = cols.gather(1, pick).squeeze(1)
    probs = q.new_zeros(logits.shape[0], k).index_copy_(0, rows, q)
    columns = cols.new_zeros(logits.shape[0], k).index_copy_(0, rows, cols)
    return tok, SparseDraw(probs=probs, columns=columns)


def make_proposal(
    request_ids: Sequence[str], states: Sequence[SamplingState], tokens: list[torch.Tensor],
    probs: list[SparseDraw | None], conf_logits: list[torch.Tensor], calibration: Calibration,
    *, vocab: torch.Tensor | None = None,
) -> DraftProposal:
    """Per-step drafts (``tokens``: K x [B] token ids, ``probs``: K x (``SparseDraw`` or None), ``conf_logits``:
    K x [B]) -> the round's ``DraftProposal``; unseeded sampled requests carry their sparse draft distributions
    ([K, S] probabilities and token ids); greedy and seeded ones (verified by coupling, ``app/engine/coupling.py``)
    none. With a draft vocabulary ``vocab`` [V'], the columns
    are indices into it and are mapped to token ids."""
    tokens_t = torch.stack(tokens, 1).cpu()
    logits_t = torch.stack(conf_logits, 1).float().cpu()
    sampled = probs[0] is not None
    probs_t = torch.stack([d.probs for d in probs], 1).cpu() if sampled else None  # [B, K, S]
    cols_t = torch.stack([d.columns for d in probs], 1) if sampled else None
    ids_t = (cols_t if vocab is None else vocab[cols_t]).cpu() if sampled else None  # [B, K, S] token ids
    blocks = [
        DraftBlock(rid, tokens_t[b], probs_t[b].clone(), prob_ids=ids_t[b].clone())
        if s.temperature > 0 and s.seed is None else DraftBlock(rid, tokens_t[b])
        for b, (rid, s) in enumerate(zip(request_ids, states))
    ]
    greedy = torch.tensor([s.temperature == 0 for s in states])[:, None]
    calibrated = torch.where(greedy, calibration.confidences(logits_t, "greedy"),
                             calibration.confidences(logits_t, "sampled"))
    return DraftProposal(blocks=blocks, confidences=calibrated, raw_confidences=torch.sigmoid(logits_t))


def coupled_draws(
    logits: torch.Tensor, tokens: torch.Tensor, states: Sequence[SamplingState], noise: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Replace the draws of seeded sampled requests by their coupled drafts: argmax of logits [B, V'] / T plus the
    request's Gumbel noise ``noise[b]`` [V'] at the position drafted (``app/engine/coupling.py``; the draft
    vocabulary's columns when there is one; None for a request that is not seeded). The target accepts such a draft
    exactly when it equals its own coupled token.

    Returns:
        tokens [B] int64 (column indices of ``logits``), changed in place for the seeded rows.
    """
    for b, (s, row) in enumerate(zip(states, noise)):
        if row is not None and s.temperature > 0:
            tokens[b] = (logits[b].float() / s.temperature + row.to(logits.device)).argmax()
    return tokens


@dataclass
class _RequestState:
    temperature: float
    generator: torch.Generator
    seed: int | None = None  # set for a seeded sampled request (``SamplingState``)
    noise: NoiseRows | None = None  # its coupling noise over the drafting vocabulary, set with ``seed``
    # [2 * layers, Hkv, capacity, Dh] injected keys (even rows) and values (odd rows); rows [0, length) are valid
    kv: torch.Tensor | None = None
    length: int = 0  # T: tokens whose features are in the context
    anchor: int = -1  # the pending token


@dataclass
class RequestProposerBase:
    """What the neural proposers share: settings, validation, per-request temperatures and state.

    Subclasses set ``drafter`` (an ``nn.Module`` with ``config.block_size``), keep their per-request state in
    ``_state`` and implement ``start``, ``update`` and ``propose``.

    Attributes:
        drafter: the drafter (eval mode, on the engine's device, usually in the target's dtype).
        calibration: per-position confidence temperatures.
        temperature: drafting temperature of requests without ``set_params`` (0: greedy argmax drafts).
        seed: base seed of the per-request generators.
        gamma: draft tokens returned per request (<= the drafter's block size).

    Raises:
        ValueError: ``gamma`` outside [1, block size] or a negative temperature.
    """

    drafter: torch.nn.Module
    calibration: Calibration = field(default_factory=Calibration)
    temperature: float = 0.0
    seed: int = 0
    gamma: int | None = None
    last_proposal: DraftProposal | None = field(default=None, init=False)
    _params: dict[str, SamplingParams] = field(default_factory=dict, init=False)
    _state: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        k = self.drafter.config.block_size
        if self.gamma is None:
            self.gamma = k
        if not 1 <= self.gamma <= k:
            raise ValueError(f"gamma must be in [1, {k}] (the drafter's block size), got {self.gamma}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def set_params(self, request_id: str, params: SamplingParams) -> None:
        """Draft ``request_id`` at its own temperature, with its coupling noise when seeded (call before ``start``;
        the hook does not see params)."""
        self._params[request_id] = params

    def finish(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def _take_params(self, request_id: str) -> tuple[float, int | None]:
        """(temperature, seed) of a starting request; seed None unless ``set_params`` gave a seeded sampled one."""
        params = self._params.pop(request_id, None)
        if params is None:
            return self.temperature, None
        return params.temperature, params.seed if params.temperature > 0 else None

    def _no_requests(self) -> list[DraftBlock]:
        """``propose([])``: no blocks, an empty [0, K] proposal."""
        self.last_proposal = DraftProposal(blocks=[], confidences=torch.zeros(0, self.gamma),
                                           raw_confidences=torch.zeros(0, self.gamma))
        return []


@dataclass
class DSparkProposer(RequestProposerBase):
    """Proposer hooks over a ``DSparkDrafter`` (module docstring; settings in ``RequestProposerBase``).

    With ``prepack`` (default) the drafter's linear layers are packed for inference in place
    (``DSparkDrafter.prepack``: oneDNN on the CPU, nothing elsewhere); a drafter to be trained further must not be
    given to a proposer with ``prepack``.
    """

    drafter: DSparkDrafter
    prepack: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prepack:
            self.drafter.prepack()

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        temperature, seed = self._take_params(request_id)
        state = _RequestState(temperature=temperature, generator=request_generator(self.seed, request_id), seed=seed)
        if seed is not None:
            vocab = self.drafter.draft_vocab
            columns = None if vocab is None else vocab.cpu()
            state.noise = NoiseRows(seed, self.drafter.config.vocab_size, columns=columns)
        self._state[request_id] = state
        self._extend([state], [first.features])
        state.anchor = first.new_token_ids[-1]

    def update(self, outputs: Sequence[StepOutput]) -> None:
        """Append every continuing request's new context rows (one batched projection for the whole step).

        ``outputs`` may hold several consecutive steps of a request (rounds in which it was not drafted), in
        order; their rows are appended in that order and the anchor is the last step's pending token.
        """
        rows: dict[str, list[torch.Tensor]] = {}
        for out in outputs:
            if not out.finished and out.request_id in self._state:
                rows.setdefault(out.request_id, []).append(out.features)
                self._state[out.request_id].anchor = out.new_token_ids[-1]
        if rows:
            self._extend([self._state[rid] for rid in rows], [torch.cat(f) for f in rows.values()])

    @torch.inference_mode()
    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        """``gamma`` drafts per request; the round's confidences are left in ``last_proposal``."""
        if not request_ids:
            return self._no_requests()
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
        base = d.base_logits(hidden[:, : self.gamma], draft=True)  # [B, gamma, V'] (V' = V without a draft vocab)
        temps, rows, uniform = round_sampling(states, self.gamma, device, coupled=True)
        # draft i is the token at position T + 1 + i (the anchor is token T)
        noise = [s.noise.rows([s.length + 1 + i for i in range(self.gamma)]) if s.noise is not None else None
                 for s in states]  # [gamma, V'] per seeded request
        prev, state = anchors[:, 0], None
        tokens, probs, conf = [], [], []
        for i in range(self.gamma):
            step = d.head_step(base[:, i], hidden[:, i], prev, state, draft=True)
            state = step.state
            index, q = draw(step.logits, temps, rows, uniform[:, i])  # index into V', q sparse | None
            index = coupled_draws(step.logits, index, states, [n[i] if n is not None else None for n in noise])
            prev = d.draft_token_ids(index)
            tokens.append(prev)
            probs.append(q)
            conf.append(step.conf_logit)
        self.last_proposal = make_proposal(request_ids, states, tokens, probs, conf, self.calibration,
                                           vocab=d.draft_vocab)
        return self.last_proposal.blocks

    # ---------------------------------------------------------------- helpers

    @torch.inference_mode()
    def _extend(self, states: list[_RequestState], features: list[torch.Tensor]) -> None:
        """Project new context rows (``features[i]`` [C_i, F] of ``states[i]``) into every layer's keys/values in
        one drafter call, and append them to each request's buffer."""
        d = self.drafter
        device = d.embed_weight.device
        counts = [f.shape[0] for f in features]
        feats = torch.cat(features).to(device)[None]  # [1, sum C, F]
        positions = torch.cat([torch.arange(s.length, s.length + c) for s, c in zip(states, counts)]).to(device)[None]
        kv = d.context_kv(feats, positions)
        rows = torch.stack([t[0] for pair in zip(kv.keys, kv.values) for t in pair])  # [2 * layers, Hkv, sum C, Dh]
        offset = 0
        for state, c in zip(states, counts):
            new_len = state.length + c
            if state.kv is None or state.kv.shape[2] < new_len:
                grown = rows.new_zeros(rows.shape[0], rows.shape[1], max(2 * new_len, 64), rows.shape[3])
                if state.kv is not None:
                    grown[:, :, : state.length] = state.kv[:, :, : state.length]
                state.kv = grown
            state.kv[:, :, state.length : new_len] = rows[:, :, offset : offset + c]
            state.length, offset = new_len, offset + c

    def _batch_context(self, states: list[_RequestState]) -> tuple[ContextKV, torch.Tensor]:
        """Right-padded context keys/values [B, Hkv, Tmax, Dh] per layer and the valid mask [B, Tmax]."""
        t_max = max(s.length for s in states)
        device = self.drafter.embed_weight.device
        lengths = torch.tensor([s.length for s in states], device=device)
        valid = torch.arange(t_max, device=device)[None] < lengths[:, None]
        first = states[0].kv
        kv = first.new_zeros(len(states), first.shape[0], first.shape[1], t_max, first.shape[3])
        for i, s in enumerate(states):
            kv[i, :, :, : s.length] = s.kv[:, :, : s.length]
        n = len(self.drafter.layers)
        keys = tuple(kv[:, 2 * i] for i in range(n))
        values = tuple(kv[:, 2 * i + 1] for i in range(n))
        return ContextKV(keys=keys, values=values), valid
