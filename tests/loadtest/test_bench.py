"""The served single-stream bench's drafter-alone round drafts a request as the served drafter does."""

from __future__ import annotations

import pytest

import app.drafters.proposer as proposer_module
import loadtest.bench as bench
from app.engine.types import SamplingParams
from app.serving.config import AppConfig


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafter_alone_drafts_at_the_requests_temperature(monkeypatch, temperature):
    """A sampled request's drafts are sampled, with the proposal probabilities rejection sampling needs; a greedy
    one's are deterministic (probs None)."""
    sampled = []
    propose = proposer_module.DSparkProposer.propose

    def recording(self, request_ids):
        blocks = propose(self, request_ids)
        sampled.extend(block.probs is not None for block in blocks)
        return blocks

    monkeypatch.setattr(proposer_module.DSparkProposer, "propose", recording)
    config = AppConfig.model_validate({**bench.app_args(bench.DEFAULT_CONFIG, {}), "policy": "dspark"})
    ms = bench.drafter_alone(config, ["What is 12 times 7?"], SamplingParams(max_tokens=16, temperature=temperature),
                             calls=3)
    assert ms > 0 and sampled and set(sampled) == {temperature > 0}


@pytest.mark.parametrize(("flags", "message"), [
    (["--policies", "none,bogus"], "error: policy bogus: ValidationError: policy: Value error, unknown policy 'bogus'"),
    (["--config", "/nonexistent.yaml"], "error: --config /nonexistent.yaml: no such file"),
    (["--policies", "none,none"], "error: --policies none,none: need distinct policy names"),
    (["--prompts", "nosuchset"], "error: prompts: 'nosuchset' is neither an evaluation set"),
])
def test_bad_flags_are_usage_errors_before_anything_runs(monkeypatch, capsys, flags, message):
    def runs(*args, **kwargs):
        raise AssertionError("the bench would run")

    monkeypatch.setattr(bench, "engine_alone", runs)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err


def test_rays_log_lines_go_to_stderr_while_a_policy_is_served(monkeypatch, capsys):
    """Ray's driver prints its workers' reported errors on stdout; the bench's stdout holds only its table and JSON."""

    def ray_prints(*args, **kwargs):
        print("(raylet) Task ServeController.graceful_shutdown failed")
        return {"tpot_ms": 10.0}

    monkeypatch.setattr(bench, "_served", ray_prints)
    assert bench.served({}, ["q"], params=[], num_cpus=None, reference=[""]) == {"tpot_ms": 10.0}
    out, err = capsys.readouterr()
    assert out == "" and "(raylet) Task ServeController.graceful_shutdown failed" in err
