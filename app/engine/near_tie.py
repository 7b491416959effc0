"""The near-tie rule for comparing two greedy outputs computed with different batch shapes (used by the
losslessness tests and by the served benchmark, which checks every served output against plain decoding).

A forward over 8 tokens and one over 1 token may differ in the last bits (different matmul blocking in
bfloat16), so two lossless greedy runs may pick different tokens where the target's top-2 logits are almost
equal. Where two greedy outputs differ, the first differing position must be such a near-tie: both tokens'
logits within NEAR_TIE_EPS of the target's best (a top-2 gap below it, or a three-way tie); anything else is
a bug.

Seeded sampled outputs (Gumbel-max coupling, ``coupling.py``) are compared the same way on the coupled scores
logits / T + g(seed, position): the first differing position must have both tokens' scores within NEAR_TIE_EPS / T
of the best score there (a logit moved by eps moves a score by eps / T).

NEAR_TIE_EPS (logits): the engine keeps activations in bfloat16 (8 mantissa bits) and computes logits with a
float32 LM head. Different batch shapes round the final hidden state differently, which moves logits of
magnitude ~20-40 by a few hundredths to a few tenths, depending on the CPU's bfloat16 kernels: on an
avx512_bf16 CPU without AMX the largest top-2 gap seen at a divergence on the 20 evaluation prompts was 0.087; on
an AMX Xeon plain decoding of 3 requests picked a token 0.44 below the best of the teacher-forced forward (0.36
below in a float32 forward of the same sequence; 0.02 below in a 1-request decoding step). 0.5 bounds what we
accept as a tie; a real acceptance bug flips tokens with gaps of several logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from app.engine.coupling import gumbel_noise
from app.engine.logits_process import RequestControls, sampling_probs
from app.engine.model import KVCache, StepLayout
from app.engine.types import SamplingParams

NEAR_TIE_EPS = 0.5
# Probability mass by which the seeded check widens a ``top_p`` nucleus: a token whose mass before it lies within this
# of top_p is in the nucleus of one batch shape and out of another's (seen: 0.9509 against top_p 0.95).
NUCLEUS_EPS = 0.01


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs first differ and whether that is allowed."""

    index: int  # first differing token (the shorter length when one output is a prefix of the other)
    gaps: dict[int, float]  # token id -> its logit's distance below the target's best there (logits); {} for length
    near_tie: bool  # both tokens within NEAR_TIE_EPS of the best: a batch-shape rounding difference, not a bug

    def describe(self) -> str:
        if not self.gaps:
            return f"outputs agree on {self.index} tokens but differ in length: a stop bug"
        kind = "near-tie" if self.near_tie else f"not a near-tie (>= {NEAR_TIE_EPS}): a losslessness bug"
        return f"outputs differ at token {self.index}, gaps to the best logit {self.gaps}: {kind}"


def teacher_forced_hidden(engine, token_ids: list[int]) -> torch.Tensor:
    """[T, Dm] last-layer hidden states (before the final norm) of the target over ``token_ids`` in one forward
    (scratch cache)."""
    return _scratch_forward(engine, [token_ids], torch.arange(len(token_ids)))


def teacher_forced_last_logits(engine, sequences: list[list[int]], chunk: int = 64) -> torch.Tensor:
    """[N, V] float32 on the host: the target's next-token logits after each of ``sequences`` (the last rows of
    ``teacher_forced_logits``), ``chunk`` sequences a forward (scratch cache, one slot each)."""
    out = []
    for i in range(0, len(sequences), chunk):
        part = sequences[i : i + chunk]
        with torch.inference_mode():
            hidden = _scratch_forward(engine, part, torch.cumsum(torch.tensor([len(s) for s in part]), 0) - 1)
            out.append(engine.model.logits_from_final_hidden(hidden).cpu())
    return torch.cat(out)


