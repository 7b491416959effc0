"""The autoregressive baseline drafter as a pure ``nn.Module``: EAGLE-3-style, and MTP-1 as its one-step case.

Owns the math only (no I/O, no request state, no sampling): fusing target features, the input projection, one
causal decoder layer over the context and the drafter's own steps, the head, and the training-time-test unroll
used in training. ``eagle_proposer.py`` drives it at inference, ``train/trainer.py`` in training.

Architecture (EAGLE-3, arXiv 2503.01840, on this project's target features):
    * Fused feature of context token j: the target's hidden states at ``fused_layers`` (low / mid / high, a
      subset of the engine's feature layers), each RMS-normalised, concatenated and projected by ``fc``
      (3 x 576 -> Dm). A single fused layer (MTP) is used as is, without ``fc``.
    * Input at position j: x_j = in_proj([RMSNorm(s_j); RMSNorm(emb(x_{j+1}))]) (2 Dm -> Dm), where s_j is the
      fused feature for a context row, or the drafter's own previous output hidden for a draft step.
    * One pre-norm decoder layer (the ``BackboneLayer`` of ``dspark.py``) with causal attention; its output h_j
      predicts token j+2 through the final RMSNorm and the target's frozen tied LM head; a confidence logit
      w . RMSNorm(h_j) + b estimates P(the draft is accepted | earlier drafts were).

Context alignment (as DSpark's): the context is feature rows 0..T-1 and the anchor (the engine's pending token)
is token T. Row T-1's input holds emb(x_T), so its output h_{T-1} gives draft 1; draft step k >= 2 feeds
[h^{(k-1)}; emb(d_{k-1})] at position T+k-2, attending to the context rows' keys and the earlier draft steps'
keys: one token per forward. Draft steps' keys are dropped after the round; committed tokens re-enter through
their true features.

DeepSpec's EAGLE-3 layout (``fusion="concat"``, with ``feature_norm=False``, ``qk_norm`` and no confidence head
for its checkpoints): the fused feature is ``fc`` of the concatenated raw features; the attention reads
a_j = [RMSNorm(emb(x_{j+1})); RMSNorm(s_j)] (2 Dm) directly, and the layer's residual stream starts from s_j
itself (no in_proj, no input norm in the layer). Everything else (alignment, final norm, head, unroll) is shared.

MTP-1 (DeepSeek-V3's multi-token-prediction module: [RMSNorm(h_t); RMSNorm(emb(x_{t+1}))] -> projection ->
one transformer block -> shared head) is this class with ``fused_layers=(29,)`` (the target's last layer,
before its final norm) and ``block_size=1``: one draft per round.

Training-time test (EAGLE-3): for an anchor a the unroll runs the context pass over all rows (causal), takes
h^{(1)} at row a-1, then for k = 2..K feeds the drafter's own h^{(k-1)} with the embedding of the true token
x_{a+k-1} (drafts < k accepted means d_{k-1} = x_{a+k-1}), with exactly the attention of inference: context rows
< a plus the chain's own earlier steps. Gradients flow through the unrolled hidden states.

Shape symbols: B batch, T context length, M anchors (chains) per sequence, K block size (gamma), V vocab,
F feature width, Dm hidden, Hkv kv heads, Dh head dim, S earlier keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.drafters.config import EagleConfig
from app.drafters.dspark import BackboneLayer
from app.engine.model import rms_norm, rope_tables
from app.engine.prepack import PrepackedLinear, prepack_named, prepack_supported


class EagleDrafter(nn.Module):
    """EAGLE-3-style drafter (module docstring). ``embed_weight`` [V, Dm] is the target's input embedding, also the LM
    head unless ``head_weight`` [V, Dm] is given (frozen, shared, never saved with the drafter).

    Raises:
        ValueError: ``embed_weight`` or ``head_weight`` is not [V, Dm] of the config.
    """

    def __init__(
        self, config: EagleConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        c = self.config = config
        for name, w in (("embedding", embed_weight), ("LM head", head_weight)):
            if w is not None and tuple(w.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"{name} {tuple(w.shape)} does not match V={c.vocab_size}, Dm={c.hidden_size}")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", None if head_weight is None else head_weight.detach(), persistent=False)
        fused = len(c.fused_layers)
        self.fc = nn.Linear(fused * c.target_hidden_size, c.hidden_size, bias=False) if fused > 1 else None
        self.state_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.embed_norm = nn.Parameter(torch.ones(c.hidden_size))
        if c.fusion == "in_proj":
            self.in_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
            self.layer = BackboneLayer(c)
        else:
            self.layer = BackboneLayer(c, attn_features=2 * c.hidden_size)
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.conf = nn.Linear(c.hidden_size, 1) if c.confidence else None
        cos, sin = rope_tables(head_dim=c.head_dim, theta=c.rope_theta, max_positions=c.rope_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.packed_head: PrepackedLinear | None = None  # the LM head prepacked (``prepack``), else None

    def prepack(self) -> int:
        """Inference only: run the decoder layer's linear layers, ``fc``, ``in_proj`` and the LM head on
        oneDNN-prepacked weights (``app/engine/prepack.py``) where this torch build packs their dtype on their
        device, as ``DSparkDrafter.prepack`` does. Returns how many layers were packed (the head not counted). The
        packed head is a copy of the frozen [V, Dm] head; a packed drafter cannot be trained or saved afterwards."""
        names = ["layer.qkv", "layer.o_proj", "layer.gate_up", "layer.down_proj", "fc", "in_proj"]
        packed = prepack_named(self, names, keep_weight=("qkv",))  # the context path slices qkv.weight
        if self.packed_head is None and prepack_supported(self.lm_head.device, self.lm_head.dtype):
            self.packed_head = PrepackedLinear(self.lm_head)
        return packed

    # ---------------------------------------------------------------- building blocks

    @property
    def lm_head(self) -> torch.Tensor:
        """[V, Dm] the frozen LM head: ``head_weight``, or the tied embedding without one."""
        return self.embed_weight if self.head_weight is None else self.head_weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's own parameters (and of its keys / values)."""
        return self.norm.dtype

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F] (all engine layers) -> fused feature [..., Dm]: the fused layers, per-layer RMS
        (``feature_norm``), fc."""
        c = self.config
        x = features.to(self.dtype).unflatten(-1, (len(c.feature_layers), c.target_hidden_size))
        x = x[..., list(c.fused_index), :]
        if c.feature_norm:
            x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)
        x = x.flatten(-2)
        return x if self.fc is None else self.fc(x)

    def inputs(self, state: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """state [..., Dm] (fused feature or own hidden), next_tokens [...] -> layer input [..., Din]: Din = Dm
        ("in_proj": the projection of [RMSNorm(state); RMSNorm(emb)]), or Din = 3 Dm ("concat": the attention input
        [RMSNorm(emb); RMSNorm(state)] followed by the residual, state itself)."""
        eps = self.config.rms_norm_eps
        emb = rms_norm(F.embedding(next_tokens, self.embed_weight).to(state.dtype), self.embed_norm, eps)
        if self.config.fusion == "concat":
            return torch.cat([emb, rms_norm(state, self.state_norm, eps), state], -1)
        return self.in_proj(torch.cat([rms_norm(state, self.state_norm, eps), emb], -1))

    def attend(
        self, x: torch.Tensor, *, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder layer on x [B, Q, Din] (``inputs``) at positions [B, Q], attending to earlier keys/values
        past_k/v [B, Hkv, S, Dh] and to its own queries under mask [B, Q, S + Q] bool.

        Returns:
            output hidden [B, Q, Dm] (before the final norm), and the queries' own keys/values [B, Hkv, Q, Dh]
            (rotary applied) for later steps.
        """
        cos = self.rope_cos[positions].to(x.dtype)[:, None]
        sin = self.rope_sin[positions].to(x.dtype)[:, None]
        if self.config.fusion == "concat":
            attn_in, x = x[..., : 2 * self.config.hidden_size], x[..., 2 * self.config.hidden_size :]
        else:
            attn_in = rms_norm(x, self.layer.input_norm, self.config.rms_norm_eps)
        k, v = self.layer.context_kv(attn_in, cos, sin)
        out = self.layer(x, ctx_k=past_k, ctx_v=past_v, cos=cos, sin=sin, mask=mask[:, None], attn_in=attn_in)
        return out, k, v

    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., Dm] -> draft logits [..., V] float32 (frozen LM head), confidence logits [...] float32
        (+inf, confidence 1, without a confidence head)."""
        h = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        x = h.to(self.lm_head.dtype)
        logits = (self.packed_head(x) if self.packed_head is not None else F.linear(x, self.lm_head)).float()
        if self.conf is None:
            return logits, torch.full(h.shape[:-1], float("inf"), device=h.device)
        return logits, self.conf(h).squeeze(-1).float()

    def empty_kv(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, 0, Dh] keys/values of nothing, in ``like``'s dtype and device."""
        c = self.config
        return like.new_zeros(batch, c.num_kv_heads, 0, c.head_dim)

    # ---------------------------------------------------------------- training-time test

    def unroll(
        self, features: torch.Tensor, tokens: torch.Tensor, anchors_idx: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training-time test (module docstring) for M anchors per sequence.

        Args:
            features: [B, T, F] context features (rows past a sequence's end are padding).
            tokens: [B, T] token ids (x_{j+1} of row j is ``tokens[:, j + 1]``).
            anchors_idx: [B, M] anchor positions a (>= 1; the context of a chain is rows < a).
            prev: [B, M, K] the true tokens x_{a+k-1} fed at step k (prev[..., 0] = x_a is already in row a-1).

        Returns:
            logits [B * M, K, V] float32 (step k predicts x_{a+k}) and confidence logits [B * M, K].
        """
        b, t = tokens.shape
        m, k = prev.shape[1], prev.shape[2]
        device = tokens.device
        next_tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(b, 1)], dim=1)
        x = self.inputs(self.fuse(features), next_tokens)  # [B, T, Dm]
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)
        empty = self.empty_kv(b, x)
        h_ctx, k_ctx, v_ctx = self.attend(x, positions=torch.arange(t, device=device).expand(b, t), past_k=empty,
                                          past_v=empty, mask=causal)
        h = h_ctx.gather(1, (anchors_idx - 1)[..., None].expand(b, m, h_ctx.shape[-1]))  # [B, M, Dm]
        hidden, keys, values = [h], [k_ctx], [v_ctx]
        ctx_mask = torch.arange(t, device=device)[None, None, :] < anchors_idx[:, :, None]  # [B, M, T]
        own = torch.eye(m, dtype=torch.bool, device=device).expand(b, m, m)  # a chain sees only its own steps
        for step in range(1, k):
            mask = torch.cat([ctx_mask] + [own] * step, dim=2)  # [B, M, T + step * M]
            h, k_new, v_new = self.attend(self.inputs(h, prev[:, :, step]), positions=anchors_idx + step - 1,
                                          past_k=torch.cat(keys, 2), past_v=torch.cat(values, 2), mask=mask)
            hidden.append(h)
            keys.append(k_new)
            values.append(v_new)
        logits, conf = self.head(torch.stack(hidden, 2).flatten(0, 1))  # [B * M, K, ...]
        return logits, conf

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
