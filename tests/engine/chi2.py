"""Chi-square goodness of fit for the sampled-distribution tests: observed counts against an exact joint."""

from __future__ import annotations

import math
from typing import Sequence

from app.engine.logits_process import sampling_probs
from app.engine.near_tie import processed_logits
from app.engine.types import SamplingParams


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


def exact_joint(engine, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple[int, ...], float]:
    """P(first ``depth`` output tokens) under the processed, truncated target, by teacher forcing."""
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in joint.items():
            probs = sampling_probs(processed_logits(engine, prompt, params, list(prefix))[None], params)[0]
            for tok in probs.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = mass * float(probs[tok])
        joint = nxt
    return joint
