"""Target distributions and lossless acceptance of a draft block (greedy and speculative sampling).

Owns: temperature / top-p shaping of the target logits, the greedy accept rule, the rejection-sampling
accept rule with its residual ("recovered") sample and the bonus sample. Pure functions of tensors and a
per-request ``torch.Generator``; no model, no request state.

Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): draft token x_i ~ q_i is accepted
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token is drawn from the residual
norm(max(0, p_i - q_i)); if all l drafts are accepted a bonus token is drawn from p_{l+1}. The committed
tokens are then distributed exactly as l+1 (or fewer) tokens sampled from p, whatever q is.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying one draft block."""

    num_accepted: int  # leading draft tokens accepted (0..l)
    tokens: list[int]  # accepted drafts followed by the recovered or bonus token (num_accepted + 1 tokens)


NUCLEUS_CANDIDATES = 1024  # top-p looks for its nucleus among this many most likely tokens first


def target_probs(logits: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    """Logits [L, V] -> sampling distribution [L, V] float32 at ``temperature`` (> 0), truncated to ``top_p``.

    Top-p keeps the smallest set of highest-probability tokens whose mass reaches ``top_p`` (the token that
    crosses the threshold is kept) and renormalises. The nucleus is found among the NUCLEUS_CANDIDATES most likely
    tokens (``topk``, about ten times cheaper than sorting a 49k vocabulary) whenever their mass reaches ``top_p``,
    which decides it exactly: every later token has at least that much mass before it. Rows where it does not are
    sorted whole.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs

    def nucleus(ranked: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """[n, V]: ``ranked`` [n, k] (probabilities most likely first, at ``order``) cut to the nucleus, scattered."""
        kept = torch.where(ranked.cumsum(-1) - ranked < top_p, ranked, torch.zeros_like(ranked))
        return probs.new_zeros(ranked.shape[0], probs.shape[-1]).scatter_(-1, order, kept)

    top, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)  # [L, k]
    truncated = nucleus(top, order)
    wide = (top.sum(-1) < top_p).nonzero().flatten()  # rows whose nucleus reaches past the candidates
    if wide.numel():
        truncated[wide] = nucleus(*probs[wide].sort(dim=-1, descending=True))
    return truncated / truncated.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the distribution ``probs`` [V] (non-negative, not necessarily normalised), by inverting its
    CDF at a uniform draw of ``generator``: exact, and much cheaper than ``torch.multinomial`` over a large
    vocabulary. A zero-probability token is never drawn (the CDF does not rise there)."""
    cdf = probs.float().cumsum(-1)
    u = torch.rand(1, generator=generator) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True))
    if token == probs.shape[-1]:  # u rounded up to the total: the last token with mass
        token = int(probs.nonzero()[-1])
    return token


def accept_greedy(draft: torch.Tensor, target: torch.Tensor) -> Acceptance:
    """Greedy verification: accept while the draft equals the target argmax.

    Args:
        draft: [l] int64 draft tokens.
        target: [l + 1] int64 the target's argmax at the pending token and each draft token.
    """
    l = draft.shape[0]
    mismatch = (draft != target[:l]).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else l
    return Acceptance(num_accepted=n, tokens=target[: n + 1].tolist())


