"""Hyperparameters of the drafters, validated (pydantic, unknown keys are errors).

Owns: each drafter kind's shape (block size, layers, widths, head type, rank, fused feature layers) and its link
to the target (feature layers, hidden size, vocabulary). Saved next to the weights as JSON (``checkpoint.py``),
with the kind (``DrafterConfig``: "dspark", ``EagleConfig``: "eagle") beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from app.engine.model import TargetModel


class DecoderShape(BaseModel):
    """Fields every drafter kind shares: the decoder layer's widths and the link to the target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field("smollm2-135m", description="Target model reference the drafter was trained against.")
    block_size: int = Field(7, ge=1, le=64, description="gamma: draft tokens per round.")
    hidden_size: int = Field(576, ge=8, description="Drafter hidden size Dm; must equal the target's (shared embedding).")
    num_heads: int = Field(9, ge=1, description="Query heads H of each decoder layer.")
    num_kv_heads: int = Field(3, ge=1, description="Key/value heads Hkv (grouped-query attention).")
    head_dim: int = Field(64, ge=8, description="Per-head width Dh.")
    intermediate_size: int = Field(1536, ge=8, description="SwiGLU MLP width of each decoder layer.")
    vocab_size: int = Field(49152, ge=2, description="V, shared with the target.")
    feature_layers: tuple[int, ...] = Field(
        (5, 11, 17, 23, 29), description="Target layers whose hidden states the engine returns (StepOutput.features)."
    )
    target_hidden_size: int = Field(576, ge=8, description="Width of one target layer's hidden state.")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    rope_theta: float = Field(100000.0, gt=0, description="Rotary base (the target's).")
    max_positions: int = Field(8192, ge=16, description="Longest context the rotary table covers.")
    qk_norm: bool = Field(
        False, description="Per-head RMSNorm of queries and keys before the rotary embedding (Qwen3 layers; applied "
        "to the injected context keys as well)."
    )

    @model_validator(mode="after")
    def _check_shape(self) -> "DecoderShape":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.feature_layers:
            raise ValueError("feature_layers must be non-empty")
        return self

    @property
    def feature_dim(self) -> int:
        """F = len(feature_layers) * target_hidden_size."""
        return len(self.feature_layers) * self.target_hidden_size

    @property
    def rope_positions(self) -> int:
        """Positions the rotary tables cover: a full context of ``max_positions`` tokens and one draft block past it
        (the engine admits prompt + max_tokens up to its context limit)."""
        return self.max_positions + self.block_size


def target_shape(target: TargetModel, *, name: str) -> dict:
    """The ``DecoderShape`` fields that size a drafter for ``target``: its layer widths and heads, vocabulary, feature
    layers, norm epsilon and rotary table, with ``name`` (the model reference) as ``target``; a dict to validate,
    merged with any other fields, into the config of any drafter kind."""
    a = target.args
    return {
        "target": name, "hidden_size": a.hidden_size, "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size,
        "feature_layers": target.feature_layers, "target_hidden_size": a.hidden_size, "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta, "max_positions": a.max_position_embeddings,
    }


class DrafterConfig(DecoderShape):
    """One DSpark drafter, or the DFlash-style one with ``head="none"`` (``app/drafters/dspark.py``)."""

    num_layers: int = Field(2, ge=1, le=8, description="Parallel backbone decoder layers.")
    head: Literal["markov", "gated", "rnn", "joint_rnn", "none"] = Field(
        "markov", description="Sequential head: low-rank Markov bias (DeepSpec 'vanilla'), the Markov bias through a "
        "sigmoid gate of [h; W1[x]] ('gated'), GRU state ('rnn'), DeepSpec's 'rnn' (one joint projection of "
        "[s; W1[x]; h] into gate, candidate and output: 'joint_rnn'), or none (purely parallel, DFlash)."
    )
    rank: int = Field(64, ge=1, description="r: width of the token table W1 [V, r] and of W2 [r, V].")
    feature_norm: bool = Field(
        True, description="RMS-normalise each target layer's feature before fc (this project's drafters; DeepSpec's "
        "format feeds the concatenated features to fc as they are)."
    )
    mask_token_id: int | None = Field(
        None, ge=0, description="Block positions after the anchor take the target's embedding row of this token id "
        "(DeepSpec); None: a learned mask embedding."
    )
    confidence: Literal["auto", "hidden", "hidden_prev", "none"] = Field(
        "auto", description="Input of the confidence head: h_k ('hidden'), [h_k; W1[x_{k-1}]] ('hidden_prev'), or "
        "'auto' (head 'rnn': [h_k; s_k], 'none': h_k, others: [h_k; W1[x_{k-1}]]); 'none': no confidence head, "
        "every draft reports confidence 1 (the whole block is verified, as DFlash does)."
    )

    @model_validator(mode="after")
    def _check_head(self) -> "DrafterConfig":
        if self.mask_token_id is not None and self.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.confidence == "hidden_prev" and self.head == "none":
            raise ValueError("confidence 'hidden_prev' needs a sequential head (W1), but head is 'none'")
        return self

    @property
    def confidence_input(self) -> Literal["hidden", "hidden_prev", "hidden_state", "none"]:
        """The confidence head's input with 'auto' resolved: 'hidden_state' is [h_k; s_k] (head 'rnn')."""
        if self.confidence != "auto":
            return self.confidence
        return {"rnn": "hidden_state", "none": "hidden"}.get(self.head, "hidden_prev")


class EagleConfig(DecoderShape):
    """One autoregressive drafter (``app/drafters/eagle.py``): EAGLE-3-style, or MTP-1 with ``block_size=1`` and
    ``fused_layers=(29,)``."""

    fused_layers: tuple[int, ...] = Field(
        (5, 17, 29), description="Subset of feature_layers fused into the input (EAGLE-3: low, mid, high; MTP: last)."
    )
    fusion: Literal["in_proj", "concat"] = Field(
        "in_proj", description="How the layer reads [state; token embedding]: projected to Dm by in_proj, then the "
        "layer's own input norm ('in_proj'), or, as DeepSpec's EAGLE-3, the attention reads [RMSNorm(emb); "
        "RMSNorm(state)] (2 Dm) directly with the state as the residual ('concat')."
    )
    feature_norm: bool = Field(
        True, description="RMS-normalise each fused target layer's feature before fc (DeepSpec's format: no)."
    )
    confidence: bool = Field(
        True, description="A confidence head on the normed hidden; without one every draft reports confidence 1."
    )

    @model_validator(mode="after")
    def _check_fused(self) -> "EagleConfig":
        unknown = [i for i in self.fused_layers if i not in self.feature_layers]
        if not self.fused_layers or unknown or len(set(self.fused_layers)) != len(self.fused_layers):
            raise ValueError(f"fused_layers {self.fused_layers} must be distinct members of feature_layers "
                             f"{self.feature_layers}")
        if len(self.fused_layers) == 1 and self.fusion == "concat":
            raise ValueError("fusion 'concat' needs fc, so at least two fused_layers")
        if len(self.fused_layers) == 1 and self.target_hidden_size != self.hidden_size:
            raise ValueError(f"one fused layer is used without a projection, so target_hidden_size "
                             f"{self.target_hidden_size} must equal hidden_size {self.hidden_size}")
        return self

    @property
    def fused_index(self) -> tuple[int, ...]:
        """Positions of ``fused_layers`` in ``feature_layers`` (slices of the engine's feature rows)."""
        return tuple(self.feature_layers.index(i) for i in self.fused_layers)
