"""The screened greedy head (app/engine/greedy_head.py): the argmax of the exact logits, on the real target and on
constructed rows where the half-precision screen alone would pick wrong or cannot decide."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.greedy_head import ScreenedArgmax
from app.engine.near_tie import teacher_forced_hidden
from app.engine.types import SamplingParams


def final_hidden(engine, token_ids: list[int]) -> torch.Tensor:
    """[T, Dm] normed final hidden states of the target over ``token_ids`` (the LM head's input)."""
    with torch.inference_mode():
        return engine.model.final_norm(teacher_forced_hidden(engine, token_ids))


def test_screened_tokens_are_the_float32_heads_argmax_on_the_real_target(bf16_engine, eval_prompts):
    engine = bf16_engine
    assert engine._screen is not None  # CPU, bfloat16 model, float32 head: the engine screens
    h = torch.cat([final_hidden(engine, engine.encode_chat([{"role": "user", "content": p}]))
                   for p in eval_prompts[::4]])
    with torch.inference_mode():
        exact = torch.nn.functional.linear(h.double(), engine.model.lm_head.weight.double()).argmax(-1)
        assert torch.equal(engine._screen(h), exact)


def test_rescoring_decides_what_the_screen_rounds_to_a_tie():
    weight = torch.zeros(4, 2)
    weight[0, 0], weight[1, 0] = 1.0, 1.0 + 2**-10  # equal in bfloat16, token 1 larger exactly
    weight[2, 1] = 1.0
    head = ScreenedArgmax(weight, weight.bfloat16(), top=3, margin=0.5)
    assert head.screen_weight[0].equal(head.screen_weight[1])
    assert head(torch.tensor([[4.0, 0.0], [0.0, 4.0]])).tolist() == [1, 2]


def test_exact_ties_go_to_the_smallest_token_id_and_no_rows_give_no_tokens():
    """Two identical head rows tie exactly: the screen picks the smaller token id, as the full head's argmax does,
    whichever of the two its top-k listed first; an empty batch gives an empty result."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 16, generator=gen) * 0.1
    weight[4000] = weight[10] = torch.full((16,), 1.0)
    screen = weight.bfloat16()
    screen[4000] += 0.0625  # the screen lists token 4000 first
    head = ScreenedArgmax(weight, screen, top=8, margin=0.5)
    h = torch.ones(2, 16)
    assert head(h).tolist() == [10, 10] == torch.nn.functional.linear(h, weight).argmax(-1).tolist()
    assert head(torch.zeros(0, 16)).shape == (0,)


def full_head_rows(monkeypatch) -> list[int]:
    """Rows passed through the full float32 head by ``ScreenedArgmax`` from now on (recorded)."""
    import app.engine.greedy_head as greedy_head

    rows, linear = [], torch.nn.functional.linear

    def recording(x, weight, *args):
        if weight.dtype == torch.float32:
            rows.append(x.shape[0])
        return linear(x, weight, *args)

    monkeypatch.setattr(greedy_head, "F", SimpleNamespace(linear=recording))
    return rows


def test_a_row_flat_over_top_is_screened_wider_before_the_full_head(monkeypatch):
    """Row 0 has 20 tokens within the margin of its best (flat over top = 5, decided over wide_top = 40), row 1 a
    clear winner: both get the exact argmax and the full head is never run."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.zeros(100, 8)
    weight[:20, 0] = 1.0 + 1e-2 * torch.randn(20, generator=gen)  # 20 near-equal logits for h = e_0
    weight[50, 1] = 3.0
    head = ScreenedArgmax(weight, weight.bfloat16(), top=5, wide_top=40, margin=1.0)
    h = torch.tensor([[4.0] + [0.0] * 7, [0.0, 4.0] + [0.0] * 6])
    used = full_head_rows(monkeypatch)
    assert head(h).tolist() == torch.nn.functional.linear(h.double(), weight.double()).argmax(-1).tolist()
    assert used == []


def test_a_row_the_screen_cannot_narrow_falls_back_to_the_full_head(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    weight = 1.0 + 1e-3 * torch.randn(100, 8, generator=gen)  # every logit within the margin of the best
    head = ScreenedArgmax(weight, weight.bfloat16(), top=5, wide_top=40, margin=1.0)
    h = torch.ones(3, 8)
    used = full_head_rows(monkeypatch)
    assert torch.equal(head(h), torch.nn.functional.linear(h, weight).argmax(-1))
    assert used == [3]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="float32"):
        ScreenedArgmax(torch.zeros(4, 2).bfloat16(), torch.zeros(4, 2).bfloat16())
    with pytest.raises(ValueError, match="top"):
        ScreenedArgmax(torch.zeros(4, 2), torch.zeros(4, 2).bfloat16(), top=0)
    with pytest.raises(ValueError, match="1 <= top <= wide_top"):
        ScreenedArgmax(torch.zeros(4, 2), torch.zeros(4, 2).bfloat16(), top=8, wide_top=4)


def test_greedy_decoding_is_the_same_with_and_without_the_screen(bf16_engine, eval_prompts):
    engine = bf16_engine
    assert engine._screen is not None
    plain = TargetEngine(EngineConfig(dtype="bfloat16", max_num_seqs=4, max_model_len=1024, greedy_screen=False,
                                      enable_prefix_caching=False))
    assert plain._screen is None
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in eval_prompts[:3]]
    params = SamplingParams(max_tokens=24)
    screened, _ = generate(engine, prompts, params)
    full, _ = generate(plain, prompts, params)
    assert [r.token_ids for r in screened] == [r.token_ids for r in full]
