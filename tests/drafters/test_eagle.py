"""EAGLE-3-style / MTP-1 drafter, its proposer and kind-dispatching checkpoints: tiny random drafters, no target."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from pydantic import ValidationError

from app.drafters.calibration import Calibration
from app.drafters.checkpoint import CONFIG, load_checkpoint, save_checkpoint
from app.drafters.config import EagleConfig
from app.drafters.dspark import DSparkDrafter
from app.drafters.eagle import EagleDrafter
from app.drafters.eagle_proposer import EagleProposer
from app.drafters.registry import load_proposer, make_proposer
from app.engine.prepack import PrepackedLinear, prepack_supported
from app.engine.types import SamplingParams, StepOutput
from tests.drafters.test_dspark import tiny as tiny_dspark

V, DM, K = 97, 32, 4
SHAPE = dict(hidden_size=DM, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=V,
             feature_layers=(0, 1, 2), target_hidden_size=DM, max_positions=256)


def tiny(block_size: int = K, fused: tuple[int, ...] = (0, 2), seed: int = 0) -> EagleDrafter:
    torch.manual_seed(seed)
    return EagleDrafter(EagleConfig(block_size=block_size, fused_layers=fused, **SHAPE), torch.randn(V, DM)).eval()


def _start(p: EagleProposer, rid: str, tokens: list[int], feats: torch.Tensor) -> None:
    """Prompt = tokens[:-1] with feature rows ``feats`` [len - 1, F], pending anchor tokens[-1]."""
    p.start(rid, tokens[:-1], StepOutput(rid, [tokens[-1]], features=feats))


def test_config_rejects_fused_layers_outside_the_engine_layers():
    with pytest.raises(ValidationError, match="fused_layers"):
        EagleConfig(fused_layers=(3, 5), **{**SHAPE, "feature_layers": (5, 11)})
    with pytest.raises(ValidationError, match="target_hidden_size"):
        EagleConfig(fused_layers=(2,), **{**SHAPE, "target_hidden_size": 16})


@torch.no_grad()
def test_unroll_shapes_and_mtp_has_no_fusion_projection():
    for drafter, k in ((tiny(), K), (tiny(block_size=1, fused=(2,)), 1)):
        t, m = 12, 3
        logits, conf = drafter.unroll(torch.randn(2, t, drafter.config.feature_dim), torch.randint(V, (2, t)),
                                      torch.tensor([[3, 5, 8], [1, 2, 9]]), torch.randint(V, (2, m, k)))
        assert logits.shape == (2 * m, k, V) and logits.dtype == torch.float32 and conf.shape == (2 * m, k)
    assert tiny().fc is not None and tiny(block_size=1, fused=(2,)).fc is None


@torch.no_grad()
def test_training_unroll_reproduces_inference_drafts():
    """Training alignment = inference: on a sequence that continues with the proposer's own greedy drafts, the
    training-time-test unroll at that anchor predicts exactly those drafts with the same logits."""
    d = tiny()
    a = 9
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(a + K + 2, d.config.feature_dim, generator=gen)
    tokens = torch.randint(V, (a + 1,), generator=gen).tolist()
    p = EagleProposer(d)
    _start(p, "r", tokens, feats[:a])
    drafts = p.propose(["r"])[0].tokens
    seq = torch.tensor(tokens + drafts.tolist() + [0])
    logits, conf = d.unroll(feats[None, : len(seq)], seq[None], torch.tensor([[a]]), seq[a : a + K][None, None])
    assert torch.equal(logits[0].argmax(-1), drafts)
    assert torch.allclose(torch.sigmoid(conf[0]), p.last_proposal.raw_confidences[0], atol=1e-5)
    # rows at and after the anchor never leak into the chain (causal context)
    feats2 = feats.clone()
    feats2[a:] = torch.randn_like(feats2[a:])
    logits2, _ = d.unroll(feats2[None, : len(seq)], seq[None], torch.tensor([[a]]), seq[a : a + K][None, None])
    assert torch.allclose(logits, logits2, atol=1e-5)


@torch.no_grad()
def test_incremental_context_matches_one_prefill_and_batching_does_not_change_drafts():
    d = tiny()
    gen = torch.Generator().manual_seed(2)
    feats = torch.randn(10, d.config.feature_dim, generator=gen)
    tokens = torch.randint(V, (11,), generator=gen).tolist()
    whole, parts = EagleProposer(d), EagleProposer(d)
    _start(whole, "r", tokens, feats)
    _start(parts, "r", tokens[:7], feats[:6])  # prompt 0..5, pending token 6
    parts.update([StepOutput("r", tokens[7:11], features=feats[6:10])])  # rows 6..9, committed 7..10
    a, b = whole._state["r"], parts._state["r"]
    assert a.length == b.length == 10
    assert torch.allclose(a.kv[:, :, :10], b.kv[:, :, :10], atol=1e-5)
    assert torch.allclose(a.last_hidden, b.last_hidden, atol=1e-5)
    alone = whole.propose(["r"])[0].tokens
    _start(parts, "s", tokens[:4], feats[:3])  # a shorter request in the same batch
    assert torch.equal(parts.propose(["s", "r"])[1].tokens, alone)


def test_update_rejects_rows_without_next_tokens():
    d = tiny()
    p = EagleProposer(d)
    _start(p, "r", [1, 2, 3], torch.randn(2, d.config.feature_dim))
    with pytest.raises(ValueError, match="3 feature rows but 2 next tokens"):
        p.update([StepOutput("r", [4, 5], features=torch.randn(3, d.config.feature_dim))])


def test_sampled_proposals_carry_distributions_and_greedy_ones_do_not():
    d = tiny()
    p = EagleProposer(d, temperature=1.0, seed=3)
    _start(p, "a", [1, 2, 3, 4], torch.randn(3, d.config.feature_dim))
    p.set_params("g", SamplingParams(temperature=0.0))
    _start(p, "g", [5, 6, 7], torch.randn(2, d.config.feature_dim))
    sampled, greedy = p.propose(["a", "g"])
    assert greedy.probs is None and sampled.probs.shape == sampled.prob_ids.shape
    q = sampled.dense_probs(V)
    assert torch.allclose(q.sum(-1), torch.ones(K), atol=1e-4)
    assert (q[torch.arange(K), sampled.tokens] > 0).all()
    assert p.last_proposal.survival.shape == (2, K)


def test_checkpoint_round_trip_dispatches_on_kind(tmp_path):
    d = tiny()
    cal = Calibration({"greedy": [1.5] * K})
    save_checkpoint(tmp_path / "eagle", d, calibration=cal, dtype=torch.float32)
    assert json.loads((tmp_path / "eagle" / CONFIG).read_text())["kind"] == "eagle"
    loaded, cal2, _ = load_checkpoint(tmp_path / "eagle", d.embed_weight)
    assert isinstance(loaded, EagleDrafter) and loaded.config == d.config and cal2 == cal
    feats, tokens = torch.randn(8, d.config.feature_dim), list(range(9))
    drafts = []
    for p in (make_proposer(d, cal), load_proposer(tmp_path / "eagle", d.embed_weight, gamma=7)):
        _start(p, "r", tokens, feats)
        drafts.append((p.propose(["r"])[0].tokens, p.last_proposal.confidences))
    assert torch.equal(drafts[0][0], drafts[1][0]) and torch.allclose(drafts[0][1], drafts[1][1])
    assert len(drafts[1][0]) == K  # gamma 7 is capped at the block size


def test_checkpoints_without_kind_load_as_dspark_and_unknown_kinds_fail(tmp_path):
    save_checkpoint(tmp_path / "old", tiny_dspark("none"), dtype=torch.float32)
    doc = json.loads((tmp_path / "old" / CONFIG).read_text())
    del doc["kind"]
    (tmp_path / "old" / CONFIG).write_text(json.dumps(doc))
    loaded, _, _ = load_checkpoint(tmp_path / "old", tiny_dspark("none").embed_weight)
    assert isinstance(loaded, DSparkDrafter) and loaded.config.head == "none"
    doc["kind"] = "medusa"
    (tmp_path / "old" / CONFIG).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="unknown drafter kind 'medusa'"):
        load_checkpoint(tmp_path / "old", tiny_dspark("none").embed_weight)


@pytest.mark.parametrize("fused", [(0, 2), (2,)], ids=["eagle3", "mtp"])
def test_a_prepacked_drafter_drafts_as_the_plain_one(fused):
    """``EagleDrafter.prepack`` (a proposer's default) packs the layer, the fusion and the LM head where oneDNN packs
    their dtype, and drafts the plain drafter's tokens with confidences within float32 rounding."""
    plain = tiny(fused=fused)
    packed = copy.deepcopy(plain)
    if not prepack_supported(torch.device("cpu"), torch.float32):
        assert packed.prepack() == 0 and packed.packed_head is None
        return
    assert packed.prepack() == 4 + (packed.fc is not None) + hasattr(packed, "in_proj")
    assert packed.prepack() == 0 and isinstance(packed.packed_head, PrepackedLinear)
    feats, tokens = torch.randn(8, plain.config.feature_dim), list(range(9))
    drafts = []
    for model, pack in ((plain, False), (packed, True)):
        p = EagleProposer(model, Calibration(), prepack=pack)
        _start(p, "r", tokens, feats)
        drafts.append((p.propose(["r"])[0].tokens, p.last_proposal.confidences))
    assert torch.equal(drafts[0][0], drafts[1][0])
    torch.testing.assert_close(drafts[0][1], drafts[1][1], rtol=0, atol=1e-5)
    assert type(plain.layer.qkv) is torch.nn.Linear and plain.packed_head is None


def test_drafts_past_a_context_of_max_positions_tokens():
    """As the DSpark drafter: a context of max_positions tokens (a full target context) still drafts a block."""
    d = tiny()
    p = EagleProposer(d)
    n = d.config.max_positions
    _start(p, "full", [i % V for i in range(n + 1)], torch.randn(n, d.config.feature_dim))
    assert p.propose(["full"])[0].tokens.shape == (K,)
