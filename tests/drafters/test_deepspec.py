"""DeepSpec-format drafters (``app/drafters/deepspec.py``): the reference's own outputs reproduced, export -> load
round trips, and clear errors for wrong or partial folders.

``tests/fixtures/deepspec`` (see its README) holds tiny random drafters written in the reference's format over a
tiny random 3-layer Qwen3 target, the target's stored hidden states, and what DeepSpec's own modules computed from
them (run outside this repository): the backbone hidden states, base and Markov-adjusted draft logits, probabilities,
greedy drafts, confidences and teacher-forced logits at two anchors; and an EAGLE-3 drafter over a 6-layer target
with its greedy drafting loop's hidden states, logits and drafts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.drafters.checkpoint import load_checkpoint, read_checkpoint_config
from app.drafters.config import DrafterConfig
from app.drafters.deepspec import export_deepspec, load_deepspec
from app.drafters.dspark import DSparkDrafter
from app.drafters.eagle import EagleDrafter

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec"
VARIANTS = {  # fixture folder -> (head, confidence) it must translate to
    "dspark_vanilla": ("markov", "hidden_prev"),
    "dspark_gated": ("gated", "hidden"),
    "dspark_rnn": ("joint_rnn", "hidden_prev"),
    "dflash": ("none", "none"),
}
ANCHORS = (5, 11)
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def target() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "target.safetensors"))


def draft(drafter: DSparkDrafter, target: dict, anchor: int, *, draft_vocab: bool = False) -> dict[str, torch.Tensor]:
    """One block at ``anchor`` (context: the features of tokens < anchor): what the fixture stores, computed by
    this project's module (greedy drafts, and teacher forcing by the sequence's own tokens)."""
    ids, k = target["input_ids"], drafter.config.block_size
    with torch.no_grad():
        ctx = drafter.context_kv(target["features"][:, :anchor], torch.arange(anchor)[None])
        hidden = drafter.backbone(drafter.block_inputs(ids[:, anchor : anchor + 1]),
                                  positions=torch.arange(anchor, anchor + k)[None], ctx=ctx,
                                  mask=torch.ones(1, k, anchor + k, dtype=torch.bool))[0]
        base = drafter.base_logits(hidden, draft=draft_vocab)
        prev, state, tokens, logits, conf = ids[0, anchor : anchor + 1], None, [], [], []
        for i in range(k):
            step = drafter.head_step(base[i : i + 1], hidden[i : i + 1], prev, state, draft=draft_vocab)
            prev, state = drafter.draft_token_ids(step.logits.argmax(-1)), step.state
            tokens.append(prev)
            logits.append(step.logits[0])
            conf.append(torch.sigmoid(step.conf_logit[0]))
        forced, _ = drafter.teacher_forced(base[None], hidden[None], ids[:, anchor : anchor + k], draft=draft_vocab)
    logits = torch.stack(logits)
    return {"hidden": hidden, "base_logits": base, "tokens": torch.cat(tokens), "logits": logits,
            "probs": torch.softmax(logits, -1), "confidences": torch.stack(conf), "teacher_forced_logits": forced[0]}


def load(folder: Path, target: dict, **kwargs) -> DSparkDrafter:
    drafter, _, _ = load_checkpoint(folder, target["embed"], **kwargs)
    return drafter


@pytest.mark.parametrize("variant", VARIANTS)
def test_outputs_equal_the_reference_implementation(variant, target):
    drafter = load(FIXTURE / variant, target)
    assert (drafter.config.head, drafter.config.confidence_input) == VARIANTS[variant]
    expected = load_file(str(FIXTURE / variant / "expected.safetensors"))
    for anchor in ANCHORS:
        ours = draft(drafter, target, anchor)
        assert torch.equal(ours["tokens"], expected[f"anchor{anchor}.tokens"])
        for name in ("hidden", "base_logits", "logits", "probs", "teacher_forced_logits"):
            torch.testing.assert_close(ours[name], expected[f"anchor{anchor}.{name}"], **TOL, msg=name)
        if f"anchor{anchor}.confidences" in expected:
            torch.testing.assert_close(ours["confidences"], expected[f"anchor{anchor}.confidences"], **TOL)
        else:  # DFlash: no confidence head, every draft reports confidence 1
            assert torch.equal(ours["confidences"], torch.ones(drafter.config.block_size))


def test_the_markov_head_changes_the_drafts(target):
    """The fixture discriminates: without its Markov bias the vanilla drafter's logits differ."""
    expected = load_file(str(FIXTURE / "dspark_vanilla" / "expected.safetensors"))
    assert not torch.allclose(expected["anchor5.logits"], expected["anchor5.base_logits"], **TOL)


