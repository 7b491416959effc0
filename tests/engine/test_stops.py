"""EOS, stop strings and max_tokens end a request exactly, also inside an accepted draft block, and as plain decoding
ends it under any drafts (ignore_eos, stop strings with min_tokens, greedy and seeded)."""

from __future__ import annotations

import pytest
import torch

from app.loop import generate
from app.engine.types import DraftBlock, FinishReason, SamplingParams
from tests.engine.near_tie import check_greedy_output, check_seeded_same_or_near_tie
from tests.engine.proposers import OracleProposer, RandomProposer

SHORT_QUESTION = "What is 2+3? Answer with the number only."


@pytest.fixture(scope="module")
def short(engine):
    """A prompt whose greedy answer ends with EOS within a few tokens, and that answer."""
    prompt = engine.encode_chat([{"role": "user", "content": SHORT_QUESTION}])
    (res,), _ = generate(engine, [prompt], SamplingParams(max_tokens=32))
    assert res.finish_reason == FinishReason.STOP and res.token_ids[-1] in engine.eos_token_ids
    assert len(res.token_ids) <= 12
    return prompt, res


def _continue_past_eos(engine, prompt, answer: list[int], extra: int) -> list[int]:
    """The answer plus ``extra`` greedy tokens the target would emit after EOS (drafts beyond the end)."""
    (res,), _ = generate(engine, [prompt + answer], SamplingParams(max_tokens=extra, ignore_eos=True))
    return answer + res.token_ids


def test_eos_inside_accepted_block_ends_exactly(engine, short):
    prompt, res = short
    reference = _continue_past_eos(engine, prompt, res.token_ids, extra=8)
    proposer = OracleProposer({"req-0": reference}, gamma=7)
    (spec,), _ = generate(engine, [prompt], SamplingParams(max_tokens=32), proposer=proposer)
    assert spec.token_ids == res.token_ids
    assert spec.finish_reason == FinishReason.STOP and spec.stop_reason is None  # EOS: no stop_reason (vLLM's)
    # The block ran past EOS, but nothing after EOS is returned or counted as accepted:
    # Every round but the last committed its accepted drafts plus a bonus token; the last ends on the accepted
    # EOS draft with no bonus. So the prefill token + one bonus per earlier round are the only non-drafts.
    assert spec.num_accepted == len(res.token_ids) - 1 - (spec.rounds - 1)
    assert spec.text == res.text


def test_ignore_eos_generates_through_it(engine, short):
    prompt, res = short
    (out,), _ = generate(engine, [prompt], SamplingParams(max_tokens=len(res.token_ids) + 3, ignore_eos=True))
    assert out.token_ids[: len(res.token_ids)] == res.token_ids
    assert len(out.token_ids) == len(res.token_ids) + 3 and out.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_inside_accepted_block(engine, short, max_tokens):
    prompt, res = short
    reference = _continue_past_eos(engine, prompt, res.token_ids, extra=8)
    proposer = OracleProposer({"req-0": reference}, gamma=7)
    (spec,), _ = generate(engine, [prompt], SamplingParams(max_tokens=max_tokens), proposer=proposer)
    assert spec.token_ids == res.token_ids[:max_tokens]
    assert spec.finish_reason == FinishReason.LENGTH and spec.stop_reason is None
    assert spec.num_accepted <= max_tokens - 1


def test_stop_string_inside_accepted_block(engine, eval_prompts):
    prompt = engine.encode_chat([{"role": "user", "content": eval_prompts[-1]}])
    (ref,), _ = generate(engine, [prompt], SamplingParams(max_tokens=40))
    # A stop string from the middle of the reference text, spanning a token boundary if possible.
    cut = len(ref.text) // 2
    stop = ref.text[cut : cut + 6]
    assert stop.strip(), "reference text too short for the test"
    proposer = OracleProposer({"req-0": ref.token_ids}, gamma=7)
    params = SamplingParams(max_tokens=40, stop=(stop,))
    (spec,), _ = generate(engine, [prompt], params, proposer=proposer)
    assert spec.text == ref.text[: ref.text.index(stop)]
    assert spec.finish_reason == FinishReason.STOP and spec.stop_reason == stop
    assert len(spec.token_ids) < len(ref.token_ids)
    # The stop string was completed by the last returned token, not earlier.
    partial = engine.tokenizer.decode(spec.token_ids[:-1], skip_special_tokens=True)
    assert stop not in partial and stop in engine.tokenizer.decode(spec.token_ids, skip_special_tokens=True)
    # include_stop_str_in_output (vLLM's): the same tokens, the text through the stop string
    kept_params = SamplingParams(max_tokens=40, stop=(stop,), include_stop_str_in_output=True)
    (kept,), _ = generate(engine, [prompt], kept_params, proposer=OracleProposer({"req-0": ref.token_ids}, gamma=7))
    assert kept.token_ids == spec.token_ids and kept.text == ref.text[: ref.text.index(stop) + len(stop)]


