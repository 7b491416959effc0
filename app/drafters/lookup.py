"""Prompt lookup beside a trained drafter: each round, per request, the draft with the longer expected accepted
length, the drafter's block or the tokens that followed the latest earlier occurrence of the request's suffix (continued
periodically when that occurrence is less than gamma tokens back: ``ngram.lookup(periodic=True)``).

Why: a small target's greedy answers repeat themselves (lists, code, and the loops of a 135M model). On the
stage-3 training answers an 8-token suffix recurs at ~30% of positions and the 7 tokens after it are then
accepted at 92-95% each (docs/drafter.md, "Prompt lookup"), far above what the drafter predicts there. Copying
costs a numpy pass over the history; the drafter's block is computed anyway (its context state must follow
every committed token).

Owns: the acceptance table of lookup drafts (``LookupRates``: P(draft k accepted | drafts < k accepted) by
match length n and position k, one table per mode, fitted on the target's own answers by ``fit_lookup_rates``),
and ``LookupHybridProposer``, a ``Proposer`` that wraps any proposer leaving ``last_proposal`` (DSpark,
DFlash- and EAGLE-3-style, MTP-1). The choice compares expected accepted draft tokens,
E = sum_k prod_{j<=k} c_j (the prefix survival of DSpark Sec. 3.2 summed over the block), from the drafter's
calibrated confidences and from the table; the chosen block's confidences go to the verify policy, so a lookup
draft is cut where its survival stops paying like any other. A lookup draft is a deterministic proposal
(``probs=None``, a point mass), which the engine verifies losslessly at any temperature.

The choice must not depend on the drafter's random draws when the engine verifies the block against the
distribution it was drawn from (rejection sampling: an unseeded sampled request, ``DraftBlock.probs`` set): a
sequential head conditions confidence k on draft k - 1, so comparing whole blocks would keep the drafter's block
more often after some first draws than after others, and the first token's output would lean towards those draws
(the early-stop argument of tests/scheduling/test_lossless.py). Such a block is valued from its first confidence
alone, which depends on committed tokens only, extended geometrically (``prefer_lookup``'s ``drawn``). Greedy and
seeded blocks (argmax, or Gumbel-max coupling, whose output does not depend on the draft) use every position.

Shape symbols: B requests, K block size (gamma), N max n-gram length.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.drafters.calibration import MODES, prefix_survival
from app.drafters.checkpoint import read_checkpoint_config
from app.drafters.ngram import NgramProposer, lookup
from app.drafters.proposer import DraftProposal
from app.engine.types import DraftBlock, SamplingParams, StepOutput

LOOKUP_RATES = "lookup_rates"  # the table's key in a checkpoint's config.json (``calibrate_lookup.py`` writes it)
# Laplace pseudo-counts of the table: a cell seen a few times stays near 1/2 instead of 0 or 1
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0


@dataclass(frozen=True)
class LookupRates:
    """Conditional acceptance of lookup drafts: ``rates[mode][n - 1][k]`` = P(draft k+1 accepted | drafts 1..k
    accepted), for a suffix match of n tokens, per mode (``greedy``: the target's argmax; ``sampled``: the
    target's sample). Shapes: N x K per mode.

    Raises:
        ValueError: an unknown mode, a ragged table, or a rate outside [0, 1].
    """

    rates: dict[str, list[list[float]]]

    def __post_init__(self) -> None:
        unknown = set(self.rates) - set(MODES)
        if unknown or not self.rates:
            raise ValueError(f"lookup rates need modes from {MODES}, got {sorted(self.rates)}")
        shapes = {(len(t), len(t[0]) if t else 0) for t in self.rates.values()}
        ragged = any(len(row) != len(t[0]) for t in self.rates.values() for row in t)
        if len(shapes) != 1 or ragged or min(shapes)[0] < 1 or min(shapes)[1] < 1:
            raise ValueError(f"lookup rates must be one N x K table per mode, got shapes {sorted(shapes)}")
        if any(not 0.0 <= r <= 1.0 for t in self.rates.values() for row in t for r in row):
            raise ValueError("lookup rates must lie in [0, 1]")

    @property
    def max_ngram(self) -> int:
        """N: the longest suffix the table covers (lookup matches up to this many tokens)."""
        return len(next(iter(self.rates.values())))

    @property
    def block_size(self) -> int:
        """K: draft positions covered."""
        return len(next(iter(self.rates.values()))[0])

    def confidences(self, n: int, length: int, mode: str, gamma: int) -> torch.Tensor:
        """[gamma] per-position confidences of a lookup draft of ``length`` tokens from an ``n``-token match (0
        beyond the draft); a mode without a table uses the other mode's."""
        table = self.rates.get(mode) or next(iter(self.rates.values()))
        conf = torch.zeros(gamma)
        k = min(length, gamma, self.block_size)
        conf[:k] = torch.tensor(table[n - 1][:k])
        return conf

    def to_json(self) -> dict:
        return {mode: [list(row) for row in table] for mode, table in self.rates.items()}

    @classmethod
    def from_json(cls, data: dict) -> LookupRates:
        return cls({mode: [[float(r) for r in row] for row in table] for mode, table in data.items()})


def read_lookup_rates(path: Path | str) -> LookupRates | None:
    """The lookup table of the checkpoint folder ``path`` (None when it has none).

    Raises:
        FileNotFoundError / ValueError: no readable config.json (``read_checkpoint_config``), or a bad table.
    """
    table = read_checkpoint_config(path).get(LOOKUP_RATES)
    if table is None:
        return None
    try:
        return LookupRates.from_json(table)
    except (TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"checkpoint {path}: bad {LOOKUP_RATES}: {err}") from None


def fit_lookup_rates(
    sequences: Iterable[tuple[Sequence[int], int]], *, max_ngram: int, gamma: int, positions_per_seq: int = 40,
    seed: int = 0,
) -> list[list[float]]:
    """Teacher-forced acceptance of lookup drafts on the target's own answers, as an N x K table (``LookupRates``).

    At ``positions_per_seq`` random response positions t of each (tokens, prompt length) sequence, the periodic
    lookup over tokens[:t] (as ``LookupHybridProposer`` drafts) drafts up to ``gamma`` tokens, compared left to
    right with tokens[t:]; rate[n-1][k] = (accepted + 1) / (tried + 2) over the drafts of n-token matches that
    reached position k. On greedy answers
    this is the greedy acceptance; on answers sampled at temperature T it estimates the sampled acceptance at T
    (the sampled next token equals the draft with the target's probability of the draft).

    Raises:
        ValueError: ``max_ngram`` or ``gamma`` < 1 (from ``lookup``).
    """
    rng = random.Random(seed)
    tried = torch.zeros(max_ngram, gamma)
    accepted = torch.zeros(max_ngram, gamma)
    for tokens, prompt_len in sequences:
        tokens = list(tokens)
        if len(tokens) - prompt_len < 2:
            continue
        for _ in range(positions_per_seq):
            t = rng.randrange(prompt_len + 1, len(tokens))
            follow, n = lookup(tokens[:t], max_ngram=max_ngram, gamma=gamma, periodic=True)
            for k, tok in enumerate(follow[: len(tokens) - t]):
                tried[n - 1, k] += 1
                if tok != tokens[t + k]:
                    break
                accepted[n - 1, k] += 1
    return ((accepted + PRIOR_ACCEPTED) / (tried + PRIOR_TRIED)).tolist()


def expected_accepted(conf: torch.Tensor) -> torch.Tensor:
    """Expected accepted draft tokens of blocks with per-position confidences ``conf`` [..., K]: the sum of the
    prefix survival probabilities prod_{j<=k} c_j (DSpark Sec. 3.2) -> [...]."""
    return prefix_survival(conf).sum(-1)


@dataclass
class PromptLookup:
    """Per-request prompt lookup with its acceptance table: the histories (an ``NgramProposer`` that matches each
    request's suffix, periodic) and, per round, each request's lookup draft with its per-position confidences.

    Used beside a drafter by ``LookupHybridProposer`` (offline) and by the target replica (serving, where it also
    drafts in rounds that do not call the drafter). Hooks as ``Proposer``'s: ``start``, ``update``, ``finish``.

    Attributes:
        rates: the lookup acceptance table; lookup matches up to ``rates.max_ngram`` tokens.
        gamma: K, the longest draft.
        min_ngram: shortest suffix matched.

    Raises:
        ValueError: ``min_ngram`` outside [1, rates.max_ngram] or ``gamma`` < 1 (from ``NgramProposer``).
    """

    rates: LookupRates
    gamma: int
    min_ngram: int = 1
    _histories: NgramProposer = field(init=False)

    def __post_init__(self) -> None:
        self._histories = NgramProposer(gamma=self.gamma, max_ngram=self.rates.max_ngram, min_ngram=self.min_ngram,
                                        periodic=True)

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        self._histories.start(request_id, prompt_ids, first)

    def update(self, outputs: Sequence[StepOutput]) -> None:
        self._histories.update(outputs)

    def finish(self, request_id: str) -> None:
        """Forget the request (unknown ids are ignored)."""
        self._histories.finish(request_id)

    @property
    def num_states(self) -> int:
        """Requests whose history this holds (leak checks)."""
        return self._histories.num_states

    def drafts(self, request_ids: Sequence[str], greedy: Sequence[bool]) -> tuple[list[DraftBlock | None], torch.Tensor]:
        """Each request's lookup draft (None without a match) and its confidences ``[B, K]`` (0 beyond the draft
        and for requests without one), from the table of the request's mode (``greedy[b]``: argmax decoding).

        Raises:
            KeyError: a request without ``start``.
        """
        blocks: list[DraftBlock | None] = []
        conf = torch.zeros(len(request_ids), self.gamma)
        for b, (rid, is_greedy) in enumerate(zip(request_ids, greedy, strict=True)):
            follow, n = self._histories.match(rid)
            if not follow:
                blocks.append(None)
                continue
            blocks.append(DraftBlock(rid, torch.tensor(follow, dtype=torch.long)))
            conf[b] = self.rates.confidences(n, len(follow), "greedy" if is_greedy else "sampled", self.gamma)
        return blocks, conf


def prefer_lookup(drafter_conf: torch.Tensor, lookup_conf: torch.Tensor, *, drawn: torch.Tensor | None = None,
                  lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool: where the lookup draft expects more accepted tokens than the drafter's block (module docstring).

    Args:
        drafter_conf, lookup_conf: [B, K] calibrated per-position confidences (0 where there is no draft).
        drawn: [B] bool, rows whose drafter block is verified against the distribution it was drawn from
            (``DraftBlock.verified_against_probs``); they are valued as c_1 + c_1^2 + ... + c_1^L from their first
            confidence c_1, the only one that does not depend on the block's own draws. None: no such row.
        lengths: [B] int64 draft tokens L of each drafter block (None: K each).
    """
    if drawn is not None:
        k = drafter_conf.shape[-1]
        within = torch.arange(k) < (lengths if lengths is not None else torch.full((len(drawn),), k))[:, None]
        first = drafter_conf[:, :1].expand_as(drafter_conf) * within
        drafter_conf = torch.where(drawn[:, None], first, drafter_conf)
    return expected_accepted(lookup_conf) > expected_accepted(drafter_conf)


@dataclass
class LookupHybridProposer:
    """A proposer plus prompt lookup (module docstring); the hooks pass through to ``inner`` and to a
    ``PromptLookup``.

    Attributes:
        inner: the trained drafter's proposer (``gamma`` draft tokens; leaves ``last_proposal`` after ``propose``).
        rates: the lookup acceptance table; lookup matches up to ``rates.max_ngram`` tokens.
        min_ngram: shortest suffix matched.
        lookup_rounds / rounds: request-rounds that drafted by lookup / all request-rounds proposed.

    Raises:
        ValueError: ``min_ngram`` outside [1, rates.max_ngram] (from ``PromptLookup``).
    """

    inner: object
    rates: LookupRates
    min_ngram: int = 1
    last_proposal: DraftProposal | None = field(default=None, init=False)
    lookup_rounds: int = field(default=0, init=False)
    rounds: int = field(default=0, init=False)
    _lookup: PromptLookup = field(init=False)
    _params: dict[str, SamplingParams] = field(default_factory=dict, init=False)  # from ``set_params``

    def __post_init__(self) -> None:
        self._lookup = PromptLookup(self.rates, self.inner.gamma, self.min_ngram)

    def set_params(self, request_id: str, params: SamplingParams) -> None:
        """Keep the request's sampling parameters (the lookup table's mode, how its blocks are verified) and pass
        them to ``inner`` when it drafts per request temperature."""
        self._params[request_id] = params
        if hasattr(self.inner, "set_params"):
            self.inner.set_params(request_id, params)

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        self._lookup.start(request_id, prompt_ids, first)
        self.inner.start(request_id, prompt_ids, first)

    def update(self, outputs: Sequence[StepOutput]) -> None:
        self._lookup.update(outputs)
        self.inner.update(outputs)

    def finish(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._lookup.finish(request_id)
        self.inner.finish(request_id)

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        """The inner proposer's blocks, each replaced by the lookup draft where that expects more accepted tokens.

        Raises:
            KeyError: a request without ``start``.
        """
        blocks = list(self.inner.propose(request_ids))
        proposal = self.inner.last_proposal
        conf, raw = proposal.confidences.clone(), proposal.raw_confidences.clone()  # [B, K]
        # without ``set_params`` a request's kind shows in its block: draft probabilities only when drawn from q
        params = [self._params.get(rid) for rid in request_ids]
        greedy = [b.probs is None if p is None else p.greedy for b, p in zip(blocks, params)]
        drawn = torch.tensor([b.probs is not None if p is None else b.verified_against_probs(p)
                              for b, p in zip(blocks, params)], dtype=torch.bool)
        lengths = torch.tensor([len(b.tokens) for b in blocks])
        found, found_conf = self._lookup.drafts(request_ids, greedy)
        for b in prefer_lookup(conf, found_conf.to(conf.dtype), drawn=drawn,
                               lengths=lengths).nonzero().flatten().tolist():
            blocks[b] = found[b]
            conf[b], raw[b] = found_conf[b], found_conf[b]
            self.lookup_rounds += 1
        self.rounds += len(request_ids)
        self.last_proposal = DraftProposal(blocks=blocks, confidences=conf, raw_confidences=raw)
        return blocks