def eagle_draft(drafter: EagleDrafter, target: dict, anchor: int) -> dict[str, torch.Tensor]:
    """Greedy drafting at ``anchor`` as ``EagleProposer`` runs it: a causal pass over the context rows < anchor
    (row j with token j + 1), then one step per draft at positions anchor, anchor + 1, ..."""
    ids, k = target["input_ids"], drafter.config.block_size
    with torch.no_grad():
        x = drafter.inputs(drafter.fuse(target["features"][:, :anchor]), ids[:, 1 : anchor + 1])
        empty = drafter.empty_kv(1, x)
        out, keys, values = drafter.attend(x, positions=torch.arange(anchor)[None], past_k=empty, past_v=empty,
                                           mask=torch.ones(anchor, anchor, dtype=torch.bool).tril()[None])
        h, hidden, logits, tokens = out[:, -1], [], [], []
        for i in range(k):
            hidden.append(h[0])
            step_logits, _ = drafter.head(h)
            logits.append(step_logits[0])
            tokens.append(step_logits[0].argmax())
            if i + 1 == k:
                break
            out, k_new, v_new = drafter.attend(drafter.inputs(h[:, None], tokens[-1].view(1, 1)),
                                               positions=torch.tensor([[anchor + i]]), past_k=keys, past_v=values,
                                               mask=torch.ones(1, 1, keys.shape[2] + 1, dtype=torch.bool))
            h, keys, values = out[:, 0], torch.cat([keys, k_new], 2), torch.cat([values, v_new], 2)
    logits = torch.stack(logits)
    return {"hidden": torch.stack(hidden), "logits": logits, "probs": torch.softmax(logits, -1),
            "tokens": torch.stack(tokens)}


@pytest.fixture(scope="module")
def eagle_target() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "eagle3" / "target.safetensors"))


def test_eagle3_outputs_equal_the_reference_implementation(eagle_target):
    drafter = load(FIXTURE / "eagle3", eagle_target)
    assert isinstance(drafter, EagleDrafter) and drafter.config.fusion == "concat"
    expected = load_file(str(FIXTURE / "eagle3" / "expected.safetensors"))
    for anchor in ANCHORS:
        ours = eagle_draft(drafter, eagle_target, anchor)
        assert torch.equal(ours["tokens"], expected[f"anchor{anchor}.tokens"])
        for name in ("hidden", "logits", "probs"):
            torch.testing.assert_close(ours[name], expected[f"anchor{anchor}.{name}"], **TOL, msg=name)
        _, conf = drafter.head(ours["hidden"])
        assert torch.equal(torch.sigmoid(conf), torch.ones(drafter.config.block_size))  # no confidence head