def test_the_token_that_ends_a_request_has_no_text_unless_asked(engine, short, eval_prompts):
    """vLLM's rule: EOS and a stop token id end the output's ids but add no text, unless
    ``include_stop_str_in_output``; ``skip_special_tokens`` False shows a special token's text (EOS's then). The
    tokens are the same every way, with drafts too."""
    prompt, res = short
    eos_text = engine.tokenizer.decode(res.token_ids[-1:])
    for skip, include, text in ((True, False, res.text), (False, False, res.text), (True, True, res.text),
                                (False, True, res.text + eos_text)):
        params = SamplingParams(max_tokens=32, skip_special_tokens=skip, include_stop_str_in_output=include)
        (out,), _ = generate(engine, [prompt], params, proposer=OracleProposer({"req-0": res.token_ids}, gamma=7))
        assert (out.token_ids, out.text) == (res.token_ids, text) and out.num_accepted > 0, (skip, include)
    assert eos_text == "<|im_end|>"
    # vLLM looks for EOS before stop_token_ids: EOS listed there too gives no stop_reason, unless EOS is ignored
    eos = res.token_ids[-1]
    for ignore_eos, reason in ((False, None), (True, eos)):
        params = SamplingParams(max_tokens=32, stop_token_ids=(eos,), ignore_eos=ignore_eos)
        (out,), _ = generate(engine, [prompt], params, proposer=OracleProposer({"req-0": res.token_ids}, gamma=7))
        assert (out.token_ids, out.stop_reason) == (res.token_ids, reason), ignore_eos
    long_prompt = engine.encode_chat([{"role": "user", "content": eval_prompts[1]}])
    (ref,), _ = generate(engine, [long_prompt], SamplingParams(max_tokens=12))
    stop = ref.token_ids[5]
    end = ref.token_ids.index(stop) + 1
    for include in (False, True):
        params = SamplingParams(max_tokens=12, stop_token_ids=(stop,), include_stop_str_in_output=include)
        (out,), _ = generate(engine, [long_prompt], params)
        assert out.token_ids == ref.token_ids[:end] and out.finish_reason == FinishReason.STOP
        assert out.stop_reason == stop
        assert out.text == engine.tokenizer.decode(ref.token_ids[: end if include else end - 1])


def test_streamed_text_concatenates_to_final_text(engine, eval_prompts):
    prompt = engine.encode_chat([{"role": "user", "content": eval_prompts[1]}])
    (ref,), _ = generate(engine, [prompt], SamplingParams(max_tokens=30))
    stop = ref.text[len(ref.text) * 2 // 3 :][:4]
    first = engine.add_request("stream", prompt, SamplingParams(max_tokens=30, stop=(stop,)))
    pieces, out = [first.text], first
    while not out.finished:
        (out,) = engine.verify([DraftBlock("stream", torch.zeros(0, dtype=torch.long))])
        pieces.append(out.text)
        assert stop not in "".join(pieces)
    assert "".join(pieces) == ref.text[: ref.text.index(stop)]


def test_ignore_eos_with_drafts_past_eos_matches_plain(engine, short):
    """With ``ignore_eos`` an accepted EOS draft does not end the request: drafts running through EOS give plain
    decoding's tokens (the target's own continuation past EOS, drafted in full blocks)."""
    prompt, res = short
    params = SamplingParams(max_tokens=len(res.token_ids) + 6, ignore_eos=True)
    (plain,), _ = generate(engine, [prompt], params)
    proposer = OracleProposer({"req-0": plain.token_ids}, gamma=7)
    (spec,), _ = generate(engine, [prompt], params, proposer=proposer)
    check_greedy_output(engine, prompt, plain.token_ids, spec.token_ids)
    assert spec.num_accepted > 0 and plain.token_ids[len(res.token_ids) - 1] in engine.eos_token_ids
    assert spec.finish_reason == FinishReason.LENGTH and len(spec.token_ids) == params.max_tokens


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_stop_string_and_min_tokens_under_random_and_perfect_drafts(engine, eval_prompts, sampling):
    """A stop string, alone and with ``min_tokens`` past its first occurrence, ends a request where plain decoding
    ends it, whatever the drafts (random: rejected; perfect: accepted through the stop)."""
    prompt = engine.encode_chat([{"role": "user", "content": eval_prompts[-1]}])
    (free,), _ = generate(engine, [prompt], SamplingParams(max_tokens=40, **sampling))
    stop = free.text[len(free.text) // 3 : len(free.text) // 3 + 3]
    assert stop.strip(), f"reference text too short: {free.text!r}"
    for extra in ({}, {"min_tokens": 12}):
        params = SamplingParams(max_tokens=40, stop=(stop,), **sampling, **extra)
        (plain,), _ = generate(engine, [prompt], params)
        for proposer in (RandomProposer(engine.vocab_size, [5], seed=2),
                         OracleProposer({"req-0": free.token_ids}, gamma=7)):
            (spec,), _ = generate(engine, [prompt], params, proposer=proposer)
            if spec.token_ids == plain.token_ids:
                assert (spec.text, spec.finish_reason) == (plain.text, plain.finish_reason)
            elif params.greedy and not params.controls():  # a near-tie, and the target's choices after it
                check_greedy_output(engine, prompt, plain.token_ids, spec.token_ids)
            else:  # the near-tie rule on the processed logits (min_tokens) or the coupled scores (seeded)
                check_seeded_same_or_near_tie(engine, prompt, plain.token_ids, spec.token_ids, params)
        assert plain.finish_reason == FinishReason.STOP and len(plain.token_ids) >= extra.get("min_tokens", 0)
