"""One entry point from a drafter (or a checkpoint folder) to its ``Proposer``, whatever its kind.

Owns the kind -> proposer mapping used by the offline evaluators and the serving layer: ``DSparkDrafter``
(DSpark, DFlash-style) -> ``DSparkProposer``, ``EagleDrafter`` (EAGLE-3-style, MTP-1) -> ``EagleProposer``.
The model-free n-gram drafter has no checkpoint (``ngram.py``); a trained drafter can be combined with prompt lookup
(``lookup.py``) when its checkpoint carries a lookup table.
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.drafters.calibration import Calibration
from app.drafters.checkpoint import Drafter, load_checkpoint
from app.drafters.dspark import DSparkDrafter
from app.drafters.eagle import EagleDrafter
from app.drafters.eagle_proposer import EagleProposer
from app.drafters.lookup import LOOKUP_RATES, LookupHybridProposer, read_lookup_rates
from app.drafters.proposer import DSparkProposer


def make_proposer(
    drafter: Drafter, calibration: Calibration, *, gamma: int | None = None, temperature: float = 0.0, seed: int = 0
) -> DSparkProposer | EagleProposer:
    """The drafter's proposer drafting ``min(gamma, block size)`` tokens per round (None: the block size).

    A drafter with a shorter block (MTP-1: 1) drafts its block size: the serving layer pads the confidences.

    Raises:
        TypeError: not a drafter module; ValueError: gamma < 1 or temperature < 0 (from the proposer).
    """
    block = drafter.config.block_size
    gamma = block if gamma is None else min(gamma, block)
    if isinstance(drafter, DSparkDrafter):
        return DSparkProposer(drafter, calibration, temperature=temperature, seed=seed, gamma=gamma)
    if isinstance(drafter, EagleDrafter):
        return EagleProposer(drafter, calibration, temperature=temperature, seed=seed, gamma=gamma)
    raise TypeError(f"no proposer for {type(drafter).__name__}")


def with_lookup(proposer: DSparkProposer | EagleProposer, path: Path | str) -> LookupHybridProposer:
    """``proposer`` plus prompt lookup with the acceptance table of the checkpoint at ``path`` (``lookup.py``).

    Raises:
        ValueError: the checkpoint has no lookup table (fit one with ``app.drafters.train.calibrate_lookup``).
    """
    rates = read_lookup_rates(path)
    if rates is None:
        raise ValueError(f"checkpoint {path} has no {LOOKUP_RATES} table for prompt lookup; fit one with "
                         "python -m app.drafters.train.calibrate_lookup")
    return LookupHybridProposer(proposer, rates)


def load_proposer(
    path: Path | str, embed_weight: torch.Tensor, *, gamma: int | None = None, temperature: float = 0.0,
    seed: int = 0, lookup: bool = False,
) -> DSparkProposer | EagleProposer | LookupHybridProposer:
    """``make_proposer`` over the checkpoint at ``path`` (any kind), on ``embed_weight`` [V, Dm]'s device; with
    ``lookup``, wrapped by ``with_lookup``.

    Raises:
        ValueError: ``lookup`` and the checkpoint has no lookup table; the errors of ``load_checkpoint``.
    """
    drafter, calibration, _ = load_checkpoint(path, embed_weight)
    proposer = make_proposer(drafter, calibration, gamma=gamma, temperature=temperature, seed=seed)
    return with_lookup(proposer, path) if lookup else proposer
