"""The Ingress's answers where the target replica fails, without Serve: fake target streams."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from ray.exceptions import ActorDiedError

from app.engine.types import ChatTemplateOptions
from app.serving.config import AppConfig
from app.serving.ingress import Ingress, _Choice, _InFlight
from app.serving.protocol import TextChunk


class _LostAfterFirstChunk:
    """A target stream whose replica died after the first chunk (Serve raises a ``RayActorError`` subclass)."""

    def __init__(self) -> None:
        self.cancelled = False

    async def __anext__(self):
        raise ActorDiedError()

    def cancel(self) -> None:
        self.cancelled = True


def test_a_target_lost_mid_request_answers_503_with_retry_after_not_500():
    """Non-streamed: a JSON 503 ``unavailable`` with Retry-After, as a stream gets an error event (it fell through to
    the catch-all 500 with Ray's exception text)."""
    config = AppConfig(mock_engine=True, drafter="mock")
    ingress = Ingress(config, target=None, router=None)
    flight = _InFlight(ingress, 1)
    stream = _LostAfterFirstChunk()
    flight.choices.append(_Choice(index=0, stream=stream, first=TextChunk(text="Hi", token_ids=[1], prompt_tokens=3)))
    response = asyncio.run(ingress._body(flight, chat=True, request_id="r", req=None))
    assert response.status_code == 503 and response.headers["retry-after"] == str(config.retry_after_s)
    assert json.loads(response.body)["error"]["code"] == "unavailable"
    flight.close()
    assert not stream.cancelled  # a choice that ended is not cancelled again


class _Request:
    """A request whose body arrives as ``parts``; ``None`` in it: the client stalls there, for ever; an exception:
    raised there."""

    def __init__(self, *parts) -> None:
        self.headers, self._parts = {}, parts

    async def stream(self):
        for part in self._parts:
            if part is None:
                await asyncio.Event().wait()
            if isinstance(part, Exception):
                raise part
            yield part


def test_a_body_that_stalls_is_a_408_and_a_client_gone_mid_body_is_no_500(monkeypatch):
    from starlette.requests import ClientDisconnect

    from app.serving import ingress as ingress_module

    monkeypatch.setattr(ingress_module, "BODY_TIMEOUT_S", 0.1)
    ingress = Ingress(AppConfig(mock_engine=True, drafter="mock"), target=None, router=None)
    stalled = asyncio.run(ingress._read_body(_Request(b'{"mod', None)))
    assert stalled.status == 408 and stalled.code == "request_timeout" and "5 bytes came" in stalled.message
    gone = asyncio.run(ingress._read_body(_Request(b'{"mod', ClientDisconnect())))
    assert gone.status == 400 and "disconnected" in gone.message
    assert asyncio.run(ingress._read_body(_Request(b'{"model"', b': "m"}'))) == b'{"model": "m"}'


def test_each_choice_s_target_request_carries_the_fields_that_set_it():
    """Besides the sampling params, the target needs whether a text prompt takes the tokenizer's special tokens
    (completions: on unless the request says otherwise; a chat: off unless it says so, as in vLLM) and which field
    errors about structured output name."""
    from app.serving.openai_api import ChatCompletionRequest, CompletionRequest

    ingress = Ingress(AppConfig(mock_engine=True, drafter="mock"), target=None, router=None)
    for prompt, echo_mode, echo in (("a", "sent", "a"), ([5], "tokens", "")):  # a token-id prompt's text: decoded
        texts = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "n": 2, "echo": True,
                                                  "structured_outputs": {"regex": "x+"}})
        assert [(i, g.add_special_tokens, g.guided_param, g.echo, e)
                for i, g, e in ingress._generates(texts, chat=False, request_id="r")] == [
            (0, True, "structured_outputs", echo_mode, echo), (1, True, "structured_outputs", echo_mode, echo)]
    cut = CompletionRequest.model_validate({"model": "m", "prompt": "abc", "echo": True, "truncate_prompt_tokens": 2})
    assert [(g.truncate_prompt_tokens, g.echo, e) for _, g, e in ingress._generates(cut, chat=False,
                                                                                       request_id="r")] == [
        (2, "tokens", "")]  # a truncated text prompt is echoed as the tokens the model took
    guarded = Ingress(AppConfig(mock_engine=True, drafter="mock", sanitize_chat_control_tokens=True), target=None,
                      router=None)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "continue_final_message": True})
    ((_, g, _),) = guarded._generates(chat, chat=True, request_id="r")
    assert g.template == ChatTemplateOptions(False, True, sanitize_control_tokens=True)  # the server's setting too
    bare = CompletionRequest.model_validate({"model": "m", "prompt": "a", "add_special_tokens": False})
    assert [g.add_special_tokens for _, g, _ in ingress._generates(bare, chat=False, request_id="r")] == [False]
    messages = [{"role": "user", "content": "hi"}]
    for fields, special, guided_param in (({}, False, "response_format"),
                                          ({"add_special_tokens": True, "response_format": {"type": "json_object"}},
                                           True, "response_format")):
        chat = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})
        ((_, g, _),) = ingress._generates(chat, chat=True, request_id="r")
        assert (g.add_special_tokens, g.guided_param, g.messages) == (special, guided_param, messages)


