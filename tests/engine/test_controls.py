"""Sampling controls and logprobs applied inside verification: speculation on gives the output of speculation off.

Greedy: token-identical for every control (up to near-ties of the *processed* logits, the rule of
``app/engine/near_tie.py``), with perfect drafts (whole blocks accepted: the state of row i must include drafts
1..i-1) and with the uncontrolled output as drafts (rejected where the control acts: recovered tokens).
Sampled: the joint distribution of three tokens from one verify step matches the exact one (chi-square); seeded, the
tokens of plain decoding with the same seed, for every control and a grammar.
Structured output: every output parses and matches its schema, greedy outputs are identical with speculation on and
off, drafts the grammar forbids are cut before verification, and a sampled request verified against draft
probabilities rejects them instead (its output distribution checked). With ``allowed_token_ids`` too, a state where
the grammar allows none of them ends the request with an error where plain decoding ends it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from app.drafters.ngram import NgramProposer
from app.engine.bench_controls import SCHEMA
from app.loop import generate
from app.engine.grammar import GrammarCompiler
from app.engine.near_tie import NEAR_TIE_EPS, teacher_forced_logits
from app.engine.types import DraftBlock, FinishReason, GuidedDecoding, SamplingParams, StepOutput
from tests.engine.chi2 import check_three_token_joint_under_speculation
from tests.engine.near_tie import check_same_or_near_tie, check_seeded_same_or_near_tie
from tests.engine.proposers import OracleProposer, RandomProposer

MAX_TOKENS = 20
RAGGED = [3, 5, 0, 7, 2]
SHORT_QUESTION = "What is 2+3? Answer with the number only."  # greedy answer ends with EOS in a few tokens


@pytest.fixture(scope="module")
def prompts(engine, eval_prompts) -> list[list[int]]:
    texts = [eval_prompts[0], eval_prompts[8], eval_prompts[14], SHORT_QUESTION]
    return [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]


@pytest.fixture(scope="module")
def plain(engine, prompts) -> list[list[int]]:
    results, _ = generate(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return [r.token_ids for r in results]


def plain_and_perfect(engine, prompts, params) -> tuple[list, list]:
    """Results without speculation, and with perfect drafts (that output, in ragged blocks)."""
    ref, _ = generate(engine, prompts, params)
    refs = {f"req-{i}": r.token_ids for i, r in enumerate(ref)}
    perfect, _ = generate(engine, prompts, params, proposer=OracleProposer(refs, gamma=7, lengths=RAGGED))
    return ref, perfect


def _token(engine, text: str) -> int:
    (tok,) = engine.encode(text)
    return tok


def _allowed(engine, plain) -> tuple[int, ...]:
    """The plain outputs' tokens but EOS and each output's second token: every output leaves its plain one there and
    keeps to a small vocabulary; the short answer, which ended with EOS, cannot end before max_tokens (vLLM does not
    add EOS to the set)."""
    return tuple(sorted({t for p in plain for t in p} - {p[1] for p in plain} - engine.eos_token_ids))


def _bad_words(engine, plain) -> tuple[str, ...]:
    """A two-word phrase of the first plain output and a word of the second (vLLM's ``bad_words``)."""
    first, second = (engine.tokenizer.decode(p, skip_special_tokens=True).split() for p in plain[:2])
    return f"{first[2]} {first[3]}", second[4]


def _contains(output: list[int], word: list[int]) -> bool:
    return any(output[i : i + len(word)] == word for i in range(len(output) - len(word) + 1))


CONTROLS = {
    "presence_penalty": lambda e, plain: {"presence_penalty": 2.0},
    "frequency_penalty": lambda e, plain: {"frequency_penalty": 1.5},
    "repetition_penalty": lambda e, plain: {"repetition_penalty": 1.5},
    "logit_bias": lambda e, plain: {"logit_bias": ((_token(e, ","), -100.0), (_token(e, "."), -100.0),
                                                   (_token(e, " the"), 4.0))},
    "min_tokens": lambda e, plain: {"min_tokens": 12},
    "stop_token_ids": lambda e, plain: {"stop_token_ids": (plain[0][6], plain[1][9])},
    "top_k_min_p": lambda e, plain: {"top_k": 3, "min_p": 0.3},
    "allowed_token_ids": lambda e, plain: {"allowed_token_ids": _allowed(e, plain)},
    "bad_words": lambda e, plain: {"bad_words": _bad_words(e, plain)},
}


@pytest.fixture(scope="module")
def controlled(engine, prompts, plain) -> dict[str, tuple[SamplingParams, list, list, list]]:
    """Every control of ``CONTROLS`` over every prompt, all in one batch (each request with its own control), three
    ways: without speculation, with perfect drafts (that output) and with the uncontrolled output as drafts (rejected
    where the control acts), both in ragged blocks. Per control: its params and the three runs' results, in prompt
    order."""
    params = {name: SamplingParams(max_tokens=MAX_TOKENS, **control(engine, plain))
              for name, control in CONTROLS.items()}
    batch = [params[name] for name in CONTROLS for _ in prompts]
    ref, perfect = plain_and_perfect(engine, prompts * len(CONTROLS), batch)
    plain_drafts = {f"req-{i}": plain[i % len(prompts)] for i in range(len(batch))}
    rejected, _ = generate(engine, prompts * len(CONTROLS), batch,
                           proposer=OracleProposer(plain_drafts, gamma=5, lengths=RAGGED))
    n = len(prompts)
    return {name: (params[name], ref[i * n : (i + 1) * n], perfect[i * n : (i + 1) * n], rejected[i * n : (i + 1) * n])
            for i, name in enumerate(CONTROLS)}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_greedy_control_is_identical_with_speculation(engine, prompts, plain, controlled, name):
    params, ref, perfect, rejected = controlled[name]
    tied = []  # prompts whose output differs at a near-tie in either speculative run
    for prompt, r, a, b in zip(prompts, ref, perfect, rejected):
        ties = [check_same_or_near_tie(engine, prompt, r.token_ids, spec.token_ids, params) for spec in (a, b)]
        for spec in (a, b):
            if spec.token_ids == r.token_ids:
                assert spec.finish_reason == r.finish_reason
        tied += [ties] if any(ties) else []
    assert len(tied) <= len(prompts) // 2, tied
    assert sum(r.num_accepted for r in perfect) > 0 and sum(r.num_draft for r in rejected) > 0
    # the control acts: (a control that cannot change a greedy output only takes the exact path)
    outputs = [r.token_ids for r in ref]
    if name == "min_tokens":
        assert all(len(o) >= 12 for o in outputs) and len(plain[3]) < 12
    elif name == "stop_token_ids":
        for out, res, p in zip(outputs, ref, plain):
            cut = next((i + 1 for i, t in enumerate(p) if t in params.stop_token_ids), len(p))
            assert out == p[:cut]
            assert res.finish_reason == (FinishReason.STOP if cut < len(p) or p[-1] in engine.eos_token_ids
                                         else FinishReason.LENGTH)
    elif name == "logit_bias":
        banned = {_token(engine, ","), _token(engine, ".")}
        assert not banned & {t for o in outputs for t in o} and outputs != plain
    elif name == "allowed_token_ids":
        assert all(set(o) <= set(params.allowed_token_ids) and o != p for o, p in zip(outputs, plain))
        assert plain[3][-1] in engine.eos_token_ids and len(plain[3]) < MAX_TOKENS
        assert len(outputs[3]) == MAX_TOKENS and ref[3].finish_reason == FinishReason.LENGTH
    elif name == "bad_words":
        banned = engine.bad_words_ids(params.bad_words)
        assert [w for w in banned if any(_contains(p, w) for p in plain[:2])]  # the plain outputs have them
        assert not [w for w in banned if any(_contains(o, w) for o in outputs)] and outputs[:2] != plain[:2]
    elif name == "top_k_min_p":  # truncations keep the argmax: the exact path gives the screened path's output
        for prompt, out, p in zip(prompts, outputs, plain):
            check_same_or_near_tie(engine, prompt, p, out)
    else:
        assert outputs != plain


def _tol(logprob: float) -> float:
    """Allowed difference of a logprob between batch shapes: bfloat16 rounding moves logits (app/engine/near_tie.py)
    by an amount that grows with their distance from the top (seen: 0.16 at -3.7, 0.25 at -12.2). A row off by one
    position, or processed logits returned instead of raw ones, is off by whole nats."""
    return LOGPROB_TOL + 0.03 * abs(logprob)


def _close_logprobs(a, b) -> None:
    """Two TokenLogprob lists of one output (the same tokens): values within ``_tol`` and the same alternatives
    except where an alternative sits within ``_tol`` of the k-th (ordering noise of batch shapes)."""
    for x, y in zip(a, b):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < _tol(x.logprob)
        dx, dy = dict(x.top), dict(y.top)
        for tok in dx.keys() & dy.keys():
            assert abs(dx[tok] - dy[tok]) < _tol(dx[tok])
        kth = min(min(dx.values()), min(dy.values()))
        assert all(dx.get(t, dy.get(t)) < kth + _tol(kth) for t in dx.keys() ^ dy.keys())


LOGPROB_TOL = NEAR_TIE_EPS


def test_greedy_logprobs_are_the_same_with_speculation(engine, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=5)
    ref, perfect = plain_and_perfect(engine, prompts, params)
    for prompt, r, s in zip(prompts, ref, perfect):
        assert len(r.logprobs) == len(r.token_ids) and len(s.logprobs) == len(s.token_ids)
        for lp in r.logprobs + s.logprobs:  # greedy under raw logprobs: the chosen token is the most likely
            assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id and lp.top[0][1] == lp.logprob
        n = next((i for i, (a, b) in enumerate(zip(r.token_ids, s.token_ids)) if a != b), len(r.token_ids))
        _close_logprobs(r.logprobs[:n], s.logprobs[:n])
        # the raw target's: log_softmax of teacher-forced logits at each position
        exact = torch.log_softmax(teacher_forced_logits(engine, prompt + r.token_ids)[len(prompt) - 1 : -1], -1)
        got = torch.tensor([lp.logprob for lp in r.logprobs])
        assert torch.allclose(got, exact[torch.arange(len(got)), torch.tensor(r.token_ids)], atol=LOGPROB_TOL)


def test_logprobs_under_allowed_token_ids_are_the_raw_targets(engine, prompts, plain):
    """The mask shapes the choice, not the returned logprobs (vLLM's default): each is the raw target's, with
    speculation on as off, and the alternatives hold tokens outside the set."""
    allowed = _allowed(engine, plain)
    params = SamplingParams(max_tokens=MAX_TOKENS, allowed_token_ids=allowed, logprobs=3)
    ref, perfect = plain_and_perfect(engine, prompts[:2], params)
    for prompt, r, s in zip(prompts, ref, perfect):
        exact = torch.log_softmax(teacher_forced_logits(engine, prompt + r.token_ids)[len(prompt) - 1 : -1], -1)
        got = torch.tensor([lp.logprob for lp in r.logprobs])
        assert torch.allclose(got, exact[torch.arange(len(got)), torch.tensor(r.token_ids)], atol=LOGPROB_TOL)
        n = next((i for i, (a, b) in enumerate(zip(r.token_ids, s.token_ids)) if a != b), len(r.token_ids))
        _close_logprobs(r.logprobs[:n], s.logprobs[:n])
    assert {t for r in ref for lp in r.logprobs for t, _ in lp.top} - set(allowed)


def test_sampled_logprobs_are_raw_at_every_committed_token(engine, prompts):
    """Temperature, top-k and penalties shape the sampling, not the returned logprobs; streamed per step."""
    params = SamplingParams(max_tokens=12, temperature=0.7, top_k=4, presence_penalty=1.0, logprobs=0, seed=3)
    prompt = prompts[0]
    outs: list[StepOutput] = [engine.add_request("lp", prompt, params)]
    while not outs[-1].finished:  # draft: the target's raw greedy next token after what is committed
        committed = [t for o in outs for t in o.new_token_ids]
        draft = int(teacher_forced_logits(engine, prompt + committed)[-1].argmax())
        (out,) = engine.verify([DraftBlock("lp", torch.tensor([draft]))])
        outs.append(out)
    tokens = [t for o in outs for t in o.new_token_ids]
    for o in outs:
        assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids)
        assert all(lp.top == () for lp in o.logprobs)
    exact = torch.log_softmax(teacher_forced_logits(engine, prompt + tokens)[len(prompt) - 1 : -1], -1)
    got = torch.tensor([lp.logprob for o in outs for lp in o.logprobs])
    assert torch.allclose(got, exact[torch.arange(len(tokens)), torch.tensor(tokens)], atol=LOGPROB_TOL)


