"""Hyperparameters of the DSpark drafter, validated (pydantic, unknown keys are errors).

Owns: the drafter's shape (block size, layers, widths, head type, rank) and its link to the target (feature
layers, hidden size, vocabulary). Saved next to the weights as JSON (``checkpoint.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DrafterConfig(BaseModel):
    """One DSpark drafter (see ``app/drafters/dspark.py`` for the architecture)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field("smollm2-135m", description="Target model reference the drafter was trained against.")
    block_size: int = Field(7, ge=1, le=64, description="gamma: draft tokens per block (anchor + gamma-1 masks).")
    num_layers: int = Field(2, ge=1, le=8, description="Parallel backbone decoder layers.")
    hidden_size: int = Field(576, ge=8, description="Drafter hidden size Dm; must equal the target's (shared embedding).")
    num_heads: int = Field(9, ge=1, description="Query heads H of each backbone layer.")
    num_kv_heads: int = Field(3, ge=1, description="Key/value heads Hkv (grouped-query attention).")
    head_dim: int = Field(64, ge=8, description="Per-head width Dh.")
    intermediate_size: int = Field(1536, ge=8, description="SwiGLU MLP width of each backbone layer.")
    vocab_size: int = Field(49152, ge=2, description="V, shared with the target.")
    feature_layers: tuple[int, ...] = Field((5, 11, 17, 23, 29), description="Target layers whose hidden states are injected.")
    target_hidden_size: int = Field(576, ge=8, description="Width of one target layer's hidden state.")
    head: Literal["markov", "rnn", "none"] = Field(
        "markov", description="Sequential head: low-rank Markov bias, GRU state, or none (purely parallel, DFlash)."
    )
    rank: int = Field(64, ge=1, description="r: width of the token table W1 [V, r] and of W2 [r, V].")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    rope_theta: float = Field(100000.0, gt=0, description="Rotary base (the target's).")
    max_positions: int = Field(8192, ge=16, description="Longest context the rotary table covers.")

    @model_validator(mode="after")
    def _check(self) -> "DrafterConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.feature_layers:
            raise ValueError("feature_layers must be non-empty")
        return self

    @property
    def feature_dim(self) -> int:
        """F = len(feature_layers) * target_hidden_size."""
        return len(self.feature_layers) * self.target_hidden_size