def accept_sampled(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    probs: torch.Tensor,
    generator: torch.Generator,
) -> Acceptance:
    """Lossless rejection sampling of a draft block (module docstring).

    Args:
        draft: [l] int64 draft tokens.
        draft_probs: [l, V] the drafter's distributions the drafts were sampled from, or None for a
            deterministic proposal (a point mass on each draft token: accept with probability p(x), residual
            is p with x removed).
        probs: [l + 1, V] target distributions (``target_probs``) at the pending token and each draft.
        generator: the request's own random generator (on the CPU).

    Returns:
        The accepted count and the committed tokens (accepted drafts + recovered or bonus token).
    """
    l = draft.shape[0]
    idx = torch.arange(l)
    p_x = probs[idx, draft]
    q_x = draft_probs[idx, draft] if draft_probs is not None else torch.ones_like(p_x)
    u = torch.rand(l, generator=generator)
    # u < p/q  <=>  u * q < p, which also handles q = 0 (never proposed) without a division.
    rejected = (u * q_x >= p_x).nonzero()
    n = int(rejected[0]) if rejected.numel() else l
    if n < l:
        residual = probs[n].clone()
        if draft_probs is None:
            residual[draft[n]] = 0.0
        else:
            residual = (residual - draft_probs[n].to(residual)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q exactly: rejection had probability 0; p is the residual limit
            residual = probs[n]
        last = sample(residual, generator)
    else:
        last = sample(probs[l], generator)
    return Acceptance(num_accepted=n, tokens=draft[:n].tolist() + [last])


def accept_sampled_batch(
    drafts: list[torch.Tensor],
    draft_probs: list[torch.Tensor | None],
    probs: torch.Tensor,
    generators: list[torch.Generator],
) -> list[Acceptance]:
    """``accept_sampled`` for a batch of requests at once, with the target distributions where they were computed (a
    GPU: only the draft tokens' probabilities and the committed tokens cross to the host, not [N, V] rows).

    The same rule, the same uniform draws from each request's generator in the same order (l to accept, then one to
    sample the recovered or bonus token), so on the same distributions the outcome equals ``accept_sampled``'s
    request by request (up to floating-point summation order of the CDF on another device).

    Args:
        drafts: per request [l_r] int64 draft tokens (host).
        draft_probs: per request [l_r, V] dense draft distributions (host), or None for a deterministic proposal.
        probs: [sum (l_r + 1), V] target distributions (``target_probs``), request-major: l_r + 1 rows each.
        generators: per request its own random generator (on the CPU).

    Returns:
        One Acceptance per request, in order.
    """
    device, vocab = probs.device, probs.shape[-1]
    lengths = [int(d.shape[0]) for d in drafts]
    firsts = list(itertools.accumulate((n + 1 for n in lengths[:-1]), initial=0))  # each request's first row
    draws = [(torch.rand(n, generator=g), torch.rand(1, generator=g)) for n, g in zip(lengths, generators)]
    accepted = list(lengths)
    if sum(lengths):
        rows = torch.cat([torch.arange(f, f + n) for f, n in zip(firsts, lengths)])
        p_x = probs[rows.to(device), torch.cat(drafts).to(device)].float().cpu()
        q_x = torch.cat([q[torch.arange(n), d].float() if q is not None else torch.ones(n)
                         for q, d, n in zip(draft_probs, drafts, lengths)])
        rejected = (torch.cat([u for u, _ in draws]) * q_x >= p_x).split(lengths)  # u < p/q, as accept_sampled
        accepted = [int(r.nonzero()[0]) if r.any() else n for r, n in zip(rejected, lengths)]
    final = probs[torch.tensor([f + a for f, a in zip(firsts, accepted)], device=device)].float()  # [B, V]
    base = final.clone()
    # at a rejection the residual norm(max(0, p - q)); a point-mass proposal just removes the rejected token
    point = [(r, int(d[a])) for r, (a, n, d, q) in enumerate(zip(accepted, lengths, drafts, draft_probs))
             if a < n and q is None]
    dense = [(r, q[a]) for r, (a, n, q) in enumerate(zip(accepted, lengths, draft_probs)) if a < n and q is not None]
    if point:
        final[tuple(torch.tensor(point, device=device).T)] = 0.0
    if dense:
        at = torch.tensor([r for r, _ in dense], device=device)
        q_rows = torch.stack([row for _, row in dense]).to(device=device, dtype=final.dtype)
        final[at] = (final[at] - q_rows).clamp_(min=0.0)
    empty = final.sum(-1) <= 0.0  # p == q exactly: rejection had probability 0; p is the residual limit
    final = torch.where(empty[:, None], base, final)
    cdf = final.cumsum(-1).cummax(-1).values  # monotone even where a device's parallel scan is not exact
    u = torch.cat([v for _, v in draws]).to(device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)
    last_with_mass = vocab - 1 - (final > 0).flip(-1).int().argmax(-1)  # where u rounded up to the total
    tokens = torch.where(tokens >= vocab, last_with_mass, tokens).tolist()
    return [Acceptance(num_accepted=a, tokens=d[:a].tolist() + [t]) for a, d, t in zip(accepted, drafts, tokens)]