@pytest.mark.parametrize("controls", [
    {"min_p": 0.1, "top_p": 0.95, "repetition_penalty": 1.8},
], ids=["min_p-top_p-repetition"])
def test_sampled_controls_keep_the_distribution_under_speculation(engine32, controls):
    """Three tokens, the last two from one verify step whose draft (the likeliest second token) is accepted often:
    row 1 must count that draft in the penalties. On the float32 target (``engine32``): its steps round as the exact
    joint does. test_controls_toy.py checks top-k, the other penalties and logit_bias through the same accept rule on a
    toy target without rounding."""
    prompt = engine32.encode("la la la la la la la")
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, **controls)
    check_three_token_joint_under_speculation(engine32, prompt, params, n=480)


JSON_QUESTIONS = {
    "json_schema": ["Describe a person as JSON with a name, an age and a pet.",
                    "Return a JSON record of a customer named Ada who is 36 and owns a dog."],
    "json_object": ["Return a JSON object with keys a and b set to 1 and 2.",
                    "Describe a person as JSON with a name and an age."],
}


@pytest.mark.slow
def test_seeded_controls_and_grammar_give_the_same_tokens_with_speculation(engine, prompts, plain):
    """A seeded sampled request with a control or a grammar takes its own accept path (Gumbel-max over the processed
    distribution, ``TargetEngine._decide``): its tokens are those of plain decoding with the same seed whatever the
    drafts, perfect (that output) or random, up to near-ties of the coupled scores (app/engine/near_tie.py)."""
    seeded = {name: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, **control(engine, plain))
              for name, control in CONTROLS.items()}
    seeded["json_object"] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7,
                                           guided=_guided("json_object"))
    batch = [params for params in seeded.values() for _ in prompts]
    ref, perfect = plain_and_perfect(engine, prompts * len(seeded), batch)
    drafted, _ = generate(engine, prompts * len(seeded), batch,
                          proposer=RandomProposer(engine.vocab_size, RAGGED, seed=5))
    ties = []
    for i, (params, r) in enumerate(zip(batch, ref)):
        prompt = prompts[i % len(prompts)]
        for spec in (perfect[i], drafted[i]):
            ties.append(check_seeded_same_or_near_tie(engine, prompt, r.token_ids, spec.token_ids, params))
    assert sum(r.num_accepted for r in perfect) > 0 and sum(r.num_draft for r in drafted) > 0
    assert sum(t is not None for t in ties) <= len(ties) // 2, [t for t in ties if t]  # bf16 steps of other shapes


