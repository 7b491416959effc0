"""Served: a tiny random Llama-3-style model saved to a directory, ``profile: auto`` with nothing measured for it.
The first start measures its profile on the target replica and caches it; the second start reuses the cache.

The model's directory is new in every run, so this host's profile cache (keyed by the model reference) holds nothing
for it; the test removes the profile it caches."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from app.serving.builder import build_app
from app.serving.config import AppConfig
from tests.conftest import save_tiny_model
from tests.serving.helpers import shared_serve

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase

LLAMA3 = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})


def test_auto_profile_is_measured_at_start_and_reused(tmp_path):
    model_dir = tmp_path / "tiny-llama3"
    save_tiny_model(model_dir, "LlamaConfig", LLAMA3)
    args = {
        "engine": {"model": str(model_dir), "device": "cpu", "dtype": "float32", "max_model_len": 256,
                   "max_num_seqs": 4},
        "served_model_name": "tiny", "policy": "dspark", "drafter": "ngram", "gamma": 4, "profile": "auto",
        "profile_budget_s": 4, "drafter_placement": "colocated", "torch_threads": 1,
        "target": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.1}, "router_num_cpus": 0.05,
    }
    assert AppConfig.model_validate(args).profile_path() is None  # nothing committed or cached for this model
    starts = []
    url = shared_serve()
    try:
        for start in range(2):
            t0 = time.perf_counter()
            serve.run(build_app(args), name="tiny", route_prefix="/")
            starts.append(time.perf_counter() - t0)
            cached = AppConfig.model_validate(args).profile_path()
            assert cached is not None, "the target replica did not cache a measured profile"
            if start == 0:
                measured_at = Path(cached).stat().st_mtime_ns, Path(cached).read_text()
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Count: 1 2 3 1 2 3 1 2"}],
                "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 12
            serve.delete("tiny")
        # the second start read the cache instead of measuring again (same file, unchanged)
        assert (Path(cached).stat().st_mtime_ns, Path(cached).read_text()) == measured_at
    finally:
        if (left := AppConfig.model_validate(args).profile_path()) is not None:
            Path(left).unlink()
    print(f"start-up: {starts[0]:.1f} s measuring the profile, {starts[1]:.1f} s reusing it")
