"""Bad input raises a clear engine error and leaves the engine usable (no slot or cache corruption)."""

from __future__ import annotations

import pytest
import torch

from app.loop import generate
from app.engine.errors import ContextLengthError, InvalidRequestError, UnknownRequestError
from app.engine.types import DraftBlock, GuidedDecoding, SamplingParams


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": ("",)}, "stop"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 8, "min_tokens": 50}, "min_tokens"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"temperature": "0.7"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": True}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_tokens": "1"}, "min_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"ignore_eos": "false"}, "ignore_eos"),
        ({"stop_token_ids": (True,)}, "stop_token_ids"),
        ({"logit_bias": ((1.7, 1.0),)}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": (3, -1)}, "allowed_token_ids"),
        ({"allowed_token_ids": (True,)}, "allowed_token_ids"),
        ({"allowed_token_ids": (2.0,)}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": ("",)}, "bad_words"),
        ({"bad_words": (" ",)}, "bad_words"),
        ({"bad_words": (5,)}, "bad_words"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    """An InvalidRequestError (a ValueError) whose message and ``param`` name the field."""
    with pytest.raises(InvalidRequestError, match=match) as err:
        SamplingParams(**kwargs)
    assert err.value.param == match


def test_allowed_token_ids_are_a_sorted_set_and_a_control():
    """Distinct ids in order, whatever the order or repeats given; a control: greedy takes the full-vocabulary path."""
    params = SamplingParams(allowed_token_ids=[9, 3, 9, 0])
    assert params.allowed_token_ids == (0, 3, 9)
    assert params.controls() == ["allowed_token_ids"] and params.greedy and params.full_logits
    assert SamplingParams().allowed_token_ids is None and not SamplingParams().controls()


def test_temperature_too_small_to_divide_by_is_greedy():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=1e-6).temperature == 0.0
    assert not SamplingParams(temperature=1e-3).greedy


def test_a_failure_after_the_slot_is_taken_gives_it_back(engine, monkeypatch):
    free = engine.num_free_slots

    def broken_decide(*args, **kwargs):
        raise RuntimeError("injected sampling failure")

    monkeypatch.setattr(engine, "_decide", broken_decide)
    with pytest.raises(RuntimeError, match="injected"):
        engine.add_request("s", [1, 2, 3], SamplingParams())
    assert engine.num_free_slots == free and not engine.has_request("s")


@pytest.mark.parametrize("kind, spec, match", [
    ("bogus", None, "kind must be one of json_object, json_schema, regex, choice, grammar"),
    ("regex", None, "a spec goes with every kind but json_object"),
    ("json_object", "{}", "a spec goes with every kind but json_object"),
    ("choice", "[]", "choice: the choices must be one or more non-empty strings"),
    ("choice", '["a", ""]', "choice: the choices must be one or more non-empty strings"),
    ("choice", "a, b", "choice: the choices must be one or more non-empty strings"),
])
def test_structured_output_values_are_checked_by_name(kind, spec, match):
    with pytest.raises(InvalidRequestError, match=match) as err:
        GuidedDecoding(kind, spec)
    assert err.value.param == "guided"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"logit_bias": ((49152, 1.0),)}, "49152"),
        ({"stop_token_ids": (2, 10**6)}, "1000000"),
        ({"guided": GuidedDecoding("json_object"), "ignore_eos": True}, "ignore_eos"),
        ({"guided": GuidedDecoding("json_object"), "min_tokens": 3}, "min_tokens"),
        ({"guided": GuidedDecoding("json_schema", '{"type": "objectx"}')}, "objectx"),
        ({"guided": GuidedDecoding("json_schema", "[1, 2")}, "json_schema"),
        ({"guided": GuidedDecoding("json_schema", '{"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}')},
         "admits no JSON value"),
        ({"guided": GuidedDecoding("regex", "(unclosed")}, "regex: unsupported regex: (.|\n)*unclosed group"),
        ({"guided": GuidedDecoding("grammar", "start: foo")}, "grammar: unsupported grammar: .*unknown name"),
        ({"guided": GuidedDecoding("grammar", "root ::= foo")}, "not a GBNF grammar llguidance reads: .*'foo'"),
        ({"allowed_token_ids": (5, 49152)}, "49152"),
        ({"allowed_token_ids": (2,), "min_tokens": 1}, r"\[2\] are all end tokens .* min_tokens=1 masks"),
        ({"allowed_token_ids": (2, 7), "stop_token_ids": (7,), "min_tokens": 2}, r"\[2, 7\] are all end tokens"),
        ({"allowed_token_ids": (5, 7), "guided": GuidedDecoding("json_object")},
         r"structured output \(json_object\) ends at EOS .*allowed_token_ids must hold an EOS token \(\[2\]\)"),
        ({"bad_words": ("x",), "guided": GuidedDecoding("json_object")}, "could leave no token"),
        ({"bad_words": ("x",), "allowed_token_ids": (5, 7)}, "could leave no token"),
    ],
)
def test_bad_controls_are_refused_before_taking_a_slot(engine, kwargs, match):
    """The error's ``param`` is the field listed first (a structured-output combination: ``guided``)."""
    free = engine.num_free_slots
    with pytest.raises(InvalidRequestError, match=match) as err:
        engine.add_request("ctl", [1, 2, 3], SamplingParams(max_tokens=4, **kwargs))
    assert engine.num_free_slots == free and not engine.has_request("ctl")
    assert err.value.param == next(iter(kwargs))


