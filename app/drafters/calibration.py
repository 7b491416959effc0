"""Confidence calibration: sequential temperature scaling, and the ECE / AUC metrics it is judged by.

Owns pure functions of tensors: the expected calibration error of predicted probabilities against (soft)
outcomes, the ROC AUC, and the left-to-right search of one temperature per block position that minimises the ECE
of the cumulative product of calibrated confidences (the prefix survival probability). Used by the calibration
CLI (``train/calibrate.py``), the proposer (to apply the temperatures) and the evaluator.

Shape symbols: N blocks, K block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODES = ("greedy", "sampled")  # greedy: argmax acceptance; sampled: speculative sampling at temperature 1
TEMPERATURE_GRID = torch.logspace(-1.0, 1.0, 81).tolist()  # 0.1 .. 10, 81 points (1-D grid search)


@dataclass(frozen=True)
class Calibration:
    """Per-position temperatures of the confidence logits, one list of K per mode (identity when absent)."""

    temperatures: dict[str, list[float]] = field(default_factory=dict)

    def confidences(self, conf_logits: torch.Tensor, mode: str) -> torch.Tensor:
        """conf_logits [N, K] -> calibrated per-position confidences c_k [N, K] (uncalibrated if mode unknown)."""
        temps = self.temperatures.get(mode)
        if temps is None:
            return torch.sigmoid(conf_logits.float())
        t = torch.tensor(temps[: conf_logits.shape[-1]], dtype=torch.float32, device=conf_logits.device)
        return torch.sigmoid(conf_logits.float() / t)

    def to_json(self) -> dict:
        return {"temperatures": self.temperatures}

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        unknown = set(data.get("temperatures", {})) - set(MODES)
        if unknown:
            raise ValueError(f"unknown calibration modes {sorted(unknown)}; expected a subset of {MODES}")
        return cls(temperatures={k: [float(x) for x in v] for k, v in data.get("temperatures", {}).items()})


def ece(pred: torch.Tensor, outcome: torch.Tensor, *, bins: int = 15) -> float:
    """Expected calibration error over equal-width bins: sum_b |B_b|/n * |mean pred - mean outcome|.

    pred, outcome: [n] floats in [0, 1] (outcome may be soft).
    """
    pred, outcome = pred.flatten().double(), outcome.flatten().double()
    if pred.numel() == 0:
        return float("nan")
    idx = (pred * bins).long().clamp_(0, bins - 1)
    sum_p = torch.bincount(idx, weights=pred, minlength=bins)
    sum_o = torch.bincount(idx, weights=outcome, minlength=bins)
    return float((sum_p - sum_o).abs().sum() / pred.numel())


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """ROC AUC of ``score`` for binary ``label`` (ties count one half); nan when a class is missing."""
    score, label = score.flatten().double(), label.flatten().bool()
    pos, neg = int(label.sum()), int((~label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(score)
    ranks = torch.empty_like(score)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    # average ranks over ties
    uniq, inverse = torch.unique(score, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.bincount(inverse, minlength=len(uniq)).double()
    ranks = (sums / counts)[inverse]
    return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


def prefix_survival(conf: torch.Tensor) -> torch.Tensor:
    """Per-position confidences [..., K] -> prefix survival probabilities a_k = prod_{j<=k} c_j [..., K]
    (non-increasing; DSpark Sec. 3, prefix survival)."""
    return torch.cumprod(conf, dim=-1)


def fit_sequential_temperatures(
    conf_logits: torch.Tensor, survived: torch.Tensor, valid: torch.Tensor, *, grid: list[float] = TEMPERATURE_GRID
) -> list[float]:
    """Sequential temperature scaling: for k = 1..K in order, the grid temperature T_k that minimises the ECE of
    prod_{j<=k} sigmoid(z_j / T_j) (earlier T_j fixed) against the survival outcome of prefix k.

    Args:
        conf_logits: [N, K] confidence logits z.
        survived: [N, K] outcome in [0, 1] that drafts 1..k were all accepted (soft for sampled acceptance).
        valid: [N, K] bool, positions with a known outcome.
    """
    temps: list[float] = []
    prefix = torch.ones(conf_logits.shape[0], dtype=torch.float64)
    for k in range(conf_logits.shape[1]):
        z, m = conf_logits[:, k].double(), valid[:, k]
        best_t, best_e = 1.0, float("inf")
        for t in grid:
            e = ece((prefix * torch.sigmoid(z / t))[m], survived[:, k][m])
            if e < best_e:
                best_t, best_e = t, e
        temps.append(best_t)
        prefix = prefix * torch.sigmoid(z / best_t)
    return temps
