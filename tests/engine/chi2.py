"""Chi-square goodness of fit for the sampled-distribution tests: observed counts against an exact joint."""

from __future__ import annotations

import math
from typing import Sequence


def pooled_chi2(observed: Sequence[float], expected: Sequence[float]) -> tuple[float, int]:
    """Chi-square of ``observed`` counts against ``expected`` counts (the same cells, the same total) over the cells
    expecting at least 5, the others pooled into one cell when it expects at least 1; and its degrees of freedom."""
    big = [i for i, e in enumerate(expected) if e >= 5]
    chi2 = sum((observed[i] - expected[i]) ** 2 / expected[i] for i in big)
    df = len(big) - 1
    rest_exp = sum(expected) - sum(expected[i] for i in big)
    rest_obs = sum(observed) - sum(observed[i] for i in big)
    if rest_exp >= 1:
        chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    return chi2, df


def chi2_quantile_999(df: int) -> float:
    """Wilson-Hilferty approximation of the 0.999 quantile of chi-square(df)."""
    return df * (1 - 2 / (9 * df) + 3.090 * math.sqrt(2 / (9 * df))) ** 3
