"""The OpenAI request schemas without a server: each request field reaches ``SamplingParams`` as documented, the
logprobs JSON shapes, ``GET /metrics``' text, the JSON depth check and the ingress admission limit."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from pydantic import ValidationError

from app.engine.errors import InvalidRequestError
from app.engine.types import ChatTemplateOptions, GuidedDecoding
from app.serving.config import AppConfig
from app.serving.ingress import admission_limit
from prometheus_client.parser import text_string_to_metric_families

from app.serving.metrics import prometheus_text
from app.serving.openai_api import (
    ChatCompletionRequest, CompletionRequest, chat_logprobs, completion_logprobs, json_too_deep, validation_error,
)
from app.serving.protocol import FALLBACK_CAUSES, SpecCounters, TokenLogprobText
from app.serving.responses import ResponsesRequest

MESSAGES = [{"role": "user", "content": "hi"}]

# request field and value -> the SamplingParams field and value it must produce
MAPPED = [
    ({"max_completion_tokens": 7}, "max_tokens", 7),
    ({"max_tokens": 9}, "max_tokens", 9),
    ({"temperature": 0.5}, "temperature", 0.5),
    ({"top_p": 0.8}, "top_p", 0.8),
    ({"seed": 11}, "seed", 11),
    ({"stop": "x"}, "stop", ("x",)),
    ({"stop": ["x", "y"]}, "stop", ("x", "y")),
    ({"presence_penalty": 0.5}, "presence_penalty", 0.5),
    ({"frequency_penalty": -0.5}, "frequency_penalty", -0.5),
    ({"repetition_penalty": 1.2}, "repetition_penalty", 1.2),
    ({"logit_bias": {"42": -100, "7": 5}}, "logit_bias", ((42, -100.0), (7, 5.0))),
    ({"top_k": 40}, "top_k", 40),
    ({"top_k": -1}, "top_k", 0),
    ({"min_p": 0.05}, "min_p", 0.05),
    ({"min_tokens": 3}, "min_tokens", 3),
    ({"stop_token_ids": [2, 5]}, "stop_token_ids", (2, 5)),
    ({"bad_words": ["foo bar", "baz"]}, "bad_words", ("foo bar", "baz")),
    ({"allowed_token_ids": [9, 2, 9]}, "allowed_token_ids", (2, 9)),
    ({}, "allowed_token_ids", None),
    ({"ignore_eos": True}, "ignore_eos", True),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", True),
    ({"skip_special_tokens": False}, "skip_special_tokens", False),
    ({"logprobs": True}, "logprobs", 0),
    ({"logprobs": True, "top_logprobs": 5}, "logprobs", 5),
    ({"response_format": {"type": "json_object"}}, "guided", GuidedDecoding("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
     "guided", GuidedDecoding("json_schema", json.dumps({"type": "object"}))),
    ({"response_format": {"type": "text"}}, "guided", None),
    ({"structured_outputs": {"choice": ["a", "b c"]}}, "guided", GuidedDecoding("choice", '["a", "b c"]')),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "guided", GuidedDecoding("regex", "[0-9]+")),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "guided", GuidedDecoding("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"json": {"type": "object"}}}, "guided",
     GuidedDecoding("json_schema", '{"type": "object"}')),
    ({"structured_outputs": {"json_object": True}}, "guided", GuidedDecoding("json_object")),
]


@pytest.mark.parametrize("fields,param,value", MAPPED, ids=[f"{p}={v}" for _, p, v in MAPPED])
def test_chat_fields_reach_sampling_params(fields, param, value):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})
    assert getattr(req.params(), param) == value


COMPLETIONS_MAPPED = [m for m in MAPPED if not {"max_completion_tokens", "logprobs"} & set(m[0])]  # chat's own


@pytest.mark.parametrize("fields,param,value", COMPLETIONS_MAPPED, ids=[f"{p}={v}" for _, p, v in COMPLETIONS_MAPPED])
def test_completion_fields_reach_sampling_params(fields, param, value):
    """The fields both endpoints share act alike (``response_format`` on completions too, as vLLM has it)."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "a", **fields})
    assert getattr(req.params(), param) == value


