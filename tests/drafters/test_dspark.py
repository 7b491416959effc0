"""DSpark drafter module, calibration and checkpoint: tiny random drafters, no target weights."""

from __future__ import annotations

import copy

import torch

from app.drafters.calibration import Calibration, ece, fit_sequential_temperatures, prefix_survival
from app.drafters.checkpoint import load_checkpoint, save_checkpoint
from app.drafters.config import DrafterConfig
from app.drafters.dspark import DSparkDrafter
from app.drafters.proposer import DSparkProposer
from app.engine.prepack import PrepackedLinear, prepack_supported
from app.engine.types import DRAFT_TOP_K
from app.engine.types import SamplingParams, StepOutput

V, DM, K = 97, 32, 4


def tiny(head: str, seed: int = 0) -> DSparkDrafter:
    torch.manual_seed(seed)
    config = DrafterConfig(block_size=K, num_layers=2, hidden_size=DM, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, vocab_size=V, feature_layers=(0, 1), target_hidden_size=DM,
                           head=head, rank=8, max_positions=256)
    drafter = DSparkDrafter(config, torch.randn(V, DM))
    if head != "none":
        torch.nn.init.normal_(drafter.w2.weight, std=0.5)  # zero at init; make the head visible
    return drafter.eval()


def block_forward(d: DSparkDrafter, t: int = 10, b: int = 2):
    feats = torch.randn(b, t, d.config.feature_dim)
    ctx = d.context_kv(feats, torch.arange(t)[None].expand(b, -1))
    anchors = torch.randint(V, (b, 1))
    mask = torch.ones(b, K, t + K, dtype=torch.bool)
    hidden = d.backbone(d.block_inputs(anchors), positions=t + torch.arange(K)[None].expand(b, -1), ctx=ctx, mask=mask)
    return hidden, anchors


@torch.no_grad()
def test_shapes_of_every_head():
    for head in ("markov", "rnn", "none"):
        d = tiny(head)
        hidden, anchors = block_forward(d)
        assert hidden.shape == (2, K, DM)
        base = d.base_logits(hidden)
        assert base.shape == (2, K, V) and base.dtype == torch.float32
        logits, conf = d.teacher_forced(base, hidden, torch.randint(V, (2, K)))
        assert logits.shape == (2, K, V) and conf.shape == (2, K)


@torch.no_grad()
def test_markov_head_conditions_on_previous_token_and_none_does_not():
    for head, depends in (("markov", True), ("rnn", True), ("none", False)):
        d = tiny(head)
        hidden, _ = block_forward(d)
        base = d.base_logits(hidden)
        prev = torch.randint(V, (2, K))
        changed = prev.clone()
        changed[:, 2] = (changed[:, 2] + 1) % V  # x_2 feeds position k = 3 (index 2)
        a, _ = d.teacher_forced(base, hidden, prev)
        b, _ = d.teacher_forced(base, hidden, changed)
        assert torch.equal(a[:, :2], b[:, :2])  # earlier positions never see x_2
        assert (not torch.allclose(a[:, 2], b[:, 2])) == depends, head


def test_calibrated_survival_is_non_increasing_and_fit_lowers_ece():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2000, K, generator=gen) * 3 + 2  # over-confident logits
    true_c = torch.sigmoid(z / 3)
    hits = torch.bernoulli(true_c, generator=gen)
    survived = prefix_survival(hits)
    valid = torch.ones_like(hits, dtype=torch.bool)
    temps = fit_sequential_temperatures(z, survived, valid)
    cal = Calibration({"greedy": temps})
    after = prefix_survival(cal.confidences(z, "greedy"))
    assert (after[:, 1:] <= after[:, :-1] + 1e-7).all()
    before_ece = ece(prefix_survival(torch.sigmoid(z)), survived)
    assert ece(after, survived) < before_ece
    assert Calibration.from_json(cal.to_json()) == cal