def test_tokenize_calls_have_their_own_limit_beside_the_generate_admission_limit():
    """At most ``TOKENIZE_LIMIT`` tokenize calls in flight (a JSON 503 beyond), none of them counted against the
    generate requests' admission limit: a burst of token counting does not turn requests away."""
    from app.serving.ingress import TOKENIZE_LIMIT

    class _Router:
        class is_draining:  # noqa: N801 (Ray's handle method shape: router.is_draining.remote())
            @staticmethod
            async def remote() -> bool:
                return False

    async def run() -> tuple[list, object]:
        ingress = Ingress(AppConfig(mock_engine=True, drafter="mock"), target=None, router=_Router())
        release = asyncio.Event()

        async def slow_tokenize():
            await release.wait()
            return [1, 2], None

        calls = [asyncio.create_task(ingress._tokenizer_call("/tokenize", slow_tokenize))
                 for _ in range(TOKENIZE_LIMIT + 1)]
        await asyncio.sleep(0.05)
        assert ingress._overloaded(ingress.limit) is None  # generate admission untouched
        release.set()
        return await asyncio.gather(*calls), ingress

    answers, ingress = asyncio.run(run())
    refused = [a for a in answers if not isinstance(a, tuple)]
    assert len(refused) == 1 and (refused[0].status, refused[0].code) == (503, "overloaded")
    assert answers.count(([1, 2], None)) == TOKENIZE_LIMIT and ingress._tokenizing == 0


class _Chunks:
    """A target stream that yields ``chunks`` (after the first chunk, which the flight holds)."""

    def __init__(self, chunks: list[TextChunk]) -> None:
        self._chunks = iter(chunks)

    async def __anext__(self) -> TextChunk:
        return next(self._chunks)

    def cancel(self) -> None:
        pass


def _answer(ingress: Ingress, texts: list[str]) -> _InFlight:
    """One choice whose chunks carry ``texts``, the last one finishing it."""
    chunks = [TextChunk(text=t, token_ids=[i], prompt_tokens=3) for i, t in enumerate(texts)]
    chunks[-1] = dataclasses.replace(chunks[-1], finish_reason="stop")
    flight = _InFlight(ingress, 1)
    flight.choices.append(_Choice(index=0, stream=_Chunks(chunks[1:]), first=chunks[0]))
    return flight


