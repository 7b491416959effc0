"""Build-time checks of a trained drafter against the target, and GPU placement for a CUDA engine (no Ray)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.engine.loader import local_checkpoint
from app.serving.builder import DrafterMismatchError, _actor_options, check_drafter_fits_target
from app.serving.config import AppConfig
from tests.conftest import TINY_LLAMA, write_model_dir

CHECKPOINT = "checkpoints/dspark-smollm2-135m"  # trained for smollm2-135m: V 49152, Dm 576, layers (5, 11, 17, 23, 29)


def smollm2_copy(directory, *, swap_tokens: bool = False):
    """SmolLM2-135M's config.json and tokenizer under another name; ``swap_tokens`` exchanges two token ids."""
    directory.mkdir()
    for src in local_checkpoint().iterdir():
        if src.name != "model.safetensors":
            shutil.copy(src, directory / src.name)
    if swap_tokens:
        tokenizer = json.loads((directory / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        a, b = list(vocab)[1000:1002]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def config(**args) -> AppConfig:
    return AppConfig.model_validate({"drafter": "dspark", "drafter_checkpoint": CHECKPOINT, "prompt_lookup": False,
                                     **args})


def test_the_committed_drafter_fits_its_target_and_a_copy_of_it(tmp_path):
    check_drafter_fits_target(config())
    check_drafter_fits_target(config(model=str(smollm2_copy(tmp_path / "smollm2-copy"))))  # same tokenizer


@pytest.mark.parametrize("target, field", [
    ({**TINY_LLAMA, "vocab_size": 32000}, "vocab_size 49152 in the drafter, 32000 in the target"),
    (TINY_LLAMA, "hidden_size 576 in the drafter, 64 in the target"),
])
def test_a_drafter_for_another_shape_fails_naming_the_field(tmp_path, target, field):
    model = str(write_model_dir(tmp_path / "tiny", target))
    with pytest.raises(DrafterMismatchError) as info:
        check_drafter_fits_target(config(model=model))
    message = str(info.value)
    assert field in message and CHECKPOINT in message and model in message
    assert "trained for smollm2-135m" in message and "drafter: ngram, or policy: none" in message
    check_drafter_fits_target(config(model=model, drafter="ngram"))  # needs no training
    check_drafter_fits_target(config(model=model, policy="none"))


def test_other_feature_layers_or_tokenizer_fail(tmp_path):
    with pytest.raises(DrafterMismatchError, match=r"feature_layers \(5, 11, 17, 23, 29\) in the drafter, \[1, 2\]"):
        check_drafter_fits_target(config(engine={"feature_layers": [1, 2]}))
    swapped = str(smollm2_copy(tmp_path / "other-model", swap_tokens=True))
    with pytest.raises(DrafterMismatchError, match="the tokenizer of smollm2-135m differs from the target's"):
        check_drafter_fits_target(config(model=swapped))


def test_a_drafter_trained_for_a_model_now_elsewhere_is_checked_without_its_tokenizer(tmp_path, caplog):
    """The path of the model a drafter was trained for (in its config) may not exist where it is served."""
    moved = tmp_path / "drafter"
    moved.mkdir()
    doc = json.loads((Path(config().drafter_checkpoint) / "config.json").read_text())
    doc["config"]["target"] = str(tmp_path / "models-moved-away" / "smollm2")
    (moved / "config.json").write_text(json.dumps(doc))
    check_drafter_fits_target(config(drafter_checkpoint=str(moved)))
    assert "which is not present here" in caplog.text


def test_a_missing_checkpoint_says_how_to_train_one(tmp_path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError) as info:
        config(engine={"model": str(tiny_llama_dir), "load_format": "dummy"},
               drafter_checkpoint=str(tmp_path / "none")).check_files()
    message = str(info.value)
    assert f"python -m app.pipeline --model {tiny_llama_dir} --out runs/drafter" in message
    assert "drafter: ngram, or policy: none" in message


def test_a_cuda_engine_asks_ray_for_gpus():
    cuda = AppConfig(device="cuda", drafter="ngram", drafter_replicas={"num_gpus": 0.5})
    assert _actor_options(cuda, cuda.target)["num_gpus"] == 1
    assert _actor_options(cuda, cuda.drafter_replicas)["num_gpus"] == 0.5  # as placed
    cpu = AppConfig(device="cpu", drafter="ngram")
    assert _actor_options(cpu, cpu.target)["num_gpus"] == 0
