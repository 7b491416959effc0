"""The Responses API schema and shapes (``app/serving/responses.py``) without a server: the request as a chat
completion, errors named by Responses field, the ``response`` object and the streaming events."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.serving.openai_api import validation_error
from app.serving.responses import ResponseEvents, ResponseShape, ResponsesRequest, response_body, responses_param


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def test_a_request_becomes_the_chat_completion_it_is_served_as():
    chat = _request(instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_p=0.9,
                    text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}).chat()
    assert chat.chat_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = chat.params()
    assert (params.max_tokens, params.temperature, params.top_p, params.guided.kind) == (9, 0.5, 0.9, "json_schema")
    turns = _request(input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                             "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]},
                            {"role": "user", "content": "Bye"}], stream=True).chat()
    assert [m["content"] for m in turns.chat_messages()] == ["Hi", "Hello", "Bye"]
    # an earlier output sent back: its reasoning item becomes the reasoning of the assistant message after it
    back = _request(input=[{"role": "user", "content": "Hi"},
                           {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                            "content": [{"type": "reasoning_text", "text": "a greeting"}], "encrypted_content": None},
                           {"type": "message", "role": "assistant", "phase": None, "status": "completed",
                            "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
                           {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
                           {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},  # no text
                           {"role": "user", "content": "Bye"}]).chat()
    assert back.chat_messages() == [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello", "reasoning": "a greeting"},
                                    {"role": "assistant", "content": "", "reasoning": "x"},
                                    {"role": "user", "content": "Bye"}]
    assert turns.stream and turns.include_usage  # the usage chunk ends the response's events
    assert _request(text={"format": {"type": "json_object"}}).chat().params().guided.kind == "json_object"
    assert _request(text={"format": {"type": "text"}}).chat().params().guided is None


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": ["input_image"] * 100}]}]}, "input.0.content"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0"),
    ({"input": [{"type": ["web_search_call"] * 100}]}, "input.0"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0"),
    ({"input": [{"role": "user", "content": "x", "call_id": "c"}]}, "input.0"),
    ({"input": [{"type": "reasoning", "role": "user", "content": []}]}, "input.0"),
    ({"input": [{"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}]}, "input.0.content"),
    ({"input": [{"role": "user"}]}, "input.0"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
])
def test_what_a_text_model_cannot_do_is_a_400_naming_the_field(fields, param):
    with pytest.raises(ValidationError) as err:
        _request(**fields)
    item = validation_error(err.value)
    assert item.status == 400 and item.param == param, item
    assert len(item.message) < 300, item


def test_chat_errors_name_the_responses_fields():
    with_instructions = _request(instructions="x", input=[{"role": "user", "content": "a"}])
    assert responses_param("messages.1.content", with_instructions) == "input.0.content"
    assert responses_param("messages.0", with_instructions) == "instructions"
    assert responses_param("messages", _request()) == "input"
    assert responses_param("max_completion_tokens", _request()) == "max_output_tokens"
    assert responses_param("response_format", _request()) == "text.format"
    assert responses_param("tools.1.function.parameters", _request()) == "tools.1.parameters"  # the flat tool
    assert responses_param("temperature", _request()) == "temperature" and responses_param(None, _request()) is None
    with pytest.raises(ValueError, match="name and a schema"):
        _request(text={"format": {"type": "json_schema"}}).chat()


CHAT_USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 2}}


def test_the_response_object_of_a_chat_completion():
    shape = ResponseShape(_request(max_output_tokens=3, metadata={"k": "v"}), "m")
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello", "reasoning": None},
                         "finish_reason": "length"}], "usage": CHAT_USAGE}
    body = response_body(shape, chat)
    assert (body["object"], body["status"], body["incomplete_details"]) == ("response", "incomplete",
                                                                           {"reason": "max_output_tokens"})
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["output"][0]["content"][0]["text"] == "Hello" and body["metadata"] == {"k": "v"}
    assert body["output"][0]["status"] == "incomplete"  # the message was cut by max_output_tokens
    assert body["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    chat["choices"][0].update(message={"role": "assistant", "content": None, "reasoning": "thinking"},
                              finish_reason="stop")
    body = response_body(shape, chat)
    assert body["status"] == "completed" and [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"][0]["text"] == "thinking" and body["output"][1]["content"][0]["text"] == ""


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_streamed_events_follow_the_responses_sequence():
    """created, in_progress; per item: added (and its content part), deltas, done; then completed with the output
    and usage; the reasoning item first; sequence numbers count up from 0."""
    events = ResponseEvents(ResponseShape(_request(), "m"))
    out = events.start()
    for chunk in (_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning": "Let me"}),
                  _chunk({"reasoning": " see"}), _chunk({"content": "Hi"}), _chunk({"content": "!"}),
                  _chunk({}, "stop"), {"choices": [], "usage": CHAT_USAGE}):
        out += events.chunk(chunk)
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert [i["content"][0]["text"] for i in final["output"]] == ["Let me see", "Hi!"]
    assert [i["status"] for i in final["output"]] == ["completed", "completed"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 3
    assert {e["output_index"] for e in out if e["type"] == "response.output_text.delta"} == {1}
    empty = ResponseEvents(ResponseShape(_request(), "m"))
    ends = empty.chunk(_chunk({}, "length")) + empty.chunk({"choices": [], "usage": CHAT_USAGE})
    assert [e["type"] for e in ends][-1] == "response.incomplete"  # no text: still a message item, empty
    assert ends[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert ends[-1]["response"]["output"][0]["status"] == "incomplete"
    failed = ResponseEvents(ResponseShape(_request(), "m")).error({"error": {"message": "boom", "code": "x"}})
    assert [e["type"] for e in failed] == ["error", "response.failed"] and failed[0]["message"] == "boom"
    assert failed[1]["response"]["status"] == "failed" and failed[1]["response"]["error"] == {"code": "x",
                                                                                             "message": "boom"}


WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_function_tools_and_calls_become_the_chat_request_s():
    """``tools`` (flat) and ``tool_choice`` become the chat request's; earlier ``function_call`` items become the
    ``tool_calls`` of the assistant message they follow (or of their own), and ``function_call_output`` items
    ``tool`` messages."""
    named = _request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                     parallel_tool_calls=False).chat()
    assert named.tools[0].function.name == "get_weather" and named.tool_mode == "named"
    assert named.parallel_tool_calls is False and named.guided_param == "tools.0.function.parameters"
    assert _request(tools=[WEATHER]).chat().tool_mode == "auto"
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
            "id": "fc_1", "status": "completed"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}
    after_text = _request(tools=[WEATHER], input=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."}, call, result]).chat()
    messages = after_text.chat_messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Checking." and messages[1]["tool_calls"][0]["id"] == "call_1"
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    alone = _request(input=[{"role": "user", "content": "Weather?"}, call, {**call, "call_id": "call_2"},
                            {**result, "output": [{"type": "input_text", "text": "18 C"}]}]).chat().chat_messages()
    assert [m["role"] for m in alone] == ["user", "assistant", "tool"] and alone[1]["content"] == ""
    assert [c["id"] for c in alone[1]["tool_calls"]] == ["call_1", "call_2"] and alone[2]["content"] == "18 C"
    dumped = {**call, "async_": None, "caller": None, "namespace": None, "parsed_arguments": {"city": "Paris"}}
    assert _request(input=[dumped]).chat().chat_messages()[0]["tool_calls"][0]["id"] == "call_1"  # SDK model_dump()
    with pytest.raises(ValidationError) as err:  # chat's nested form, sent here: the message says the right one
        _request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "names a function as" in validation_error(err.value).message


def test_calls_are_function_call_items_whole_and_streamed():
    """A chat answer's tool calls: ``function_call`` items (``call_id`` the chat call's id), no message item when
    the answer is calls alone; streamed, each call opens its item, streams its arguments and closes; the events and
    the final response parse as the SDK's types."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    shape = ResponseShape(_request(tools=[WEATHER]), "m")
    call = {"id": "chatcmpl-tool-abc", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "reasoning": None,
                                                 "tool_calls": [call]}, "finish_reason": "tool_calls"}],
            "usage": CHAT_USAGE}
    body = response_body(shape, chat)
    assert [item["type"] for item in body["output"]] == ["function_call"]
    assert body["output"][0] | {"id": None} == {"type": "function_call", "id": None, "call_id": "chatcmpl-tool-abc",
                                                "name": "get_weather", "arguments": "{}", "status": "completed"}
    assert body["tool_choice"] == "auto" and body["tools"] == [WEATHER]
    Response.model_validate({**body, "usage": None})  # the client's usage type asks for cache write counts too
    events = ResponseEvents(shape)
    out = events.start()
    for chunk in (_chunk({"content": "Sure."}), _chunk({"tool_calls": [{**call, "index": 0, "function": {
                      "name": "get_weather", "arguments": '{"city"'}}]}),
                  _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]}),
                  _chunk({}, "tool_calls"), {"choices": [], "usage": CHAT_USAGE}):
        out += events.chunk(chunk)
    kinds = [e["type"] for e in out]
    assert kinds[kinds.index("response.content_part.done") + 1:] == [
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"city": "Paris"}' and final["output"][1]["status"] == "completed"
    assert {e["output_index"] for e in out if e["type"].startswith("response.function_call")} == {1}
    named = ResponseShape(_request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}), "m")
    cut = dict(chat, choices=[{**chat["choices"][0], "finish_reason": "length"}])
    assert response_body(named, cut)["output"][0]["status"] == "incomplete"  # its arguments were cut short
    events = ResponseEvents(named)
    events.chunk(_chunk({"tool_calls": [{**call, "index": 0}]}, "length"))
    assert events.chunk({"choices": [], "usage": CHAT_USAGE})[-1]["response"]["output"][0]["status"] == "incomplete"
    later = ResponseEvents(ResponseShape(_request(tools=[WEATHER]), "m"))
    for chunk in (_chunk({"content": "Checking."}), _chunk({"tool_calls": [{**call, "index": 0}]}),
                  _chunk({"content": " Done."}), _chunk({}, "stop")):
        later.chunk(chunk)
    items = later.chunk({"choices": [], "usage": CHAT_USAGE})[-1]["response"]["output"]
    assert [i["type"] for i in items] == ["message", "function_call", "message"]  # text after a call: a new item
    assert [i["content"][0]["text"] for i in (items[0], items[2])] == ["Checking.", " Done."]
    assert items[0]["id"] != items[2]["id"]
    for event in out:  # the response objects' usage aside, as above
        TypeAdapter(ResponseStreamEvent).validate_python(
            event | ({"response": {**event["response"], "usage": None}} if "response" in event else {}))


def test_every_request_field_is_sorted_by_what_it_does():
    from app.serving import responses as api

    assert set(ResponsesRequest.model_fields) == set(api.ACTING + api.HARMLESS + api.REJECTED + api.EXTENSIONS)