def _guided(kind: str) -> GuidedDecoding:
    return GuidedDecoding("json_schema", json.dumps(SCHEMA)) if kind == "json_schema" else GuidedDecoding(kind)


def _check_json(kind: str, result) -> None:
    assert result.finish_reason == FinishReason.STOP, f"did not finish: {result.text!r}"
    value = json.loads(result.text)
    assert isinstance(value, dict)
    if kind == "json_schema":
        jsonschema.validate(value, SCHEMA)


@pytest.fixture(scope="module")
def grammars(engine) -> GrammarCompiler:
    return GrammarCompiler(engine.tokenizer, vocab_size=engine.vocab_size, eos_token_ids=sorted(engine.eos_token_ids))


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_greedy_json_is_valid_and_identical_with_speculation(engine, kind):
    params = SamplingParams(max_tokens=64, guided=_guided(kind))
    prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in JSON_QUESTIONS[kind]]
    ref, perfect = plain_and_perfect(engine, prompts, params)
    noisy, _ = generate(engine, prompts, params, proposer=RandomProposer(engine.vocab_size, [4], seed=2))
    for prompt, r, a, b in zip(prompts, ref, perfect, noisy):
        _check_json(kind, r)
        for spec in (a, b):
            if check_same_or_near_tie(engine, prompt, r.token_ids, spec.token_ids, params) is None:
                assert spec.text == r.text
            _check_json(kind, spec)
    assert all(x.num_accepted > 0 for x in perfect)
    # random drafts are mostly forbidden (outside strings): cut before verification, far fewer verified than the 4
    # proposed per round
    assert sum(x.num_draft for x in noisy) < 2 * sum(x.rounds for x in noisy)


