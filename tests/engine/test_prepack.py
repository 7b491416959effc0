"""Prepacked linear layers (app/engine/prepack.py): bfloat16 ones give the same numbers as ``F.linear`` at every row
count, float32 ones the same row whatever the row count (the LM head from one row, decoder layers from two), and an
engine decodes the same tokens and features with and without them (float32: up to near-ties)."""

from __future__ import annotations

import pytest
import torch

from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.prepack import PrepackedLinear, prepack_linears, prepack_supported
from app.engine.types import DraftBlock, SamplingParams
from tests.engine.near_tie import check_same_or_near_tie

needs_prepack = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16),
                                   reason="this CPU or torch build has no oneDNN bfloat16 kernels")


def ragged_verify_step(engine, prompts: list[list[int]], results, params) -> list:
    """The outputs of one verify step over ``prompts`` (added fresh, released after) where request i drafts the
    next i tokens of ``results[i]`` (0, 1, 2, ...: a ragged step)."""
    firsts = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    blocks = [DraftBlock(f.request_id, torch.tensor(r.token_ids[1 : 1 + i])) for i, (f, r) in enumerate(zip(firsts,
                                                                                                      results))]
    outs = engine.verify(blocks)
    for f in firsts:
        engine.release(f.request_id)
    return outs


@needs_prepack
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_is_f_linear_bit_for_bit(out_features, in_features, bias):
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = (0.05 * torch.randn(out_features, in_features, generator=gen)).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    layer = PrepackedLinear(weight, b)
    x = torch.randn(64, in_features, generator=gen).bfloat16()
    for rows in (1, 3, 8, 16, 64):  # oneDNN picks its kernel by row count: each must match F.linear's choice
        assert torch.equal(layer(x[:rows]), torch.nn.functional.linear(x[:rows], weight, b))
    assert layer(x[:6].view(2, 3, in_features)).shape == (2, 3, out_features)


needs_float32_prepack = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32),
                                           reason="this torch build has no oneDNN")


@needs_float32_prepack
def test_prepack_linears_replaces_the_layers_it_can_pack():
    """float32 layers always (oneDNN), bfloat16 ones where oneDNN has bfloat16 kernels, half precision never."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False).bfloat16(), torch.nn.Linear(8, 4),
                                torch.nn.Linear(4, 4).half())
    x = torch.randn(5, 8)
    before = model[0](x.bfloat16()), model[1](x)
    bf16 = prepack_supported(torch.device("cpu"), torch.bfloat16)
    assert prepack_linears(model) == 1 + bf16
    assert isinstance(model[0], PrepackedLinear) == bf16 and isinstance(model[1], PrepackedLinear)
    assert type(model[2]) is torch.nn.Linear
    assert torch.equal(model[0](x.bfloat16()), before[0])
    torch.testing.assert_close(model[1](x), before[1], rtol=0, atol=1e-5)
    assert prepack_linears(model) == 0  # already packed


@needs_float32_prepack
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 576), (3072, 576), (576, 1536)])
def test_prepacked_float32_layer_rows_do_not_depend_on_the_row_count(out_features, in_features):
    """The decoder's layer shapes, with a bias: a row is the same at every row count from two up and within float32
    rounding of ``F.linear``'s (alone too: a one-row call may take another kernel, module docstring of prepack.py)."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = 0.05 * torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    layer = PrepackedLinear(weight, bias)
    x = torch.randn(64, in_features, generator=gen)
    torch.testing.assert_close(layer(x[:1]), torch.nn.functional.linear(x[:1], weight, bias), rtol=0, atol=1e-5)
    pair = layer(x[:2])[0]
    for rows in (3, 8, 9, 16, 64):
        out = layer(x[:rows])
        assert torch.equal(out[0], pair)
        torch.testing.assert_close(out, torch.nn.functional.linear(x[:rows], weight, bias), rtol=0, atol=1e-5)


