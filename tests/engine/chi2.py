"""Chi-square goodness of fit for the sampled-distribution tests: observed counts against an exact joint."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from app.engine.logits_process import sampling_probs
from app.engine.near_tie import controlled_logits, teacher_forced_last_logits
from app.engine.types import SamplingParams
from app.loop import generate
from tests.engine.proposers import TableProposer


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
    """P(first ``depth`` output tokens) under the processed, truncated target, by teacher forcing (the prefixes of
    one depth in batched forwards; their logits through ``params``' controls: ``near_tie.controlled_logits``)."""
    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        logits = teacher_forced_last_logits(engine, [prompt + list(prefix) for prefix in prefixes])
        nxt = {}
        for prefix, row in zip(prefixes, logits):
            probs = sampling_probs(controlled_logits(engine, prompt, params, list(prefix), row[None])[None], params)[0]
            for tok in probs.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = joint[prefix] * float(probs[tok])
        joint = nxt
    return joint


def check_three_token_joint_under_speculation(
    engine, prompt: list[int], params: SamplingParams | list[SamplingParams], n: int
) -> None:
    """Decode ``n`` copies of ``prompt`` (3 tokens each, ``params``: one for all or one per copy; its controls
    without the seed give the exact joint) with the likeliest second token drafted after each first token, so the
    last two tokens come from one verify step whose draft is often accepted; assert the drafts were accepted in a
    quarter of the requests or more and the outputs' joint passes the chi-square test against ``exact_joint``."""
    first = params if isinstance(params, SamplingParams) else params[0]
    joint = exact_joint(engine, prompt, dataclasses.replace(first, seed=None), depth=3)
    second: dict[int, dict[int, float]] = {}
    for (t1, t2, _), mass in joint.items():
        second.setdefault(t1, {}).setdefault(t2, 0.0)
        second[t1][t2] += mass
    table = {(t1,): max(d, key=d.get) for t1, d in second.items()}
    results, _ = generate(engine, [prompt] * n, params, proposer=TableProposer(table))
    assert sum(r.num_accepted for r in results) > n // 4
    check_outputs_follow_joint(results, joint)


def check_outputs_follow_joint(results, joint: dict[tuple[int, ...], float]) -> None:
    """Assert the outputs' token sequences (``results``' ``token_ids``) pass the chi-square test against ``joint``
    (``exact_joint``), with at least 3 degrees of freedom."""
    n = len(results)
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    cells = list(joint) + [c for c in counts if c not in joint]  # an impossible output counts in the pooled cell
    chi2, df = pooled_chi2([counts.get(c, 0) for c in cells], [joint.get(c, 0.0) * n for c in cells])
    assert df >= 3 and chi2 < chi2_quantile_999(df), f"chi-square {chi2:.1f} on {df} df"