def test_defaults_seeds_per_choice_and_completion_logprobs():
    params = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES}).params()
    assert (params.temperature, params.top_p, params.max_tokens, params.logprobs) == (1.0, 1.0, 256, None)
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "n": 3, "seed": 2**63 - 1})
    assert [req.params(j).seed for j in range(3)] == [2**63 - 1, -(2**63), -(2**63) + 1]  # wraps within int64
    req = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "logprobs": 3, "n": 2})
    assert req.prompts == ["a", "b"] and req.params().logprobs == 3 and req.num_choices == 2
    assert req.params().max_tokens == 16  # completions: OpenAI's (and vLLM's) default
    assert req.params().prompt_logprobs is None
    echoed = CompletionRequest.model_validate({"model": "m", "prompt": "a", "logprobs": 3, "echo": True})
    assert (echoed.params().logprobs, echoed.params().prompt_logprobs) == (3, 3)  # the echoed prompt is scored
    assert CompletionRequest.model_validate({"model": "m", "prompt": "a", "echo": True}).params().prompt_logprobs \
        is None
    prompt_only = CompletionRequest.model_validate({"model": "m", "prompt": "a", "logprobs": 1, "echo": True,
                                                    "max_tokens": 0})
    assert prompt_only.prompt_only and prompt_only.params().max_tokens == 1  # one token sampled, left out
    both = CompletionRequest.model_validate({"model": "m", "prompt": "a", "logprobs": 1, "echo": True,
                                             "prompt_logprobs": 4})
    assert (both.params().prompt_logprobs, both.echoed_logprobs) == (4, 1)  # scored once, for the larger view
    assert (req.add_special_tokens, ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES})
            .add_special_tokens) == (True, False)  # vLLM's defaults: a chat template writes its own BOS
    asked = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "prompt_logprobs": 0, "n": 2})
    assert [asked.params(j).prompt_logprobs for j in range(2)] == [0, None]  # one prompt: scored for one choice