GUIDED_TEXT = [  # (kind, spec, question, what every output must match whole)
    ("regex", r"[0-9]{1,3}(\.[0-9]{1,2})?", "What is 12.5 times 3? Answer with the number only.",
     r"[0-9]{1,3}(\.[0-9]{1,2})?"),
    ("choice", json.dumps(["yes", "no", "it depends"]), "Is the sky blue?", r"yes|no|it depends"),
    ("grammar", 'root ::= ("red" | "green" | "yellow") " apple, " [0-9] " grams"', "Describe an apple.",
     r"(red|green|yellow) apple, [0-9] grams"),  # GBNF
    ("grammar", 'start: "The answer is " ("A" | "B" | "C") "."', "Pick A, B or C.", r"The answer is [ABC]\."),  # Lark
]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_regex_choice_and_grammar_outputs_match_and_are_the_same_with_speculation(engine, sampling):
    """vLLM's structured outputs beyond JSON, each request of one batch with its own: every output matches whole and
    ends (EOS once the grammar is complete), with speculation on (perfect and random drafts) as off: greedy, and
    seeded (its tokens are plain decoding's with the same seed)."""
    params = [SamplingParams(max_tokens=24, guided=GuidedDecoding(kind, spec), **sampling)
              for kind, spec, _, _ in GUIDED_TEXT]
    prompts = [engine.encode_chat([{"role": "user", "content": q}]) for _, _, q, _ in GUIDED_TEXT]
    ref, perfect = plain_and_perfect(engine, prompts, params)
    noisy, _ = generate(engine, prompts, params, proposer=RandomProposer(engine.vocab_size, [4], seed=2))
    check = check_seeded_same_or_near_tie if sampling else check_same_or_near_tie
    for (_, _, _, pattern), prompt, p, r, a, b in zip(GUIDED_TEXT, prompts, params, ref, perfect, noisy):
        for out in (r, a, b):
            assert out.finish_reason == FinishReason.STOP and re.fullmatch(pattern, out.text), out.text
        for out in (a, b):
            if check(engine, prompt, r.token_ids, out.token_ids, p) is None:
                assert out.text == r.text


