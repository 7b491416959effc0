"""The committed DSpark checkpoint driving the real engine: lossless greedy outputs, sampled runs complete, also
with a draft vocabulary.

Uses the session-scoped ``engine`` fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch

from app.drafters.checkpoint import load_checkpoint
from app.drafters.lookup import LookupHybridProposer, read_lookup_rates
from app.drafters.proposer import DSparkProposer
from app.engine.types import DRAFT_TOP_K
from app.loop import generate
from app.engine.types import DraftBlock, SamplingParams
from app.drafters.checkpoint import DEFAULT_CHECKPOINT
from tests.engine.near_tie import check_greedy_output, check_same_or_near_tie

DRAFT_VOCAB = 8192  # V' = the ids below it (the special ids 0-2 included); many answer tokens lie above
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Janet has 3 apples and buys 5 more. How many apples does she have? Think step by step.",
    "Write a Python function that returns the square of a number.",
]
REPEAT = "Write the word 'hello' twenty times."  # lookup drafts the repeats (accepted length 5.2)


@pytest.fixture(scope="module")
def drafter(engine):
    if not (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        pytest.skip(f"no committed checkpoint at {DEFAULT_CHECKPOINT}")
    return load_checkpoint(DEFAULT_CHECKPOINT, engine.model.embed_tokens.weight)


@pytest.fixture(scope="module")
def vocab_drafter(engine, drafter):
    """Another copy of the committed checkpoint, drafting over the DRAFT_VOCAB lowest token ids."""
    model, calibration, _ = load_checkpoint(DEFAULT_CHECKPOINT, engine.model.embed_tokens.weight)
    model.set_draft_vocab(torch.arange(DRAFT_VOCAB))
    return model, calibration


class DraftLog:
    """Proposer hooks passed through to ``inner``, keeping every block it proposed."""

    def __init__(self, inner: DSparkProposer) -> None:
        self.inner, self.blocks = inner, []

    def start(self, request_id, prompt_ids, first) -> None:
        self.inner.start(request_id, prompt_ids, first)

    def propose(self, request_ids):
        blocks = self.inner.propose(request_ids)
        self.blocks += blocks
        return blocks

    def update(self, outputs) -> None:
        self.inner.update(outputs)

    def finish(self, request_id) -> None:
        self.inner.finish(request_id)


def test_greedy_speculative_output_equals_plain_greedy(engine, drafter):
    model, calibration, _ = drafter
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=48)
    plain, _ = generate(engine, ids, params)
    spec, stats = generate(engine, ids, params, proposer=DSparkProposer(model, calibration, gamma=7))
    for prompt, p, s in zip(ids, plain, spec):  # identical, or apart from a near-tie on, a greedy path of the target
        check_greedy_output(engine, prompt, p.token_ids, s.token_ids)
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


def test_greedy_with_a_draft_vocab_equals_plain_greedy(engine, vocab_drafter):
    model, calibration = vocab_drafter
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=48)
    plain, _ = generate(engine, ids, params)
    assert any(t >= DRAFT_VOCAB for r in plain for t in r.token_ids)  # the target does emit tokens outside V'
    log = DraftLog(DSparkProposer(model, calibration, gamma=7))
    spec, _ = generate(engine, ids, params, proposer=log)
    for prompt, p, s in zip(ids, plain, spec):
        check_same_or_near_tie(engine, prompt, p.token_ids, s.token_ids)
    drafted = torch.cat([b.tokens for b in log.blocks])
    assert drafted.numel() > 0 and int(drafted.max()) < DRAFT_VOCAB
    assert sum(r.num_accepted for r in spec) > 0


def test_sampled_with_a_draft_vocab_proposes_inside_it(engine, vocab_drafter):
    model, calibration = vocab_drafter
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=i) for i in range(len(ids))]
    log = DraftLog(DSparkProposer(model, calibration, temperature=1.0, seed=0))
    results, _ = generate(engine, ids, params, proposer=log)
    for r in results:
        assert r.finish_reason is not None and 1 <= len(r.token_ids) <= 32
    for block in log.blocks:
        assert block.probs.shape == block.prob_ids.shape == (7, DRAFT_TOP_K)  # sparse, whatever V
        assert int(block.tokens.max()) < DRAFT_VOCAB and int(block.prob_ids.max()) < DRAFT_VOCAB
        assert torch.allclose(block.dense_probs(engine.vocab_size).sum(-1), torch.ones(7), atol=1e-4)


def test_greedy_with_prompt_lookup_equals_plain_greedy(engine, drafter):
    """The committed checkpoint's lookup table beside the drafter: lookup drafts are taken (the repeated line) and
    the output is plain greedy decoding's."""
    model, calibration, _ = drafter
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in [*PROMPTS, REPEAT]]
    params = SamplingParams(max_tokens=48)
    plain, _ = generate(engine, ids, params)
    hybrid = LookupHybridProposer(DSparkProposer(model, calibration, gamma=7), read_lookup_rates(DEFAULT_CHECKPOINT))
    log = DraftLog(hybrid)
    spec, _ = generate(engine, ids, params, proposer=log)
    for prompt, p, s in zip(ids, plain, spec):
        check_same_or_near_tie(engine, prompt, p.token_ids, s.token_ids)
    assert hybrid.lookup_rounds > 0
    assert spec[-1].accepted_length > 3.0  # the repeats are drafted and accepted


