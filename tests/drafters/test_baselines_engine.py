"""Every baseline drafter kind through the real engine: greedy speculative output equals plain greedy output.

Untrained drafters on the target's own embedding (losslessness must not depend on draft quality) plus the
model-free n-gram drafter, which does get drafts accepted. Uses the session-scoped ``engine`` fixture of
``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch

from app.drafters.calibration import Calibration
from app.drafters.config import DrafterConfig, EagleConfig
from app.drafters.dspark import DSparkDrafter
from app.drafters.eagle import EagleDrafter
from app.drafters.ngram import NgramProposer
from app.drafters.registry import make_proposer
from app.loop import generate
from app.engine.types import DraftBlock, SamplingParams
from tests.engine.near_tie import check_greedy_output

PROMPTS = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "Write a Python function that returns the square of a number.",
]
PARAMS = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(engine, prompt_ids):
    results, _ = generate(engine, prompt_ids, PARAMS)
    return [r.token_ids for r in results]


def _drafter(engine, kind: str):
    a, embed = engine.model.args, engine.model.embed_tokens.weight
    shape = dict(intermediate_size=128, feature_layers=engine.model.feature_layers, rope_theta=a.rope_theta)
    torch.manual_seed(0)
    if kind == "dflash":
        return DSparkDrafter(DrafterConfig(num_layers=2, head="none", **shape), embed)
    if kind == "eagle":
        return EagleDrafter(EagleConfig(fused_layers=(5, 17, 29), **shape), embed)
    return EagleDrafter(EagleConfig(block_size=1, fused_layers=(29,), **shape), embed)  # mtp


def _check(engine, prompt_ids, reference, results) -> None:
    for p, ref, r in zip(prompt_ids, reference, results):
        check_greedy_output(engine, p, ref, r.token_ids)


@pytest.mark.parametrize(("kind", "gamma"), [("dflash", 7), ("eagle", 7), ("mtp", 1)])
def test_untrained_drafter_is_lossless(engine, prompt_ids, reference, kind, gamma):
    drafter = _drafter(engine, kind).to(engine.model.embed_tokens.weight.dtype).eval()
    proposer = make_proposer(drafter, Calibration(), gamma=7)
    assert proposer.gamma == gamma
    results, _ = generate(engine, prompt_ids, PARAMS, proposer=proposer)
    _check(engine, prompt_ids, reference, results)
    assert all(r.verified_per_round[0] == gamma for r in results)
    assert not proposer._state  # every request's state was released


def test_ngram_drafter_is_lossless_and_accepted(engine, prompt_ids, reference):
    proposer = NgramProposer(gamma=7, max_ngram=4, min_ngram=2)
    results, _ = generate(engine, prompt_ids, PARAMS, proposer=proposer)
    _check(engine, prompt_ids, reference, results)
    assert sum(r.num_accepted for r in results) > 0


@pytest.mark.parametrize("kind", ["dflash", "eagle"])
def test_updates_of_skipped_rounds_arrive_together(engine, prompt_ids, kind):
    """Rounds the serving draft gate skips reach the drafter as several steps in one ``update``: the drafts
    must equal those of a drafter that saw each step on its own."""
    drafter = _drafter(engine, kind).to(engine.model.embed_tokens.weight.dtype).eval()
    first = engine.add_request("skip", prompt_ids[0], PARAMS)
    try:
        steps = [engine.verify([DraftBlock("skip", torch.zeros(0, dtype=torch.long))])[0] for _ in range(3)]
    finally:
        engine.release("skip")
    one_by_one, together = (make_proposer(drafter, Calibration(), gamma=7) for _ in range(2))
    for proposer in (one_by_one, together):
        proposer.start("skip", prompt_ids[0], first)
    for out in steps:
        one_by_one.update([out])
    together.update(steps)
    (a,), (b,) = one_by_one.propose(["skip"]), together.propose(["skip"])
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(one_by_one.last_proposal.confidences, together.last_proposal.confidences, atol=1e-3)