@pytest.mark.parametrize("where", ["masks", "commit"])
def test_a_grammar_that_fails_ends_its_request_alone(engine, monkeypatch, where):
    """llguidance may give up on a request (its parser past a per-step limit: ``ParserTooComplex``), after which its
    masks no longer hold: that request ends with ``FinishReason.ERROR`` and the reason, at the next verify step or
    commit, while the request beside it in the same steps decodes exactly as alone (it failed the whole step)."""
    from app.engine.grammar import GrammarError
    from app.engine.types import NewRequest

    prompt = engine.encode_chat([{"role": "user", "content": JSON_QUESTIONS["json_object"][1]}])
    plain = SamplingParams(max_tokens=12)
    (alone,), _ = generate(engine, [prompt], plain)
    guided = SamplingParams(max_tokens=12, guided=_guided("json_object"))
    outs = {o.request_id: [o] for o in engine.add_requests([NewRequest("json", prompt, guided),
                                                            NewRequest("plain", prompt, plain)])}
    grammar = engine._requests["json"].grammar

    def gives_up(*args, **kwargs):
        raise GrammarError("Parser Error: ParserTooComplex")

    monkeypatch.setattr(grammar, "block_masks" if where == "masks" else "commit", gives_up)
    while any(not o[-1].finished for o in outs.values()):
        live = [rid for rid, o in outs.items() if not o[-1].finished]
        for out in engine.verify([DraftBlock(rid, torch.zeros(0, dtype=torch.long)) for rid in live]):
            outs[out.request_id].append(out)
    failed = outs["json"][-1]
    assert failed.finish_reason == FinishReason.ERROR and "ParserTooComplex" in failed.error
    assert len([t for o in outs["json"] for t in o.new_token_ids]) <= 2  # it ended at once
    assert [t for o in outs["plain"] for t in o.new_token_ids] == alone.token_ids
    assert outs["plain"][-1].error is None and not engine.has_request("json")


