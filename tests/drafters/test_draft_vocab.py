"""Draft vocabulary: drafting over a token subset V' (tiny random drafters, no target weights), the sampled
toy check that q = 0 outside V' keeps speculative sampling exact, checkpoints and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.drafters.calibration import Calibration
from app.drafters.checkpoint import CONFIG, WEIGHTS, load_checkpoint, save_checkpoint, write_draft_vocab
from app.drafters.dspark import check_draft_vocab
from app.drafters.proposer import DSparkProposer
from app.drafters.train import draft_vocab as cli
from app.engine.types import StepOutput
from tests.drafters.test_dspark import K, V, block_forward, tiny
from tests.drafters.test_eagle import tiny as tiny_eagle
from tests.engine import test_sampling as toy

SUBSET = torch.arange(1, V, 3)  # 32 ids whose index in V' differs from the id (a mix-up would show)
ANCHOR, T = 5, 9


def _start(proposer: DSparkProposer, rid: str, seed: int) -> torch.Tensor:
    """Start ``rid`` with T random feature rows and the pending anchor ANCHOR; returns the rows [T, F]."""
    feats = torch.randn(T, proposer.drafter.config.feature_dim, generator=torch.Generator().manual_seed(seed))
    proposer.start(rid, list(range(T)), StepOutput(request_id=rid, new_token_ids=[ANCHOR], features=feats))
    return feats


@torch.no_grad()
def _teacher_forced_full(d, feats: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-vocabulary logits [K, V] and confidence logits [K] of the block the proposer drafted for one
    request (context ``feats`` [T, F], anchor ANCHOR), teacher-forced on its drafts [K]."""
    ctx = d.context_kv(feats[None], torch.arange(T)[None])
    mask = torch.ones(1, K, T + K, dtype=torch.bool)
    hidden = d.backbone(d.block_inputs(torch.tensor([[ANCHOR]])), positions=(T + torch.arange(K))[None], ctx=ctx,
                        mask=mask)
    prev = torch.cat([torch.tensor([ANCHOR]), drafts[:-1]])[None]
    logits, conf = d.teacher_forced(d.base_logits(hidden), hidden, prev)
    return logits[0], conf[0]


@torch.no_grad()
@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_draft_logits_are_the_full_logits_at_the_draft_ids(head):
    d = tiny(head)
    hidden, _ = block_forward(d)
    full = d.base_logits(hidden)
    d.set_draft_vocab(SUBSET)
    base = d.base_logits(hidden, draft=True)
    assert base.shape == (2, K, SUBSET.numel())
    assert torch.allclose(base, full[..., SUBSET], atol=1e-5)
    assert torch.equal(d.base_logits(hidden), full)  # the training path keeps V
    prev = torch.randint(V, (2,))
    ref = d.head_step(full[:, 0], hidden[:, 0], prev, None)
    got = d.head_step(base[:, 0], hidden[:, 0], prev, None, draft=True)
    assert torch.allclose(got.logits, ref.logits[:, SUBSET], atol=1e-5)
    assert torch.allclose(got.conf_logit, ref.conf_logit)
    assert torch.equal(d.draft_token_ids(torch.tensor([0, 2])), SUBSET[[0, 2]])


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_teacher_forced_over_the_draft_vocab_is_the_full_at_the_draft_ids_and_trains_only_their_rows(head, mode):
    d = tiny(head)
    d.train(mode == "train")
    hidden, _ = block_forward(d)
    prev = torch.randint(V, (2, K))
    full, full_conf = d.teacher_forced(d.base_logits(hidden), hidden, prev)
    d.set_draft_vocab(SUBSET)
    logits, conf = d.teacher_forced(d.base_logits(hidden, draft=True), hidden, prev, draft=True)
    assert logits.shape == (2, K, SUBSET.numel())
    assert torch.allclose(logits, full[..., SUBSET], atol=1e-5) and torch.allclose(conf, full_conf, atol=1e-6)
    if head == "none":
        return
    d.zero_grad()
    logits.logsumexp(-1).sum().backward()
    grad = d.w2.weight.grad
    outside = torch.ones(V, dtype=torch.bool)
    outside[SUBSET] = False
    assert grad[SUBSET].abs().sum() > 0 and not grad[outside].any()


