"""``attention: flash``: a token-major KV cache; steps of one token per request attend by FlashAttention-2's
variable-length kernel (one call, no mask), longer runs by SDPA over transposed views of the cache. The kernel runs on
CUDA only (tests/gpu checks it there against SDPA); here its layouts and the cache's
token-major writes are checked on the CPU by running the engine with ``flash_varlen`` replaced by its reference
(``varlen_attention_math``: each request over its own ``key_lens`` keys, causal from the bottom right): greedy
speculation (ragged and bucketed steps) must give the tokens of the SDPA engine, which a key offset, a length or a
write in the wrong place would change.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import app.engine.engine as engine_module
import app.engine.model as model_module
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.model import (PROBE_TOLERANCE, KVCache, StepLayout, flash_varlen_problem, varlen_attention_math,
                              varlen_probe_error)
from app.engine.types import SamplingParams
from app.loop import generate
from tests.conftest import load_prompts
from tests.engine.chi2 import check_outputs_follow_joint, check_three_token_joint_under_speculation, exact_joint
from tests.engine.proposers import check_greedy_speculation

RAGGED = [0, 1, 3, 5, 7, 2]
GREEDY = SamplingParams(max_tokens=32)


def test_varlen_layouts_name_each_requests_queries_and_keys():
    """Steps of single tokens over a token-major cache attend by one flash_varlen call; longer runs by SDPA calls."""
    layout = StepLayout.build(slots=[5, 0, 2], starts=[10, 3, 0], lengths=[1, 1, 1], groups=3,
                              device=torch.device("cpu"), dtype=torch.float32, slot_len=64)
    v = layout.varlen
    assert layout.calls == () and v.cu_queries.tolist() == [0, 1, 2, 3]
    assert v.key_offsets.tolist()[:3] == [320, 0, 128] and v.key_lens.tolist() == [11, 4, 1]
    assert (v.max_queries, v.max_keys) == (1, 11)
    assert layout.positions.tolist() == [10, 3, 0] and layout.token_slots.tolist() == [5, 0, 2]
    longer = StepLayout.build(slots=[5, 0, 2], starts=[10, 3, 0], lengths=[2, 4, 1], groups=3,
                              device=torch.device("cpu"), dtype=torch.float32, slot_len=64)
    assert longer.varlen is None and len(longer.calls) >= 1
    grid = StepLayout.grid(torch.tensor([7, 0, 30]), tokens=1, key_len=128, groups=3, dtype=torch.float32,
                           slot_len=64)
    assert grid.varlen.cu_queries.tolist() == [0, 1, 2, 3] and grid.varlen.key_offsets.tolist() == [0, 64, 128, 192]
    assert grid.varlen.key_lens.tolist() == [8, 1, 31] and grid.varlen.max_keys == 129
    assert grid.positions.tolist() == [7, 0, 30]
    # a row outside the step starts at its slot's tail, past key_len: it reads its first key only
    tail = StepLayout.grid(torch.tensor([7, 63]), tokens=1, key_len=16, groups=3, dtype=torch.float32, slot_len=64)
    assert tail.varlen.key_lens.tolist() == [8, 1] and tail.varlen.max_keys == 17
    with pytest.raises(ValueError, match="at least one token"):
        StepLayout.build(slots=[0, 1], starts=[3, 4], lengths=[1, 0], groups=3, device=torch.device("cpu"),
                         dtype=torch.float32, slot_len=64)
    wide = StepLayout.grid(torch.tensor([7, 0, 30]), tokens=2, key_len=128, groups=3, dtype=torch.float32,
                           slot_len=64)
    assert wide.varlen is None and wide.calls[0].mask.shape == (3, 1, 6, 128)


def test_the_start_up_probe_catches_a_kernel_that_drops_keys(engine):
    """``varlen_probe_error``: the math reference agrees; a kernel that reads one key block (128 keys) fewer for the
    request over 700 keys, or offsets one request's keys by a slot, misses the tolerance."""
    args, cpu = engine.model.args, torch.device("cpu")
    assert varlen_probe_error(args, device=cpu, dtype=torch.bfloat16, kernel=varlen_attention_math) < PROBE_TOLERANCE

    def short(q, keys, values, varlen):
        lens = varlen.key_lens.clone()
        lens[0] -= 128
        return varlen_attention_math(q, keys, values, replace(varlen, key_lens=lens))

    def shifted(q, keys, values, varlen):
        offsets = varlen.key_offsets.clone()
        offsets[2] -= 1024
        return varlen_attention_math(q, keys, values, replace(varlen, key_offsets=offsets))

    for wrong in (short, shifted):
        assert varlen_probe_error(args, device=cpu, dtype=torch.bfloat16, kernel=wrong) > PROBE_TOLERANCE