def test_llguidance_giving_up_is_a_grammar_error_at_the_committed_state_and_a_cut_block_at_a_draft(engine, grammars):
    """A matcher past llguidance's per-step item limit (here set to 20) is in an error state for good: at the
    committed state that is a ``GrammarError`` (the engine ends the request); at a draft the block is cut there and
    the committed state is left as it was (speculation ends no request plain decoding would go on with)."""
    import llguidance

    from app.engine.grammar import GrammarError, RequestGrammar, _grammar

    def tight() -> RequestGrammar:
        limits = llguidance.LLParserLimits(step_max_items=20)
        matcher = llguidance.LLMatcher(grammars._tokenizer, _grammar(_guided("json_object")), log_level=0,
                                       limits=limits)
        return RequestGrammar(matcher, grammars)

    ids = engine.encode('{"name": "Ada", "age": 36')
    committed = tight()
    committed.commit(ids)
    with pytest.raises(GrammarError, match="Too many items"):
        committed.block_masks([])
    drafted = tight()
    kept, allowed = drafted.block_masks(ids)  # the parser gives up on the drafts
    assert kept < len(ids) and allowed.shape == (kept + 1, engine.vocab_size)
    assert not drafted._matcher.is_error()  # the committed state as it was: its mask holds again
    assert torch.equal(drafted.block_masks([])[1][0], allowed[0])


def _digits(engine) -> list[int]:
    return [_token(engine, str(d)) for d in range(10)]


def test_allowed_token_ids_cut_the_grammars_masks_and_a_state_with_none_left_is_a_grammar_error(engine, grammars):
    """Masks keep to the set: a draft the grammar allows but the set does not is cut like a forbidden one; a draft
    after which the grammar allows none of the set cuts the block before it; at the committed state that is a
    ``GrammarError`` (the engine ends the request)."""
    from app.engine.grammar import GrammarError

    digits, eos = _digits(engine), sorted(engine.eos_token_ids)
    grammar = grammars.matcher(GuidedDecoding("regex", r"[0-9]{1,3}\.[0-9]"), allowed_token_ids=digits + eos)
    one, two, three, dot = digits[1], digits[2], digits[3], _token(engine, ".")
    kept, allowed = grammar.block_masks([one, two, three])  # after three digits the regex wants "."
    assert kept == 2 and allowed.shape == (3, engine.vocab_size)
    assert allowed[0].nonzero().flatten().tolist() == sorted(digits)
    assert grammar.block_masks([one, dot])[0] == 1
    grammar.commit([one, two, three])
    with pytest.raises(GrammarError, match="allowed_token_ids hold none of the tokens the grammar allows"):
        grammar.block_masks([])


