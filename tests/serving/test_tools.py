"""Tool calling (``app/serving/tools.py``): the calls each reader finds in a whole answer, the streamed deltas joining
into them whatever the chunking, the grammars of named and required calls, the request's tool fields, and the tool
template rendering as the model's own template where no tools are given."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.engine.errors import InvalidRequestError
from app.serving.openai_api import ChatCompletionRequest, TokenizeRequest, ToolCallParam, validation_error
from app.serving.tools import Tool, ToolReader, calls_grammar

TEMPLATE = Path(__file__).resolve().parents[2] / "deployments" / "templates" / "chatml_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
NAMES = ("get_weather", "get_time")
HERMES, LLAMA = ToolReader("auto", "hermes", names=NAMES), ToolReader("auto", "llama3_json", names=NAMES)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# reader, answer text -> (content, [(name, arguments)])
SPLITS = [
    (HERMES, f"Let me look.\n\n{CALL}\n", ("Let me look.", [("get_weather", '{"city": "Paris"}')])),
    (HERMES, f"{CALL}\n{CALL}", (None, [("get_weather", '{"city": "Paris"}')] * 2)),
    (HERMES, "It is sunny.\n", ("It is sunny.\n", [])),  # no calls: the text as written
    (HERMES, "<tool_call>{not json}</tool_call> ok", ("<tool_call>{not json}</tool_call> ok", [])),
    (HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object: text
     ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    (HERMES, '<tool_call>{"name": "get_time"}</tool_call>', (None, [("get_time", "{}")])),
    (HERMES, 'a <tool_call>{"name": "f", "arguments": {}', ('a <tool_call>{"name": "f", "arguments": {}', [])),  # cut
    (HERMES, "<tool_ca", ("<tool_ca", [])),  # a start of the tag, not the tag
    (ToolReader("auto", "hermes", names=NAMES, parallel=False), f"{CALL}\n{CALL}",
     (None, [("get_weather", '{"city": "Paris"}')])),  # the first call only; later ones dropped (vLLM's rule)
    (ToolReader("auto", "llama3_json", names=NAMES, parallel=False), '{"name": "get_time", "parameters": {}}; '
     '{"name": "get_time", "parameters": {}}', (None, [("get_time", "{}")])),
    (HERMES, '<tool_call>{"name": "delete_files", "arguments": {}}</tool_call>',  # not a listed function: text
     ('<tool_call>{"name": "delete_files", "arguments": {}}</tool_call>', [])),
    (HERMES, '<tool_call>{"type": "function", "name": "get_time", "parameters": {}}</tool_call>',
     (None, [("get_time", "{}")])),  # other keys ignored, as vLLM's parsers do
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"n": ' + "1" * 5000 + '}}</tool_call>',  # too large
     ('<tool_call>{"name": "get_time", "arguments": {"n": ' + "1" * 5000 + '}}</tool_call>', [])),
    (HERMES, "<tool_call>" + "[" * 5000 + "</tool_call>", ("<tool_call>" + "[" * 5000 + "</tool_call>", [])),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"n": NaN}}</tool_call>',  # not strict JSON
     ('<tool_call>{"name": "get_time", "arguments": {"n": NaN}}</tool_call>', [])),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"s": "\\ud800"}}</tool_call>',  # a lone surrogate
     ('<tool_call>{"name": "get_time", "arguments": {"s": "\\ud800"}}</tool_call>', [])),
    (LLAMA, '{"name": "get_time"}', ('{"name": "get_time"}', [])),  # llama3_json's calls carry their parameters
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"a": 1e400}}</tool_call>',  # inf: no JSON text for it
     ('<tool_call>{"name": "get_time", "arguments": {"a": 1e400}}</tool_call>', [])),
    (LLAMA, '{"name": "get_time", "parameters": ' + '{"a": ' * 991 + "1" + "}" * 992,  # parsed, too deep to write
     ('{"name": "get_time", "parameters": ' + '{"a": ' * 991 + "1" + "}" * 992, [])),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    (LLAMA, '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', (None, [("get_time", '{"tz": "UTC"}')])),
    (LLAMA, 'The call is {"name": "get_time", "parameters": {}}',  # not opened by JSON
     ('The call is {"name": "get_time", "parameters": {}}', [])),
    (LLAMA, '{"city": "Paris"}', ('{"city": "Paris"}', [])),  # JSON, but not a call
    (ToolReader("required"), '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", '
     '"parameters": {}}]', (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    (ToolReader("required"), '[{"name": "get_time", "parameters": {}}, {"name": "get_we',
     (', {"name": "get_we', [("get_time", "{}")])),  # cut short: the unfinished call is text
    (ToolReader("required"), '[{"name": "get_time", "parameters": {"n": ' + "1" * 5000,
     ('[{"name": "get_time", "parameters": {"n": ' + "1" * 5000, [])),
    (ToolReader("named", function="get_weather"), '{"city": "Paris"}', (None, [("get_weather", '{"city": "Paris"}')])),
    (ToolReader("named", function="get_weather"), '{"city": "Pa', (None, [("get_weather", '{"city": "Pa')])),
]
IDS = [f"{r.mode}-{r.parser}-{t[:24]!r}" for r, t, _ in SPLITS]


def calls_of(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("reader,text,expected", SPLITS, ids=IDS)
def test_a_whole_answer_splits_into_content_and_calls(reader, text, expected):
    content, calls = reader.split(text)
    assert (content, calls_of(calls)) == expected
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("reader,text,expected", SPLITS, ids=IDS)
def test_streamed_deltas_join_into_the_whole_answer_s_split(reader, text, expected):
    """Any chunking: the content deltas join into the content, and the call deltas (a call whole, or a named call's
    arguments as they come) merge by index into the calls, each id sent once."""
    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(rng.randint(0, 6), len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, content, merged = reader.stream(), "", {}
        for out in [stream.feed(p) for p in pieces] + [stream.finish()]:
            content += out[0]
            for delta in out[1]:
                if "id" in delta:
                    assert delta["index"] not in merged and delta["type"] == "function"
                    merged[delta["index"]] = [delta["function"]["name"], ""]
                merged[delta["index"]][1] += delta["function"]["arguments"]
        assert (content or None, [tuple(merged[i]) for i in sorted(merged)]) == expected, pieces


def test_a_call_streams_once_it_closes_and_content_waits_only_on_a_possible_tag():
    stream = HERMES.stream()
    assert stream.feed("Sure. <tool") == ("Sure.", [])  # the space may precede a call: held
    assert stream.feed('_call>{"name": "get_time"}') == ("", [])
    content, deltas = stream.feed("</tool_call>")
    assert content == "" and [d["function"] for d in deltas] == [{"name": "get_time", "arguments": "{}"}]
    assert stream.finish() == ("", [])  # the held space goes with the calls
    named = ToolReader("named", function="f").stream()
    first = named.feed('{"a"')[1]
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "f", "arguments": '{"a"'}}]
    assert named.feed(": 1}") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])


def test_finish_reason_is_tool_calls_where_openai_gives_it():
    assert HERMES.finish_reason("stop", True) == "tool_calls"
    assert HERMES.finish_reason("stop", False) == "stop"
    assert ToolReader("required").finish_reason("stop", True) == "tool_calls"
    assert ToolReader("named", function="f").finish_reason("stop", True) == "stop"  # a forced call: stop, as OpenAI
    assert HERMES.finish_reason("length", True) == "length"


def test_named_and_required_calls_are_written_by_a_schema():
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(CLOCK)]
    named = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [WEATHER, CLOCK], "tool_choice": {
                                                      "type": "function", "function": {"name": "get_weather"}}})
    assert named.guided().kind == "json_schema" and json.loads(named.guided().spec) == WEATHER["function"][
        "parameters"]
    assert named.guided_param == "tools.0.function.parameters" and named.tool_mode == "named"  # a schema error's
    required = json.loads(calls_grammar(tools, "required", parallel=True).spec)
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert all(c["additionalProperties"] is False for c in required["items"]["anyOf"])  # a call is name + parameters
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert json.loads(calls_grammar(tools, "required", parallel=False).spec)["maxItems"] == 1
    assert calls_grammar(tools, "auto", parallel=True) is None and calls_grammar(tools, "none", parallel=True) is None
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    nested = Tool.model_validate({"type": "function", "function": {"name": "plan", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": place}}}})
    hoisted = json.loads(calls_grammar([nested, tools[1]], "required", parallel=True).spec)
    assert hoisted["$defs"] == {"Place": place} and "$defs" not in hoisted["items"]["anyOf"][0]["properties"][
        "parameters"]  # "#/$defs/Place" resolves from the root, where vLLM moves it
    other = nested.model_copy(update={"function": nested.function.model_copy(update={
        "name": "trip", "parameters": {**nested.function.parameters, "$defs": {"Place": {"type": "string"}}}})})
    with pytest.raises(InvalidRequestError, match="define \\$defs 'Place' differently"):
        calls_grammar([nested, other], "required", parallel=True)
    odd = Tool.model_validate({"type": "function", "function": {"name": "odd", "parameters": {"$defs": [1]}}})
    assert json.loads(calls_grammar([odd], "required", parallel=True).spec)["items"]["anyOf"][0]["properties"][
        "parameters"] == {"$defs": [1]}  # not definitions: left for the grammar library to judge (a 400)


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice",
     '{"type": "function", "function": {"name": ...}}'),
])
def test_tool_fields_that_disagree_are_400s_naming_the_field(fields, param, words):
    """Including a named choice in the Responses API's flat form, which chat's field does not take."""
    with pytest.raises(ValidationError) as err:
        chat_request(**fields)
    item = validation_error(err.value)
    assert (item.status, item.param) == (400, param) and words in item.message, item


def test_earlier_calls_and_their_results_reach_the_template():
    """An assistant turn's ``tool_calls`` as a response gave them (arguments as JSON text) reach the template with the
    arguments as an object; a ``tool`` message keeps its ``tool_call_id``; ``tool_choice: none`` makes no reader."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = chat_request(messages=[{"role": "user", "content": "Weather?"},
                                 {"role": "assistant", "tool_calls": [call]},  # content left out, as OpenAI allows
                                 {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}],
                       tools=[WEATHER], tool_choice="none")
    assistant, result = req.chat_messages()[1:]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and assistant["content"] == ""
    deep = '{"a": ' * 100 + "1" + "}" * 100  # nested past what the renderer walks: the template gets the text
    assert ToolCallParam.model_validate({**call, "function": {"name": "f", "arguments": deep}}).template_dict()[
        "function"]["arguments"] == deep
    assert result == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    assert req.tool_reader("hermes") is None and req.guided() is None
    assert req.template_options().tools == (WEATHER,)
    with pytest.raises(ValueError, match="tool_calls are for assistant"):
        chat_request(messages=[{"role": "user", "content": "x", "tool_calls": [call]}])
    with pytest.raises(ValueError, match="content is needed"):
        chat_request(messages=[{"role": "user"}])
    with pytest.raises(ValidationError) as err:  # /tokenize renders tools too: the same check
        TokenizeRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, WEATHER]})
    assert validation_error(err.value).param == "tools"