def test_eagle3_export_then_load_gives_identical_drafts(eagle_target, tmp_path):
    drafter = load(FIXTURE / "eagle3", eagle_target)
    export_deepspec(drafter, tmp_path / "out", dtype=torch.float32)
    again = load(tmp_path / "out", eagle_target)
    assert read_checkpoint_config(tmp_path / "out")["kind"] == "eagle"
    for anchor in ANCHORS:
        a, b = eagle_draft(drafter, eagle_target, anchor), eagle_draft(again, eagle_target, anchor)
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_read_checkpoint_config_translates_the_folder():
    doc = read_checkpoint_config(FIXTURE / "dspark_vanilla")
    assert doc["format"] == "deepspec" and doc["kind"] == "dspark"
    c = DrafterConfig.model_validate(doc["config"])
    assert (c.feature_layers, c.mask_token_id, c.block_size, c.rank, c.qk_norm, c.feature_norm) == (
        (0, 1), 250, 4, 16, True, False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_then_load_gives_identical_drafts(variant, target, tmp_path):
    drafter = load(FIXTURE / variant, target)
    export_deepspec(drafter, tmp_path / "out", dtype=torch.float32)
    again = load(tmp_path / "out", target)
    for anchor in ANCHORS:
        a, b = draft(drafter, target, anchor), draft(again, target, anchor)
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_round_trip_with_a_draft_vocabulary_writes_d2t(target, tmp_path):
    drafter = load(FIXTURE / "dspark_vanilla", target)
    ids = torch.cat([torch.arange(0, 200, 2), torch.tensor([239, 250])])  # even ids and two the drafts use
    drafter.set_draft_vocab(ids)
    export_deepspec(drafter, tmp_path / "out", dtype=torch.float32)
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(stored["d2t"] + torch.arange(len(ids)), ids)
    assert stored["lm_head.weight"].shape == (len(ids), 32) and stored["markov_head.markov_w2.weight"].shape == (
        len(ids), 16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["draft_vocab_size"] == len(ids)
    again = load(tmp_path / "out", target)
    assert torch.equal(again.draft_vocab, ids)
    for anchor in ANCHORS:
        a = draft(drafter, target, anchor, draft_vocab=True)
        b = draft(again, target, anchor, draft_vocab=True)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["logits"], b["logits"])
        assert set(a["tokens"].tolist()) <= set(ids.tolist())


def test_export_writes_calibration_and_cost_table(target, tmp_path):
    from app.drafters.calibration import Calibration

    calibration = Calibration(temperatures={"greedy": [1.5, 2.0, 2.5, 3.0]})
    profile = next(Path(__file__).resolve().parents[2].glob("profiles/dspark-engine-smollm2-135m-*.json"))
    export_deepspec(load(FIXTURE / "dspark_vanilla", target), tmp_path / "out", calibration=calibration,
                    profile=profile)
    assert json.loads((tmp_path / "out" / "dspark_cost_table.json").read_text()) == json.loads(profile.read_text())
    _, loaded, meta = load_checkpoint(tmp_path / "out", target["embed"])
    assert loaded == calibration and meta["format"] == "deepspec"
    export_deepspec(load(FIXTURE / "dspark_vanilla", target), tmp_path / "out")  # again, without a profile
    assert not (tmp_path / "out" / "dspark_cost_table.json").exists()  # the earlier one described another export
    with pytest.raises(FileNotFoundError):
        export_deepspec(load(FIXTURE / "dspark_vanilla", target), tmp_path / "new", profile=tmp_path / "none.json")
    assert not (tmp_path / "new").exists()  # refused before anything was written


def test_export_refuses_options_the_format_cannot_express(target):
    c = DrafterConfig(vocab_size=256, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                      feature_layers=(0, 1), target_hidden_size=32, qk_norm=True, mask_token_id=250)
    with pytest.raises(ValueError, match="feature_norm"):
        export_deepspec(DSparkDrafter(c, target["embed"]), "/nonexistent/never-written")
    c = c.model_copy(update={"feature_norm": False, "head": "rnn"})
    with pytest.raises(ValueError, match="head='rnn'"):
        export_deepspec(DSparkDrafter(c, target["embed"]), "/nonexistent/never-written")


def test_training_loss_of_a_drafter_without_confidence_head_is_finite(target):
    """DFlash (no confidence head, confidence logits +inf) trains on the draft losses alone: bce is 0, not inf."""
    from types import SimpleNamespace

    from app.drafters.train.trainer import BlockOutputs, dspark_loss

    drafter = load(FIXTURE / "dflash", target)
    out = draft(drafter, target, 5)
    logits = out["teacher_forced_logits"][None].requires_grad_()
    _, conf = drafter.teacher_forced(out["base_logits"][None], out["hidden"][None], target["input_ids"][:, 5:9])
    ids = target["input_ids"][:, 6:10]
    batch = SimpleNamespace(labels=ids, valid=torch.ones(1, 4, dtype=torch.bool), topk_ids=ids[..., None],
                            topk_probs=torch.ones(1, 4, 1))
    loss, parts = dspark_loss(BlockOutputs(logits=logits, conf_logits=conf), batch, gamma_decay=4.0,
                              device=torch.device("cpu"))
    loss.backward()
    assert parts["bce"] == 0.0 and torch.isfinite(loss) and torch.isfinite(logits.grad).all()


def test_export_cli_refuses_the_committed_checkpoint_naming_the_option(tmp_path, capsys):
    """The committed SmolLM2 checkpoint uses this project's layout (no q/k norm, normed features, learned mask): a
    usage error (exit 2, one line naming the option), as a missing checkpoint is."""
    from app.drafters.deepspec import main
    from app.drafters.checkpoint import DEFAULT_CHECKPOINT

    for checkpoint, message in ((DEFAULT_CHECKPOINT, "cannot express qk_norm=False"),
                                (tmp_path / "none", "none")):
        with pytest.raises(SystemExit) as exit_:
            main(["export", str(checkpoint), str(tmp_path / "out")])
        assert exit_.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def _broken_copy(tmp_path: Path, *, config=None, tensors=None, variant: str = "dspark_vanilla") -> Path:
    """A copy of a fixture drafter with its config dict and/or tensor dict edited in place by the callables."""
    folder = tmp_path / "broken"
    shutil.copytree(FIXTURE / variant, folder)
    if config:
        doc = json.loads((folder / "config.json").read_text())
        config(doc)
        (folder / "config.json").write_text(json.dumps(doc))
    if tensors:
        state = load_file(str(folder / "model.safetensors"))
        tensors(state)
        save_file(state, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("edit, message", [
    (dict(tensors=lambda s: s.pop("layers.1.self_attn.k_norm.weight")), "layers.1.self_attn.k_norm.weight"),
    (dict(tensors=lambda s: s.pop("confidence_head.proj.bias")), "confidence_head.proj.bias"),
    (dict(tensors=lambda s: s.update({"fc.weight": torch.zeros(32, 96)})), "'fc.weight' has shape (32, 96)"),
    (dict(tensors=lambda s: s.update({"mtp.extra": torch.zeros(2)})), "unexpected tensor(s) ['mtp.extra']"),
    (dict(tensors=lambda s: s.update({"d2t": torch.zeros(256, dtype=torch.long)})), "'d2t'"),
    (dict(config=lambda d: d.pop("mask_token_id")), "'mask_token_id' is missing"),
    (dict(config=lambda d: d.update(architectures=["Gemma4DSparkModel"])), "Gemma4DSparkModel"),
    (dict(config=lambda d: d.update(markov_head_type="bogus")), "markov_head_type 'bogus'"),
    (dict(config=lambda d: d.update(target_layer_ids=[-1, 1])), "target_layer_ids [-1, 1]"),
    (dict(config=lambda d: d.update(num_hidden_layers=3)), "layers.2."),
    (dict(config=lambda d: d.update(markov_rank=8)), "'markov_head.markov_w1.weight' has shape (256, 16)"),
    (dict(config=lambda d: d.update(mask_token_id=999)), "mask_token_id 999"),
])
def test_a_wrong_or_partial_folder_names_what_is_wrong(edit, message, target, tmp_path):
    with pytest.raises(ValueError) as err:
        load_checkpoint(_broken_copy(tmp_path, **edit), target["embed"])
    assert message in str(err.value)


@pytest.mark.parametrize("edit, message", [
    (dict(config=lambda d: d.update(num_hidden_layers=2)), "num_hidden_layers 2"),
    (dict(config=lambda d: d.pop("ttt_length")), "'ttt_length' is missing"),
    (dict(tensors=lambda s: s.pop("layers.0.hidden_norm.weight")), "layers.0.hidden_norm.weight"),
    (dict(tensors=lambda s: s.update({"layers.0.self_attn.q_proj.weight": torch.zeros(32, 32)})),
     "'layers.0.self_attn.q_proj.weight' has shape (32, 32), expected (32, 64)"),
    (dict(config=lambda d: d.update(draft_vocab_size=128)), "draft_vocab_size 128"),
])
def test_a_wrong_eagle3_folder_names_what_is_wrong(edit, message, eagle_target, tmp_path):
    with pytest.raises(ValueError) as err:
        load_checkpoint(_broken_copy(tmp_path, variant="eagle3", **edit), eagle_target["embed"])
    assert message in str(err.value)


def test_an_unused_mask_embedding_placeholder_is_accepted(target, tmp_path):
    folder = _broken_copy(tmp_path, tensors=lambda s: s.update({"mask_embedding": torch.ones(32)}))
    expected = load_file(str(FIXTURE / "dspark_vanilla" / "expected.safetensors"))
    torch.testing.assert_close(draft(load(folder, target), target, 5)["logits"], expected["anchor5.logits"], **TOL)


def test_a_drafter_for_another_target_is_refused(target, eagle_target):
    with pytest.raises(ValueError, match="vocab_size 256 and hidden_size 32, but the target's embedding is"):
        load_checkpoint(FIXTURE / "dspark_vanilla", torch.zeros(300, 32))
    with pytest.raises(ValueError, match="hidden_size 32"):
        load_checkpoint(FIXTURE / "eagle3", torch.zeros(256, 64))


def test_a_folder_without_lm_head_needs_the_targets_head(target, tmp_path):
    folder = _broken_copy(tmp_path, tensors=lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
        load_deepspec(folder, target["embed"])
    drafter, _, _ = load_deepspec(folder, target["embed"], head_weight=target["lm_head"])
    expected = load_file(str(FIXTURE / "dspark_vanilla" / "expected.safetensors"))
    torch.testing.assert_close(draft(drafter, target, 5)["logits"], expected["anchor5.logits"], **TOL)
