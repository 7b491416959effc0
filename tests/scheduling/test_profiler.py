"""The profiler CLI times the real engine and writes a profile that loads and matches the model."""

from __future__ import annotations

import pytest
import torch

from app.engine.loader import resolve_dtype
from app.scheduling.profile import ProfileMismatchError, load_profile, measured_profiles
from app.scheduling.profiler import main

AUTO_DTYPE = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # what the profiler ran


def test_profiler_writes_valid_measured_profile(tmp_path):
    path = main(["--batch-sizes", "1,2", "--tokens-per-request", "1,2,4", "--repeats", "2", "--context", "32",
                 "--out", str(tmp_path)])
    profile = load_profile(path)
    assert profile.provenance.source == "measured" and profile.provenance.context_tokens == 32
    assert profile.batch_sizes == [1, 2] and profile.tokens_per_request == [1, 2, 4]
    assert all(t > 0 for row in profile.verify_ms for t in row)
    assert profile.has_sampled and all(t > 0 for row in profile.sampled_verify_ms for t in row)
    profile.ensure_matches("smollm2-135m", dtype=AUTO_DTYPE, engine="dspark-engine")
    with pytest.raises(ProfileMismatchError, match="model"):
        profile.ensure_matches("Qwen3-8B")


def test_profiler_on_dummy_weights_with_a_dummy_drafter(tmp_path, tiny_llama_dir):
    path = main(["--model", str(tiny_llama_dir), "--load-format", "dummy", "--dummy-drafter", "--batch-sizes", "1,2",
                 "--tokens-per-request", "1,2,4", "--repeats", "2", "--context", "16", "--out", str(tmp_path)])
    profile = load_profile(path)
    prov = profile.provenance
    assert path.name.startswith("dspark-engine-tiny-llama-dummy-")
    assert prov.model == "tiny-llama-dummy" and prov.source == "measured"
    assert "weights: dummy" in prov.notes and "drafter: dummy DSpark" in prov.notes
    assert profile.draft_gamma == 7 and all(ms > 0 for ms in profile.draft_ms)
    profile.ensure_matches("tiny-llama", dtype=AUTO_DTYPE, engine="dspark-engine")
    assert measured_profiles(tmp_path, model="tiny-llama") == [(prov, path)]
    assert profile.verify_step == "ragged"


def test_profiler_records_padded_verify_steps(tmp_path, tiny_llama_dir):
    path = main(["--model", str(tiny_llama_dir), "--load-format", "dummy", "--verify-step", "bucketed",
                 "--batch-sizes", "1,2", "--tokens-per-request", "1,2,4", "--repeats", "1", "--context", "16",
                 "--no-sampled", "--out", str(tmp_path)])
    profile = load_profile(path)
    assert not profile.has_sampled  # --no-sampled: greedy steps only
    assert profile.verify_step == "bucketed" and profile.padded and "verify step: bucketed" in profile.provenance.notes
    assert "attention: sdpa" in profile.provenance.notes and "compiled" not in profile.provenance.notes
    assert measured_profiles(tmp_path, model="tiny-llama", verify_step="ragged") == []


def test_profiler_drafter_options_exclude_each_other():
    with pytest.raises(SystemExit):
        main(["--drafter", "checkpoints/dspark-smollm2-135m", "--dummy-drafter"])
    with pytest.raises(SystemExit):
        main(["--attention", "fast"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="both settings run on CUDA")
def test_profiler_refuses_engine_settings_the_device_cannot_run(tmp_path, tiny_llama_dir, capsys):
    common = ["--model", str(tiny_llama_dir), "--load-format", "dummy", "--out", str(tmp_path)]
    for flag, match in ((["--attention", "flash"], "attention 'flash' cannot run here"),
                        (["--compile-elementwise"], "compile_elementwise cannot run here")):
        with pytest.raises(SystemExit) as exit_:  # a usage error naming the setting, before any timing
            main(common + flag)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "the engine refuses these flags: " in err and match in err, err
