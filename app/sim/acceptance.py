"""Acceptance behaviour for the simulator: per-slot acceptance probabilities and the drafter's confidences.

This module owns the synthetic acceptance model and the reader of the offline evaluator's statistics. It
does not schedule or time anything.

Shape symbols: B batch (requests in a round), K gamma (draft block size).

Synthetic model (logit space, sigma = logistic function):
    z_{r,j} = mu_j + delta_r + eps_{r,j},  delta_r ~ N(0, request_noise^2)  (fixed per request: easy/hard text),
                                           eps_{r,j} ~ N(0, slot_noise^2)    (fresh every round: token difficulty)
    p_{r,j} = sigma(z_{r,j})                         true probability that draft token j is accepted, given
                                                     tokens < j were (a conditional acceptance rate)
    c_{r,j} = sigma(z_{r,j} + eta_{r,j}),  eta ~ N(0, confidence_noise^2)   the drafter's confidence: a noisy
                                                     estimate of p, calibrated when confidence_noise = 0
    accepted length = number of leading successes of Bernoulli(p_{r,j}), j = 1..K.
mu_j is solved so that the mean of p_{r,j} over requests and rounds equals ``per_position_acceptance[j]``
(Gauss-Hermite quadrature, then bisection). The measured conditional rate at deep positions is a little
higher than that mean, because requests that reach them are easier than average (selection on delta_r).

Acceptance statistics files read here (other keys are ignored):
    {"per_position_acceptance": [alpha_1, ..., alpha_K], ...}
    alpha_j = P(draft token j accepted | tokens 1..j-1 accepted), each in (0, 1); its length sets K.
or the offline evaluator's ``report.json`` (``python -m app.eval.evaluate``), one measurement per row:
    {"rows": [{"set": ..., "temperature": ..., "rule": ..., "accept_rate_per_position": [alpha_1, ...]}, ...]}
    where alpha_j is null at positions no round reached (K ends before the first) and may be exactly 0 or 1 on a
    finite sample (clipped into [RATE_FLOOR, 1 - RATE_FLOOR]).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_ACCEPTANCE = (0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)  # synthetic alpha_j for K = 7
_HERMITE_POINTS = 40  # quadrature points for E[sigma(mu + s Z)], Z ~ N(0, 1)
RATE_FLOOR = 1e-3  # a measured rate of 0 or 1 (finite sample) is taken as RATE_FLOOR or 1 - RATE_FLOOR


class AcceptanceModel(BaseModel):
    """Synthetic acceptance and confidence model (see the module docstring for the equations)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_position_acceptance: list[float] = Field(
        default=list(DEFAULT_ACCEPTANCE),
        min_length=1,
        description="Mean conditional acceptance rate alpha_j of draft position j (1-indexed), each in (0, 1).",
    )
    request_noise: float = Field(default=0.5, ge=0.0, description="Std of the per-request logit offset delta_r.")
    slot_noise: float = Field(default=1.0, ge=0.0, description="Std of the per-round, per-slot logit noise eps.")
    confidence_noise: float = Field(
        default=0.3, ge=0.0, description="Std of the logit error eta of the drafter's confidence (0: calibrated)."
    )

    @field_validator("per_position_acceptance")
    @classmethod
    def _in_open_unit_interval(cls, values: list[float]) -> list[float]:
        bad = [v for v in values if not 0.0 < v < 1.0]
        if bad:
            raise ValueError(f"per_position_acceptance entries must lie in (0, 1), got {bad}")
        return values

    @property
    def gamma(self) -> int:
        return len(self.per_position_acceptance)

    def logit_means(self) -> np.ndarray:
        """mu_j [K] such that E[sigma(mu_j + delta + eps)] = alpha_j."""
        spread = math.hypot(self.request_noise, self.slot_noise)
        nodes, weights = np.polynomial.hermite_e.hermegauss(_HERMITE_POINTS)
        weights = weights / weights.sum()

        def mean_p(mu: float) -> float:
            return float(weights @ (1.0 / (1.0 + np.exp(-(mu + spread * nodes)))))

        out = []
        for alpha in self.per_position_acceptance:
            lo, hi = -30.0, 30.0
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if mean_p(mid) < alpha else (lo, mid)
            out.append(0.5 * (lo + hi))
        return np.array(out)

    def draw_difficulty(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """delta_r [n] for new requests."""
        return rng.normal(0.0, self.request_noise, size=n)

    def sample_round(
        self, rng: np.random.Generator, difficulty: np.ndarray, logit_means: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """One round's confidences and acceptance run lengths.

        Args:
            difficulty: delta_r [B]; logit_means: mu_j [K] from :meth:`logit_means`.
        Returns:
            confidences: c [B, K] float32 in [0, 1]; run: [B] int64, leading accepted draft tokens (0..K)
            if all K were verified.
        """
        batch, gamma = difficulty.shape[0], logit_means.shape[0]
        z = logit_means[None, :] + difficulty[:, None] + rng.normal(0.0, self.slot_noise, size=(batch, gamma))
        p = 1.0 / (1.0 + np.exp(-z))
        conf = 1.0 / (1.0 + np.exp(-(z + rng.normal(0.0, self.confidence_noise, size=(batch, gamma)))))
        accepted = rng.random((batch, gamma)) < p
        run = np.cumprod(accepted, axis=1).sum(axis=1)
        return conf.astype(np.float32), run


def load_acceptance_stats(path: str | Path, row: str | None = None, **noise: float) -> AcceptanceModel:
    """Acceptance model whose alpha_j come from a statistics file (formats in the module docstring).

    Args:
        path: a ``{"per_position_acceptance": [...]}`` file or the evaluator's ``report.json``.
        row: which row of a report, named as the evaluator's JSON line names it: ``SET/T<temperature>/<rule>``,
            e.g. ``gsm8k-eval/T0/greedy``; may be left out when the report has a single row.
        noise: optional ``request_noise``, ``slot_noise``, ``confidence_noise`` overrides.
    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, neither format, ``row`` names no row of the report (or is needed and missing), a
            report row with no reached position, or invalid values.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return AcceptanceModel(per_position_acceptance=_report_rates(data["rows"], row, path), **noise)
    if not isinstance(data, dict) or "per_position_acceptance" not in data:
        raise ValueError(f"{path}: expected an evaluator report (rows) or an object with 'per_position_acceptance'")
    if row is not None:
        raise ValueError(f"{path}: row {row!r} given, but the file is not an evaluator report (it has no rows)")
    return AcceptanceModel(per_position_acceptance=data["per_position_acceptance"], **noise)


def row_name(row: dict) -> str:
    """An evaluator report row's name, as its JSON line prints it (``app/eval/evaluate.py``):
    ``SET/T<temperature>/<rule>``."""
    return f"{row['set']}/T{row['temperature']:g}/{row['rule']}"


def _report_rates(rows: list[dict], row: str | None, path: str | Path) -> list[float]:
    try:
        names = [row_name(r) for r in rows]
        by_name = {name: r["accept_rate_per_position"] for name, r in zip(names, rows)}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: its rows are not the evaluator's (set, temperature, rule, "
                         "accept_rate_per_position)") from None
    if not by_name:
        raise ValueError(f"{path}: the report has no rows")
    if len(by_name) < len(names):
        raise ValueError(f"{path}: rows repeat a name ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    if row is None and len(by_name) != 1:
        raise ValueError(f"{path}: {len(by_name)} rows; name one: {', '.join(by_name)}")
    name = row if row is not None else next(iter(by_name))
    if name not in by_name:
        raise ValueError(f"{path}: no row {name!r}; rows: {', '.join(by_name)}")
    rates = []
    for rate in by_name[name]:
        if rate is None:
            break
        rates.append(min(max(float(rate), RATE_FLOOR), 1.0 - RATE_FLOOR))
    if not rates:
        raise ValueError(f"{path}: row {name!r} reached no draft position (no acceptance measured)")
    return rates