REFUSED = [  # request -> the field the 400 must name
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": MESSAGES, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0"),
    ({"messages": MESSAGES, "tools": [{"function": {"name": "f"}}]}, "tools.0.type"),
    ({"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": MESSAGES, "reasoning_effort": "low"}, "reasoning_effort"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),  # a cross-field check, still named
    ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "logit_bias": {"\u0661\u0660": 1}}, "logit_bias"),  # Arabic-Indic digits: "10" to int()
    ({"messages": MESSAGES, "logit_bias": {"0" * 5000 + "5": 1}}, "logit_bias"),  # past Python's int() limit
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),  # a chat has no echo
    ({"messages": MESSAGES, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"messages": MESSAGES, "structured_outputs": {}}, "structured_outputs"),
    ({"messages": MESSAGES, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"messages": MESSAGES, "structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"messages": MESSAGES, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"prompt": "a", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"prompt": "a", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"prompt": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"prompt": "a", "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ({"messages": MESSAGES, "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"messages": MESSAGES, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"messages": MESSAGES, "truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM's rule: not streamed
    ({"messages": MESSAGES, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),  # 0 too (0 == False)
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # the prompt alone needs echo
    ({"prompt": "a", "max_tokens": 0, "echo": True, "min_tokens": 2}, "min_tokens"),
    ({"messages": MESSAGES, "logit_bias": {"\uff15": 1}}, "logit_bias"),  # a fullwidth 5
    ({"messages": MESSAGES, "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a superscript 2: a digit int() refuses
    ({"messages": MESSAGES, "top_k": -5}, "top_k"),
    ({"messages": MESSAGES, "top_k": 2.5}, "top_k"),
    ({"messages": MESSAGES, "unknown_thing": 1}, "unknown_thing"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
     "messages.0.content.1.text"),  # a content part's error names the part
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]},
     "messages.0.content.1.type"),
    ({"messages": [{"role": "user", "content": [{"type": ["image"] * 100}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}]},
     "messages.0.content.1.text"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "best_of": 2}, "best_of"),  # combinations of fields: the one to change
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": ["a"] * 5, "n": 4}, "n"),
    ({"prompt": [1, -2, 3]}, "prompt"),
    ({"prompt": [[1, 2], [True]]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    # nothing is coerced: a value of the wrong JSON type is a 400 naming its field
    ({"messages": MESSAGES, "temperature": "0.5"}, "temperature"),
    ({"messages": MESSAGES, "temperature": True}, "temperature"),
    ({"messages": MESSAGES, "max_tokens": True}, "max_tokens"),
    ({"messages": MESSAGES, "seed": "1"}, "seed"),
    ({"messages": MESSAGES, "n": 2.0}, "n"),
    ({"messages": MESSAGES, "stream": "yes"}, "stream"),
    ({"messages": MESSAGES, "stream": 1}, "stream"),
    ({"messages": MESSAGES, "logprobs": "true"}, "logprobs"),
    ({"messages": MESSAGES, "logit_bias": {"28": "5"}}, "logit_bias"),
    ({"messages": MESSAGES, "stop_token_ids": ["30"]}, "stop_token_ids.0"),
    ({"messages": MESSAGES, "allowed_token_ids": ["30"]}, "allowed_token_ids.0"),
    ({"prompt": "a", "allowed_token_ids": [1.0]}, "allowed_token_ids.0"),
    ({"messages": MESSAGES, "allowed_token_ids": 30}, "allowed_token_ids"),
    ({"messages": MESSAGES, "ignore_eos": "yes"}, "ignore_eos"),
    ({"messages": MESSAGES, "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    # text that is not Unicode (a lone surrogate, as a JSON "\ud800" escape decodes) never reaches the tokenizer
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages.0.content.0.text"),
    ({"prompt": ["ok", "\ud800"]}, "prompt"),
    # streaming-only and non-streaming-only options
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"messages": MESSAGES, "stream": True, "return_token_ids": True}, "return_token_ids"),
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[str(b)[:60] for b, _ in REFUSED])
def test_unsupported_fields_are_400s_naming_them(body, param):
    schema = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(ValidationError) as err:
        schema.model_validate({"model": "m", **body})
    item = validation_error(err.value)
    assert item.status == 400 and item.param == param, item
    assert item.message and "Value error" not in item.message and len(item.message) < 300


@pytest.mark.parametrize("schema,body", [
    (ChatCompletionRequest, {"messages": MESSAGES, "allowed_token_ids": []}),
    (CompletionRequest, {"prompt": "a", "allowed_token_ids": [3, -1]}),
])
def test_allowed_token_ids_sampling_params_refuse_name_the_field(schema, body):
    """An empty list or a negative id passes the schema and is refused building the engine's settings, which the
    ingress answers as a 400 with this ``param``."""
    req = schema.model_validate({"model": "m", **body})
    with pytest.raises(InvalidRequestError, match="allowed_token_ids must be one or more token ids >= 0") as err:
        req.params()
    assert err.value.param == "allowed_token_ids"


def test_neutral_values_of_options_this_server_lacks_are_accepted_and_bad_prompts_named_by_kind():
    for field, value in (("reasoning_effort", "none"), ("tool_choice", "none"), ("tools", [])):
        ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, field: value})
    for prompt, message in (([[1, 2], [-3]], "prompt token ids must be integers >= 0"),
                            ([["a"]], "prompt must be a string, a list of strings, a list of token ids or a list of "
                                      "lists of token ids")):
        with pytest.raises(ValidationError) as err:
            CompletionRequest.model_validate({"model": "m", "prompt": prompt})
        item = validation_error(err.value)
        assert item.param == "prompt" and message in item.message, item


@pytest.mark.parametrize("body,message", [
    ({"stop": 5}, "stop: Input should be a valid string or a valid list"),
    ({"stop": ["a", 5]}, "stop.1: Input should be a valid string"),
    ({"messages": [{"role": "user", "content": 5}]},
     "messages.0.content: Input should be a valid string or a valid list"),
    ({"tool_choice": 5}, 'tool_choice: a named tool_choice is {"type": "function", "function": {"name": '
     '...}}; the others are "none", "auto" and "required" (got 5)'),
    ({"seed": "a"}, "seed: Input should be a valid integer"),
    ({"input": 123}, "input: Input should be a valid list or a valid string"),
])
def test_a_value_of_none_of_a_fields_types_is_told_every_type(body, message):
    schema, base = (ResponsesRequest, {}) if "input" in body else (ChatCompletionRequest, {"messages": MESSAGES})
    with pytest.raises(ValidationError) as err:
        schema.model_validate({"model": "m", **base, **body})
    assert validation_error(err.value).message == message


@pytest.mark.parametrize("prompt,prompts", [("ab", ["ab"]), (["ab", "c"], ["ab", "c"]), ([5, 0, 7], [[5, 0, 7]]),
                                            ([[5], [0, 7]], [[5], [0, 7]])])
def test_the_four_prompt_shapes_give_their_prompts(prompt, prompts):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts == prompts


def test_text_parts_join_with_newlines():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "refusal": None, "tool_calls": []}]})
    assert req.chat_messages() == [{"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "c"}]


ENTRIES = [TokenLogprobText(" w1", -0.5, ((" w1", -0.5), (" w2", -1.5))), TokenLogprobText("é", -0.25, ())]


def test_logprobs_json_shapes():
    chat = chat_logprobs(ENTRIES)
    assert chat["refusal"] is None and len(chat["content"]) == 2
    assert chat["content"][0] == {"token": " w1", "logprob": -0.5, "bytes": [32, 119, 49], "top_logprobs": [
        {"token": " w1", "logprob": -0.5, "bytes": [32, 119, 49]},
        {"token": " w2", "logprob": -1.5, "bytes": [32, 119, 50]}]}
    assert chat["content"][1]["bytes"] == [0xC3, 0xA9] and chat["content"][1]["top_logprobs"] == []
    partial = TokenLogprobText("\ufffd", -0.1, (("\ufffd", -0.1), ("a", -2.0)), token_bytes=b"\xf0\x9f",
                               top_bytes=(b"\xf0\x9f", b"a"))
    own = chat_logprobs([partial])["content"][0]  # a token ending inside a character: its own bytes, not U+FFFD's
    assert own["bytes"] == [0xF0, 0x9F] and [t["bytes"] for t in own["top_logprobs"]] == [[0xF0, 0x9F], [97]]
    text = completion_logprobs(ENTRIES, offset=4)
    assert text == {"tokens": [" w1", "é"], "token_logprobs": [-0.5, -0.25], "text_offset": [4, 7],
                    "top_logprobs": [{" w1": -0.5, " w2": -1.5}, {"é": -0.25}]}
    # a character split over two tokens: both start where it does (each token decoded alone reads U+FFFD)
    split = [TokenLogprobText("a", -0.1, text_len=1), TokenLogprobText("\ufffd", -0.1, text_len=0),
             TokenLogprobText("\ufffd", -0.1, text_len=1), TokenLogprobText("b", -0.1, text_len=1)]
    assert completion_logprobs(split, offset=0)["text_offset"] == [0, 1, 1, 2]  # the text is "a🌟b"
    prompt = [TokenLogprobText("Hi", None, text_len=2), TokenLogprobText(" there", -3.0, (("!", -0.5),), text_len=6)]
    echoed = completion_logprobs(ENTRIES, offset=8, prompt=prompt)  # echo "Hi there", then the answer
    assert echoed == {"tokens": ["Hi", " there", " w1", "é"], "token_logprobs": [None, -3.0, -0.5, -0.25],
                      "text_offset": [0, 2, 8, 11],
                      "top_logprobs": [None, {"!": -0.5, " there": -3.0}, {" w1": -0.5, " w2": -1.5}, {"é": -0.25}]}
    # an echoed "a🌟" split over two tokens: the text its tokens bring, not their lone decodes' U+FFFD
    split_prompt = [TokenLogprobText("a", None, text_len=1), TokenLogprobText("\ufffd", -1.0, text_len=0),
                    TokenLogprobText("\ufffd", -1.0, text_len=1)]
    assert completion_logprobs(ENTRIES, offset=2, prompt=split_prompt)["text_offset"] == [0, 1, 1, 2, 5]
    # vLLM's return_tokens_as_token_ids: tokens named by id, their bytes those of the name, offsets still the text's
    ids = [dataclasses.replace(e, token_id=i, top_ids=tuple(range(10 * i, 10 * i + len(e.top)))) for i, e in
           enumerate(ENTRIES, start=1)]
    named = chat_logprobs(ids, token_ids=True)["content"][0]
    assert (named["token"], named["bytes"]) == ("token_id:1", list(b"token_id:1"))
    assert [t["token"] for t in named["top_logprobs"]] == ["token_id:10", "token_id:11"]
    assert completion_logprobs(ids, offset=4, token_ids=True) == {
        "tokens": ["token_id:1", "token_id:2"], "token_logprobs": [-0.5, -0.25], "text_offset": [4, 7],
        "top_logprobs": [{"token_id:10": -0.5, "token_id:11": -1.5, "token_id:1": -0.5}, {"token_id:2": -0.25}]}


def test_metrics_text_has_vllm_spec_decode_counters():
    counters = SpecCounters()
    counters.add_round([3, 0, 2], [2, 0, 2], round_ms=30.0, verify_ms=20.0, drafter_wait_ms=5.0,
                       verify_cpu_wait_ms=1.5)
    counters.add_round([3], [0], round_ms=12.5, verify_ms=10.0)
    counters.fallbacks = {"timeout": 2, "drafter_error": 1}
    counters.prefix_cache_queries, counters.prefix_cache_hits = 40, 30
    total = counters + SpecCounters(drafts=1, draft_tokens=1, accepted_tokens=1, accepted_per_pos=[1],
                                    fallbacks={"timeout": 1, "a_new_cause": 1}, prefix_cache_queries=9,
                                    output_tokens=17, requests_finished=5, requests_length=3, requests_cancelled=2)
    one, other = SpecCounters(), SpecCounters()  # two replicas' request histograms
    for ttft in (0.03, 0.3):
        one.ttft_s.observe(ttft)
    other.ttft_s.observe(3000.0)  # above the last edge
    other.itl_s.observe(0.01)  # on an edge: counted in its bucket (le)
    total = total + one + other
    text = prometheus_text(total, model_name='m"x', positions=4, running=3, waiting=2)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    label = 'model_name="m\\"x"'
    assert samples[f"vllm:spec_decode_num_drafts_total{{{label}}}"] == "4"
    assert samples[f"vllm:spec_decode_num_draft_tokens_total{{{label}}}"] == "9"
    assert samples[f"vllm:spec_decode_num_accepted_tokens_total{{{label}}}"] == "5"
    assert samples[f"dspark_spec_decode_accepted_tokens_total{{{label}}}"] == "5"
    per_pos = [samples[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{k}"}}']
               for k in range(4)]
    assert per_pos == ["3", "2", "0", "0"]
    assert [float(samples[f"dspark_{name}_total{{{label}}}"]) for name in (
        "rounds", "round_requests", "round_seconds", "verify_seconds", "drafter_wait_seconds",
        "verify_cpu_wait_seconds")] == pytest.approx([2, 4, 0.0425, 0.03, 0.005, 0.0015])
    assert (samples[f"vllm:prefix_cache_queries_total{{{label}}}"], samples[f"vllm:prefix_cache_hits_total{{{label}}}"],
            samples[f"dspark_prefix_cache_hits_total{{{label}}}"]) == ("49", "30", "30")
    assert samples[f"vllm:prompt_tokens_total{{{label}}}"] == "49"
    generated = samples[f"vllm:generation_tokens_total{{{label}}}"]
    assert generated == samples[f"dspark_output_tokens_total{{{label}}}"] == "17"
    assert [samples[f'vllm:request_success_total{{{label},finished_reason="{reason}"}}']
            for reason in ("stop", "length", "abort")] == ["2", "3", "2"]
    assert (samples[f"vllm:num_requests_running{{{label}}}"], samples[f"vllm:num_requests_waiting{{{label}}}"]) == \
        ("3", "2")
    fallbacks = {cause: samples[f'dspark_fallbacks_total{{{label},cause="{cause}"}}']
                 for cause in (*FALLBACK_CAUSES, "a_new_cause")}
    assert fallbacks == {**{cause: "0" for cause in FALLBACK_CAUSES}, "timeout": "3", "drafter_error": "1",
                         "a_new_cause": "1"}  # every known cause from zero, an unknown one too
    assert text.endswith("\n")
    families = {f.name: f for f in text_string_to_metric_families(text)}  # Prometheus' own parser
    assert families["vllm:spec_decode_num_drafts"].type == "counter"
    assert [s.value for s in families["vllm:spec_decode_num_drafts"].samples] == [4.0]
    assert families["vllm:spec_decode_num_accepted_tokens_per_pos"].type == "counter"
    assert families["vllm:num_requests_running"].type == "gauge"
    ttft = families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert (buckets["0.001"], buckets["0.04"], buckets["0.25"], buckets["0.5"], buckets["2560.0"], buckets["+Inf"]) == \
        (0, 1, 1, 2, 2, 3)  # cumulative, over both replicas' counts
    assert samples[f"vllm:time_to_first_token_seconds_count{{{label}}}"] == "3"
    assert float(samples[f"vllm:time_to_first_token_seconds_sum{{{label}}}"]) == pytest.approx(3000.33)
    assert samples[f'vllm:inter_token_latency_seconds_bucket{{{label},le="0.01"}}'] == "1"
    for name in ("request_queue_time_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):  # present before the first request, all zero
        assert families[f"vllm:{name}"].type == "histogram"
        assert samples[f"vllm:{name}_count{{{label}}}"] == "0"
    with pytest.raises(ValueError, match="bucket edges differ"):
        one.ttft_s + one.itl_s


def test_json_depth_and_admission_limit():
    assert not json_too_deep(json.loads("[" * 64 + "]" * 64))
    assert json_too_deep(json.loads("[" * 65 + "]" * 65))
    assert json_too_deep({"a": [{"b": json.loads("[" * 62 + "]" * 62)}]})
    assert not json_too_deep({"a": "[[[[" * 100})
    config = AppConfig(mock_engine=True, drafter="mock", max_num_seqs=4, max_queued_requests=2,
                       target={"num_replicas": 3}, ingress={"num_replicas": 2}, profile="auto")
    assert admission_limit(config) == math.ceil((4 + 2) * 3 / 2)


def test_chat_logprobs_bytes_rebuild_text_split_inside_characters():
    """The Target's logprobs carry each token's own bytes (``TokenBytes``): joined over a stream they are the text,
    where a token that ends inside a character reads as U+FFFD on its own."""
    from transformers import AutoTokenizer

    from app.engine.loader import local_checkpoint
    from app.engine.types import TokenLogprob
    from app.engine.detokenizer import TokenBytes, TokenTexts
    from app.serving.target import logprob_texts

    tokenizer = AutoTokenizer.from_pretrained(local_checkpoint(), local_files_only=True)
    text = "Party 🎉 time 😀!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = [TokenLogprob(token_id=i, logprob=-0.1, top=((i, -0.1),)) for i in ids]
    entries = logprob_texts(TokenTexts(tokenizer), logprobs, TokenBytes(tokenizer))
    content = chat_logprobs(entries)["content"]
    assert any(item["token"] == "\ufffd" for item in content)
    assert bytes(b for item in content for b in item["bytes"]) == text.encode()
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in content)


def test_chat_template_fields_give_the_template_options():
    """vLLM's chat fields: the generation prompt unless the final message is continued; template variables as sent."""
    def options(**fields):
        return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields}).template_options()

    assert options() == ChatTemplateOptions()
    assert options(continue_final_message=True) == ChatTemplateOptions(False, True)
    assert options(add_generation_prompt=False) == ChatTemplateOptions(False)
    assert options(chat_template_kwargs={"enable_thinking": False}).template_kwargs == {"enable_thinking": False}


def test_an_assistant_turn_comes_back_as_a_response_gave_it():
    """An earlier assistant message with ``content`` null and its ``reasoning`` (vLLM's field or older name) is
    accepted and reaches the template as ``reasoning``, which Hugging Face's renderer gives templates as
    ``reasoning_content``; on other roles they are 400s."""
    turn = {"role": "assistant", "content": None, "reasoning": "2 + 3 = 5", "refusal": None}
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [*MESSAGES, turn, *MESSAGES]})
    assert req.chat_messages()[1] == {"role": "assistant", "content": "", "reasoning": "2 + 3 = 5"}
    old = {"role": "assistant", "content": "5", "reasoning_content": "adding"}
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": [*MESSAGES, old]}).chat_messages()[1] == \
        {"role": "assistant", "content": "5", "reasoning": "adding"}
    for bad in ({"role": "user", "content": None}, {"role": "user", "content": "x", "reasoning": "y"}):
        with pytest.raises(ValidationError) as err:
            ChatCompletionRequest.model_validate({"model": "m", "messages": [bad]})
        item = validation_error(err.value)
        assert item.status == 400 and item.param.startswith("messages.0"), item


def test_every_request_field_is_sorted_by_what_it_does():
    """Each field of the chat and completions schemas is in one list (acting, harmless, rejected, or an extension),
    which the docs and the field walk follow: a new field must say what it does."""
    from app.serving import openai_api as api

    for model, lists in ((ChatCompletionRequest, api.ACTING_CHAT + api.HARMLESS_CHAT + api.REJECTED_CHAT),
                         (CompletionRequest, api.ACTING_COMPLETIONS + api.HARMLESS_COMPLETIONS +
                          api.REJECTED_COMPLETIONS)):
        assert set(model.model_fields) <= set(lists + api.EXTENSIONS), model.__name__
