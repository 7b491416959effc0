"""The DSpark drafter as a pure ``nn.Module``: parallel backbone with KV injection + sequential head + confidence.

Owns the math only (no I/O, no request state, no sampling): projecting target features into injected keys and
values, the parallel backbone over a block, and one step of the sequential head. ``proposer.py`` drives it at
inference, ``train/trainer.py`` in training; both go through the same functions.

Architecture (DSpark, arXiv 2607.05147, on the DFlash backbone):
    * Context: target features of the tokens already in the target's cache ([T, F], F = 5 x 576) are
      RMS-normalised per target layer (``feature_norm``; DeepSpec's format skips this), projected by ``fc``
      (F -> Dm) and RMSNorm-ed into ``ctx``; every backbone layer turns ``ctx`` into extra keys/values with its
      own k/v projections (KV injection; with ``qk_norm``, the Qwen3 per-head key RMSNorm applies to them too).
    * Block: the anchor (the last committed token, the engine's pending token, at absolute position T) and
      K-1 mask embeddings (learned, or the embedding row of ``mask_token_id``) at positions T+1 .. T+K-1;
      bidirectional attention inside the block plus attention to the whole context. Block position i's output
      h_i gives the base logits U_{i+1} of draft token i+1 through the frozen LM head: one forward gives K base
      logits.
    * Sequential head, left to right, with e_k = W1[x_{k-1}] (rank r): logits_k = U_k + W2 z_k where
      z_k = e_k ("markov", DeepSpec "vanilla"); z_k = sigmoid(G [h_k; e_k] + g) * e_k ("gated");
      z_k = s_k = GRU([h_k; e_k], s_{k-1}) ("rnn"); or, DeepSpec's "rnn" ("joint_rnn"):
      [a; c; o] = J [s_{k-1}; e_k; h_k] + j, s_k = sigmoid(a) s_{k-1} + (1 - sigmoid(a)) tanh(c), z_k = tanh(o);
      no bias at all with "none" (purely parallel, DFlash). x_0 is the anchor, s_0 = 0; in training x_{k-1} is
      the target's token (teacher forcing), at inference the draft.
    * Confidence: c_k = sigmoid(w . [h_k; e_k] + b) (``confidence`` "hidden": [h_k]; head "rnn" by default:
      [h_k; s_k]), the probability that draft k is accepted given drafts 1..k-1 were; without a confidence
      head (``confidence="none"``) every c_k is 1.

The token embedding and LM head are the target's (passed in, frozen, never saved with the drafter); the LM head is
the embedding unless ``head_weight`` is given (an untied target, or a DeepSpec checkpoint's own ``lm_head``).

Draft vocabulary: ``set_draft_vocab(ids)`` restricts drafting to a sorted subset of V' token ids (EAGLE-3's
frequent-token head). The embedding rows and W2 rows of those ids are sliced once; with ``draft=True``,
``base_logits``, ``head_step`` and ``teacher_forced`` then return logits over V' only, and ``draft_token_ids``
maps an index in V' back to its token id. Training may use either: ``teacher_forced`` with ``draft=False`` keeps
the full V, with ``draft=True`` (in training mode) it slices W2 afresh so its V' rows get gradients.

Shape symbols: B batch, T context length, K block size (gamma), Q queries per sequence (M blocks x K),
V vocab, V' draft vocabulary size (V without one), F feature width, Dm hidden, H heads, Hkv kv heads, Dh head dim,
r rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.drafters.config import DecoderShape, DrafterConfig
from app.engine.model import apply_rope, rms_norm, rope_tables
from app.engine.prepack import PrepackedLinear, prepack_named, prepack_supported


@dataclass(frozen=True)
class ContextKV:
    """Injected keys/values of a context, one pair per backbone layer."""

    # per layer [B, Hkv, T, Dh] keys (rotary applied at the context positions)
    keys: tuple[torch.Tensor, ...]
    # per layer [B, Hkv, T, Dh] values
    values: tuple[torch.Tensor, ...]


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Validate a draft vocabulary: a non-empty, strictly increasing 1-D integer tensor of ids in [0, V).

    Returns:
        ids [V'] as int64 (same device).

    Raises:
        TypeError: not an integer tensor; ValueError: not 1-D, empty, an id outside [0, vocab_size), or not
        strictly increasing (the message names the first unsorted or duplicate id).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"draft_vocab must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    ids = ids.long()
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        raise ValueError(f"draft_vocab id {int(ids[bad[0, 0]])} (index {int(bad[0, 0])}) is outside the vocabulary "
                         f"[0, {vocab_size})")
    step = ids[1:] - ids[:-1]
    bad = (step <= 0).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        what = "duplicate id" if int(step[i]) == 0 else "unsorted ids"
        raise ValueError(f"draft_vocab must be sorted and distinct: {what} {int(ids[i])}, {int(ids[i + 1])} at "
                         f"indices {i}, {i + 1}")
    return ids


@dataclass(frozen=True)
class HeadStep:
    """One step of the sequential head for a batch of rows."""

    # [B, V] float32 logits of draft k ([B, V'] with ``draft=True`` and a draft vocabulary)
    logits: torch.Tensor
    # [B] float32 confidence logit of draft k (before sigmoid and calibration)
    conf_logit: torch.Tensor
    # [B, r] recurrent state s_k after step k ("rnn", "joint_rnn"), else None
    state: torch.Tensor | None


class BackboneLayer(nn.Module):
    """A pre-norm decoder layer whose attention also sees injected context keys/values (shared by every kind).

    With ``attn_features`` (EAGLE-3's reference layout) the attention reads an already-normed input of that width,
    given to ``forward`` as ``attn_in``, and the layer has no input norm of its own.
    """

    def __init__(self, c: DecoderShape, *, attn_features: int | None = None) -> None:
        super().__init__()
        self.c = c
        self.q_out, self.kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv = nn.Linear(attn_features or c.hidden_size, self.q_out + 2 * self.kv_out, bias=False)
        self.o_proj = nn.Linear(self.q_out, c.hidden_size, bias=False)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        if attn_features is None:
            self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        if c.qk_norm:  # Qwen3: RMSNorm over each head's Dh before the rotary embedding
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))

    def _norm_head(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """x [B, H, L, Dh] -> per-head RMSNorm with ``q_norm`` / ``k_norm`` (``qk_norm``), else x."""
        return rms_norm(x, getattr(self, which), self.c.rms_norm_eps) if self.c.qk_norm else x

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, T, Dm] (already normed), cos/sin [B, 1, T, Dh] -> keys, values [B, Hkv, T, Dh]."""
        b, t, _ = ctx.shape
        kv = F.linear(ctx, self.qkv.weight[self.q_out :])
        k = kv[..., : self.kv_out].view(b, t, self.c.num_kv_heads, self.c.head_dim).transpose(1, 2)
        v = kv[..., self.kv_out :].view(b, t, self.c.num_kv_heads, self.c.head_dim).transpose(1, 2)
        return apply_rope(self._norm_head(k, "k_norm"), cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        *,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        attn_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, Q, Dm] (the residual stream); ctx_k/v [B, Hkv, T, Dh]; cos/sin [B, 1, Q, Dh];
        mask [B, 1, Q, T + Q] bool; attn_in [B, Q, A] the attention's input with ``attn_features`` (else the layer
        norms x itself) -> [B, Q, Dm]."""
        c = self.c
        b, q_len, _ = x.shape
        h = rms_norm(x, self.input_norm, c.rms_norm_eps) if attn_in is None else attn_in
        qkv = self.qkv(h)
        q = qkv[..., : self.q_out].view(b, q_len, c.num_heads, c.head_dim).transpose(1, 2)
        k = qkv[..., self.q_out : self.q_out + self.kv_out].view(b, q_len, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = qkv[..., self.q_out + self.kv_out :].view(b, q_len, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(self._norm_head(q, "q_norm"), cos, sin), apply_rope(self._norm_head(k, "k_norm"), cos, sin)
        keys = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        values = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, q_len, self.q_out))
        h = rms_norm(x, self.post_attn_norm, c.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class DSparkDrafter(nn.Module):
    """DSpark drafter (module docstring). ``embed_weight`` [V, Dm] is the target's input embedding, also the LM head
    unless ``head_weight`` [V, Dm] is given (frozen, shared, never saved with the drafter).

    Raises:
        ValueError: ``embed_weight`` or ``head_weight`` is not [V, Dm] of the config.
    """

    def __init__(
        self, config: DrafterConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        c = self.config = config
        for name, w in (("embedding", embed_weight), ("LM head", head_weight)):
            if w is not None and tuple(w.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"{name} {tuple(w.shape)} does not match V={c.vocab_size}, Dm={c.hidden_size}")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", None if head_weight is None else head_weight.detach(), persistent=False)
        self.fc = nn.Linear(c.feature_dim, c.hidden_size, bias=False)
        self.ctx_norm = nn.Parameter(torch.ones(c.hidden_size))
        if c.mask_token_id is None:
            self.mask_embed = nn.Parameter(torch.randn(c.hidden_size) * 0.02)
        self.layers = nn.ModuleList(BackboneLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        if c.head != "none":
            self.w1 = nn.Embedding(c.vocab_size, c.rank)
            nn.init.normal_(self.w1.weight, std=0.02)
            self.w2 = nn.Linear(c.rank, c.vocab_size, bias=False)
            nn.init.zeros_(self.w2.weight)  # starts as the purely parallel drafter
        if c.head == "gated":
            self.gate = nn.Linear(c.hidden_size + c.rank, c.rank)
        if c.head == "rnn":
            self.cell = nn.GRUCell(c.hidden_size + c.rank, c.rank)
        if c.head == "joint_rnn":
            self.joint = nn.Linear(2 * c.rank + c.hidden_size, 3 * c.rank)
        conf_in = {"hidden": c.hidden_size, "none": 0}.get(c.confidence_input, c.hidden_size + c.rank)
        self.conf = nn.Linear(conf_in, 1) if conf_in else None
        cos, sin = rope_tables(head_dim=c.head_dim, theta=c.rope_theta, max_positions=c.rope_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # draft vocabulary (``set_draft_vocab``): [V'] int64 ids, their embedding rows [V', Dm] and W2 rows [V', r]
        self.register_buffer("draft_vocab", None, persistent=False)
        self.register_buffer("draft_embed", None, persistent=False)
        self.register_buffer("draft_w2", None, persistent=False)
        self.draft_head: PrepackedLinear | None = None  # draft_embed prepacked (``prepack``), else None
        self.prepacked = False
        self.register_load_state_dict_post_hook(DSparkDrafter._reslice_draft_vocab)

    # ---------------------------------------------------------------- draft vocabulary

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft over the token ids ``ids`` [V'] only (sorted, distinct, in [0, V)); None: the full vocabulary.

        Slices the embedding rows and W2's output rows once (in their current dtype and device): call it after
        loading the weights and after any ``.to()`` that changes them (``.to()`` also moves the slices).

        Raises:
            TypeError / ValueError: from ``check_draft_vocab``.
        """
        self.draft_head = None
        if ids is None:
            self.draft_vocab = self.draft_embed = self.draft_w2 = None
            return
        ids = check_draft_vocab(ids, self.config.vocab_size).to(self.embed_weight.device)
        self.draft_vocab = ids
        self.draft_embed = self.lm_head.index_select(0, ids)
        self.draft_w2 = self.w2.weight.detach().index_select(0, ids) if self.config.head != "none" else None
        if self.prepacked and prepack_supported(self.draft_embed.device, self.draft_embed.dtype):
            self.draft_head = PrepackedLinear(self.draft_embed)

    def prepack(self) -> int:
        """Inference only: run the backbone's linear layers, the context projection ``fc`` and the LM head over the
        draft vocabulary on oneDNN-prepacked weights (``app/engine/prepack.py``) where this torch build packs their
        dtype on their device; at a few rows the packed float32 kernel reads each weight once where ``F.linear``'s
        does not. Returns how many layers were packed (0 where nothing can be, or all is packed already).

        Drafts are the same up to float32 rounding (bfloat16: bit for bit). A packed drafter cannot be trained or
        saved afterwards: packed layers hold no gradients and no ``state_dict`` entries.
        """
        names = [f"layers.{i}.{n}" for i in range(len(self.layers)) for n in ("qkv", "o_proj", "gate_up", "down_proj")]
        # qkv.weight and fc.weight stay readable: the context path slices the one and reads the other's dtype
        packed = prepack_named(self, names + ["fc"], keep_weight=("qkv", "fc"))
        self.prepacked = True
        if self.draft_vocab is not None:
            self.set_draft_vocab(self.draft_vocab)
        return packed

    @staticmethod
    def _reslice_draft_vocab(module: nn.Module, _incompatible_keys: object) -> None:
        """load_state_dict post-hook: the cached draft rows must follow newly loaded weights."""
        if module.draft_vocab is not None:
            module.set_draft_vocab(module.draft_vocab)

    @property
    def lm_head(self) -> torch.Tensor:
        """[V, Dm] the frozen LM head: ``head_weight``, or the tied embedding without one."""
        return self.embed_weight if self.head_weight is None else self.head_weight

    def draft_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the drafting vocabulary (any shape, int64) -> token ids: ``draft_vocab[index]``, or
        ``index`` itself without a draft vocabulary."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    # ---------------------------------------------------------------- context

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, F] (target dtype) -> ctx [B, T, Dm]: per-layer RMS (``feature_norm``), ``fc``, RMSNorm."""
        c = self.config
        x = features.to(self.fc.weight.dtype)
        if c.feature_norm:
            x = x.unflatten(-1, (len(c.feature_layers), c.target_hidden_size))
            x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)
            x = x.flatten(-2)
        return rms_norm(self.fc(x), self.ctx_norm, c.rms_norm_eps)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """features [B, T, F], positions [B, T] -> the injected keys/values of every layer."""
        ctx = self.project_context(features)
        cos, sin = self._rope(positions, ctx.dtype)
        pairs = [layer.context_kv(ctx, cos, sin) for layer in self.layers]
        return ContextKV(keys=tuple(k for k, _ in pairs), values=tuple(v for _, v in pairs))

    # ---------------------------------------------------------------- parallel backbone

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [B, M] -> block inputs [B, M * K, Dm]: each anchor's embedding followed by K-1 mask embeddings
        (learned, or the embedding row of ``mask_token_id``)."""
        b, m = anchors.shape
        c = self.config
        mask = self.mask_embed if c.mask_token_id is None else self.embed_weight[c.mask_token_id].to(self.norm.dtype)
        anchor_emb = F.embedding(anchors, self.embed_weight).to(mask.dtype)  # [B, M, Dm]
        masks = mask.expand(b, m, c.block_size - 1, -1)
        return torch.cat([anchor_emb[:, :, None], masks], dim=2).flatten(1, 2)

    def backbone(
        self, x: torch.Tensor, *, positions: torch.Tensor, ctx: ContextKV, mask: torch.Tensor
    ) -> torch.Tensor:
        """Block inputs x [B, Q, Dm] at positions [B, Q], mask [B, Q, T + Q] bool -> normed hidden [B, Q, Dm]."""
        cos, sin = self._rope(positions, x.dtype)
        attn_mask = mask[:, None]
        for layer, k, v in zip(self.layers, ctx.keys, ctx.values):
            x = layer(x, ctx_k=k, ctx_v=v, cos=cos, sin=sin, mask=attn_mask)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def base_logits(self, hidden: torch.Tensor, *, draft: bool = False) -> torch.Tensor:
        """normed hidden [..., Dm] -> U [..., V] float32 through the frozen LM head; with ``draft`` and a
        draft vocabulary, U [..., V'] over its ids only (column j is token ``draft_vocab[j]``)."""
        weight = self.draft_embed if draft and self.draft_vocab is not None else self.lm_head
        # one 2-D matmul: a non-contiguous [B, gamma < K, Dm] slice would go through bmm with a per-row copy of the weight
        flat = hidden.to(weight.dtype).reshape(-1, hidden.shape[-1])
        head = self.draft_head if draft else None  # set only with a draft vocabulary
        logits = head(flat) if head is not None else F.linear(flat, weight)
        return logits.float().reshape(*hidden.shape[:-1], weight.shape[0])

    # ---------------------------------------------------------------- sequential head

    def head_step(
        self, base: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None,
        *, draft: bool = False,
    ) -> HeadStep:
        """Draft k's logits and confidence logit: base [B, V], hidden [B, Dm], prev x_{k-1} [B] (token ids),
        state s_{k-1} [B, r] | None (None: s_0 = 0). With ``draft`` and a draft vocabulary, base and the logits are
        [B, V'] (the W2 bias of the draft ids only); the confidence does not depend on the vocabulary. The
        stateless heads ("markov", "gated", "none") accept any leading shape [...] in place of [B]."""
        if self.config.head == "none":
            return HeadStep(logits=base, conf_logit=self._confidence(hidden, None, None), state=None)
        e = self.w1(prev).to(hidden.dtype)  # [B, r]
        z, state = self._latent(hidden, e, state)
        return HeadStep(logits=base + F.linear(z, self._w2(draft)).float(),
                        conf_logit=self._confidence(hidden, e, state), state=state)

    def teacher_forced(
        self, base: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor, *, draft: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All K steps with known previous tokens: base [N, K, V], hidden [N, K, Dm], prev [N, K] ->
        logits [N, K, V] float32 and confidence logits [N, K]. Same math as K calls of ``head_step``; the
        stateless heads run all positions at once. With ``draft`` and a draft vocabulary, base and the logits
        are [N, K, V'] (training over V': W2's rows of V' get gradients, the others none)."""
        if self.config.head in ("markov", "gated", "none"):
            step = self.head_step(base, hidden, prev, None, draft=draft)
            return step.logits, step.conf_logit
        state, logits, conf = None, [], []
        for k in range(base.shape[1]):
            step = self.head_step(base[:, k], hidden[:, k], prev[:, k], state, draft=draft)
            state = step.state
            logits.append(step.logits)
            conf.append(step.conf_logit)
        return torch.stack(logits, 1), torch.stack(conf, 1)

    def _latent(
        self, hidden: torch.Tensor, e: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """z_k [..., r] (the input of W2) and s_k [..., r] (None for the stateless heads) from h_k [..., Dm],
        e_k [..., r] and s_{k-1} (module docstring)."""
        head = self.config.head
        if head == "markov":
            return e, None
        if head == "gated":
            return torch.sigmoid(self.gate(torch.cat([hidden, e], -1))) * e, None
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.config.rank)
        if head == "rnn":
            state = self.cell(torch.cat([hidden, e], -1), state)
            return state, state
        a, c, o = self.joint(torch.cat([state, e, hidden], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(a)
        return torch.tanh(o), gate * state + (1.0 - gate) * torch.tanh(c)

    def _confidence(self, hidden: torch.Tensor, e: torch.Tensor | None, state: torch.Tensor | None) -> torch.Tensor:
        """Confidence logits [...] float32 from h_k [..., Dm] and the head's e_k / s_k (``confidence_input``);
        +inf (confidence 1) without a confidence head."""
        kind = self.config.confidence_input
        if kind == "none":
            return torch.full(hidden.shape[:-1], float("inf"), device=hidden.device)
        x = hidden if kind == "hidden" else torch.cat([hidden, e if kind == "hidden_prev" else state], -1)
        return self.conf(x).squeeze(-1).float()

    # ---------------------------------------------------------------- helpers

    def _w2(self, draft: bool) -> torch.Tensor:
        """W2 [V, r], or its draft-vocabulary rows [V', r] with ``draft``: the slice cached by ``set_draft_vocab``
        at inference, a fresh (differentiable) one in training mode or with gradients on (a trainer refreshes the
        cache with ``set_draft_vocab`` when it is done)."""
        if not draft or self.draft_vocab is None:
            return self.w2.weight
        if self.training or (torch.is_grad_enabled() and self.w2.weight.requires_grad):
            return self.w2.weight.index_select(0, self.draft_vocab)
        return self.draft_w2

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, L] -> cos, sin [B, 1, L, Dh]."""
        return self.rope_cos[positions].to(dtype)[:, None], self.rope_sin[positions].to(dtype)[:, None]

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
