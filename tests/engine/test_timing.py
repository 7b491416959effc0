"""Verify-step timing runs on natural text: no row of the real target falls back to the float32 LM head."""

import pytest
import torch

from app.engine import greedy_head
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.timing import TIMING_TEXT, time_mixed_step, time_prefill, time_verify_step, timing_tokens


def test_timing_tokens_tile_the_text(engine):
    ids = engine.encode(TIMING_TEXT)
    tokens = timing_tokens(engine, 2 * len(ids) + 3)
    assert tokens == ids + ids + ids[:3]


def test_timed_verify_steps_take_the_screened_path(bf16_engine, monkeypatch):
    """A flat row (the screen cannot rule out the vocabulary) costs a float32 matmul over it: timing on random
    tokens hit those and overstated multi-token verify steps (``app/engine/timing.py``)."""
    engine = bf16_engine
    rows, flat = [], []
    screen = engine._screen
    call = greedy_head.ScreenedArgmax.__call__

    def counting(self, hidden):
        low = hidden.float().to(self.screen_weight.dtype)
        values = torch.nn.functional.linear(low, self.screen_weight).float().topk(self.top, dim=-1).values
        rows.append(len(values))
        flat.append(int((values[:, -1] >= values[:, 0] - 2 * self.margin).sum()))
        return call(self, hidden)

    assert screen is not None
    monkeypatch.setattr(greedy_head.ScreenedArgmax, "__call__", counting)
    assert time_verify_step(engine, batch=4, tokens_per_request=4, context=120, repeats=2, warmup=1) > 0
    assert sum(rows) == 4 * 4 * 3 + 4  # 3 steps of 4 x 4 rows, plus the 4 prefills' last rows
    assert sum(flat) == 0
    assert engine.num_active == 0


def test_a_mixed_step_is_timed_at_its_contexts_and_leaves_no_request(engine, monkeypatch):
    seen = []
    verify = type(engine).verify

    def recording(self, blocks):
        seen.append([(self._requests[b.request_id].num_cached, len(b.tokens)) for b in blocks])
        return verify(self, blocks)

    monkeypatch.setattr(type(engine), "verify", recording)
    assert time_mixed_step(engine, contexts=[40, 300, 90], tokens=[1, 5, 3], repeats=2, warmup=1) > 0
    assert seen[0] == [(40, 0), (300, 4), (90, 2)] and len(seen) == 3
    assert engine.num_active == 0
    with pytest.raises(ValueError, match="one verify length"):
        time_mixed_step(engine, contexts=[40, 300], tokens=[1])
    with pytest.raises(ValueError, match="one verify length"):
        time_mixed_step(engine, contexts=[40], tokens=[engine.config.max_draft_len + 2])


def test_a_prefill_is_timed_with_the_planned_prefix_in_the_cache(engine, monkeypatch):
    cached = TargetEngine(EngineConfig(max_num_seqs=4, max_model_len=256), loaded=engine.target)
    computed = []
    prefill = type(cached)._prefill

    def recording(self, reqs, limits=None):
        computed.extend(len(r.prompt) - r.num_cached for r in reqs)  # the prompt past the reused prefix
        return prefill(self, reqs, limits)

    monkeypatch.setattr(type(cached), "_prefill", recording)
    for shared in (0, 30, 63):
        assert time_prefill(cached, context=64, shared=shared, repeats=2) > 0
    # each call's warm-up puts its shared prefix in the cache (it meets only the previous call's shorter one)
    assert computed == [64, 64, 64] + [64, 34, 34] + [34, 1, 1]
    assert cached.num_active == 0
    with pytest.raises(ValueError, match="prefix caching"):
        time_prefill(engine, context=64, shared=30)
    with pytest.raises(ValueError, match="0 <= shared < context"):
        time_prefill(cached, context=64, shared=64)
