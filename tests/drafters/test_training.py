"""Training pipeline on the real target: datagen shard -> batches with inference alignment -> falling loss.

Uses the session-scoped ``engine`` fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.drafters.config import DrafterConfig, EagleConfig
from app.drafters.dspark import DSparkDrafter
from app.drafters.eagle import EagleDrafter
from app.drafters.train.calibrate import collect_outcomes
from app.drafters.train.data import Sequence_, TargetTopK, load_shards, make_batch
from app.drafters.train import trainer
from app.drafters.train.datagen import generate_shard
from app.drafters.train.trainer import (BlockOutputs, HeldOutEval, dspark_loss, evaluate_heldout, forward_batch,
                                        heldout_batches, plateaued, split_heldout, train, vocab_columns)
from app.engine.engine import TargetEngine
from app.engine.types import SamplingParams

CPU = torch.device("cpu")
PROMPTS = ["What is 12 times 7?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def data_folder(engine, tmp_path_factory) -> Path:
    """A datagen folder of one shard: the target's answers to PROMPTS."""
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    shard = generate_shard(engine, ids, [SamplingParams(max_tokens=24)] * len(ids), max_batch=2, id_prefix="t")
    folder = tmp_path_factory.mktemp("data")
    save_file(shard, str(folder / "shard-0000.safetensors"))
    return folder


@pytest.fixture(scope="module")
def seqs(engine, data_folder):
    return load_shards(data_folder, topk=target_topk(engine, k=8), progress=False)


def target_topk(engine, *, k: int, calls: list | None = None) -> TargetTopK:
    """The real target's top-k source; ``calls`` (when given) records the rows of each LM-head call."""
    def logits_fn(hidden):
        if calls is not None:
            calls.append(hidden.shape[0])
        return engine.model.logits_from_final_hidden(hidden)
    return TargetTopK(logits_fn, k=k, hidden_size=engine.model.args.hidden_size, device=CPU, model="smollm2-135m")


def tiny_drafter(engine: TargetEngine) -> DSparkDrafter:
    a = engine.model.args
    torch.manual_seed(0)
    config = DrafterConfig(block_size=4, num_layers=1, intermediate_size=128, head="markov", rank=8,
                           feature_layers=engine.model.feature_layers, rope_theta=a.rope_theta)
    return DSparkDrafter(config, engine.model.embed_tokens.weight)


def test_shard_features_match_the_target_and_labels_align(engine, seqs):
    s = seqs[0]
    batch = make_batch([s], block_size=4, anchors_per_seq=3, generator=torch.Generator().manual_seed(0))
    a = int(batch.positions[0, 0])  # first block's anchor position
    assert a >= s.prompt_len and int(batch.anchors[0, 0]) == int(s.tokens[a])
    assert not batch.mask[0, 0, a:len(s.tokens)].any() and batch.mask[0, 0, :a].all()  # context = rows < a
    # the target's greedy token at row a + k - 1 is label k: features are the target's own
    logits = engine.model.logits_from_final_hidden(s.features[a : a + 4, -engine.model.args.hidden_size :])
    valid = batch.valid[0, 0]
    assert torch.equal(logits.argmax(-1)[valid], batch.labels[0, 0][valid])
    assert torch.equal(batch.topk_ids[0, 0, :, 0][valid], batch.labels[0, 0][valid])  # top-1 of the target


