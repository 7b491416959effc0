"""The Locust user: closed-loop streamed OpenAI chat completions, timed as the bytes arrive.

Run it through the sweep (``python -m loadtest.sweep``) or directly::

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 4 -r 4 -t 60s \\
        --model smollm2-135m --max-tokens 128 --records runs/records.jsonl

Each user sends one request after another (no wait) with the next prompt from ``--prompts`` (in the order seeded by
``--prompt-seed``, from line ``--prompt-offset`` on; the users of a process share the sequence); with ``--multi-turn``
a user plays each prompt line as a conversation, every later turn sent with the earlier turns and the server's answers
to them (a prompt set with one turn a line sends the same requests either way). The answer is read
with ``iter_content(chunk_size=None)``, which returns each chunk as the socket delivers it (Locust's and
requests' line iterators wait to fill a buffer, which delays the timestamps). Every request is reported to
Locust's statistics (so the web UI and ``--csv`` files show it):

    POST /v1/chat/completions   response_time = end-to-end ms, response_length = output tokens
    SSE  ttft_ms / tpot_ms / itl_ms   the request's TTFT, TPOT and each inter-token gap, in ms
    SSE  user_tok_s             the request's per-user speed (the "response time" column holds tok/s)

and, with ``--records PATH``, appended to a JSONL file as one ``RequestRecord`` a line (plus ``test_start``,
``spawning_complete`` and ``test_stopping`` markers with their wall times), which the sweep aggregates.

Import this module only inside a Locust process: Locust monkey-patches the standard library with gevent.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

import requests
from locust import User, constant, events, task

from loadtest.prompts import (
    DEFAULT_PROMPTS, chat_messages, load_conversation_spec, max_tokens_plan, rotated, shuffled,
)
from app.argtypes import base_url
from loadtest.stream import StreamObserver, observe_stream

ROUTE = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, env_var="LOADTEST_PROMPTS",
                        help="Evaluation set names or JSONL paths, comma-separated (loadtest/prompts.py).")
    parser.add_argument("--prompt-seed", type=int, default=0, env_var="LOADTEST_PROMPT_SEED",
                        help="Seed of the prompt order (the same order for every run).")
    parser.add_argument("--prompt-offset", type=int, default=0, env_var="LOADTEST_PROMPT_OFFSET",
                        help="Start at this line of the seeded order (the sweep gives each level its own slice).")
    parser.add_argument("--model", default="smollm2-135m", env_var="LOADTEST_MODEL", help="Served model name.")
    parser.add_argument("--max-tokens", type=int, default=128, env_var="LOADTEST_MAX_TOKENS")
    parser.add_argument("--max-tokens-range-ratio", type=float, default=0.0, env_var="LOADTEST_MAX_TOKENS_RANGE_RATIO",
                        help="Each request's max_tokens uniform in max_tokens x [1 - r, 1 + r] (seeded by "
                             "--prompt-seed; 0: all the same).")
    parser.add_argument("--temperature", type=float, default=0.0, env_var="LOADTEST_TEMPERATURE")
    parser.add_argument("--system-prompt", default="", env_var="LOADTEST_SYSTEM_PROMPT",
                        help="A system message sent before every prompt (a shared prefix: what prefix caching "
                             "reuses); default none.")
    parser.add_argument("--multi-turn", action="store_true", env_var="LOADTEST_MULTI_TURN",
                        help="Send every turn of a prompt line in order, each after the answers to the earlier ones "
                             "(mt-bench has two turns a line); default first turns only.")
    parser.add_argument("--ignore-eos", action="store_true", env_var="LOADTEST_IGNORE_EOS",
                        help="Always generate max_tokens (fixed-length answers).")
    parser.add_argument("--no-spec-stats", action="store_true", env_var="LOADTEST_NO_SPEC_STATS",
                        help="Do not ask for the spec_stats extension (servers that reject unknown fields).")
    parser.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY", ""), env_var="LOADTEST_API_KEY",
                        is_secret=True, help="Bearer key (default $DSPARK_API_KEY).")
    parser.add_argument("--request-timeout", type=float, default=600.0, env_var="LOADTEST_REQUEST_TIMEOUT",
                        help="Seconds to wait for the next byte of an answer.")
    parser.add_argument("--records", default="", env_var="LOADTEST_RECORDS",
                        help="Append one JSON line per request to this file.")


class _Records:
    """The JSONL sink shared by all users of this process (one line per write, flushed)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8") if path else None
        self._lock = threading.Lock()

    def write(self, row: dict) -> None:
        if self._file is None:
            return
        with self._lock:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_state: dict = {}