def _scratch_forward(engine, sequences: list[list[int]], index: torch.Tensor) -> torch.Tensor:
    """[len(index), Dm] last-layer hidden states (before the final norm) at rows ``index`` of the flattened
    ``sequences``, each from position 0 in its own slot of a scratch cache, in one forward."""
    model, dtype, device = engine.model, engine.cache.k.dtype, engine.device
    lengths = [len(s) for s in sequences]
    cache = KVCache(model.args, num_slots=len(sequences), max_len=max(lengths), dtype=dtype, device=device)
    layout = StepLayout.build(slots=list(range(len(sequences))), starts=[0] * len(sequences), lengths=lengths,
                              groups=model.args.num_heads // model.args.num_kv_heads, device=device, dtype=dtype)
    ids = torch.tensor([t for s in sequences for t in s], device=device)
    with torch.inference_mode():
        hidden, _ = model.hidden_states(ids, cache=cache, layout=layout, index=index.to(device))
    return hidden


def teacher_forced_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """[T, V] float32 next-token logits of the target over ``token_ids`` in one forward (scratch cache)."""
    with torch.inference_mode():
        return engine.model.logits_from_final_hidden(teacher_forced_hidden(engine, token_ids))


def processed_logits(engine, prompt: list[int], params: SamplingParams | None, prefix: list[int]) -> torch.Tensor:
    """[V] float32 on the host: the target's teacher-forced logits after ``prompt + prefix`` through ``params``'
    controls and grammar (steps 1-5 of ``app/engine/logits_process.py``, on the host as the engine applies them at
    that position); the raw logits when ``params`` is None or sets no control."""
    return controlled_logits(engine, prompt, params, prefix, teacher_forced_logits(engine, prompt + prefix)[-1:].cpu())


def controlled_logits(engine, prompt: list[int], params: SamplingParams | None, prefix: list[int],
                      logits: torch.Tensor) -> torch.Tensor:
    """[V]: ``logits`` ([1, V] float32 on the host, the target's after ``prompt + prefix``) through ``params``'
    controls and grammar as ``processed_logits`` applies them; the row itself when ``params`` is None or sets no
    control."""
    if params is None or not params.controls():
        return logits[0]
    controls = RequestControls(params, prompt, eos_token_ids=sorted(engine.eos_token_ids), vocab_size=engine.vocab_size)
    controls.commit(prefix)
    allowed = None
    if params.guided is not None:
        grammar = engine._grammar(params)
        grammar.commit(prefix)
        allowed = grammar.block_masks([])[1]
    return controls.process(logits, [], allowed)[0]


def first_divergence(
    engine, prompt: list[int], expected: list[int], got: list[int], params: SamplingParams | None = None
) -> Divergence | None:
    """None if ``got == expected``; otherwise the first difference, judged on the target's teacher-forced logits after
    ``prompt + expected[:index]`` (one forward of the ``TargetEngine``'s model) through the request's controls and
    grammar (``processed_logits``).

    Greedy (``params`` None or temperature 0): gaps to the best processed logit. Seeded sampled (``params.seed`` set):
    gaps on the coupled scores logits / T + g(seed, position), scaled back to logits (times T), so the same
    NEAR_TIE_EPS applies: each token's to the best score among the tokens a ``top_p`` < 1 nucleus narrowed by
    NUCLEUS_EPS keeps, the token itself, and the other token where its logit is higher by over NEAR_TIE_EPS (a nucleus
    that kept this token kept that one); the token must lie in the nucleus widened by NUCLEUS_EPS (else the gap is
    infinite). So an edge token (in the widened nucleus, not in the narrowed one) that one run kept is no rival of the
    other run's token: that run may have left it out. Without a ``top_p`` cut every token is a rival.

    Raises:
        ValueError: ``params`` is sampled without a seed (unseeded outputs are compared by distribution only).
    """
    if params is not None and not params.greedy and params.seed is None:
        raise ValueError("an unseeded sampled request has no reference output to diverge from")
    if got == expected:
        return None
    j = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    if j == min(len(expected), len(got)):
        return Divergence(index=j, gaps={}, near_tie=False)
    logits = processed_logits(engine, prompt, params, expected[:j])
    if params is None or params.greedy:
        scores, t = logits, 1.0
        kept = torch.ones_like(logits, dtype=torch.bool)
    else:
        t = params.temperature
        scores = logits / t + gumbel_noise(params.seed, [len(prompt) + j], logits.shape[-1])[0]
        if params.top_p < 1.0:
            # a token at the nucleus' edge may be in or out with the step's rounding: the two tokens may come from a
            # nucleus widened a little, and each is measured against what one narrowed a little keeps
            wide = replace(params, top_p=min(1.0, params.top_p + NUCLEUS_EPS))
            narrow = replace(params, top_p=max(params.top_p / 2, params.top_p - NUCLEUS_EPS))
        else:
            wide = narrow = params
        scores = scores.masked_fill(sampling_probs(logits[None], wide)[0] == 0, float("-inf"))
        kept = sampling_probs(logits[None], narrow)[0] > 0
    gaps = {}
    for tok, other in ((expected[j], got[j]), (got[j], expected[j])):
        rivals = kept.clone()
        rivals[tok] = True
        # a nucleus keeps tokens in order of probability: a run that kept ``tok`` kept ``other`` too where its logit is
        # higher by more than a step's rounding moves one
        rivals[other] |= bool(logits[other] > logits[tok] + NEAR_TIE_EPS)
        gaps[tok] = t * (float(scores.masked_fill(~rivals, float("-inf")).max()) - float(scores[tok]))
    return Divergence(index=j, gaps=gaps, near_tie=max(gaps.values()) < NEAR_TIE_EPS)