def test_a_grammar_that_allows_none_of_allowed_token_ids_ends_its_request_where_plain_decoding_does(engine):
    """Digits and EOS only: a JSON object cannot start (the request ends at its first token), a regex that wants a
    "." after three digits ends after them, one the digits complete ends with EOS; all with an error where plain
    decoding has one, with speculation on (perfect and random drafts) as off."""
    allowed = tuple(_digits(engine) + sorted(engine.eos_token_ids))
    guided = [GuidedDecoding("json_object"), GuidedDecoding("regex", r"[0-9]{1,3}\.[0-9]"),
              GuidedDecoding("regex", r"[0-9]{1,3}(\.[0-9]{1,2})?")]
    params = [SamplingParams(max_tokens=12, allowed_token_ids=allowed, guided=g) for g in guided]
    prompt = engine.encode_chat([{"role": "user", "content": "What is 12.5 times 3? Answer with the number only."}])
    ref, perfect = plain_and_perfect(engine, [prompt] * len(params), params)
    noisy, _ = generate(engine, [prompt] * len(params), params, proposer=RandomProposer(engine.vocab_size, [4], seed=2))
    for p, r, a, b in zip(params, ref, perfect, noisy):
        assert set(r.token_ids) <= set(allowed) and r.token_ids[-1] in engine.eos_token_ids
        for spec in (a, b):
            check_same_or_near_tie(engine, prompt, r.token_ids, spec.token_ids, p)
            assert spec.finish_reason == r.finish_reason
    assert [r.finish_reason for r in ref] == [FinishReason.ERROR, FinishReason.ERROR, FinishReason.STOP]
    assert len(ref[0].token_ids) == 1 and len(ref[1].token_ids) == 4
    assert "allowed_token_ids hold none of the tokens the grammar allows" in ref[1].error
    assert re.fullmatch(r"[0-9]{1,3}", ref[2].text) and sum(x.num_accepted for x in perfect) > 0


def test_a_grammar_is_read_as_gbnf_only_where_it_defines_rules_so(grammars):
    """GBNF defines rules with ``name ::=`` at a line's start; a Lark grammar may hold "::=" in a literal."""
    grammars.matcher(GuidedDecoding("grammar", 'start: "a ::= b"'))
    grammars.matcher(GuidedDecoding("grammar", '# GBNF\n  root ::= "a" | "b"'))


def test_drafts_the_grammar_forbids_are_cut_before_verification(engine, grammars):
    params = SamplingParams(max_tokens=64, guided=_guided("json_schema"))
    prompt = engine.encode_chat([{"role": "user", "content": JSON_QUESTIONS["json_schema"][0]}])
    (ref,), _ = generate(engine, [prompt], params)
    tokens = ref.token_ids

    def forbidden_after(prefix: list[int]) -> int:  # a token the grammar forbids after ``prefix``
        grammar = grammars.matcher(params.guided)
        grammar.commit(prefix)
        return int((~grammar.block_masks([])[1][0]).nonzero()[0])

    first = engine.add_request("cut", prompt, params)
    assert first.new_token_ids == tokens[:1]
    (out,) = engine.verify([DraftBlock("cut", torch.tensor([forbidden_after(tokens[:1]), *tokens[1:3]]))])
    assert out.num_draft == 0 and out.new_token_ids == tokens[1:2]
    (out,) = engine.verify([DraftBlock("cut", torch.tensor([*tokens[2:4], forbidden_after(tokens[:4]), *tokens[4:6]]))])
    assert out.num_draft == 2 and out.num_accepted == 2 and out.new_token_ids == tokens[2:5]
    engine.release("cut")


