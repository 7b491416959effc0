"""The target's greedy next token without a float32 LM-head matmul over the whole vocabulary.

Why: the engine computes logits with a float32 copy of the LM head (bfloat16 logits tie and depend on the batch
shape: ``TargetModel.logits_from_final_hidden``). On a small CPU that matmul is about a third of a single-token
step of SmolLM2-135M, and this module (bfloat16 matmul + rescoring) takes about half its time at 1-64 rows; on a GPU
at Llama-3.1-8B's head (V 128256) it is the largest kernel of a 64-request x 8-token verify step, and this module
takes about a fifth of its time at 512 rows. A greedy row only needs the argmax.

Rule (``ScreenedArgmax``): bfloat16 logits s = bf16(h) . W_bf16 screen the vocabulary; of the ``top`` best tokens
by s, those within 2 * ``margin`` of the row's best are rescored exactly (float64 dot products of the float32 head
rows with the float32 normed hidden state h) and the best exact logit wins. A row whose ``top`` screened tokens
all lie within the margin (a flat distribution: the screen cannot rule out the rest) is screened again over its
``wide_top`` best tokens; only a row flat even there falls back to the full float32 logits (a pass over the whole
float32 head). The winner is the argmax of the exact logits whenever the screen's error is below ``margin`` on
the tokens involved. Measured error on SmolLM2-135M, 2064 prompt positions of the evaluation sets: at most 0.147
logits (SCREEN_MARGIN is 1.0), and the screened token equalled the float64 argmax at every position, as did the
float32 head's. The worst-case bound, (2u + D u_fp32) sum_i |h_i W_ji| with u = 2^-8, is 2.3-3.3 logits on those
rows: the margin is measured, not proven. A row's winner is rescored exactly, so it does not depend on the batch
shape (the screen's own rounding can only move tokens near the margin's edge, far below the winner).

Shape symbols: M rows, V vocabulary, Dm hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.engine.prepack import PrepackedLinear

SCREEN_TOP = 64  # screened tokens kept per row (on the rows above, at most 32 lay within the margin)
SCREEN_MARGIN = 1.0  # logits: bound assumed on the screen's error (measured max 0.147)
SCREEN_WIDE_TOP = 2048  # screened tokens kept for a row flat over SCREEN_TOP, before the full head


class ScreenedArgmax:
    """Greedy tokens from normed final hidden states (module docstring).

    Args:
        weight: [V, Dm] float32 LM head (the exact logits are h . weight_j).
        screen_weight: [V, Dm] the same head in bfloat16 (or float16).
        top, margin, wide_top: ``SCREEN_TOP``, ``SCREEN_MARGIN``, ``SCREEN_WIDE_TOP``.
        prepack: run the screen on a oneDNN-prepacked copy of ``screen_weight`` (``app/engine/prepack.py``; bfloat16
            on a CPU where ``prepack_supported``).
    Raises:
        ValueError: mismatched shapes, ``weight`` not float32, ``top`` < 1, ``wide_top`` < ``top`` or ``margin`` <= 0,
            or ``prepack`` for a screen weight that cannot be prepacked.
    """

    def __init__(self, weight: torch.Tensor, screen_weight: torch.Tensor, *, top: int = SCREEN_TOP,
                 margin: float = SCREEN_MARGIN, wide_top: int = SCREEN_WIDE_TOP, prepack: bool = False) -> None:
        if weight.shape != screen_weight.shape or weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(f"need float32 weight and a screen weight of the same [V, Dm] shape, got "
                             f"{tuple(weight.shape)} {weight.dtype} and {tuple(screen_weight.shape)}")
        if top < 1 or wide_top < top or not margin > 0:
            raise ValueError(f"need 1 <= top <= wide_top and margin > 0, got {top}, {wide_top}, {margin}")
        self.weight, self.screen_weight = weight, screen_weight
        self.top, self.wide_top, self.margin = min(top, weight.shape[0]), min(wide_top, weight.shape[0]), margin
        self._packed = PrepackedLinear(screen_weight) if prepack else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, Dm] normed final hidden states (any float dtype) -> [M] int64 greedy tokens."""
        h = hidden.float()
        low = h.to(self.screen_weight.dtype)
        screen = self._packed(low) if self._packed is not None else F.linear(low, self.screen_weight)  # [M, V]
        tokens, flat = self._rescore(screen, h, self.top)
        if bool(flat.any()):  # rows flat over ``top`` tokens: screened again, wider
            rows = flat.nonzero().squeeze(1)
            wide, still = self._rescore(screen[rows], h[rows], self.wide_top)
            if bool(still.any()):  # flat even there: the full float32 head
                wide[still] = F.linear(h[rows[still]], self.weight).argmax(-1)
            tokens[rows] = wide
        return tokens

    def _rescore(self, screen: torch.Tensor, h: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Screen rows [M, V] and their float32 hidden states [M, Dm] -> the best exact logit among each row's
        ``top`` screened tokens that lie within 2 x margin of its best ([M] token ids; among exact ties the smallest
        id, as the full head's argmax picks), and [M] bool: the row's ``top`` tokens all lie within (a flat row, whose
        tokens are not decided)."""
        values, index = screen.topk(top, dim=-1)  # [M, top], best first (exact in the screen's dtype)
        values = values.float()
        near = values >= values[:, :1] - 2 * self.margin  # a prefix of each row
        # only the near (row, rank) pairs are rescored: a padded [M, width] gather would read width head rows for
        # every row as soon as one row is wide
        rows, ranks = near.nonzero(as_tuple=True)  # [N] each
        exact = torch.full(near.shape, float("-inf"), dtype=torch.float64, device=h.device)
        exact[rows, ranks] = torch.einsum("nd,nd->n", self.weight[index[rows, ranks]].double(), h[rows].double())
        best = exact == exact.max(-1, keepdim=True).values
        return index.masked_fill(~best, torch.iinfo(index.dtype).max).min(-1).values, near[:, -1]
