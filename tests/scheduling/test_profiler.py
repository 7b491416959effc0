"""The profiler CLI times the real engine and writes a profile that loads and matches the model."""

from __future__ import annotations

import pytest

from app.scheduling.profile import ProfileMismatchError, load_profile
from app.scheduling.profiler import main


def test_profiler_writes_valid_measured_profile(tmp_path):
    path = main(["--batch-sizes", "1,2", "--tokens-per-request", "1,2,4", "--repeats", "2", "--context", "32",
                 "--out", str(tmp_path)])
    profile = load_profile(path)
    assert profile.provenance.source == "measured" and profile.provenance.context_tokens == 32
    assert profile.batch_sizes == [1, 2] and profile.tokens_per_request == [1, 2, 4]
    assert all(t > 0 for row in profile.verify_ms for t in row)
    profile.ensure_matches("smollm2-135m", dtype="bfloat16", engine="dspark-engine")
    with pytest.raises(ProfileMismatchError, match="model"):
        profile.ensure_matches("Qwen3-8B")