@needs_float32_prepack
def test_prepacked_float32_head_rows_do_not_depend_on_the_row_count():
    """The LM head's shape: F.linear's float32 rows change in the last bits with the number of rows in the call; the
    packed head's do not, and stay within float32 rounding of F.linear's."""
    gen = torch.Generator().manual_seed(0)
    weight = 0.05 * torch.randn(49152, 576, generator=gen)
    head = PrepackedLinear(weight, keep_weight=True)
    assert head.weight.data_ptr() == weight.data_ptr()  # the same storage, not a copy
    x = torch.randn(64, 576, generator=gen)
    alone = head(x[:1])[0]
    for rows in (2, 3, 8, 9, 16, 64):
        out = head(x[:rows])
        assert torch.equal(out[0], alone)
        torch.testing.assert_close(out, torch.nn.functional.linear(x[:rows], weight), rtol=0, atol=1e-4)
    assert head(x[:0]).shape == (0, 49152)


def test_weights_that_cannot_be_prepacked_are_rejected():
    with pytest.raises(ValueError, match="cannot prepack"):
        PrepackedLinear(torch.zeros(4, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="cannot prepack"):
        PrepackedLinear(torch.zeros(4))


@needs_prepack
def test_engine_decodes_the_same_tokens_and_features_prepacked(eval_prompts):
    plain = TargetEngine(EngineConfig(max_num_seqs=4, max_model_len=1024, prepack=False))
    packed = TargetEngine(EngineConfig(max_num_seqs=4, max_model_len=1024, prepack=True))
    assert not plain.prepacked and packed.prepacked
    assert isinstance(packed.model.layers[0].gate_up, PrepackedLinear)
    assert isinstance(packed.model.lm_head, PrepackedLinear) and not isinstance(plain.model.lm_head, PrepackedLinear)
    prompts = [plain.encode_chat([{"role": "user", "content": p}]) for p in eval_prompts[:3]]
    params = SamplingParams(max_tokens=24)
    a, _ = generate(plain, prompts, params)
    b, _ = generate(packed, prompts, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    # One ragged verify step with drafts: the target's features (the drafter's input) are equal bit for bit.
    outs = {name: ragged_verify_step(eng, prompts, a, params) for name, eng in (("plain", plain), ("packed", packed))}
    for x, y in zip(outs["plain"], outs["packed"]):
        assert x.new_token_ids == y.new_token_ids and torch.equal(x.features, y.features)


@needs_float32_prepack
def test_a_float32_engine_packs_its_layers_and_decodes_the_same_tokens(eval_prompts):
    """A float32 target packs its decoder layers and its head, and greedy decoding gives ``prepack=False``'s tokens up
    to near-ties (the packed float32 kernel sums in another order); so do one ragged verify step's features, within
    float32 rounding."""
    plain = TargetEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=1024, prepack=False))
    packed = TargetEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=1024, prepack=True))
    assert packed.prepacked and not plain.prepacked
    assert isinstance(packed.model.layers[0].gate_up, PrepackedLinear) and isinstance(packed.model.lm_head,
                                                                                      PrepackedLinear)
    assert type(plain.model.layers[0].gate_up) is torch.nn.Linear
    prompts = [plain.encode_chat([{"role": "user", "content": p}]) for p in eval_prompts[:3]]
    params = SamplingParams(max_tokens=24)
    a, _ = generate(plain, prompts, params)
    b, _ = generate(packed, prompts, params)
    for prompt, x, y in zip(prompts, a, b):
        check_same_or_near_tie(plain, prompt, x.token_ids, y.token_ids)
    outs = {name: ragged_verify_step(eng, prompts, a, params) for name, eng in (("plain", plain), ("packed", packed))}
    for x, y in zip(outs["plain"], outs["packed"]):
        torch.testing.assert_close(x.features, y.features, rtol=1e-3, atol=1e-3)
