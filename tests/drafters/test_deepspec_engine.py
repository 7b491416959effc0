"""A DeepSpec-format drafter over the real SmolLM2 target: written by the export CLI, loaded by the serving layer's
loading function from ``drafter_checkpoint``, greedy speculative decoding equals plain greedy decoding.

The drafter is a reference-format DSpark (Qwen3 draft layers, Markov head, confidence head) with random weights
sized for SmolLM2; losslessness does not depend on its weights. Uses the session-scoped ``engine`` fixture.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.drafters.checkpoint import save_checkpoint
from app.drafters.config import DrafterConfig, target_shape
from app.drafters.deepspec import main as deepspec_cli
from app.drafters.dspark import DSparkDrafter
from app.drafters.proposer import DSparkProposer
from app.loop import generate
from app.engine.types import SamplingParams
from app.serving.config import AppConfig
from app.serving.drafter import make_proposer
from app.serving.target import make_engine
from tests.engine.near_tie import check_same_or_near_tie

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
]


@pytest.fixture(scope="module")
def exported(engine, tmp_path_factory):
    """A DSpark checkpoint of this project built with the reference options, saved, then exported by the CLI."""
    torch.manual_seed(0)
    config = DrafterConfig.model_validate({
        **target_shape(engine.model, name="smollm2-135m"), "block_size": 4, "num_layers": 1, "rank": 16,
        "qk_norm": True, "feature_norm": False, "mask_token_id": 2, "confidence": "hidden_prev",
    })
    drafter = DSparkDrafter(config, engine.model.embed_tokens.weight.float())
    with torch.no_grad():
        drafter.w2.weight.normal_(std=0.05)  # a Markov bias that moves the drafts
    root = tmp_path_factory.mktemp("deepspec")
    save_checkpoint(root / "ours", drafter)
    deepspec_cli(["export", str(root / "ours"), str(root / "theirs")])
    return root / "theirs"


def test_export_cli_writes_a_reference_config(exported):
    hf = json.loads((exported / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["markov_head_type"] == "vanilla"
    assert hf["target_layer_ids"] == [5, 11, 17, 23, 29] and hf["mask_token_id"] == 2
    assert (exported / "dspark_calibration.json").is_file()


def test_export_cli_checks_the_profile_before_it_writes(exported, capsys):
    """A missing profile is a usage error before the target loads and nothing is written; one measured for another
    model is shipped with a warning naming both."""
    ours, out = exported.parent / "ours", exported.parent / "with-profile"
    with pytest.raises(SystemExit) as exit_:
        deepspec_cli(["export", str(ours), str(out), "--profile", str(exported.parent / "none.json")])
    assert exit_.value.code == 2 and "--profile:" in capsys.readouterr().err and not out.exists()
    profile = Path(__file__).resolve().parents[2] / "profiles" / "roofline-llama-3.1-8b-h200.json"
    deepspec_cli(["export", str(ours), str(out), "--profile", str(profile)])
    assert "was measured for 'Llama-3.1-8B', the drafter's target is 'smollm2-135m'" in capsys.readouterr().err
    assert (out / "dspark_cost_table.json").is_file()


@pytest.mark.slow
def test_served_greedy_run_with_a_deepspec_drafter_is_lossless(engine, exported):
    config = AppConfig(drafter="dspark", drafter_checkpoint=str(exported), prompt_lookup=False, gamma=4)
    proposer = make_proposer(config, engine.model.embed_tokens.weight)
    assert isinstance(proposer, DSparkProposer) and proposer.drafter.config.qk_norm
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=16)
    plain, _ = generate(engine, ids, params)
    spec, _ = generate(engine, ids, params, proposer=proposer)
    for prompt, p, s in zip(ids, plain, spec):
        check_same_or_near_tie(engine, prompt, p.token_ids, s.token_ids)
    assert sum(r.num_draft for r in spec) > 0  # drafts were proposed and verified


def test_served_engine_returns_the_feature_layers_of_the_drafter(monkeypatch):
    """A DeepSpec drafter's target_layer_ids (here [0, 1]) become the served engine's feature layers."""
    import app.engine.engine

    built = []
    monkeypatch.setattr(app.engine.engine, "TargetEngine", built.append)
    folder = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec" / "dspark_vanilla"
    make_engine(AppConfig(drafter="dspark", drafter_checkpoint=str(folder), prompt_lookup=False))
    make_engine(AppConfig(drafter="ngram"))
    assert [c.feature_layers for c in built] == [(0, 1), None]
