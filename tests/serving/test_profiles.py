"""profile 'auto' on a target replica (no Ray): measure what is missing, cache it, reuse it while it covers the
config."""

from __future__ import annotations

import pytest

from app.engine.engine import TargetEngine
from app.scheduling.profile import save_profile
from app.serving import profiles
from app.serving.config import AppConfig


def test_startup_profile_is_measured_cached_and_reused(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    args = {"engine": {"model": str(tiny_llama_dir), "load_format": "dummy", "device": "cpu", "max_model_len": 256,
                       "max_num_seqs": 2}, "policy": "dspark", "drafter": "ngram", "gamma": 2, "profile_budget_s": 60}
    config = AppConfig.model_validate(args)
    engine = TargetEngine(config.engine_config())
    assert config.profile_path() is None
    profile = profiles.serving_profile(config, engine)
    assert profile.batch_sizes == [1, 2] and profile.tokens_per_request == [1, 2, 3]
    assert profile.provenance.model == str(tiny_llama_dir) and "measured at start-up" in profile.provenance.notes
    assert profile.has_sampled  # sampled rows priced from their own steps
    assert config.profile_path() is not None

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    with monkeypatch.context() as m:
        m.setattr(profiles, "measure_startup_profile", no_measuring)
        assert profiles.serving_profile(config, engine) == profile  # reused from the cache
        wider = AppConfig.model_validate({**args, "gamma": 3})  # verify lengths the cached grid does not reach
        with pytest.raises(AssertionError, match="measured again"):
            profiles.serving_profile(wider, TargetEngine(wider.engine_config()))
        greedy_only = profile.model_copy(update={"sampled_verify_ms": None})  # cached before the sampled table
        save_profile(greedy_only, profiles.profile_cache_path(config, hardware=profile.provenance.hardware,
                                                                dtype=profile.provenance.dtype))
        with pytest.raises(AssertionError, match="measured again"):
            profiles.serving_profile(config, engine)


def test_a_small_budget_thins_the_verify_lengths(tmp_path, monkeypatch, tiny_llama_dir, caplog):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    config = AppConfig.model_validate({
        "engine": {"model": str(tiny_llama_dir), "load_format": "dummy", "device": "cpu", "max_model_len": 256,
                   "max_num_seqs": 2}, "policy": "dspark", "drafter": "ngram", "gamma": 4, "profile_budget_s": 0.001})
    profile = profiles.serving_profile(config, TargetEngine(config.engine_config()))
    assert profile.batch_sizes == [1, 2] and profile.tokens_per_request == [1, 5]  # still reaches gamma + 1
    assert "median of 1 steps" in profile.provenance.notes
    assert "over profile_budget_s" in caplog.text


def test_a_padded_engine_is_timed_at_its_token_buckets(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    args = {"engine": {"model": str(tiny_llama_dir), "load_format": "dummy", "device": "cpu", "max_model_len": 256,
                       "max_num_seqs": 3, "verify_step": "bucketed"},
            "policy": "dspark", "drafter": "ngram", "gamma": 4, "profile_budget_s": 60}
    config = AppConfig.model_validate(args)
    profile = profiles.serving_profile(config, TargetEngine(config.engine_config()))
    assert profile.verify_step == "bucketed" and profile.padded
    assert profile.batch_sizes == [1, 2, 3] and profile.tokens_per_request == [1, 2, 4, 5]
    # a smaller gamma pads to other token buckets (1, 2, 4): the cached cells do not fit it, though they cover it
    smaller = AppConfig.model_validate({**args, "gamma": 3})
    again = profiles.serving_profile(smaller, TargetEngine(smaller.engine_config()))
    assert again.tokens_per_request == [1, 2, 4] and again.padded
