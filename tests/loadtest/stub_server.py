"""A stub OpenAI-compatible streaming server with a known timeline, for checking what the load test measures.

Every streamed answer: headers at once, the role chunk, then after ``ttft_s`` the first text chunk, then a
chunk of ``tokens_per_chunk`` tokens every ``itl_s`` until ``max_tokens``; a final chunk with
``finish_reason`` (and ``spec_stats`` when asked), the usage chunk when asked (a word per prompt token, the words of
every message before the last cached), ``[DONE]``. Chunked transfer encoding, one event per write, as a real server
streams.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Timeline:
    ttft_s: float = 0.3
    itl_s: float = 0.1
    tokens_per_chunk: int = 2
    model: str = "stub-model"


def usage(messages: list[dict], completion_tokens: int) -> dict:
    """A word per prompt token; the words of every message before the last (a system message, earlier turns and
    answers) count as found in the prefix cache."""
    prompt = sum(len(m["content"].split()) for m in messages)
    cached = sum(len(m["content"].split()) for m in messages[:-1])
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def make_handler(timeline: Timeline):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": timeline.model, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def _event(self, body: dict | str) -> None:
            data = f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if req.get("model") != timeline.model:
                self._json(404, {"error": {"message": "unknown model"}})
                return
            if not req.get("stream"):
                self._json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                              "finish_reason": "stop"}]})
                return
            n = req.get("max_tokens") or 16
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(**delta) -> dict:
                return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                         "finish_reason": None}]}

            self._event(chunk(role="assistant", content=""))
            time.sleep(timeline.ttft_s)
            self._event(chunk(content="t0 "))
            sent, rounds = 1, 0
            while sent < n:
                time.sleep(timeline.itl_s)
                k = min(timeline.tokens_per_chunk, n - sent)
                self._event(chunk(content="".join(f"t{sent + i} " for i in range(k))))
                sent, rounds = sent + k, rounds + 1
            final = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {},
                                                                    "finish_reason": "length"}]}
            if req.get("spec_stats"):
                accepted = (n - 1) - rounds
                final["spec_stats"] = {"rounds": rounds, "draft_tokens": 3 * rounds, "accepted_tokens": accepted,
                                       "mean_accepted_length": (accepted + rounds) / max(rounds, 1),
                                       "fallback": False}
            self._event(final)
            if (req.get("stream_options") or {}).get("include_usage"):
                self._event({"object": "chat.completion.chunk", "choices": [],
                             "usage": usage(req.get("messages") or [], n)})
            self._event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


@contextlib.contextmanager
def stub_server(timeline: Timeline = Timeline()):
    """Serve the stub on a free loopback port; yield its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(timeline))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