def test_loading_weights_reslices_the_draft_rows():
    """The W2 rows V' drafts with are a slice cached by set_draft_vocab; loading new weights must refresh it."""
    d, other = tiny("markov"), tiny("markov")
    with torch.no_grad():
        other.w2.weight.add_(1.0)
    d.set_draft_vocab(SUBSET)
    d.load_state_dict(other.state_dict())
    hidden, _ = block_forward(d)
    prev = torch.randint(V, (2, K))
    with torch.no_grad():
        full, _ = d.teacher_forced(d.base_logits(hidden), hidden, prev)
        logits, _ = d.teacher_forced(d.base_logits(hidden, draft=True), hidden, prev, draft=True)
    assert torch.allclose(logits, full[..., SUBSET], atol=1e-5)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_greedy_drafts_are_the_argmax_over_the_draft_vocab(head):
    """Each draft is the best token of V' given the previous *token id* (W1 lookup), not its index in V'."""
    d = tiny(head)
    d.set_draft_vocab(SUBSET)
    p = DSparkProposer(d, Calibration())
    feats = _start(p, "a", 0)
    (block,) = p.propose(["a"])
    assert block.probs is None and torch.isin(block.tokens, SUBSET).all()
    logits, conf = _teacher_forced_full(d, feats, block.tokens)
    assert torch.equal(block.tokens, SUBSET[logits[:, SUBSET].argmax(-1)])
    assert torch.allclose(p.last_proposal.raw_confidences[0], torch.sigmoid(conf), atol=1e-5)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_sampled_draft_probs_live_on_the_draft_vocab(head):
    d = tiny(head)
    d.set_draft_vocab(SUBSET)
    p = DSparkProposer(d, Calibration(), temperature=0.7, seed=1)
    feats = _start(p, "a", 0)
    (block,) = p.propose(["a"])
    assert torch.isin(block.tokens, SUBSET).all() and torch.isin(block.prob_ids, SUBSET).all()
    q = block.dense_probs(V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[SUBSET] = False
    assert (q[:, outside] == 0).all()
    assert torch.allclose(q.sum(-1), torch.ones(K), atol=1e-5)
    logits, _ = _teacher_forced_full(d, feats, block.tokens)
    assert torch.allclose(q[:, SUBSET], torch.softmax(logits[:, SUBSET] / 0.7, -1), atol=1e-5)  # V' <= DRAFT_TOP_K
    assert (q[torch.arange(K), block.tokens] > 0).all()


@pytest.mark.parametrize("vocab", [None, SUBSET])
def test_a_shorter_gamma_drafts_the_prefix_of_the_full_block(vocab):
    """gamma < K takes the first gamma positions of the same backbone pass (two requests, so rows of the
    flattened [B * gamma, Dm] matmul must land back in their own request)."""
    d = tiny("markov")
    d.set_draft_vocab(vocab)
    full, short = DSparkProposer(d, Calibration()), DSparkProposer(d, Calibration(), gamma=3)
    for p in (full, short):
        _start(p, "a", 0)
        _start(p, "b", 1)
    long_blocks, short_blocks = full.propose(["a", "b"]), short.propose(["a", "b"])
    for long_block, short_block in zip(long_blocks, short_blocks):
        assert torch.equal(short_block.tokens, long_block.tokens[:3])
    assert torch.allclose(short.last_proposal.raw_confidences, full.last_proposal.raw_confidences[:, :3], atol=1e-6)


def test_clearing_the_draft_vocab_restores_full_vocabulary_drafts():
    drafts = []
    for vocab in (None, SUBSET):
        d = tiny("markov")
        if vocab is not None:
            d.set_draft_vocab(vocab)
            d.set_draft_vocab(None)
        p = DSparkProposer(d, Calibration(), temperature=1.0, seed=2)
        _start(p, "a", 0)
        drafts.append(p.propose(["a"])[0])
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    assert torch.equal(drafts[0].dense_probs(V), drafts[1].dense_probs(V))


@pytest.mark.parametrize("ids, error, match", [
    (torch.tensor([3, 1, 5]), ValueError, r"unsorted ids 3, 1 at indices 0, 1"),
    (torch.tensor([1, 2, 2]), ValueError, r"duplicate id 2, 2 at indices 1, 2"),
    (torch.tensor([1, V]), ValueError, rf"id {V} \(index 1\) is outside the vocabulary \[0, {V}\)"),
    (torch.tensor([-1, 2]), ValueError, r"id -1 \(index 0\) is outside"),
    (torch.tensor([], dtype=torch.long), ValueError, r"non-empty 1-D .* shape \(0,\)"),
    (torch.tensor([[1, 2]]), ValueError, r"shape \(1, 2\)"),
    (torch.tensor([1.0, 2.0]), TypeError, r"integer tensor, got torch.float32"),
    ([1, 2], TypeError, r"integer tensor, got list"),
])
def test_bad_draft_vocab_is_rejected(ids, error, match):
    with pytest.raises(error, match=match):
        check_draft_vocab(ids, V)
    with pytest.raises(error, match=match):
        tiny("markov").set_draft_vocab(ids)


def test_restricted_draft_keeps_speculative_sampling_exact():
    """Toy Markov target (tests/engine/test_sampling.py): a drafter that never proposes token 1 (q = 0 there,
    built from a distribution over V' = {0, 2, 3}) still gives the target's joint."""
    subset = torch.tensor([0, 2, 3])
    draft = toy._markov(1)[:, subset]
    draft = torch.zeros(draft.shape[0], toy.V).index_copy_(-1, subset, draft / draft.sum(-1, keepdim=True))
    assert (draft[:, 1] == 0).all()
    n = 6000
    counts = toy._sample_sequences(n, toy._markov(0), draft, block=3, seed=4)
    exp = toy._expected(toy._markov(0)) * n
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    assert chi2 < 103.4, f"chi-square {chi2:.1f} (0.999 quantile of 63 dof: 103.4): not the target's distribution"
    assert counts[:, 1].sum() > 0  # the never-proposed token still appears (through the residual and bonus)


def test_checkpoint_round_trip_with_and_without_draft_vocab(tmp_path):
    d = tiny("markov")
    save_checkpoint(tmp_path / "plain", d, dtype=torch.float32)
    d.set_draft_vocab(SUBSET)
    save_checkpoint(tmp_path / "vocab", d, dtype=torch.float32)
    assert load_file(str(tmp_path / "vocab" / WEIGHTS))["draft_vocab"].dtype == torch.int64
    plain, _, _ = load_checkpoint(tmp_path / "plain", d.embed_weight)
    loaded, _, _ = load_checkpoint(tmp_path / "vocab", d.embed_weight)
    assert plain.draft_vocab is None
    assert torch.equal(loaded.draft_vocab, SUBSET)
    blocks = []
    for model in (d, loaded):
        p = DSparkProposer(model, Calibration(), temperature=1.0, seed=3)
        _start(p, "a", 0)
        blocks.append(p.propose(["a"])[0])
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    assert torch.allclose(blocks[0].dense_probs(V), blocks[1].dense_probs(V))


def test_write_draft_vocab_adds_it_to_a_checkpoint_and_bad_ones_fail_on_load(tmp_path):
    d = tiny("markov")
    save_checkpoint(tmp_path / "c", d, dtype=torch.float32)
    write_draft_vocab(tmp_path / "c", SUBSET, info={"size": SUBSET.numel()})
    loaded, _, metadata = load_checkpoint(tmp_path / "c", d.embed_weight)
    assert torch.equal(loaded.draft_vocab, SUBSET) and metadata["draft_vocab"] == {"size": SUBSET.numel()}
    assert torch.equal(loaded.w2.weight, d.w2.weight)  # the weights are untouched
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_draft_vocab(tmp_path / "c", torch.tensor([0, V + 3]), info={})
    state = load_file(str(tmp_path / "c" / WEIGHTS))
    state["draft_vocab"] = torch.tensor([4, 2])
    save_file(state, str(tmp_path / "c" / WEIGHTS))
    with pytest.raises(ValueError, match=r"checkpoint .*c: draft_vocab must be sorted and distinct: unsorted ids 4, 2"):
        load_checkpoint(tmp_path / "c", d.embed_weight)


def test_draft_vocab_only_on_dspark_checkpoints(tmp_path):
    e = tiny_eagle()
    save_checkpoint(tmp_path / "e", e, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs kind 'dspark', not 'eagle'"):
        write_draft_vocab(tmp_path / "e", SUBSET, info={})
    state = load_file(str(tmp_path / "e" / WEIGHTS))
    save_file({**state, "draft_vocab": SUBSET}, str(tmp_path / "e" / WEIGHTS))
    with pytest.raises(ValueError, match="only supported for kind 'dspark', not 'eagle'"):
        load_checkpoint(tmp_path / "e", e.embed_weight)


def test_choose_draft_vocab_keeps_specials_then_most_frequent():
    counts = torch.zeros(V, dtype=torch.long)
    counts[[50, 60, 70, 80]] = torch.tensor([9, 7, 7, 1])
    ids = cli.choose_draft_vocab(counts, 5, always=[2, 0, 60])
    assert ids.tolist() == [0, 2, 50, 60, 70]  # 60 kept once; ties (60, 70) broken by lower id
    assert cli.choose_draft_vocab(counts, 7, always=[0]).tolist() == [0, 1, 2, 50, 60, 70, 80]  # unseen: low ids
    with pytest.raises(ValueError, match=r"size must be in \[3, 97\], got 2"):
        cli.choose_draft_vocab(counts, 2, always=[0, 1, 2])
    with pytest.raises(ValueError, match=r"always-kept ids \[0, 97\]"):
        cli.choose_draft_vocab(counts, 5, always=[0, V])


def _shard(path, sequences: list[tuple[list[int], int]]) -> None:
    """A datagen shard of (tokens, prompt length) sequences (features are not read: zero width)."""
    tokens = [t for seq, _ in sequences for t in seq]
    offsets = torch.tensor([0] + [len(seq) for seq, _ in sequences]).cumsum(0)
    save_file({"tokens": torch.tensor(tokens, dtype=torch.int32), "features": torch.zeros(len(tokens), 0),
               "offsets": offsets, "prompt_lens": torch.tensor([p for _, p in sequences])}, str(path))


def test_response_token_counts_skip_prompts_and_reject_foreign_ids(tmp_path):
    _shard(tmp_path / "shard-0000.safetensors", [([7, 7, 9, 9, 9], 2), ([9, 4, 4], 1)])
    _shard(tmp_path / "shard-0001.safetensors", [([4, 8], 0)])
    counts, n = cli.response_token_counts(sorted(tmp_path.glob("shard-*")), V)
    assert n == 3 and counts.sum() == 7
    assert (counts[9], counts[4], counts[8], counts[7]) == (3, 3, 1, 0)
    _shard(tmp_path / "bad.safetensors", [([1, V + 1], 1)])
    with pytest.raises(ValueError, match=rf"token ids in \[1, {V + 1}\] are outside"):
        cli.response_token_counts([tmp_path / "bad.safetensors"], V)


def test_cli_writes_the_draft_vocab_with_the_target_special_ids(tmp_path, engine, capsys):
    """End to end on a tiny checkpoint and two data folders; the special ids come from the real target's tokenizer
    (EOS included)."""
    data, more = tmp_path / "data", tmp_path / "more"
    data.mkdir()
    more.mkdir()
    _shard(data / "shard-0000.safetensors", [([30, 31, 40, 40, 41], 2), ([30, 50, 50], 1)])
    _shard(more / "shard-0006.safetensors", [([30, 50], 1)])
    d = tiny("markov")
    save_checkpoint(tmp_path / "c", d, dtype=torch.float32)
    info = cli.main(["--data", str(data), str(more), "--checkpoint", str(tmp_path / "c"), "--size", "6"])
    loaded, _, metadata = load_checkpoint(tmp_path / "c", d.embed_weight)
    eos = sorted(engine.eos_token_ids)
    assert set(eos) <= set(info["special_ids"])
    by_count = [50, 40, 41]  # response tokens 40 40 41 | 50 50 | 50 (the prompts' 30, 31, 30, 30 are not counted)
    assert loaded.draft_vocab.tolist() == sorted(info["special_ids"] + by_count[: 6 - len(info["special_ids"])])
    assert metadata["draft_vocab"]["response_tokens"] == 6 and info["shards"] == 2 and info["sequences"] == 3
    assert json.loads((tmp_path / "c" / CONFIG).read_text())["metadata"]["draft_vocab"] == info
    with pytest.raises(SystemExit) as exc:  # a folder twice would count its answers twice
        cli.main(["--data", str(data), str(tmp_path / ".." / tmp_path.name / "data"), "--checkpoint",
                  str(tmp_path / "c"), "--size", "6"])
    assert exc.value.code == 2 and "is given twice" in capsys.readouterr().err
