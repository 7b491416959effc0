"""The committed DSpark checkpoint driving the real engine: lossless greedy outputs, sampled runs complete.

Uses the session-scoped ``engine`` fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch

from app.drafters.checkpoint import load_checkpoint
from app.drafters.proposer import DSparkProposer
from app.engine.decode import generate
from app.engine.types import DraftBlock, SamplingParams
from app.eval.evaluate import DEFAULT_CHECKPOINT

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Janet has 3 apples and buys 5 more. How many apples does she have? Think step by step.",
    "Write a Python function that returns the square of a number.",
]


@pytest.fixture(scope="module")
def drafter(engine):
    if not (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        pytest.skip(f"no committed checkpoint at {DEFAULT_CHECKPOINT}")
    return load_checkpoint(DEFAULT_CHECKPOINT, engine.model.embed_tokens.weight)


def test_greedy_speculative_output_equals_plain_greedy(engine, drafter):
    model, calibration, _ = drafter
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=48)
    plain, _ = generate(engine, ids, params)
    spec, stats = generate(engine, ids, params, proposer=DSparkProposer(model, calibration, gamma=7))
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
    assert sum(r.num_accepted for r in spec) > 0  # the trained drafter is actually accepted
    assert stats.rounds < sum(len(r.token_ids) for r in plain)


def test_sampled_speculative_run_completes(engine, drafter):
    model, calibration, _ = drafter
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=i) for i in range(len(ids))]
    proposer = DSparkProposer(model, calibration, temperature=1.0, seed=0)
    results, _ = generate(engine, ids, params, proposer=proposer)
    for r in results:
        assert r.finish_reason is not None and 1 <= len(r.token_ids) <= 32
        assert all(0 <= t < engine.vocab_size for t in r.token_ids)
    conf = proposer.last_proposal.confidences
    assert ((conf >= 0) & (conf <= 1)).all()


def test_updates_of_skipped_rounds_arrive_together(engine, drafter):
    """Rounds without drafting (draft gate closed) reach the drafter as several steps in one ``update``: the
    context must be the same as when each step arrived on its own (positions, order, anchor)."""
    model, calibration, _ = drafter
    prompt = engine.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    first = engine.add_request("skip", prompt, SamplingParams(max_tokens=32))
    steps = []
    try:
        for _ in range(3):
            (out,) = engine.verify([DraftBlock("skip", torch.zeros(0, dtype=torch.long))])
            steps.append(out)
    finally:
        engine.release("skip")
    one_by_one, together = (DSparkProposer(model, calibration, gamma=7) for _ in range(2))
    for proposer in (one_by_one, together):
        proposer.start("skip", prompt, first)
    for out in steps:
        one_by_one.update([out])
    together.update(steps)
    (a,), (b,) = one_by_one.propose(["skip"]), together.propose(["skip"])
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(one_by_one.last_proposal.confidences, together.last_proposal.confidences)
