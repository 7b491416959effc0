"""Training pipeline on the real target: datagen shard -> batches with inference alignment -> falling loss.

Uses the session-scoped ``engine`` fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from app.drafters.config import DrafterConfig, EagleConfig
from app.drafters.dspark import DSparkDrafter
from app.drafters.eagle import EagleDrafter
from app.drafters.train.data import load_shards, make_batch, with_target_topk
from app.drafters.train.datagen import generate_shard
from app.drafters.train.trainer import dspark_loss, forward_batch, train
from app.engine.engine import TargetEngine
from app.engine.types import SamplingParams

CPU = torch.device("cpu")
PROMPTS = ["What is 12 times 7?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def seqs(engine, tmp_path_factory):
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    shard = generate_shard(engine, ids, [SamplingParams(max_tokens=24)] * len(ids), max_batch=2, id_prefix="t")
    folder = tmp_path_factory.mktemp("data")
    save_file(shard, str(folder / "shard-0000.safetensors"))
    return with_target_topk(load_shards(folder), engine.model.logits_from_final_hidden, k=8,
                            hidden_size=engine.model.args.hidden_size, device=CPU, progress=False)


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


def assert_loss_falls(drafter, seqs, *, block_size: int) -> None:
    """12 training steps cut the loss on a fixed batch by more than 20%."""
    gen = torch.Generator().manual_seed(1)
    fixed = make_batch(seqs, block_size=block_size, anchors_per_seq=8, generator=gen)
    with torch.no_grad():
        before, _ = dspark_loss(forward_batch(drafter, fixed, CPU), fixed, gamma_decay=4.0, device=CPU)
    history = train(drafter, seqs, steps=12, batch_seqs=2, anchors_per_seq=8, lr=3e-3, gamma_decay=4.0, seed=0,
                    device=CPU, progress=False)
    with torch.no_grad():
        after, _ = dspark_loss(forward_batch(drafter, fixed, CPU), fixed, gamma_decay=4.0, device=CPU)
    assert float(after) < 0.8 * float(before), (float(before), float(after), history[-1])


def test_tiny_drafter_loss_falls(engine, seqs):
    assert_loss_falls(tiny_drafter(engine), seqs, block_size=4)


def test_tiny_eagle_drafter_loss_falls_with_training_time_test(engine, seqs):
    torch.manual_seed(0)
    config = EagleConfig(block_size=3, intermediate_size=128, feature_layers=engine.model.feature_layers,
                         fused_layers=(5, 17, 29), rope_theta=engine.model.args.rope_theta)
    assert_loss_falls(EagleDrafter(config, engine.model.embed_tokens.weight), seqs, block_size=3)


def test_time_budget_fits_the_schedule_after_the_warm_up_steps(engine, seqs):
    """A clock that ticks 1 s per reading: steps 5..25 time at 1.05 s/step, so a 50 s budget (28 s spent by then)
    fits 25 + int(22 / 1.05) = 45 steps in all, far below the 1000-step cap; without a budget the cap holds."""
    ticks = iter(range(10_000))
    history = train(tiny_drafter(engine), seqs, steps=1000, batch_seqs=1, anchors_per_seq=2, lr=1e-3,
                    gamma_decay=4.0, seed=0, device=CPU, progress=False, max_seconds=50.0,
                    clock=lambda: float(next(ticks)))
    assert len(history) == 45
    assert len(train(tiny_drafter(engine), seqs, steps=7, batch_seqs=1, anchors_per_seq=2, lr=1e-3, gamma_decay=4.0,
                     seed=0, device=CPU, progress=False)) == 7


@pytest.mark.parametrize("text", ['{"head": rnn}', '["head"]'])
def test_trainer_rejects_a_config_that_is_not_a_json_object(text, tmp_path, capsys):
    from app.drafters.train.trainer import main

    with pytest.raises(SystemExit) as exc:
        main(["--data", str(tmp_path), "--out", str(tmp_path / "ckpt"), "--config", text])
    assert exc.value.code == 2 and "--config" in capsys.readouterr().err
