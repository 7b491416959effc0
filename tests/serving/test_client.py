"""``python -m app.serving.client`` against fake servers (``httpx.MockTransport``): what it prints and how it ends."""

from __future__ import annotations

import io
import json
import socket

import httpx
import pytest

from app.serving import client


def _chunk(content: str | None = None, finish: str | None = None, **extra) -> str:
    choices = [] if content is None and finish is None else \
        [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]
    event = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices, **extra}
    return f"data: {json.dumps(event)}\n\n"


def _server(body: str, status: int = 200, seen: list | None = None) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((str(request.url), json.loads(request.content)))
        media = "text/event-stream" if status == 200 else "application/json"
        return httpx.Response(status, content=body.encode(), headers={"content-type": media})

    return httpx.Client(transport=httpx.MockTransport(handler))


def _chat(url: str, http_client: httpx.Client, out: io.StringIO | None = None) -> dict:
    return client.stream_chat(url, "hi", model="m", max_tokens=8, temperature=0.0, api_key=None,
                              out=out or io.StringIO(), http_client=http_client)


def test_an_answer_streams_with_usage_and_spec_stats_from_the_url_the_ready_line_prints():
    stats = {"mean_accepted_length": 2.5}
    body = _chunk("Hel") + _chunk("lo", "stop", spec_stats=stats) + \
        _chunk(usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}) + "data: [DONE]\n\n"
    for url in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/", "http://127.0.0.1:8000"):
        out, seen = io.StringIO(), []
        result = _chat(url, _server(body, seen=seen), out)
        assert out.getvalue() == "Hello" and result["finish_reason"] == "stop" and result["spec_stats"] == stats
        assert result["usage"]["completion_tokens"] == 2
        assert seen[0][0] == "http://127.0.0.1:8000/v1/chat/completions" and seen[0][1]["spec_stats"] is True


def test_errors_end_with_one_line_not_a_traceback():
    error = {"error": {"message": "target replica failed mid-request, retry", "type": "server_error"}}
    with pytest.raises(SystemExit, match="ended the stream with an error: target replica failed mid-request"):
        _chat("http://x/v1", _server(_chunk("Hi") + f"data: {json.dumps(error)}\n\n" + "data: [DONE]\n\n"))
    with pytest.raises(SystemExit, match="the stream ended before the answer did"):  # cut: no finish, no [DONE]
        _chat("http://x/v1", _server(_chunk("Hi")))
    refused = {"error": {"message": "max_tokens: must be >= 1", "type": "invalid_request_error"}}
    with pytest.raises(SystemExit, match="HTTP 400: max_tokens: must be >= 1"):
        _chat("http://x/v1", _server(json.dumps(refused), status=400))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=f"cannot reach http://127.0.0.1:{port}/v1"):
        client.stream_chat(f"http://127.0.0.1:{port}", "hi", model="m", max_tokens=8, temperature=0.0, api_key=None)


def test_bad_flags_are_usage_errors(capsys):
    for argv, message in ((["hi", "--url", "notaurl"], "--url must be an http:// or https:// URL"),
                          (["hi", "--max-tokens", "0"], "--max-tokens"),
                          (["hi", "--temperature", "-1"], "--temperature")):
        with pytest.raises(SystemExit) as exc:
            client.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