def test_target_topk_is_the_softmax_top_k_computed_once_per_shard(engine, data_folder, tmp_path):
    """The cached top-k equals the exact softmax's top-k; a second load reads the cache (no LM-head call); another
    k, another model or a shard generated again computes afresh."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "shard-0000.safetensors").write_bytes((data_folder / "shard-0000.safetensors").read_bytes())
    calls: list[int] = []
    first = load_shards(folder, topk=target_topk(engine, k=8, calls=calls), progress=False)
    assert calls and (folder / "topk8-shard-0000.safetensors").is_file()
    s = first[0]
    probs = torch.softmax(engine.model.logits_from_final_hidden(s.features[:, -engine.model.args.hidden_size :]), -1)
    top = probs.topk(8, dim=-1)
    assert torch.equal(s.topk_ids, top.indices)
    torch.testing.assert_close(s.topk_probs, top.values, rtol=1e-4, atol=1e-7)  # float32 rounding of two formulas
    made = len(calls)
    again = load_shards(folder, topk=target_topk(engine, k=8, calls=calls), progress=False)
    assert len(calls) == made  # read from the cache
    assert all(torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_probs, b.topk_probs)
               for a, b in zip(first, again))
    assert load_shards(folder, topk=target_topk(engine, k=4, calls=calls), progress=False)[0].topk_ids.shape[1] == 4
    assert len(calls) > made  # another k
    made = len(calls)
    load_shards(folder, topk=replace(target_topk(engine, k=4, calls=calls), model="another-model"), progress=False)
    assert len(calls) > made  # another target
    shard = load_file(str(folder / "shard-0000.safetensors"))  # generated again: other answers of the same length
    save_file({**shard, "tokens": shard["tokens"].flip(0).contiguous()}, str(folder / "shard-0000.safetensors"))
    made = len(calls)
    load_shards(folder, topk=replace(target_topk(engine, k=4, calls=calls), model="another-model"), progress=False)
    assert len(calls) > made  # another shard content, with as many rows
    assert sorted(p.name for p in folder.iterdir()) == ["shard-0000.safetensors", "topk4-shard-0000.safetensors",
                                                        "topk8-shard-0000.safetensors"]


def assert_loss_falls(drafter, seqs, *, block_size: int, draft_vocab: bool = False) -> None:
    """12 training steps cut the loss on a fixed batch by more than 20%."""
    gen = torch.Generator().manual_seed(1)
    fixed = make_batch(seqs, block_size=block_size, anchors_per_seq=8, generator=gen)
    columns = vocab_columns(drafter.draft_vocab, drafter.config.vocab_size) if draft_vocab else None

    def loss() -> float:
        with torch.no_grad():
            out = forward_batch(drafter, fixed, CPU, draft_vocab=draft_vocab)
            return float(dspark_loss(out, fixed, gamma_decay=4.0, device=CPU, columns=columns)[0])

    before = loss()
    result = train(drafter, seqs, steps=12, batch_seqs=2, anchors_per_seq=8, lr=3e-3, gamma_decay=4.0, seed=0,
                   device=CPU, progress=False, draft_vocab=draft_vocab)
    after = loss()
    assert after < 0.8 * before, (before, after, result.history[-1])


def test_tiny_drafter_loss_falls(engine, seqs):
    assert_loss_falls(tiny_drafter(engine), seqs, block_size=4)


def seen_vocab(seqs, vocab_size: int) -> torch.Tensor:
    """The sequences' tokens (the labels among them) and every 97th id: some of the target's top-k tokens fall
    outside this draft vocabulary (draft probability 0 in the TV term)."""
    ids = torch.unique(torch.cat([s.tokens for s in seqs] + [torch.arange(0, vocab_size, 97)]))
    topk = torch.unique(torch.cat([s.topk_ids.flatten() for s in seqs]))
    assert not torch.isin(topk, ids).all()
    return ids


def test_dspark_loss_over_a_draft_vocab_is_the_full_loss_with_zero_probability_outside_it():
    """Columns map token ids to V' (ids 0, 3, 6, ...: index != id); the reference is the full-vocabulary loss
    with logits -inf outside V', and, for the cross-entropy, labels outside V' left out."""
    n, k, vocab_size, top = 6, 4, 50, 5
    gen = torch.Generator().manual_seed(0)
    vocab = torch.arange(0, vocab_size, 3)
    full = torch.randn(n, k, vocab_size, generator=gen)
    outside = torch.ones(vocab_size, dtype=torch.bool)
    outside[vocab] = False
    full[..., outside] = float("-inf")
    out_full = BlockOutputs(logits=full, conf_logits=torch.randn(n, k, generator=gen))
    out_draft = BlockOutputs(logits=full[..., vocab], conf_logits=out_full.conf_logits)
    topk_ids = torch.stack([torch.randperm(vocab_size, generator=gen)[:top] for _ in range(n * k)]).view(n, k, top)
    topk_probs = torch.softmax(torch.randn(n, k, top, generator=gen), -1) * 0.9
    labels = topk_ids[..., 0].clone()
    assert outside[labels].any() and not outside[labels].all() and outside[topk_ids[..., 1:]].any()
    valid = torch.ones(n, k, dtype=torch.bool)
    batch = SimpleNamespace(labels=labels, valid=valid, topk_ids=topk_ids, topk_probs=topk_probs)
    columns = vocab_columns(vocab, vocab_size)
    loss, parts = dspark_loss(out_draft, batch, gamma_decay=4.0, device=CPU, columns=columns)
    _, ref = dspark_loss(out_full, batch, gamma_decay=4.0, device=CPU)
    assert parts["tv"] == pytest.approx(ref["tv"]) and parts["bce"] == pytest.approx(ref["bce"])
    keep = ~outside[labels]
    w = torch.exp(-torch.arange(k) / 4.0).expand(n, k)[keep]
    ce = (torch.logsumexp(full, -1) - full.gather(-1, labels[..., None]).squeeze(-1))[keep]
    assert parts["ce"] == pytest.approx(float((w * ce).sum() / w.sum()))
    assert parts["a1"] == pytest.approx(ref["a1"]) and parts["tau"] == pytest.approx(ref["tau"])
    assert math.isfinite(float(loss))


def test_draft_vocab_loss_equals_the_full_loss_when_the_draft_vocab_is_everything(engine, seqs):
    drafter = tiny_drafter(engine)
    batch = make_batch(seqs, block_size=4, anchors_per_seq=4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = dspark_loss(forward_batch(drafter, batch, CPU), batch, gamma_decay=4.0, device=CPU)
        drafter.set_draft_vocab(torch.arange(drafter.config.vocab_size))
        columns = vocab_columns(drafter.draft_vocab, drafter.config.vocab_size)
        restricted, _ = dspark_loss(forward_batch(drafter, batch, CPU, draft_vocab=True), batch, gamma_decay=4.0,
                                    device=CPU, columns=columns)
    assert float(restricted) == pytest.approx(float(full), rel=1e-5)


def test_draft_vocab_training_trains_only_the_draft_rows_and_the_loss_falls(engine, seqs):
    drafter = tiny_drafter(engine)
    vocab = seen_vocab(seqs, drafter.config.vocab_size)
    drafter.set_draft_vocab(vocab)
    w2_before = drafter.w2.weight.detach().clone()
    assert_loss_falls(drafter, seqs, block_size=4, draft_vocab=True)
    outside = torch.ones(drafter.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.equal(drafter.w2.weight[outside], w2_before[outside])  # no gradient outside V'
    assert not torch.equal(drafter.w2.weight[vocab], w2_before[vocab])
    assert torch.equal(drafter.draft_w2, drafter.w2.weight.detach()[vocab])  # the drafting slice is refreshed
    with pytest.raises(ValueError, match="draft vocabulary"):
        train(tiny_drafter(engine), seqs, steps=1, batch_seqs=1, anchors_per_seq=2, lr=1e-3, gamma_decay=4.0, seed=0,
              device=CPU, progress=False, draft_vocab=True)


def test_calibration_outcomes_are_measured_over_the_draft_vocabulary(engine, seqs):
    """With V' = the answers' most frequent token alone, the drafter drafts that token everywhere and hits
    wherever it is the label; over the full vocabulary an untrained drafter hits (almost) nowhere: calibration
    must see the drafter as it drafts."""
    drafter = tiny_drafter(engine)
    kwargs = {"anchors_per_seq": 12, "seed": 0, "device": CPU}
    full = collect_outcomes(drafter, engine.model, seqs, **kwargs)
    answers = torch.cat([s.tokens[s.prompt_len:] for s in seqs])
    drafter.set_draft_vocab(torch.mode(answers).values.view(1))
    restricted = collect_outcomes(drafter, engine.model, seqs, **kwargs)
    valid = full["valid"].bool()
    assert float(restricted["hit"][valid].mean()) > float(full["hit"][valid].mean()) + 0.02
    assert not torch.equal(restricted["accept"], full["accept"])
    assert torch.equal(restricted["conf_logits"], full["conf_logits"])  # the confidence ignores the vocabulary


def test_tiny_eagle_drafter_loss_falls_with_training_time_test(engine, seqs):
    torch.manual_seed(0)
    config = EagleConfig(block_size=3, intermediate_size=128, feature_layers=engine.model.feature_layers,
                         fused_layers=(5, 17, 29), rope_theta=engine.model.args.rope_theta)
    assert_loss_falls(EagleDrafter(config, engine.model.embed_tokens.weight), seqs, block_size=3)


def test_time_budget_fits_the_schedule_after_the_warm_up_steps(engine, seqs):
    """A clock that ticks 1 s per reading: steps 5..25 time at 1.05 s/step, so a 50 s budget (28 s spent by then)
    fits 25 + int(22 / 1.05) = 45 steps in all, far below the 1000-step cap; without a budget the cap holds."""
    ticks = iter(range(10_000))
    result = train(tiny_drafter(engine), seqs, steps=1000, batch_seqs=1, anchors_per_seq=2, lr=1e-3,
                   gamma_decay=4.0, seed=0, device=CPU, progress=False, max_seconds=50.0,
                   clock=lambda: float(next(ticks)))
    assert len(result.history) == 45 and result.stopped is None
    assert len(train(tiny_drafter(engine), seqs, steps=7, batch_seqs=1, anchors_per_seq=2, lr=1e-3, gamma_decay=4.0,
                     seed=0, device=CPU, progress=False).history) == 7


def test_time_budget_fits_the_schedule_again_when_steps_speed_up(engine, seqs):
    """Clock readings 4 s apart up to the first fit (step 25, t = 112 s), 1 s apart after: the first fit, at 4.2
    s/step, gives a 260 s budget 25 + int(148 / 4.2) = 60 steps; the refit after max(10% of 35, min(20, 35 // 2)) = 17
    steps, at step 42 (t = 130 s), times steps 25..42 at 18 / 17 s/step and gives 42 + int(130 * 17 / 18) = 164."""
    readings = itertools.count()

    def clock() -> float:
        k = next(readings)
        return 4.0 * k if k <= 28 else 112.0 + (k - 28)

    result = train(tiny_drafter(engine), seqs, steps=1000, batch_seqs=1, anchors_per_seq=2, lr=1e-3,
                   gamma_decay=4.0, seed=0, device=CPU, progress=False, max_seconds=260.0, clock=clock)
    assert len(result.history) == 164 and result.stopped is None


def test_time_budget_refit_leaves_held_out_evaluations_out(engine, seqs, monkeypatch):
    """Clock readings 1 s apart; the held-out evaluations at steps 30 and 60 take 100 s more each. The first fit
    (step 25, t = 28 s, 1.05 s/step) gives a 400 s budget 25 + int(372 / 1.05) = 379 steps and a refit after 36; at
    step 61 (t = 269 s) the 36 steps since took 241 s, 202 of them evaluating: 39 / 36 s/step and
    61 + int(131 * 36 / 39) = 181 steps (counting the evaluations would give 61 + int(131 * 36 / 241) = 80)."""
    now, slow = [0.0], [2]

    def clock() -> float:
        now[0] += 1.0
        return now[0] - 1.0

    def slow_evaluation(*args, **kwargs):
        if slow[0]:
            slow[0] -= 1
            now[0] += 100.0
        return evaluate_heldout(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate_heldout", slow_evaluation)
    batches = heldout_batches(seqs, count=1, block_size=4, batch_seqs=1, anchors_per_seq=2, seed=0)
    result = train(tiny_drafter(engine), seqs, steps=1000, batch_seqs=1, anchors_per_seq=2, lr=1e-3, gamma_decay=4.0,
                   seed=0, device=CPU, progress=False, max_seconds=400.0, clock=clock,
                   heldout=HeldOutEval(batches=batches, every=30))
    assert len(result.history) == 181 and result.stopped is None


RUN = dict(steps=8, batch_seqs=2, anchors_per_seq=4, lr=3e-3, gamma_decay=4.0, seed=0, device=CPU, progress=False,
           save_every=3)


def test_a_run_killed_and_resumed_ends_with_the_weights_of_a_run_never_stopped(engine, seqs, tmp_path):
    whole = tiny_drafter(engine)
    train(whole, seqs, state_path=tmp_path / "whole.pt", **RUN)
    killed, steps = tiny_drafter(engine), []

    def kill_in_step_5(module, inputs):  # the context projection runs once per training step
        steps.append(1)
        if len(steps) == 5:
            raise KeyboardInterrupt

    hook = killed.fc.register_forward_pre_hook(kill_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(killed, seqs, state_path=tmp_path / "run.pt", **RUN)
    hook.remove()
    resumed = tiny_drafter(engine)  # a new process: fresh weights, the rest from the state saved after step 3
    resumed.fc.register_forward_pre_hook(lambda module, inputs: steps.append(1))
    result = train(resumed, seqs, state_path=tmp_path / "run.pt", **RUN)
    assert len(steps) == 5 + 5 and len(result.history) == 8  # steps 4..8 run again
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    again = train(tiny_drafter(engine), seqs, state_path=tmp_path / "run.pt", **RUN)  # a finished run stays finished
    assert len(again.history) == 8


def test_heldout_evaluations_stop_training_on_a_plateau(engine, seqs):
    """lr 0: the held-out loss never falls, so with patience 2 the third evaluation (step 6) ends the run."""
    drafter = tiny_drafter(engine)
    batches = heldout_batches(seqs, count=2, block_size=4, batch_seqs=2, anchors_per_seq=4, seed=0)
    result = train(drafter, seqs, **{**RUN, "steps": 50, "lr": 0.0},
                   heldout=HeldOutEval(batches=batches, every=2, patience=2))
    assert result.stopped == "plateau" and len(result.history) == 6
    assert [e["step"] for e in result.evals] == [2, 4, 6]
    first = result.evals[0]
    assert all(e["loss"] == first["loss"] for e in result.evals)
    assert 1.0 <= first["tau"] <= 5.0 and all(0.0 <= first[f"a{k}"] <= 1.0 for k in range(1, 5))
    result = train(tiny_drafter(engine), seqs, **RUN, heldout=HeldOutEval(batches=batches, every=3))
    assert result.stopped is None and [e["step"] for e in result.evals] == [3, 6, 8]  # and after the last step


def test_plateau_needs_patience_evaluations_without_a_new_best():
    assert not plateaued([3.0, 2.0, 2.5], patience=2, min_delta=0.0)  # only one evaluation since the best
    assert plateaued([3.0, 2.0, 2.5, 2.1], patience=2, min_delta=0.0)
    assert not plateaued([3.0, 2.0, 2.5, 1.9], patience=2, min_delta=0.0)
    assert plateaued([3.0, 2.0, 2.5, 1.999], patience=2, min_delta=0.01)  # not better by 1%
    assert not plateaued([3.0, 2.0, 2.5, 2.1], patience=None, min_delta=0.0)


def test_teacher_forced_acceptance_per_position_is_conditional_on_the_drafts_before():
    """Greedy hits [[1, 1, 0], [1, 0, 1], [0, 1, 1]]: a1 = 2/3, a2 = 1/2, a3 = 0/1; tau = 1 + (2 + 1 + 0) / 3."""
    hits = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    labels = torch.zeros(3, 3, dtype=torch.long)
    logits = torch.where(hits[..., None], torch.tensor([5.0, 0.0]), torch.tensor([0.0, 5.0]))  # [N, K, 2]
    batch = SimpleNamespace(labels=labels, valid=torch.ones(3, 3, dtype=torch.bool), topk_ids=labels[..., None],
                            topk_probs=torch.ones(3, 3, 1))
    _, stats = dspark_loss(BlockOutputs(logits=logits, conf_logits=torch.zeros(3, 3)), batch, gamma_decay=4.0,
                           device=CPU)
    assert (stats["a1"], stats["a2"], stats["a3"]) == pytest.approx((2 / 3, 1 / 2, 0.0))
    assert stats["tau"] == pytest.approx(2.0)


@pytest.mark.parametrize("text", ['{"head": rnn}', '["head"]'])
def test_trainer_rejects_a_config_that_is_not_a_json_object(text, tmp_path, capsys):
    from app.drafters.train.trainer import main

    with pytest.raises(SystemExit) as exc:
        main(["--data", str(tmp_path), "--out", str(tmp_path / "ckpt"), "--config", text])
    assert exc.value.code == 2 and "--config" in capsys.readouterr().err


def test_heldout_split_keeps_all_answers_to_a_prompt_on_one_side():
    def seq(prompt: list[int], answer: list[int]):
        tokens = torch.tensor(prompt + answer)
        return Sequence_(tokens=tokens, features=torch.zeros(len(tokens), 1), prompt_len=len(prompt))

    greedy = [seq([p, p], [9]) for p in range(10)]  # one answer per prompt: every 5th held out
    train_part, held = split_heldout(greedy, 0.2)
    assert [int(s.tokens[0]) for s in held] == [0, 5] and len(train_part) == 8
    sampled = [seq([p, p], [8]) for p in (7, 5, 3, 0)]  # more answers to prompts 0 and 5 (held out) and 3, 7
    train_part, held = split_heldout(greedy + sampled, 0.2)  # index 10 (prompt 7's answer) is held out too
    assert sorted(int(s.tokens[0]) for s in held) == [0, 0, 5, 5, 7, 7]
    assert {int(s.tokens[0]) for s in train_part} == {1, 2, 3, 4, 6, 8, 9}


def test_the_trainer_takes_the_target_the_data_was_generated_with(tmp_path):
    import json

    for name, model in (("a", "/models/qwen3"), ("b", "/models/qwen3"), ("c", "smollm2-135m")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps({"model": model}))
    a, b, c = (tmp_path / n for n in "abc")
    assert trainer.data_model([a, b], None) == "/models/qwen3"
    assert trainer.data_model([a], "/models/../models/qwen3") == "/models/../models/qwen3"  # the same directory
    assert trainer.data_model([tmp_path / "no-meta"], None) == "smollm2-135m"
    with pytest.raises(ValueError, match=r"--model smollm2-135m is not the target the --data was generated with"):
        trainer.data_model([a], "smollm2-135m")
    with pytest.raises(ValueError, match="different targets"):
        trainer.data_model([a, c], None)
    with pytest.raises(SystemExit):
        trainer.main(["--data", str(a), "--out", str(tmp_path / "out"), "--model", "smollm2-135m"])