@events.init.add_listener
def _init(environment, **_kwargs) -> None:
    options = environment.parsed_options
    conversations = load_conversation_spec(options.prompts)
    if not options.multi_turn:
        conversations = [turns[:1] for turns in conversations]
    order = rotated(shuffled(conversations, options.prompt_seed), options.prompt_offset)
    _state["conversations"] = itertools.cycle(order)
    _state["max_tokens"] = max_tokens_plan(options.max_tokens, options.max_tokens_range_ratio, options.prompt_seed)
    _state["records"] = _Records(options.records)


def _marker(kind: str, **extra) -> None:
    if "records" in _state:
        _state["records"].write({"kind": kind, "t": time.time(), **extra})


@events.test_start.add_listener
def _test_start(**_kwargs) -> None:
    _marker("test_start")


@events.spawning_complete.add_listener
def _spawning_complete(user_count: int, **_kwargs) -> None:
    _marker("spawning_complete", user_count=user_count)


@events.test_stopping.add_listener
def _test_stopping(**_kwargs) -> None:
    _marker("test_stopping")


@events.quitting.add_listener
def _quitting(**_kwargs) -> None:
    if "records" in _state:
        _state["records"].close()


class ChatCompletionUser(User):
    """One simulated user: a closed loop of streamed chat completions, a conversation's turns in order (the next
    conversation after its last turn, or after a failed request)."""

    wait_time = constant(0)
    _ids = itertools.count()

    def on_start(self) -> None:
        self.user_id = next(ChatCompletionUser._ids)
        self.session = requests.Session()
        options = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.url = base_url(self.environment.host) + ROUTE
        self.turns: list[str] = []  # the conversation's user turns not sent yet
        self.history: list[tuple[str, str]] = []  # its (user turn, answer) pairs so far

    def on_stop(self) -> None:
        self.session.close()

    def body(self, prompt: str) -> dict:
        options = self.environment.parsed_options
        body = {
            "model": options.model, "messages": chat_messages(prompt, options.system_prompt, self.history),
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": next(_state["max_tokens"]),
            "temperature": options.temperature,
        }
        if options.ignore_eos:
            body["ignore_eos"] = True
        if not options.no_spec_stats:
            body["spec_stats"] = True
        return body

    @task
    def chat(self) -> None:
        if not self.turns:
            self.turns, self.history = list(next(_state["conversations"])), []
        prompt = self.turns.pop(0)
        body = self.body(prompt)
        timeout = (10.0, self.environment.parsed_options.request_timeout)
        observer = StreamObserver(user=self.user_id, start_wall=time.time(), start_perf=time.perf_counter(),
                                  turn=len(self.history))
        status, error = None, None
        try:
            with self.session.post(self.url, json=body, headers=self.headers, stream=True, timeout=timeout) as r:
                status = r.status_code
                if status == 200:
                    observe_stream(r.iter_content(chunk_size=None), observer)
                else:
                    error = f"HTTP {status}: {r.text[:300]}"
        except requests.RequestException as err:
            error = f"{type(err).__name__}: {err}"
        record = observer.record(end_perf=time.perf_counter(), status=status, error=error)
        if record.ok:
            self.history.append((prompt, observer.text))
        else:  # no answer to carry on from
            self.turns = []
        self.report(record)
        _state["records"].write(record.to_json())

    def report(self, record) -> None:
        fire = self.environment.events.request.fire
        fire(request_type="POST", name=ROUTE, response_time=record.e2el_ms, response_length=record.output_tokens,
             exception=None if record.ok else RuntimeError(record.error), context={}, start_time=record.start,
             url=self.url, response=None)
        if not record.ok:
            return
        values = [("ttft_ms", record.ttft_ms), ("tpot_ms", record.tpot_ms), ("user_tok_s", record.user_tok_s)]
        values += [("itl_ms", gap) for gap in record.itl_ms]
        for name, value in values:
            if value is not None:
                fire(request_type="SSE", name=name, response_time=value, response_length=0, exception=None,
                     context={}, start_time=record.start, url=self.url, response=None)