def test_sampled_with_prompt_lookup_completes_with_point_mass_lookup_blocks(engine, drafter):
    model, calibration, _ = drafter
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in [*PROMPTS, REPEAT]]
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=i) for i in range(len(ids))]
    hybrid = LookupHybridProposer(DSparkProposer(model, calibration, temperature=1.0, seed=0),
                                  read_lookup_rates(DEFAULT_CHECKPOINT))
    log = DraftLog(hybrid)
    results, _ = generate(engine, ids, params, proposer=log)
    for r in results:
        assert r.finish_reason is not None and 1 <= len(r.token_ids) <= 32
    # sampled requests carry draft distributions, except lookup drafts (deterministic: a point mass)
    assert sum(b.probs is None for b in log.blocks) == hybrid.lookup_rounds


# (prompt, chat template, temperature, top_k, prompt lookup beside the drafter): a chat prompt the drafter drafts well
# (its q overlaps p: rejections draw from residuals that differ from p), and a periodic one where lookup drafts too.
# top_k bounds the exact joint's support.
DISTRIBUTION_CASES = {"dspark": ("List three fruits.", True, 1.0, 6, False),
                      "dspark+lookup": ("a b c a b c a b c a b", False, 0.7, 8, True)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_sampled_outputs_follow_the_target_distribution(engine32, case):
    """Unseeded sampled requests, the drafter's blocks drawn from its top-k sparse distribution and verified by
    rejection sampling against it, alone and beside prompt lookup's point masses (chosen per request): the
    three-token joint of the outputs passes the chi-square test against the target's exact joint
    (tests/engine/chi2.py)."""
    from tests.engine.chi2 import check_outputs_follow_joint, exact_joint

    if not (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        pytest.skip(f"no committed checkpoint at {DEFAULT_CHECKPOINT}")
    engine = engine32
    text, chat, temperature, top_k, lookup = DISTRIBUTION_CASES[case]
    model, calibration, _ = load_checkpoint(DEFAULT_CHECKPOINT, engine.model.embed_tokens.weight)
    prompt = engine.encode_chat([{"role": "user", "content": text}]) if chat else engine.encode(text)
    params, n = SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True), 360
    proposer = DSparkProposer(model, calibration, temperature=temperature)
    if lookup:
        proposer = LookupHybridProposer(proposer, read_lookup_rates(DEFAULT_CHECKPOINT))
    log = DraftLog(proposer)
    results, _ = generate(engine, [prompt] * n, params, proposer=log)
    drawn = sum(b.probs is not None for b in log.blocks)
    assert drawn > 0 and (drawn < len(log.blocks)) == lookup  # lookup's point masses beside the drawn blocks
    assert sum(r.num_accepted for r in results) > n // 8
    check_outputs_follow_joint(results, exact_joint(engine, prompt, params, depth=3))
