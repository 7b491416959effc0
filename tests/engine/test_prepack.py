"""Prepacked linear layers (app/engine/prepack.py): bfloat16 ones give the same numbers as ``F.linear`` at every row
count, the float32 LM head the same row whatever the row count, and an engine decodes the same tokens and features
with and without them."""

from __future__ import annotations

import pytest
import torch

from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.prepack import PrepackedLinear, prepack_linears, prepack_supported
from app.engine.types import DraftBlock, SamplingParams

needs_prepack = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16),
                                   reason="this CPU or torch build has no oneDNN bfloat16 kernels")


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


@needs_prepack
def test_prepack_linears_replaces_bfloat16_layers_only():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False).bfloat16(), torch.nn.Linear(8, 4))  # 2nd float32
    x = torch.randn(5, 8).bfloat16()
    before = model[0](x)
    assert prepack_linears(model) == 1
    assert isinstance(model[0], PrepackedLinear) and isinstance(model[1], torch.nn.Linear)
    assert torch.equal(model[0](x), before)
    assert prepack_linears(model) == 0  # already packed


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN")
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
    outs = {}
    for name, eng in (("plain", plain), ("packed", packed)):
        firsts = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        blocks = [DraftBlock(f.request_id, torch.tensor(r.token_ids[1 : 1 + i])) for i, (f, r) in
                  enumerate(zip(firsts, a))]
        outs[name] = eng.verify(blocks)
        for f in firsts:
            eng.release(f.request_id)
    for x, y in zip(outs["plain"], outs["packed"]):
        assert x.new_token_ids == y.new_token_ids and torch.equal(x.features, y.features)


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN")
def test_a_float32_model_packs_its_head_only_and_is_not_reported_prepacked(tiny_llama_dir):
    """``prepacked`` says whether the decoder's layers were packed: a float32 model's stay ``nn.Linear`` (only
    bfloat16 layers are packed), while its float32 LM head is packed."""
    engine = TargetEngine(EngineConfig(model=str(tiny_llama_dir), load_format="dummy", device="cpu", dtype="float32",
                                       max_num_seqs=2, max_model_len=128))
    assert not engine.prepacked
    assert isinstance(engine.model.layers[0].gate_up, torch.nn.Linear)
    assert isinstance(engine.model.lm_head, PrepackedLinear)
