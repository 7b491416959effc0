"""Gumbel-max coupling (app/engine/coupling.py) keeps the target's distribution, top-p included, and its outcome for a
seed does not depend on the draft; rejection sampling keeps it under top-p too (toy Markov target of test_sampling)."""

from __future__ import annotations

import pytest
import torch

from app.engine.coupling import NoiseRows, accept_coupled, coupled_tokens, gumbel_noise, noise_key
from app.engine.sampling import target_probs
from tests.engine import test_sampling as toy

CHI2_999_63 = 103.4  # 0.999 quantile of chi-square with 63 degrees of freedom (the 64 cells of V**SEQ, minus one)


def _truncated(target: torch.Tensor, top_p: float) -> torch.Tensor:
    """The toy target's rows [V, V] truncated to ``top_p`` (``target_probs`` at temperature 1)."""
    return target_probs(target.log(), temperature=1.0, top_p=top_p)


def _chi2(counts: torch.Tensor, target: torch.Tensor, n: int) -> float:
    """Chi-square of ``counts`` against the joint of ``target`` over the cells it can produce (cells it cannot must
    stay empty: a token outside the nucleus is a failure by itself)."""
    exp = toy._expected(target) * n
    assert counts[exp == 0].sum() == 0, "a token outside the nucleus was sampled"
    live = exp > 0
    return float(((counts[live] - exp[live]) ** 2 / exp[live]).sum())


def _coupled_sequences(n: int, target: torch.Tensor, *, top_p: float, drafts: str, block: int = 3):
    """``n`` seeded sequences (seed i for sequence i) of SEQ tokens by coupled verification; the drafts are random
    tokens, the drafter's own coupled draws (same noise, a different Markov drafter) or none (plain decoding).
    Returns the counts [V] * SEQ and the list of sequences."""
    logits_of = target.log()
    draft_logits = toy._markov(1).log()
    counts, seqs = torch.zeros((toy.V,) * toy.SEQ), []
    gen = torch.Generator().manual_seed(11)
    for seed in range(n):
        seq = [0]  # token 0 is the prompt, at position 0; the token at position t has t tokens before it
        while len(seq) < toy.SEQ + 1:
            k = 0 if drafts == "none" else block
            draft, prev = [], seq[-1]
            for i in range(k):
                if drafts == "random":
                    tok = int(torch.randint(toy.V, (1,), generator=gen))
                else:
                    noise = gumbel_noise(seed, [len(seq) + i], toy.V)
                    tok = int(coupled_tokens(draft_logits[prev][None], noise, temperature=1.0, top_p=1.0)[0])
                draft.append(tok)
                prev = tok
            context = [seq[-1]] + draft
            logits = torch.stack([logits_of[t] for t in context])
            noise = gumbel_noise(seed, list(range(len(seq), len(seq) + k + 1)), toy.V)
            seq.extend(accept_coupled(torch.tensor(draft, dtype=torch.long), logits, noise, temperature=1.0,
                                      top_p=top_p).tokens)
        counts[tuple(seq[1 : toy.SEQ + 1])] += 1
        seqs.append(seq[1 : toy.SEQ + 1])
    return counts, seqs


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_coupled_verification_matches_target_joint(top_p):
    target, n = toy._markov(0), 3000
    counts, _ = _coupled_sequences(n, target, top_p=top_p, drafts="coupled")
    chi2 = _chi2(counts, _truncated(target, top_p), n)
    assert chi2 < CHI2_999_63, f"chi-square {chi2:.1f}: coupled output differs from the target's (top_p {top_p})"


def test_coupled_outcome_of_a_seed_does_not_depend_on_the_draft():
    target = toy._markov(0)
    runs = [_coupled_sequences(300, target, top_p=0.9, drafts=kind)[1] for kind in ("none", "random", "coupled")]
    assert runs[0] == runs[1] == runs[2]


def test_rejection_sampling_matches_truncated_target_joint():
    """The rejection rule against a top-p truncated target (draft over the full vocabulary)."""
    target, n = _truncated(toy._markov(0), 0.8), 6000
    counts = toy._sample_sequences(n, target, toy._markov(1), block=3, seed=5)
    chi2 = _chi2(counts, target, n)
    assert chi2 < CHI2_999_63, f"chi-square {chi2:.1f}: output differs from the truncated target's"


def test_noise_is_keyed_to_seed_and_position_only():
    a = gumbel_noise(7, [3, 4, 5], 50)
    assert torch.equal(a[1:], gumbel_noise(7, [4, 5], 50))  # no dependence on draws made before
    assert torch.equal(a[0], gumbel_noise(7, [3], 50)[0])
    assert not torch.equal(a[0], gumbel_noise(8, [3], 50)[0]) and not torch.equal(a[0], a[1])
    assert noise_key(7, 3) != noise_key(3, 7) and 0 <= noise_key(-(2**63), 0) < 2**63


def test_noise_rows_are_gumbel_noise_whatever_was_asked_before():
    """The cache of a request's rows returns ``gumbel_noise``'s rows for rounds that overlap, move on, go back or repeat
    a position, restricted to a column set when given, and holds no row before the last call's first position."""
    columns = torch.tensor([5, 0, 17, 3])
    rows, narrow = NoiseRows(7, 32), NoiseRows(7, 32, columns=columns)
    for positions in ([10, 11, 12, 13], [12, 13, 14, 15], [15, 16], [9, 10], [20, 20, 21], []):
        expected = gumbel_noise(7, positions, 32)
        assert torch.equal(rows.rows(positions), expected)
        assert torch.equal(narrow.rows(positions), expected[:, columns])
        if positions:
            assert min(rows._rows) == min(positions)  # nothing before this call's first position is held
    assert rows.rows([]).shape == (0, 32) and narrow.rows([]).shape == (0, 4)
    assert not torch.equal(NoiseRows(8, 32).rows([10]), gumbel_noise(7, [10], 32))