def test_whitespace_between_json_tokens_is_bounded(engine, grammars):
    """A small model can pad JSON with whitespace forever: at most JSON_WHITESPACE's 24 characters in a row."""
    grammar = grammars.matcher(GuidedDecoding("json_object"))
    grammar.commit(engine.encode("{"))
    newline = _token(engine, "\n")
    allowed = 0
    while allowed < 40 and bool(grammar.block_masks([])[1][0, newline]):
        grammar.commit([newline])
        allowed += 1
    assert allowed == 24
    assert bool(grammar.block_masks([])[1][0, _token(engine, '"')])  # the object goes on


def test_sampled_json_schema_is_always_valid_under_speculation(engine):
    prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in JSON_QUESTIONS["json_schema"]] * 3
    params = [SamplingParams(max_tokens=64, temperature=0.8, top_k=20, seed=i, guided=_guided("json_schema"))
              for i in range(len(prompts))]
    results, _ = generate(engine, prompts, params, proposer=NgramProposer(gamma=5))
    for r in results:
        _check_json("json_schema", r)


def test_sampled_drafts_the_grammar_forbids_are_rejected_not_cut(engine):
    """Rejection sampling against a draft distribution q must see a draft the grammar forbids (target probability 0)
    and draw from the residual (p - q)+ there; cutting the block before it draws from p instead, and the output leans
    to the tokens q favours. One-token blocks with q = w on an allowed token a (w = p(a)) and 1 - w on a forbidden
    one: P(a) is p(a) when exact, w + (1 - w) p(a) = p(a) + p(a)(1 - p(a)) when cut. z-test of the count of a.
    The 384 copies of the prompt are prefilled by an engine with prefix caching (``engine``'s weights)."""
    from app.engine.config import EngineConfig
    from app.engine.engine import TargetEngine
    from app.engine.logits_process import sampling_probs
    from app.engine.near_tie import processed_logits
    from app.engine.types import NewRequest

    engine = TargetEngine(EngineConfig(max_num_seqs=24, max_model_len=512), loaded=engine.target)

    params = SamplingParams(max_tokens=4, temperature=1.0, guided=_guided("json_object"))
    prompt = engine.encode_chat([{"role": "user", "content": JSON_QUESTIONS["json_object"][0]}])
    draws, targets = torch.Generator().manual_seed(0), {}

    def target(first: int) -> tuple[float, int, int]:  # p(a), a, a forbidden token, after the first output token
        if first not in targets:
            p = sampling_probs(processed_logits(engine, prompt, params, [first])[None], params)[0]
            a = int((p * (1 - p)).argmax())
            targets[first] = float(p[a]), a, int((p == 0).nonzero()[0])
        return targets[first]

    hits, expected, variance = 0, 0.0, 0.0
    for batch in range(16):
        reqs = [NewRequest(f"forbidden-{batch}-{i}", prompt, params) for i in range(24)]
        firsts = [out.new_token_ids[0] for out in engine.add_requests(reqs)]
        blocks = []
        for req, first in zip(reqs, firsts):
            pa, a, f = target(first)
            w = min(max(pa, 0.05), 0.95)
            q = torch.zeros(engine.vocab_size)
            q[a], q[f] = w, 1 - w
            x = a if torch.rand(1, generator=draws).item() < w else f
            blocks.append(DraftBlock(req.request_id, torch.tensor([x]), q[None]))
        outs = engine.verify(blocks)
        assert [o.num_draft for o in outs] == [1] * len(outs)  # the forbidden drafts are verified too
        for req, first, out in zip(reqs, firsts, outs):
            pa, a, _ = target(first)
            hits += out.new_token_ids[0] == a
            expected, variance = expected + pa, variance + pa * (1 - pa)
            if not out.finished:
                engine.release(req.request_id)
    # cutting would add sum p(a)(1 - p(a)) = variance outputs of a: z = sqrt(variance) under that rule
    assert variance ** 0.5 >= 6, f"too little power: z = {variance ** 0.5:.1f} for a cut block"
    z = (hits - expected) / variance ** 0.5
    assert abs(z) < 4, f"{hits} outputs of the favoured token against {expected:.1f} expected (z = {z:.1f})"