def _start(proposer: DSparkProposer, rid: str, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(t, proposer.drafter.config.feature_dim, generator=g)
    proposer.start(rid, list(range(t)), StepOutput(request_id=rid, new_token_ids=[3], features=feats))


def test_checkpoint_round_trip_gives_identical_drafts(tmp_path):
    d = tiny("markov")
    save_checkpoint(tmp_path / "ckpt", d, calibration=Calibration({"greedy": [1.5] * K}), dtype=torch.float32)
    loaded, cal, _ = load_checkpoint(tmp_path / "ckpt", d.embed_weight)
    assert cal.temperatures["greedy"] == [1.5] * K
    drafts = []
    for model, calibration in ((d, Calibration({"greedy": [1.5] * K})), (loaded, cal)):
        p = DSparkProposer(model, calibration)
        _start(p, "a", 7, 0)
        _start(p, "b", 12, 1)
        blocks = p.propose(["a", "b"])
        drafts.append((torch.stack([b.tokens for b in blocks]), p.last_proposal.confidences))
    assert torch.equal(drafts[0][0], drafts[1][0])
    assert torch.allclose(drafts[0][1], drafts[1][1])


def test_proposer_incremental_context_matches_full_projection():
    d = tiny("rnn")
    feats = torch.randn(9, d.config.feature_dim)
    whole, parts = DSparkProposer(d), DSparkProposer(d)
    whole.start("r", [0] * 9, StepOutput("r", [5], features=feats))
    parts.start("r", [0] * 6, StepOutput("r", [4], features=feats[:6]))
    parts.update([StepOutput("r", [9, 8, 5], features=feats[6:9])])  # pending + 2 accepted, bonus 5
    a, b = whole._state["r"], parts._state["r"]
    assert a.length == b.length == 9
    assert torch.allclose(a.kv[:, :, :9], b.kv[:, :, :9], atol=1e-5)
    assert torch.equal(whole.propose(["r"])[0].tokens, parts.propose(["r"])[0].tokens)


def test_sampled_proposals_carry_distributions():
    d = tiny("markov")
    p = DSparkProposer(d, temperature=1.0, seed=3)
    _start(p, "a", 5, 0)
    _start(p, "b", 6, 1)
    p.set_params("g", SamplingParams(temperature=0.0))
    _start(p, "g", 8, 2)
    block, _, greedy = p.propose(["a", "b", "g"])
    assert greedy.probs is None
    assert block.probs.shape == block.prob_ids.shape == (K, min(V, DRAFT_TOP_K))  # sparse: no [K, V] on the wire
    q = block.dense_probs(V)
    assert torch.allclose(q.sum(-1), torch.ones(K), atol=1e-4)
    assert (q[torch.arange(K), block.tokens] > 0).all()
    assert p.last_proposal.survival.shape == (3, K)


@torch.no_grad()
def test_teacher_forced_equals_stepwise_head():
    for head in ("markov", "rnn", "none"):
        d = tiny(head)
        hidden, _ = block_forward(d)
        base = d.base_logits(hidden)
        prev = torch.randint(V, (2, K))
        logits, conf = d.teacher_forced(base, hidden, prev)
        state = None
        for k in range(K):
            step = d.head_step(base[:, k], hidden[:, k], prev[:, k], state)
            state = step.state
            assert torch.allclose(step.logits, logits[:, k], atol=1e-5)
            assert torch.allclose(step.conf_logit, conf[:, k], atol=1e-5)


def test_sampled_drafts_follow_their_distribution():
    d = tiny("none")
    p = DSparkProposer(d, temperature=1.0, seed=5)
    _start(p, "a", 5, 0)
    counts = torch.zeros(V)
    for _ in range(400):
        block = p.propose(["a"])[0]
        counts[block.tokens[0]] += 1
    q = block.dense_probs(V)[0]  # position 1 does not depend on earlier draws for the parallel head
    assert 0.5 * (counts / counts.sum() - q).abs().sum() < 0.15


@torch.no_grad()
def test_a_prepacked_drafter_drafts_as_the_plain_one():
    """``DSparkDrafter.prepack`` (a proposer's default): packed backbone, context projection and draft-vocabulary head
    give the plain drafter's hidden states and logits within float32 rounding, and its greedy drafts; training
    state is untouched in the plain copy."""
    plain = tiny("markov")
    plain.set_draft_vocab(torch.arange(0, V, 2))
    packed = copy.deepcopy(plain)
    if not prepack_supported(torch.device("cpu"), torch.float32):
        assert packed.prepack() == 0
        return
    assert packed.prepack() == 4 * 2 + 1 and packed.prepack() == 0  # 4 linears a layer and fc; once
    assert isinstance(packed.layers[0].qkv, PrepackedLinear) and isinstance(packed.draft_head, PrepackedLinear)
    torch.manual_seed(5)
    hidden, _ = block_forward(plain)
    torch.manual_seed(5)
    hidden_packed, _ = block_forward(packed)
    torch.testing.assert_close(hidden_packed, hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.base_logits(hidden, draft=True), plain.base_logits(hidden, draft=True),
                               rtol=0, atol=1e-5)
    drafts = []
    for model, pack in ((plain, False), (packed, True)):
        p = DSparkProposer(model, prepack=pack)
        _start(p, "a", 7, 0)
        _start(p, "b", 12, 1)
        drafts.append(torch.stack([b.tokens for b in p.propose(["a", "b"])]))
    assert torch.equal(drafts[0], drafts[1])
    assert type(plain.layers[0].qkv) is torch.nn.Linear and plain.draft_head is None


def test_drafts_past_a_context_of_max_positions_tokens():
    """A request may fill the target's whole context (prompt + max_tokens = max_model_len <= max_positions): the block
    drafted after max_positions context tokens lies past the rotary range the checkpoint names, and drafts."""
    p = DSparkProposer(tiny("markov"))
    _start(p, "full", p.drafter.config.max_positions, 0)
    assert p.propose(["full"])[0].tokens.shape == (K,)
