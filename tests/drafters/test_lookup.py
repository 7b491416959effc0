"""Prompt lookup beside a trained drafter: the acceptance table (validation, fitting, JSON) and the per-request
choice of ``LookupHybridProposer`` (stub drafter, no model); the real engine runs in test_proposer_engine.py."""

from __future__ import annotations

import json

import pytest
import torch

from app.drafters.checkpoint import CONFIG
from app.drafters.lookup import (
    LOOKUP_RATES,
    LookupHybridProposer,
    LookupRates,
    expected_accepted,
    fit_lookup_rates,
    prefer_lookup,
    read_lookup_rates,
)
from app.drafters.proposer import DraftProposal
from app.engine.types import DraftBlock, SamplingParams, StepOutput

K = 4


def table(value: float, n: int = 3) -> list[list[float]]:
    return [[value] * K for _ in range(n)]


class StubDrafter:
    """Drafts token 7 everywhere with fixed confidences; sampled requests (``set_params``) carry draft probs."""

    def __init__(self, conf: float | list[float]) -> None:
        self.conf, self.calls, self.sampled, self.gamma = conf, [], set(), K

    def set_params(self, request_id, params: SamplingParams) -> None:
        if params.temperature > 0:
            self.sampled.add(request_id)

    def start(self, request_id, prompt_ids, first) -> None:
        self.calls.append(("start", request_id))

    def update(self, outputs) -> None:
        self.calls.append(("update", [o.request_id for o in outputs]))

    def finish(self, request_id) -> None:
        self.calls.append(("finish", request_id))

    def propose(self, request_ids):
        blocks = [DraftBlock(r, torch.full((K,), 7), torch.full((K, 10), 0.1) if r in self.sampled else None)
                  for r in request_ids]
        conf = torch.tensor(self.conf if isinstance(self.conf, list) else [self.conf] * K).expand(len(request_ids), K)
        self.last_proposal = DraftProposal(blocks=blocks, confidences=conf, raw_confidences=conf.clone())
        return blocks


def test_rates_validate_and_round_trip():
    rates = LookupRates({"greedy": table(0.9), "sampled": table(0.5)})
    assert (rates.max_ngram, rates.block_size) == (3, K)
    assert LookupRates.from_json(json.loads(json.dumps(rates.to_json()))) == rates
    with pytest.raises(ValueError, match="modes"):
        LookupRates({"beam": table(0.9)})
    with pytest.raises(ValueError, match="N x K"):
        LookupRates({"greedy": table(0.9), "sampled": table(0.9, n=2)})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        LookupRates({"greedy": table(1.5)})


def test_confidences_cover_the_draft_only_and_fall_back_to_the_other_mode():
    rates = LookupRates({"greedy": [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]})
    assert rates.confidences(2, 3, "greedy", gamma=5).tolist() == pytest.approx([0.5, 0.6, 0.7, 0, 0])
    assert rates.confidences(1, 9, "sampled", gamma=K).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_fit_counts_teacher_forced_acceptance():
    # a period-3 answer after its prompt: every periodic lookup draft is right, so long matches rate near 1
    periodic = ([5, 6, 9] * 30, 3)
    rates = fit_lookup_rates([periodic], max_ngram=4, gamma=K, positions_per_seq=50)
    assert min(rates[3]) > 0.9
    # "1 2 x" with a new x each time: after the bigram "1 2" the draft (the previous x) is always wrong, after
    # the unigram "1" (the bigram "x 1" is new) the draft "2" is always right
    fresh = ([tok for i in range(40) for tok in (1, 2, 100 + i)], 0)
    rates = fit_lookup_rates([fresh], max_ngram=2, gamma=K, positions_per_seq=200)
    assert rates[1][0] < 0.1 and rates[0][0] > 0.9


def test_choice_goes_to_the_longer_expected_acceptance():
    # history ... 1 2 3 | 1 2 -> the 2-gram "1 2" recurs, lookup drafts [3, 1, 2] and continues the period: 3
    rates = LookupRates({"greedy": table(0.9)})
    weak = LookupHybridProposer(StubDrafter(conf=0.3), rates)
    strong = LookupHybridProposer(StubDrafter(conf=0.99), rates)
    for p in (weak, strong):
        p.start("a", [1, 2, 3, 1], StepOutput("a", [2]))
        p.start("b", [4, 5, 6], StepOutput("b", [8]))  # no repeat: always the drafter
    blocks = weak.propose(["a", "b"])
    assert blocks[0].tokens.tolist() == [3, 1, 2, 3] and blocks[0].probs is None
    assert blocks[1].tokens.tolist() == [7] * K
    conf = weak.last_proposal.confidences
    assert conf[0].tolist() == pytest.approx([0.9] * K) and conf[1].tolist() == pytest.approx([0.3] * K)
    assert expected_accepted(conf[0]) > expected_accepted(torch.full((K,), 0.3))
    assert (weak.lookup_rounds, weak.rounds) == (1, 2)
    assert [b.tokens.tolist() for b in strong.propose(["a", "b"])] == [[7] * K, [7] * K]
    assert strong.lookup_rounds == 0