def test_a_reasoning_parser_gives_the_thinking_apart_from_the_answer_streamed_and_not():
    """vLLM's ``reasoning``: with a parser set, a chat's ``<think>`` text is ``message.reasoning`` (streamed:
    ``delta.reasoning``, tags split between chunks included) and the rest its content; ``include_reasoning: false``
    leaves it out; without a parser the text is the content as written."""
    from app.serving.openai_api import ChatCompletionRequest

    texts = ["<thi", "nk>Two and", " three</th", "ink>\n\nFive", "."]

    async def streamed(ingress: Ingress, req) -> list[dict]:
        events = [e async for e in ingress._sse(_answer(ingress, texts), chat=True, request_id="r", req=req)]
        return [json.loads(e[6:])["choices"][0]["delta"] for e in events if e.startswith("data: {")]

    for parser, include, reasoning, content in (("qwen3", True, "Two and three", "\n\nFive."),
                                                ("deepseek_r1", False, None, "\n\nFive."),
                                                (None, True, None, "".join(texts))):
        ingress = Ingress(AppConfig(mock_engine=True, drafter="mock", reasoning_parser=parser), target=None,
                          router=None)
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "2+3?"}],
                                                    "include_reasoning": include})
        body = asyncio.run(ingress._body(_answer(ingress, texts), chat=True, request_id="r", req=req))
        message = body["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (reasoning, content), parser
        deltas = asyncio.run(streamed(ingress, req))
        assert "".join(d.get("reasoning", "") for d in deltas) == (reasoning or ""), parser
        assert "".join(d.get("content") or "" for d in deltas) == content, parser


def test_structured_output_and_a_closed_prefill_are_the_answer_under_a_reasoning_parser():
    """A grammar constrains the whole output, so with ``response_format`` it is all content; an output continuing a
    message whose thinking the client closed (``continue_final_message``) is content too, streamed and not."""
    from app.serving.openai_api import ChatCompletionRequest

    ingress = Ingress(AppConfig(mock_engine=True, drafter="mock", reasoning_parser="deepseek_r1"), target=None,
                      router=None)
    user = [{"role": "user", "content": "2+2?"}]
    for fields in ({"response_format": {"type": "json_object"}},
                   {"messages": user + [{"role": "assistant", "content": "<think>Easy.</think>It"}],
                    "continue_final_message": True}):
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": user, **fields})
        body = asyncio.run(ingress._body(_answer(ingress, ['{"a"', ": 4}"]), chat=True, request_id="r", req=req))
        assert (body["choices"][0]["message"]["reasoning"], body["choices"][0]["message"]["content"]) == (
            None, '{"a": 4}'), fields

        async def streamed() -> list[dict]:
            events = [e async for e in ingress._sse(_answer(ingress, ['{"a"', ": 4}"]), chat=True, request_id="r",
                                                    req=req)]
            return [json.loads(e[6:])["choices"][0]["delta"] for e in events if e.startswith("data: {")]

        deltas = asyncio.run(streamed())
        assert "".join(d.get("content") or "" for d in deltas) == '{"a": 4}' and not any("reasoning" in d
                                                                                          for d in deltas)
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": user})
    body = asyncio.run(ingress._body(_answer(ingress, ['{"a"', ": 4}"]), chat=True, request_id="r", req=plain))
    assert body["choices"][0]["message"]["content"] is None  # deepseek_r1 without them: all reasoning


def test_tool_calls_come_apart_from_the_content_streamed_and_not():
    """OpenAI's ``tool_calls``: with the server's ``hermes`` parser the calls a chat answer writes are
    ``message.tool_calls`` (streamed: ``delta.tool_calls``, each call whole once its block closes, tags split between
    chunks included), the rest its content, and the answer finishes with ``tool_calls``; a named function's call is
    the whole output, streamed as its arguments come, finishing with ``stop``; without tools the text is the content."""
    from app.serving.openai_api import ChatCompletionRequest

    weather = {"type": "function", "function": {"name": "get_weather"}}
    ingress = Ingress(AppConfig(mock_engine=True, drafter="mock", tool_call_parser="hermes",
                                enable_auto_tool_choice=True), target=None, router=None)
    auto = ["Checking.\n<tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>', "\n"]
    named = ['{"city"', ': "Paris"}']
    for tools, texts, content, finish in (({"tools": [weather]}, auto, "Checking.", "tool_calls"),
                                          ({"tools": [weather], "tool_choice": weather}, named, None, "stop")):
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "?"}],
                                                    **tools})
        body = asyncio.run(ingress._body(_answer(ingress, texts), chat=True, request_id="r", req=req))
        choice = body["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (content, finish)
        [call] = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["id"]

        async def streamed() -> list[dict]:
            events = [e async for e in ingress._sse(_answer(ingress, texts), chat=True, request_id="r", req=req)]
            return [json.loads(e[6:])["choices"][0] for e in events if e.startswith("data: {")]

        choices = asyncio.run(streamed())
        deltas = [c["delta"] for c in choices]
        assert "".join(d.get("content") or "" for d in deltas) == (content or "")
        entries = [e for d in deltas for e in d.get("tool_calls", ())]
        assert entries[0]["function"]["name"] == "get_weather" and entries[0]["type"] == "function"
        assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Paris"}'
        assert len(entries) == (1 if texts is auto else 2) and choices[-1]["finish_reason"] == finish
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "?"}]})
    body = asyncio.run(ingress._body(_answer(ingress, auto), chat=True, request_id="r", req=plain))
    assert body["choices"][0]["message"]["content"] == "".join(auto) and "tool_calls" not in body["choices"][0][
        "message"]


def test_calls_the_model_chooses_need_the_server_s_parser():
    """vLLM's rule: ``tool_choice`` auto (the default with tools) without ``enable_auto_tool_choice`` is a 400 naming
    ``tool_choice``; required and named calls need no parser (their grammar writes them)."""
    from app.serving.openai_api import ChatCompletionRequest

    ingress = Ingress(AppConfig(mock_engine=True, drafter="mock"), target=None, router=None)
    weather = {"type": "function", "function": {"name": "get_weather"}}
    for choice, refused in ((None, True), ("auto", True), ("required", False), (weather, False), ("none", False)):
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "?"}],
                                                    "tools": [weather], "tool_choice": choice})
        answer = ingress._auto_tools_refused(req)
        assert (answer is not None) == refused, choice
        if refused:
            assert (answer.status, answer.param) == (400, "tool_choice") and "enable_auto_tool_choice" in answer.message


def test_responses_with_tools_follow_the_same_auto_tool_choice_rule():
    """``/v1/responses`` with function tools (auto by default) on a server without ``enable_auto_tool_choice``: the
    chat path's 400 naming ``tool_choice``, not a request served with no parser to read its calls."""
    ingress = Ingress(AppConfig(mock_engine=True, drafter="mock"), target=None, router=None)
    body = {"model": ingress.config.served_model_name, "input": "Weather?",
            "tools": [{"type": "function", "name": "get_weather"}]}
    answer = asyncio.run(ingress.responses(_Request(json.dumps(body).encode())))
    assert answer.status_code == 400 and json.loads(answer.body)["error"]["param"] == "tool_choice"
