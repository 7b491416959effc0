"""The engine contract: both engines implement it, and the offline loop runs on either."""

from __future__ import annotations

import pytest

from app.engine.contract import Engine
from app.loop import generate
from app.engine.engine import TargetEngine
from app.engine.testing import MockEngine, MockEngineConfig, next_token
from app.engine.types import SamplingParams
from app.serving.mock import MockProposer


def test_an_engine_missing_a_method_cannot_be_built():
    class Partial(Engine):
        def verify(self, blocks):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_both_engines_are_engines(engine):
    assert isinstance(engine, TargetEngine) and isinstance(engine, Engine)
    assert engine.input_embeddings.shape[0] == engine.vocab_size and engine.max_num_seqs == engine.config.max_num_seqs
    mock = MockEngine(MockEngineConfig(max_num_seqs=3))
    assert isinstance(mock, Engine) and mock.input_embeddings is None and mock.max_num_seqs == 3


def test_the_offline_loop_runs_on_the_mock_engine_with_speculation():
    """generate() needs only the contract: greedy output of the mock rule with and without (partly wrong) drafts."""
    mock = MockEngine(MockEngineConfig(max_num_seqs=2, max_draft_len=4))
    prompts = [[5, 6], [9], [1, 2, 3]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain, _ = generate(mock, prompts, params)
    spec, _ = generate(mock, prompts, params, proposer=MockProposer(vocab_size=mock.vocab_size, gamma=4))
    for prompt, p, s in zip(prompts, plain, spec):
        expected, tok = [], prompt[-1]
        for _ in range(12):
            tok = next_token(tok, mock.vocab_size)
            expected.append(tok)
        assert p.token_ids == s.token_ids == expected
    assert sum(r.num_accepted for r in spec) > 0 and mock.num_active == 0