def test_allowed_end_tokens_under_min_tokens_pass_where_they_are_not_masked(engine):
    """With ``ignore_eos`` EOS is no end token (min_tokens does not mask it), and a set with one other token leaves
    that token: both generate until max_tokens."""
    for kwargs in ({"allowed_token_ids": (2,), "ignore_eos": True}, {"allowed_token_ids": (2, 7)}):
        out = engine.add_request("ends", [1, 2, 3], SamplingParams(max_tokens=2, min_tokens=2, **kwargs))
        assert out.new_token_ids == ([2] if "ignore_eos" in kwargs else [7]) and not out.finished
        engine.release("ends")


def test_a_chat_template_that_refuses_the_messages_is_a_request_error(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="chat template refuses these messages: roles must alternate") as err:
        engine.encode_chat([{"role": "user", "content": "hi"}])
    assert err.value.param == "prompt"


def test_a_model_without_a_chat_template_refuses_chat_prompts_only(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)  # a base model's tokenizer
    with pytest.raises(InvalidRequestError, match="has no chat template .*send a raw prompt to /v1/completions") as err:
        engine.encode_chat([{"role": "user", "content": "hi"}])
    assert err.value.param == "prompt"
    assert engine.encode("hi")


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    assert not engine.has_request("e")


def test_prompt_token_outside_vocab(engine):
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("v", [1, engine.vocab_size], SamplingParams())


def test_prompt_over_context_limit_counts_max_tokens_not_the_draft_block(engine):
    """vLLM's rule: prompt + max_tokens <= max_model_len (the cache holds the draft block's room past the limit)."""
    free = engine.num_free_slots
    limit = engine.config.max_model_len
    with pytest.raises(ContextLengthError, match=f"prompt of {limit - 10} tokens \\+ max_tokens 11 = {limit + 1} "
                                                 f"exceeds the context limit of {limit} tokens") as err:
        engine.add_request("long", [1] * (limit - 10), SamplingParams(max_tokens=11))
    assert err.value.param == "max_tokens"  # a smaller max_tokens fits
    with pytest.raises(ContextLengthError) as err:
        engine.add_request("long", [1] * (limit + 1), SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    assert engine.num_free_slots == free
    engine.add_request("long", [1] * (limit - 10), SamplingParams(max_tokens=10))  # fills the context exactly
    engine.release("long")


def test_duplicate_request_id(engine):
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="already exists"):
        engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.release("dup")


def test_verify_unknown_and_released_requests(engine):
    with pytest.raises(UnknownRequestError, match="unknown request"):
        engine.verify([DraftBlock("nope", torch.tensor([1]))])
    engine.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.release("gone")
    with pytest.raises(UnknownRequestError):
        engine.verify([DraftBlock("gone", torch.tensor([1]))])
    with pytest.raises(UnknownRequestError):
        engine.release("gone")


def test_bad_draft_leaves_batch_untouched(engine):
    """A batch with one bad block raises before any forward: the good request's state is unchanged."""
    prompt = engine.encode("Once upon a time")
    first = engine.add_request("good", prompt, SamplingParams(max_tokens=6))
    engine.add_request("bad", prompt, SamplingParams(max_tokens=6))
    bad_blocks = [
        DraftBlock("bad", torch.tensor([engine.vocab_size])),
        DraftBlock("bad", torch.tensor([-1])),
        DraftBlock("bad", torch.zeros(engine.config.max_draft_len + 1, dtype=torch.long)),
        DraftBlock("bad", torch.tensor([1, 2]), probs=torch.ones(2, 7)),
        DraftBlock("bad", torch.tensor([1, 2]), probs=torch.ones(2, 3), prob_ids=torch.ones(2, 2, dtype=torch.long)),
        DraftBlock("bad", torch.tensor([1, 2]), probs=torch.ones(2, 2), prob_ids=torch.tensor([[1, 2], [3, 3]])),
        DraftBlock("bad", torch.tensor([1, 2]), probs=torch.ones(2, 1),
                   prob_ids=torch.tensor([[1], [engine.vocab_size]])),
        DraftBlock("bad", torch.tensor([1, 2]), probs=torch.ones(1, 1), prob_ids=torch.tensor([[1]])),
    ]
    for bad in bad_blocks:
        with pytest.raises(InvalidRequestError):
            engine.verify([DraftBlock("good", torch.tensor([1, 2])), bad])
    with pytest.raises(InvalidRequestError, match="twice"):
        engine.verify([DraftBlock("good", torch.tensor([1])), DraftBlock("good", torch.tensor([1]))])
    # The good request continues exactly as a plain decode of the same prompt.
    tokens = list(first.new_token_ids)
    while engine.has_request("good"):
        (out,) = engine.verify([DraftBlock("good", torch.zeros(0, dtype=torch.long))])
        tokens += out.new_token_ids
    engine.release("bad")
    (ref,), _ = generate(engine, [prompt], SamplingParams(max_tokens=6))
    assert tokens == ref.token_ids


@pytest.mark.parametrize("param", ["logit_bias", "stop_token_ids", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_name_their_field(engine, param):
    """A token id past the vocabulary in ``logit_bias``, ``stop_token_ids`` or ``allowed_token_ids`` is refused at
    admission with the field named (the serving layer answers it as the OpenAI error's ``param``), and nothing is left
    in the engine."""
    bad = engine.vocab_size + 5
    params = SamplingParams(**({"logit_bias": ((bad, 1.0),)} if param == "logit_bias" else {param: (bad,)}))
    free = engine.num_free_slots
    with pytest.raises(InvalidRequestError, match=rf"{param}: token ids \[{bad}\] are outside") as err:
        engine.add_request("out-of-vocab", [1, 2, 3], params)
    assert err.value.param == param and engine.num_free_slots == free and not engine.has_request("out-of-vocab")