def test_sampled_requests_use_the_sampled_table_and_hooks_pass_through():
    rates = LookupRates({"greedy": table(0.9), "sampled": table(0.1)})
    stub = StubDrafter(conf=0.3)
    p = LookupHybridProposer(stub, rates)
    p.set_params("s", SamplingParams(temperature=1.0))
    p.start("s", [1, 2, 3, 1], StepOutput("s", [2]))
    (block,) = p.propose(["s"])
    assert block.tokens.tolist() == [7] * K and block.probs is not None  # 0.1 per draft does not beat 0.3
    p.update([StepOutput("s", [3, 1, 2])])  # history now ends "... 1 2 3 1 2": the lookup follows the update
    (found,), conf = p._lookup.drafts(["s"], [False])
    assert found.tokens.tolist()[:3] == [3, 1, 2] and conf[0, 0] == pytest.approx(0.1)
    p.finish("s")
    assert stub.calls == [("start", "s"), ("update", ["s"]), ("finish", "s")]
    with pytest.raises(KeyError):
        p.propose(["s"])


def exact_first_token(p: list[float], q: list[float], lookup_token: int, drafter_kept) -> list[float]:
    """P(first output token) of one verify step, exactly: the drafter's first draft x ~ q, the drafter's block kept
    where ``drafter_kept(x)`` (else a point-mass lookup draft of ``lookup_token``), rejection sampling (accept x with
    min(1, p[x] / q[x]), else a draw from norm(max(p - q, 0)))."""

    def verified(x: int, draft_q: list[float]) -> list[float]:
        accept = min(1.0, p[x] / draft_q[x])
        residual = [max(pi - qi, 0.0) for pi, qi in zip(p, draft_q)]
        out = [(1 - accept) * r / sum(residual) for r in residual]
        out[x] += accept
        return out

    point_mass = [float(t == lookup_token) for t in range(len(p))]
    total = [0.0] * len(p)
    for x, qx in enumerate(q):
        y = verified(x, q) if drafter_kept(x) else verified(lookup_token, point_mass)
        total = [t + qx * yi for t, yi in zip(total, y)]
    return total


def test_a_drawn_block_is_chosen_without_looking_at_its_own_draws():
    """The early-stop toy of tests/scheduling/test_lossless.py beside a lookup draft: the drafter's second confidence
    depends on its first draw (0.9 after A, 0.1 after B). Valuing a drawn block by its whole confidences keeps it only
    after A, and the first output token leans to A (0.6 instead of 0.5); valuing it from c_1 keeps the target's."""
    p1, q1, c1, c2 = [0.5, 0.5], [0.8, 0.2], 0.7, [0.9, 0.1]
    lookup_conf = torch.tensor([[0.6, 0.6]])  # expects 0.96 accepted: between 0.77 (after B) and 1.33 (after A)

    def kept(drawn: bool):
        return lambda x: not bool(prefer_lookup(torch.tensor([[c1, c2[x]]]), lookup_conf,
                                                drawn=torch.tensor([drawn]))[0])

    assert exact_first_token(p1, q1, 1, kept(drawn=False)) == pytest.approx([0.6, 0.4])  # the bias, shown
    assert exact_first_token(p1, q1, 1, kept(drawn=True)) == pytest.approx(p1)


def test_a_sampled_drafters_block_is_valued_from_its_first_confidence():
    # the drafter: c = (0.5, 1, 1, 1): 3.5 expected over the whole block, 0.94 from c_1 = 0.5 alone; lookup 0.6 per
    # draft: 1.31. A greedy request (a deterministic block) keeps the drafter's, a sampled one (drawn) the lookup's.
    rates = LookupRates({"greedy": table(0.6), "sampled": table(0.6)})
    stub = StubDrafter(conf=[0.5, 1.0, 1.0, 1.0])
    p = LookupHybridProposer(stub, rates)
    p.set_params("s", SamplingParams(temperature=1.0))
    p.set_params("z", SamplingParams(temperature=1.0, seed=1))  # coupling: its output does not depend on the draft
    for rid in ("g", "s", "z"):
        p.start(rid, [1, 2, 3, 1], StepOutput(rid, [2]))
    greedy, sampled, seeded = p.propose(["g", "s", "z"])
    assert greedy.tokens.tolist() == [7] * K
    assert sampled.tokens.tolist() == [3, 1, 2, 3] and sampled.probs is None
    assert seeded.tokens.tolist() == [7] * K and "z" in stub.sampled  # drafted with probs, valued in full


def test_a_drawn_block_is_valued_over_its_own_length():
    drafter, lookup = torch.tensor([[0.5, 0.9, 0.9, 0.9]]), torch.tensor([[0.7, 0.0, 0.0, 0.0]])  # lookup: 0.7
    drawn = torch.tensor([True])
    assert not prefer_lookup(drafter, lookup, drawn=drawn)  # 0.5 + 0.25 + 0.125 + 0.0625 = 0.94 over K = 4
    assert prefer_lookup(drafter, lookup, drawn=drawn, lengths=torch.tensor([1]))  # a one-token block: 0.5


def test_min_ngram_is_checked_against_the_table():
    with pytest.raises(ValueError, match="min_ngram"):
        LookupHybridProposer(StubDrafter(0.5), LookupRates({"greedy": table(0.9)}), min_ngram=4)


def test_read_lookup_rates(tmp_path):
    doc = {"kind": "dspark", "config": {"target": "t"}}
    (tmp_path / CONFIG).write_text(json.dumps(doc))
    assert read_lookup_rates(tmp_path) is None
    doc[LOOKUP_RATES] = {"greedy": table(0.8)}
    (tmp_path / CONFIG).write_text(json.dumps(doc))
    assert read_lookup_rates(tmp_path) == LookupRates({"greedy": table(0.8)})
    doc[LOOKUP_RATES] = {"greedy": "x"}
    (tmp_path / CONFIG).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=LOOKUP_RATES):
        read_lookup_rates(tmp_path)
