"""Sampled controls inside verification, on a toy target whose distribution is known exactly.

The engine's accept-rule hook (``TargetEngine._decide``: controls -> truncation -> rejection sampling or Gumbel-max
coupling) runs on a toy Markov target over V = 6 tokens, with random drafts of 2 tokens from another Markov chain.
The joint of the first three output tokens must be the sequential (speculation-off) one for every control, whatever
the drafts: penalty state advancing per accepted draft, top-k / min-p / top-p cuts at every verified row, logit_bias,
allowed_token_ids, bad_words (their context advancing per accepted draft) and min_tokens at every row. Toy logits
have no batch-shape rounding, so the cuts (top-k among them) cannot fall on the near-ties that make such a test
unreliable on the real model.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from app.engine.engine import TargetEngine, _Request
from app.engine.logits_process import RequestControls, sampling_probs
from app.engine.types import SamplingParams
from tests.engine.chi2 import chi2_quantile_999, pooled_chi2

V = 6  # toy vocabulary; token 0 is the prompt
SEQ = 3  # output tokens per sequence: the joint over V**SEQ cells is tested
BLOCK = 2  # drafts per verify step
N = 3000  # sequences per case


def _chain(seed: int, scale: float) -> torch.Tensor:
    """[V, V] logits of a Markov chain: row ``prev`` gives the next token's logits."""
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * scale


TARGET = _chain(0, 1.5)
DRAFTER = torch.softmax(_chain(1, 1.0) + TARGET, -1)  # [V, V] a proposal that agrees with the target often

CASES = {
    "top_k-presence-frequency": dict(top_k=3, presence_penalty=0.8, frequency_penalty=0.6),
    "logit_bias-min_p-top_p": dict(logit_bias=((1, 2.0), (4, -1.5)), min_p=0.15, top_p=0.9),
    "repetition-top_k-min_tokens": dict(repetition_penalty=1.6, top_k=4, min_tokens=2, stop_token_ids=(5,)),
    "allowed-logit_bias-top_p": dict(allowed_token_ids=(0, 1, 3, 4), logit_bias=((3, 1.0),), top_p=0.8),
    "bad_words-min_p": dict(bad_words=("toy",), min_p=0.05),
}
# the token ids of the toy's bad words (the engine tokenizes words: TargetEngine.bad_words_ids): one token banned
# everywhere, one after a 1, one after two 4s
BAD_WORDS_IDS = {("toy",): ((2,), (1, 3), (4, 4, 1))}


def _params(case: str, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=SEQ, temperature=1.0, ignore_eos=True, seed=seed, **CASES[case])


def _controls(params: SamplingParams, cls: type[RequestControls] = RequestControls) -> RequestControls:
    return cls(params, [0], eos_token_ids=[], vocab_size=V, bad_words_ids=BAD_WORDS_IDS.get(params.bad_words, ()))


def _exact_joint(params: SamplingParams) -> torch.Tensor:
    """[V] * SEQ: P(first SEQ tokens) decoding one token at a time (speculation off)."""
    joint = torch.zeros((V,) * SEQ)
    for cell in itertools.product(range(V), repeat=SEQ):
        mass, controls = 1.0, _controls(params)
        for tok, prev in zip(cell, (0,) + cell):
            row = controls.process(TARGET[prev][None], [], None)
            mass *= float(sampling_probs(row, params)[0, tok])
            controls.commit([tok])
        joint[cell] = mass
    return joint


class _CountOncePerStep(RequestControls):
    """A known bug: every row of a verify step sees only the committed output (drafts not counted)."""

    def process(self, logits, draft, allowed):
        return torch.cat([super(_CountOncePerStep, self).process(row[None], [], allowed) for row in logits])


class _AllowedAtFirstRowOnly(RequestControls):
    """A known bug: ``allowed_token_ids`` masks the first row of a verify step only (for a case of logit_bias and
    the mask alone: the drafted rows get the bias without the mask)."""

    def process(self, logits, draft, allowed):
        out = super().process(logits, draft, allowed)
        out[1:] = logits[1:].float() + self.bias.nan_to_num(neginf=0.0)
        return out