def test_token_major_cache_shape_and_flash_refused_off_cuda(engine):
    args = engine.model.args
    cache = KVCache(args, num_slots=3, max_len=40, dtype=torch.float32, device="cpu", token_major=True)
    assert cache.k.shape == (args.num_layers, 3, 40, args.num_kv_heads, args.head_dim)
    assert (cache.num_slots, cache.max_len, cache.slot_len) == (3, 40, 40)
    assert KVCache(args, num_slots=3, max_len=40, dtype=torch.float32, device="cpu").slot_len is None
    assert "needs CUDA" in flash_varlen_problem(args, device=torch.device("cpu"), dtype=torch.bfloat16)
    if engine.device.type != "cpu":
        pytest.skip("the refusal is a CPU's (tests/gpu checks flash on CUDA)")
    assert engine.attention == "sdpa"  # auto on a CPU
    with pytest.raises(ValueError, match="attention 'flash' cannot run here: .*needs CUDA"):
        TargetEngine(EngineConfig(attention="flash", max_num_seqs=2, max_model_len=256), loaded=engine.target)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    texts = load_prompts("mt-bench", count=2) + load_prompts("humaneval", count=2) + load_prompts(
        "gsm8k", start=700, count=2)
    return [engine.encode_chat([{"role": "user", "content": p}]) for p in texts]


@pytest.mark.parametrize("step", ["ragged", "bucketed"])
def test_token_major_steps_decode_as_the_sdpa_engine(engine, prompts, step, monkeypatch):
    if engine.device.type != "cpu":
        pytest.skip("the reference kernel stands in for FlashAttention on a CPU (tests/gpu runs the kernel)")
    config = EngineConfig(max_num_seqs=8, max_model_len=512, verify_step=step, enable_prefix_caching=False)  # as engine
    sdpa = TargetEngine(config, loaded=engine.target)
    reference = [r.token_ids for r in generate(sdpa, prompts, GREEDY)[0]]
    monkeypatch.setattr(engine_module, "flash_varlen_problem", lambda *a, **k: None)
    monkeypatch.setattr(model_module, "flash_varlen", varlen_attention_math)
    varlen = TargetEngine(config.model_copy(update={"attention": "flash"}), loaded=engine.target)
    assert varlen.attention == "flash" and varlen.cache.token_major
    check_greedy_speculation(varlen, prompts, reference, GREEDY, RAGGED)
    assert varlen.num_active == 0


@pytest.fixture
def token_major(engine32, monkeypatch):
    """A token-major engine of 24 slots on the float32 target (tests/conftest.py ``engine32``: sampled distributions
    against an exact joint), ``varlen_attention_math`` standing in for the kernel."""
    if engine32.device.type != "cpu":
        pytest.skip("the reference kernel stands in for FlashAttention on a CPU (tests/gpu runs the kernel)")
    monkeypatch.setattr(engine_module, "flash_varlen_problem", lambda *a, **k: None)
    monkeypatch.setattr(model_module, "flash_varlen", varlen_attention_math)
    return TargetEngine(EngineConfig(max_num_seqs=24, max_model_len=512, attention="flash"), loaded=engine32.target)


@pytest.mark.parametrize("rule", ["rejection", "seeded-coupling"])
def test_token_major_sampled_speculation_keeps_the_target_distribution(token_major, rule):
    """Sampled verify steps (runs of 2: SDPA over the token-major cache's views), both accept rules, with top_p."""
    prompt = token_major.encode("la la la la la la la")
    base = dict(max_tokens=3, temperature=1.0, min_p=0.1, top_p=0.9, ignore_eos=True)
    n = 480
    params = [SamplingParams(**base, seed=i if rule == "seeded-coupling" else None) for i in range(n)]
    check_three_token_joint_under_speculation(token_major, prompt, params, n)


def test_token_major_plain_sampled_decoding_keeps_the_target_distribution(token_major, monkeypatch):
    """Plain sampled decoding: every step after prefill brings one token per request, the variable-length call."""
    prompt = token_major.encode("la la la la la la la")
    params = SamplingParams(max_tokens=3, temperature=1.0, min_p=0.1, top_p=0.9, ignore_eos=True)
    calls = []
    monkeypatch.setattr(model_module, "flash_varlen", lambda *args: calls.append(1) or varlen_attention_math(*args))
    results, _ = generate(token_major, [prompt] * 480, params)
    assert calls  # the single-token steps went through the variable-length call
    check_outputs_follow_joint(results, exact_joint(token_major, prompt, params, depth=3))
