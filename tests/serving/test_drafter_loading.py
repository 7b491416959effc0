"""A Drafter replica's trained drafter reads only the target's input embedding from its files, never the whole
target, and its resident memory grows by a fraction of what loading the target costs."""

from __future__ import annotations

import logging

import pytest
import torch

from app.drafters.checkpoint import save_checkpoint
from app.drafters.config import DrafterConfig, target_shape
from app.drafters.dspark import DSparkDrafter
from app.engine import loader
from app.engine.model import ModelArgs, TargetModel
from app.serving import drafter as drafter_module
from app.serving.config import AppConfig
from tests.conftest import TINY_LLAMA, save_tiny_model

# MLP-heavy (the decoder's 9.4M parameters outweigh the 3.1M of the embedding), untied LM head
WIDE = {**TINY_LLAMA, "intermediate_size": 8192, "num_hidden_layers": 6, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def target_and_drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    hf = save_tiny_model(root / "wide", "LlamaConfig", {k: v for k, v in WIDE.items() if k not in ("architectures",
                                                                                                    "model_type")})
    from transformers import AutoConfig

    with torch.device("meta"):
        target = TargetModel(ModelArgs.from_hf_config(AutoConfig.from_pretrained(root / "wide")), feature_layers=(0, 5))
    config = DrafterConfig.model_validate({**target_shape(target, name=str(root / "wide")), "rank": 8})
    save_checkpoint(root / "drafter", DSparkDrafter(config, hf.model.embed_tokens.weight.detach()))
    return root / "wide", root / "drafter", hf.model.embed_tokens.weight.detach()


def test_drafter_reads_only_the_embedding(target_and_drafter, monkeypatch, caplog):
    model_dir, checkpoint, embed = target_and_drafter

    def no_target(*args, **kwargs):
        raise AssertionError("the drafter loaded the whole target")

    monkeypatch.setattr(loader, "load_target", no_target)
    config = AppConfig.model_validate({"engine": {"model": str(model_dir), "device": "cpu", "dtype": "bfloat16",
                                                  "feature_layers": [0, 5], "max_model_len": 512},
                                       "drafter": "dspark", "drafter_checkpoint": str(checkpoint),
                                       "prompt_lookup": False, "gamma": 4})
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        proposer = drafter_module.make_proposer(config)
    assert torch.equal(proposer.drafter.embed_weight, embed.to(torch.bfloat16))
    assert "MiB before loading" in caplog.text and "(49152, 64)" in caplog.text


def test_embedding_alone_costs_a_fraction_of_the_target(target_and_drafter):
    model_dir = str(target_and_drafter[0])
    rss0 = drafter_module.resident_mib()
    embed = loader.load_embedding(model_dir, device="cpu")
    rss1 = drafter_module.resident_mib()
    target = loader.load_target(model_dir, device="cpu")
    rss2 = drafter_module.resident_mib()
    assert torch.equal(embed, target.model.embed_tokens.weight)
    assert rss1 - rss0 < (rss2 - rss1) / 3, (rss0, rss1, rss2)


def test_dummy_embedding_is_the_dummy_targets(tiny_llama_dir):
    embed = loader.load_embedding(str(tiny_llama_dir), device="cpu", load_format="dummy")
    target = loader.load_target(str(tiny_llama_dir), device="cpu", load_format="dummy")
    assert torch.equal(embed, target.model.embed_tokens.weight)