def test_the_tool_template_renders_as_smollm2_s_own_without_tools(engine):
    """``deployments/templates/chatml_tools.jinja``: conversations without tools render token for token as the
    model's own template (a server can take it as its default); with tools, the system turn lists them and earlier
    calls and results are written in the Hermes format."""
    template = TEMPLATE.read_text()
    own = engine.tokenizer.chat_template
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    for messages in conversations:
        for generation in (True, False):
            assert engine.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                        add_generation_prompt=generation) == \
                engine.tokenizer.apply_chat_template(messages, chat_template=own, tokenize=False,
                                                     add_generation_prompt=generation), (messages, generation)
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "content": "18 C", "tool_call_id": "c"}], tools=[WEATHER], chat_template=template,
        tokenize=False, add_generation_prompt=True)
    assert json.dumps(WEATHER) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text


def test_a_template_that_does_not_show_tools_is_a_400_naming_tools(engine, monkeypatch):
    """SmolLM2's own template never reads ``tools``: the model would not see them, so the request is refused; the
    engine's ``chat_template`` (the serving config's) serves them."""
    from app.engine.types import ChatTemplateOptions

    user = [{"role": "user", "content": "Weather in Paris?"}]
    with pytest.raises(InvalidRequestError) as err:
        engine.encode_chat(user, options=ChatTemplateOptions(tools=(WEATHER,)))
    assert err.value.param == "tools" and "chatml_tools.jinja" in str(err.value)
    plain = engine.encode_chat(user)
    named = {"default": engine.tokenizer.chat_template, "tool_use": TEMPLATE.read_text()}
    monkeypatch.setattr(engine.tokenizer, "chat_template", named)  # Hermes-2-Pro's kind: templates by name
    assert engine.encode_chat(user) == plain  # the default one, as before
    shown = engine.tokenizer.decode(engine.encode_chat(user, options=ChatTemplateOptions(tools=(WEATHER,))))
    assert '"name": "get_weather"' in shown  # the tool_use one, with tools
    monkeypatch.setattr(engine.tokenizer, "chat_template", named["default"])
    monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"chat_template": TEMPLATE.read_text()}))
    shown = engine.tokenizer.decode(engine.encode_chat(user, options=ChatTemplateOptions(tools=(WEATHER,))))
    assert '"name": "get_weather"' in shown and shown.endswith("<|im_start|>assistant\n")