def _speculative_counts(case: str, *, seeded: bool, controls_cls=RequestControls) -> torch.Tensor:
    """Counts [V] * SEQ of N sequences decoded through ``TargetEngine._decide`` with random draft blocks."""
    engine = SimpleNamespace(vocab_size=V)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros((V,) * SEQ)
    for i in range(N):
        params = _params(case, seed=i if seeded else None)
        req = _Request(request_id="toy", slot=0, params=params, prompt_len=1, detok=None,
                       generator=torch.Generator().manual_seed(10_000 + i),
                       controls=_controls(params, controls_cls))
        out = [0]
        while len(out) <= SEQ:
            draft = []
            for _ in range(min(BLOCK, SEQ - len(out))):
                draft.append(int(torch.multinomial(DRAFTER[(out + draft)[-1]], 1, generator=gen)))
            draft_t = torch.tensor(draft, dtype=torch.long)
            head = TARGET[torch.tensor([out[-1]] + draft)]  # [l + 1, V]
            q = DRAFTER[torch.tensor(out[-1:] + draft[:-1])] if draft else None  # [l, V]
            acc = TargetEngine._decide(engine, req, draft_t, q, head, None, first_position=len(out))
            out.extend(acc.tokens)
            req.controls.commit(acc.tokens)
        counts[tuple(out[1 : SEQ + 1])] += 1
    return counts


def _chi2(counts: torch.Tensor, joint: torch.Tensor) -> tuple[float, int]:
    """``pooled_chi2`` of ``counts`` against N * ``joint``, cell by cell."""
    return pooled_chi2(counts.flatten().tolist(), (joint * N).flatten().tolist())


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "seeded-coupling"])
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_controls_keep_the_target_distribution(case, seeded):
    joint = _exact_joint(_params(case))
    assert float((joint == 0).sum()) > 0, "the case truncates nothing: it would not test the cuts"
    counts = _speculative_counts(case, seeded=seeded)
    assert float(counts[joint == 0].sum()) == 0, "a token outside the processed, truncated distribution came out"
    allowed = CASES[case].get("allowed_token_ids")
    if allowed is not None:  # the exact joint goes through the same controls: the set checked on its own too
        outside = torch.tensor([t for t in range(V) if t not in allowed])
        assert all(float(counts.index_select(d, outside).sum()) == 0 for d in range(SEQ)), "a token outside the set"
    for word in BAD_WORDS_IDS.get(_params(case).bad_words, ()):  # checked on their own too, as the set above
        for cell in counts.nonzero().tolist():
            assert all(tuple(cell[i : i + len(word)]) != word for i in range(SEQ)), f"bad word {word} in {cell}"
    chi2, df = _chi2(counts, joint)
    assert df >= 10 and chi2 < chi2_quantile_999(df), f"chi-square {chi2:.1f} on {df} df"


def test_allowed_token_ids_at_the_first_row_only_would_be_caught():
    """Control: drafted rows without the mask accept drafts outside the set (cells of probability 0)."""
    case = "allowed-logit_bias-top_p"
    counts = _speculative_counts(case, seeded=False, controls_cls=_AllowedAtFirstRowOnly)
    assert float(counts[_exact_joint(_params(case)) == 0].sum()) > 0


def test_penalties_counted_once_per_step_would_be_caught():
    """Control: penalty state that ignores the accepted drafts of the same step fails the test above."""
    case = "top_k-presence-frequency"
    counts = _speculative_counts(case, seeded=False, controls_cls=_CountOncePerStep)
    chi2, df = _chi2(counts, _exact_joint(_params(case)))
    assert chi2 > chi2_quantile_999(df), f"chi-square {chi2:.1f} on {df} df"


class _BadWordsAfterCommittedOnly(RequestControls):
    """A known bug: ``bad_words`` matched against the committed output only (drafts of the step not counted)."""

    def _bad_word_rows(self, draft, n):
        committed = RequestControls._bad_word_rows(self, [], 1)  # the bans after the committed output
        return [(i, tok) for i in range(n) for _, tok in committed]


def test_bad_words_that_ignore_the_drafts_would_be_caught():
    """Control: a bad word completed by a draft of the same step slips through (cells of probability 0)."""
    case = "bad_words-min_p"
    counts = _speculative_counts(case, seeded=False, controls_cls=_BadWordsAfterCommittedOnly)
    assert float(counts[_exact_joint(_params(case)) == 0].sum()) > 0
