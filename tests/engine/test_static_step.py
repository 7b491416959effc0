"""Bucketed verify steps (``verify_step: bucketed``, app/engine/static_step.py) are lossless: padding rows and tokens
change no request's logits nor any committed cache entry; greedy output is token-identical to plain decoding;
sampled output keeps the target's distribution (rejection sampling and the seeded coupling, with top_p).

The engines here share the session ``engine``'s weights (tests/conftest.py), each with its own KV cache.
"""

from __future__ import annotations

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.model import Elementwise, compile_problem
from app.engine.static_step import bucket_sizes, ceil_bucket, key_buckets
from app.engine.types import NewRequest, SamplingParams
from app.loop import generate
from tests.conftest import load_prompts
from tests.engine.chi2 import check_three_token_joint_under_speculation
from tests.engine.proposers import check_greedy_speculation

RAGGED = [0, 1, 3, 5, 7, 2]  # per-request draft lengths sharing one batch, plain decoding included
GREEDY = SamplingParams(max_tokens=40)


def test_buckets_cover_every_size_up_to_their_limit():
    assert bucket_sizes(1) == [1] and bucket_sizes(9) == [1, 2, 4, 8, 9] and bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert key_buckets(2048) == [128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert key_buckets(1000) == [128, 192, 256, 384, 512, 768, 1000] and key_buckets(64) == [64]
    sizes = key_buckets(131072)
    assert all(1 < b / a <= 1.5 for a, b in zip(sizes, sizes[1:]))
    assert [ceil_bucket(n, [1, 2, 4, 8, 9]) for n in (1, 3, 4, 5, 9)] == [1, 4, 4, 8, 9]
    with pytest.raises(ValueError, match="10 exceeds the largest bucket 9"):
        ceil_bucket(10, [1, 2, 4, 8, 9])


def test_config_rejects_bucketed_steps_with_batch_invariance_and_graphs_off_cuda(engine):
    with pytest.raises(ValueError, match="verify_step 'bucketed' needs verify_step 'ragged'"):
        EngineConfig(batch_invariant=True, verify_step="bucketed")
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device, the engine runs on cpu"):
        TargetEngine(EngineConfig(device="cpu", verify_step="cuda_graphs", max_num_seqs=2, max_model_len=256),
                     loaded=engine.target)
    with pytest.raises(ValueError, match="compile_elementwise cannot run here: compiled elementwise kernels need a "
                                         "CUDA device, the engine runs on cpu"):
        TargetEngine(EngineConfig(device="cpu", compile_elementwise=True, max_num_seqs=2, max_model_len=256),
                     loaded=engine.target)


def test_compile_elementwise_by_default_where_triton_runs(engine, monkeypatch):
    """``compile_elementwise: None`` resolves to compiled kernels where ``compile_problem`` (checks and a probe) names
    no problem, to eager ones otherwise (the reason logged on CUDA), and stays off on a CPU, where the check says why;
    ``true`` where it cannot run is an error."""
    import app.engine.engine as engine_module

    assert engine.config.compile_elementwise is None and engine.compile_elementwise is False
    assert Elementwise.compiled() is Elementwise.compiled()  # one compilation a process, shared by its engines
    assert "need a CUDA device" in compile_problem(Elementwise.compiled(), engine.model.args,
                                                   device=torch.device("cpu"), dtype=torch.bfloat16)
    config = EngineConfig(device="cpu", max_num_seqs=2, max_model_len=256)
    monkeypatch.setattr(engine_module, "compile_problem", lambda *a, **k: None)
    assert TargetEngine(config, loaded=engine.target).compile_elementwise is True
    assert TargetEngine(config.model_copy(update={"compile_elementwise": False}),
                        loaded=engine.target).compile_elementwise is False
    monkeypatch.setattr(engine_module, "compile_problem", lambda *a, **k: "the triton package is not installed")
    assert TargetEngine(config, loaded=engine.target).compile_elementwise is False
    with pytest.raises(ValueError, match="compile_elementwise cannot run here: the triton package is not installed"):
        TargetEngine(config.model_copy(update={"compile_elementwise": True}), loaded=engine.target)


@pytest.fixture(scope="module")
def bucketed(engine):
    """Prefix caching off, as ``engine`` (tests/conftest.py): greedy runs are compared token for token."""
    return TargetEngine(EngineConfig(max_num_seqs=24, max_model_len=512, verify_step="bucketed",
                                     enable_prefix_caching=False), loaded=engine.target)


@pytest.fixture(scope="module")
def bucketed32(engine32):
    """Bucketed steps on the float32 target (tests/conftest.py ``engine32``: sampled distributions against an exact
    joint)."""
    return TargetEngine(EngineConfig(max_num_seqs=24, max_model_len=512, verify_step="bucketed"),
                        loaded=engine32.target)


@pytest.fixture(scope="module")
def ragged(engine):
    return TargetEngine(EngineConfig(max_num_seqs=8, max_model_len=512, enable_prefix_caching=False),
                        loaded=engine.target)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    texts = load_prompts("mt-bench", count=2) + load_prompts("humaneval", count=2) + load_prompts(
        "gsm8k", start=700, count=2)
    return [engine.encode_chat([{"role": "user", "content": p}]) for p in texts]


def test_padding_changes_no_real_row_and_no_committed_cache(bucketed, prompts):
    """Six requests in slots 0-5; slots 1 and 4 freed, slot 2 active but outside the step: the step's grid has 8
    rows, padding rows among them, and runs of 1-6 tokens padded to 8. The same step with other padding (other
    token ids, rows outside the step written elsewhere) gives bit-identical hidden states and features on the real
    rows, and slot 2's cached keys/values are untouched."""
    bucketed.add_requests([NewRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    bucketed.release("r1")
    bucketed.release("r4")
    step = bucketed._bucketed
    reqs = [bucketed._requests[r] for r in ("r0", "r3", "r5")]
    held = bucketed._requests["r2"]
    committed = tuple(t.clone() for t in bucketed.cache.slot_tokens(held.slot, held.num_cached))
    gen = torch.Generator().manual_seed(0)
    runs = [torch.cat([torch.tensor([r.pending]), torch.randint(bucketed.vocab_size, (n,), generator=gen)])
            for r, n in zip(reqs, (0, 5, 2))]
    rows, width, key_len = step.shape(rows=6, tokens=6, keys=max(r.num_cached + len(t) for r, t in zip(reqs, runs)))
    assert (rows, width) == (8, 8) and key_len < bucketed.cache.max_len
    outputs = []
    for pad, outside in ((0, bucketed.cache.max_len - width), (bucketed.vocab_size - 1, 100)):
        grid = torch.full((rows, width), pad, dtype=torch.long)
        starts = torch.full((rows,), outside, dtype=torch.long)
        starts[held.slot] = held.num_cached  # outside the step: any position at or past its cached tokens
        index = []
        for r, run in zip(reqs, runs):
            grid[r.slot, : len(run)] = run
            starts[r.slot] = r.num_cached
            index += range(r.slot * width, r.slot * width + len(run))
        with torch.inference_mode():
            hidden, features = step._run(grid, starts, key_len)
            outputs.append((hidden[index].clone(), features[index].clone()))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    keys, values = bucketed.cache.slot_tokens(held.slot, held.num_cached)
    assert torch.equal(keys, committed[0]) and torch.equal(values, committed[1])
    for rid in ("r0", "r2", "r3", "r5"):
        bucketed.release(rid)


def test_bucketed_greedy_speculation_is_token_identical(bucketed, ragged, prompts):
    reference = [r.token_ids for r in generate(ragged, prompts, GREEDY)[0]]
    check_greedy_speculation(bucketed, prompts, reference, GREEDY, RAGGED)
    assert bucketed.num_active == 0


@pytest.mark.parametrize("rule", ["rejection", "seeded-coupling"])
def test_bucketed_sampled_speculation_keeps_the_target_distribution(bucketed32, rule):
    prompt = bucketed32.encode("la la la la la la la")
    base = dict(max_tokens=3, temperature=1.0, min_p=0.1, top_p=0.9, ignore_eos=True)  # min_p bounds the exact joint
    n = 480
    params = [SamplingParams(**base, seed=i if rule == "seeded-coupling" else None) for i in range(n)]
    check_three_token_joint_under_speculation(bucketed32, prompt, params, n)

