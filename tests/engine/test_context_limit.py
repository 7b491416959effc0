"""The context limit is vLLM's: a request fits when prompt + max_tokens <= ``max_model_len``, draft blocks or not. A
KV slot holds ``max_draft_len`` positions past the limit, where the padding of a verify step's last rows lands, so a
request that fills the context to its last token decodes losslessly with drafts in every round, in every verify-step
layout, greedy and sampled.

The real-model engines here share the session ``engine32``'s float32 weights (tests/conftest.py; prompts cut short
meet near-ties in bfloat16), each with its own KV cache.
"""

from __future__ import annotations

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.errors import ContextLengthError
from app.engine.types import SamplingParams
from app.loop import generate
from tests.conftest import load_prompts
from tests.engine.proposers import RandomProposer, check_greedy_speculation

LIMIT, PROMPT = 72, 48  # max_model_len, and the prompt tokens that leave max_tokens 24 to fill it
LENGTHS = [7, 3, 0, 5]  # per-request draft lengths (max_draft_len is 8)
LAYOUTS = {"ragged": {}, "bucketed": {"verify_step": "bucketed"}, "batch_invariant": {"batch_invariant": True}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def full(request, engine32):
    return TargetEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=LIMIT, enable_prefix_caching=False,
                                     **LAYOUTS[request.param]), loaded=engine32.target)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    texts = load_prompts("gsm8k", start=700, count=2) + load_prompts("mt-bench", count=2)
    ids = [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]
    assert min(map(len, ids)) >= PROMPT
    return [x[:PROMPT] for x in ids]


def test_prompt_and_max_tokens_may_fill_the_context_exactly(full, prompts):
    """Greedy: plain decoding, random drafts and perfect drafts (whole blocks up to the last token) give the same
    output, each request generating max_tokens tokens to the last position of the context; one token more is
    refused."""
    params = SamplingParams(max_tokens=LIMIT - PROMPT, ignore_eos=True)
    reference = [r.token_ids for r in generate(full, prompts, params)[0]]
    assert all(len(r) == LIMIT - PROMPT for r in reference)
    results = check_greedy_speculation(full, prompts, reference, params, LENGTHS)
    assert all(r.finish_reason == "length" for r in results)
    with pytest.raises(ContextLengthError, match=f"= {LIMIT + 1} exceeds the context limit of {LIMIT} tokens"):
        full.add_request("over", prompts[0], SamplingParams(max_tokens=LIMIT - PROMPT + 1))
    assert full.num_active == 0


def test_sampled_requests_fill_the_context_with_drafts(full, prompts):
    """Sampled, seeded: every request reaches the last position of the context with random drafts in every round;
    in batch-invariant mode its tokens are those of plain decoding (the seeded guarantee, exact there)."""
    params = SamplingParams(max_tokens=LIMIT - PROMPT, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7)
    plain = generate(full, prompts, params)[0]
    drafted = generate(full, prompts, params, proposer=RandomProposer(full.vocab_size, LENGTHS, seed=2))[0]
    assert all(len(r.token_ids) == LIMIT - PROMPT for r in plain + drafted)
    if full.config.batch_invariant:
        assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert full.num_active == 0


def test_the_model_s_whole_context_with_drafts_past_its_rotary_range(tiny_llama_dir):
    """max_model_len = max_position_embeddings (2048, a tiny dummy-weight Llama): the padding of the last rounds'
    steps runs at positions past the model's range (its rotary tables cover a draft block's room past it), and
    perfect drafts give plain decoding's output to the last token of the context."""
    engine = TargetEngine(EngineConfig(model=str(tiny_llama_dir), load_format="dummy", dtype="float32", device="cpu",
                                       max_model_len=2048, max_num_seqs=2, verify_step="bucketed"))
    assert engine.model.args.max_position_embeddings == 2048
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist() for n in (2030, 2020)]
    params = SamplingParams(max_tokens=18, ignore_eos=True)
    with pytest.raises(ContextLengthError):  # 2030 + 28 tokens
        engine.add_request("over", prompts[0], SamplingParams(max_tokens=28, ignore_eos=True))
    reference = [r.token_ids for r in generate(engine, prompts, params)[0]]
    check_greedy_speculation(engine, prompts, reference, params, [7, 5])
