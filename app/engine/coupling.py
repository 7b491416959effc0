"""Seeded sampling that reproduces: Gumbel-max coupling with noise keyed to (seed, token position).

Owns: the position-keyed Gumbel noise of a seeded request, the coupled target token of a row and the accept rule of a
seeded request's draft block. Pure functions of tensors and integers; no model, no request state.

Noise: ``gumbel_noise(seed, t, V)`` is standard Gumbel noise g_t = -log(-log(u)), u ~ U[0, 1)^V, drawn by numpy's
SFC64 generator (float32 draws; several times faster than torch's CPU generator for a row) seeded with a hash of
(seed, t), where t is the absolute position of the token being sampled (the number of tokens before it: prompt plus
output so far). It depends on nothing else: not on how many draws earlier rounds made, the batch, the draft, the
verify length or the placement. numpy does not promise the same draws across its versions (NEP 19): a seed reproduces
within one environment, and target and drafter replicas should share it (a drafter that draws other noise still
gives the target's distribution, with fewer drafts accepted).

Target token at position t (the Gumbel-max trick; Gumbel 1954, Maddison et al. 2014 "A* Sampling"):
    y_t = argmax_v (log p_t(v) + g_t(v)) = argmax_{v in nucleus} (logits_t(v) / T + g_t(v)),
with p_t the target distribution at temperature T truncated to ``top_p`` (``sampling.target_probs``: tokens outside the
nucleus have p = 0, log p = -inf; the normaliser is a constant shift). y_t is a draw from p_t, and the noise of
different positions is independent, so the sequence y is distributed as plain autoregressive sampling from the target.

Verification (coupling): request r's draft d_1..d_l is accepted while d_i == y_i; the first mismatch commits y_i (the
*recovered* token), a fully accepted block commits the *bonus* y_{l+1}. The committed tokens are then exactly the y's
plain decoding with that seed produces from the same logits, whatever was drafted: the outcome for a seed does not
depend on the draft. A drafter that samples its proposals with the same noise (argmax of its own logits / T + g_t)
proposes y_t whenever its logits rank the tokens near the top like the target's, which raises acceptance.

Unseeded requests keep rejection sampling (``sampling.accept_sampled``), which accepts at least as much: its acceptance
sum_v min(p, q) is the largest of any coupling of p and q.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from app.engine.sampling import Acceptance, accept_greedy, target_probs


def noise_key(seed: int, position: int) -> int:
    """The 63-bit generator seed of (request seed, token position): the first 8 bytes of SHA-256 of both."""
    digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def gumbel_noise(seed: int, positions: list[int], vocab_size: int) -> torch.Tensor:
    """Gumbel noise [n, V] float32 of the token positions ``positions`` [n] of a request seeded with ``seed``.

    Row i depends on (seed, positions[i]) only. u = 0 gives -inf (that token is never chosen), u < 1 always.
    """
    noise = np.empty((len(positions), vocab_size), dtype=np.float32)
    for row, t in zip(noise, positions):
        np.random.Generator(np.random.SFC64(noise_key(seed, t))).random(vocab_size, dtype=np.float32, out=row)
    return torch.from_numpy(noise).log_().neg_().log_().neg_()  # -log(-log(u)), in place


class NoiseRows:
    """The ``gumbel_noise`` rows of one seeded request, each position's row drawn once while it may be asked again.

    A round asks for the rows of the positions it samples (a verify step: the pending token's and one per draft); the
    next round starts right after the tokens committed, so the rows of rejected positions are asked for again. Each
    call keeps the rows at or after its first position and drops the earlier ones, so at most one round's rows are
    held ([max_draft_len + 1, V'] float32). A pure cache: the rows are ``gumbel_noise``'s whatever was asked before.

    Args:
        seed: the request's seed.
        vocab_size: V, the width ``gumbel_noise`` draws (the noise of a token id does not depend on any other).
        columns: [V'] int64 token ids to keep of each row (a drafter's draft vocabulary), or None for all V.
    """

    def __init__(self, seed: int, vocab_size: int, *, columns: torch.Tensor | None = None) -> None:
        self.seed, self.vocab_size, self.columns = seed, vocab_size, columns
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, positions: list[int]) -> torch.Tensor:
        """[n, V'] float32: row i is ``gumbel_noise(seed, [positions[i]], V)`` (its ``columns``)."""
        if not positions:
            return torch.zeros(0, self.vocab_size if self.columns is None else len(self.columns))
        first = min(positions)
        self._rows = {t: row for t, row in self._rows.items() if t >= first}
        missing = sorted({t for t in positions if t not in self._rows})
        if missing:
            fresh = gumbel_noise(self.seed, missing, self.vocab_size)
            self._rows.update(zip(missing, fresh if self.columns is None else fresh[:, self.columns]))
        return torch.stack([self._rows[t] for t in positions])


def coupled_tokens(logits: torch.Tensor, noise: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    """The coupled target tokens (module docstring) of logits [n, V] under noise [n, V]: [n] int64.

    Each is a draw from ``target_probs(logits, temperature=temperature, top_p=top_p)`` when the noise row is fresh
    standard Gumbel noise.
    """
    scores = logits.float() / temperature + noise
    if top_p < 1.0:
        nucleus = target_probs(logits, temperature=temperature, top_p=top_p) > 0
        scores = scores.masked_fill(~nucleus, float("-inf"))
    return scores.argmax(-1)


def accept_coupled(draft: torch.Tensor, logits: torch.Tensor, noise: torch.Tensor, *, temperature: float,
                   top_p: float) -> Acceptance:
    """Coupled verification of a draft block (module docstring).

    Args:
        draft: [l] int64 draft tokens.
        logits: [l + 1, V] target logits at the pending token and each draft.
        noise: [l + 1, V] ``gumbel_noise`` of the positions those rows predict.

    Returns:
        The accepted count and the committed tokens (accepted drafts + the recovered or bonus token).
    """
    return accept_greedy(draft, coupled_tokens(logits, noise, temperature=temperature, top_p=top_p))
