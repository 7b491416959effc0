"""The HTTP ingress: OpenAI-compatible routes on FastAPI, in front of the target replicas.

Owns: ``/v1/chat/completions`` and ``/v1/completions`` (streaming SSE and non-streaming), ``/v1/responses`` (a chat
completion in the Responses shapes: ``responses.py``), ``/v1/models`` and ``/v1/models/{id}``, vLLM's ``/tokenize``,
``/detokenize`` and ``/version``, ``/metrics`` (Prometheus text), ``/health``; the API
key check (``Authorization: Bearer`` on ``/v1`` routes, ``/tokenize`` and ``/detokenize``); parsing and validation
(every failure is an OpenAI-style JSON error with a 4xx, before any work); admission (at most ``admission_limit``
target requests in flight per ingress replica, and ``TOKENIZE_LIMIT`` tokenize calls apart from them: beyond either a
JSON 503 with ``Retry-After`` at once, so Ray Serve's own queues never fill and its plain-text backpressure never
reaches a client); one target request per choice (``n`` x prompts), each placed by the Router; relaying the
target's chunks. The first chunk of every choice is awaited before any byte is sent, so errors found at admission
(context length, overload) still get their status code. A client that disconnects cancels the target streams, which
frees the requests' KV slots and drafter state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import math
import secrets
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve import context as serve_context
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.engine.types import ChatTemplateOptions
from app.serving.config import AppConfig
from app.serving.metrics import prometheus_text
from app.serving.openai_api import (
    MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, chat_logprobs,
    choice_body, chunk_body, completion_body, completion_logprobs, echoed_prompt, error_body, json_too_deep, usage,
    validation_error, vllm_prompt_logprobs,
)
from app.serving.protocol import DRAINING, ErrorItem, GenerateRequest, SpecStats, TextChunk, TokenizeCall, openai_param
from app.serving.reasoning import ReasoningParser
from app.serving.responses import (PARAMS, ResponseEvents, ResponseShape, ResponsesRequest, response_body,
                                   responses_param)
from app.serving.tools import ToolReader

log = logging.getLogger("ray.serve")

ROUTER_HEALTH_TIMEOUT_S = 2.0  # /health's wait for the Router's drain flag
BODY_TIMEOUT_S = 60.0  # a request body not received whole within this is a 408 (a stalled client holds no slot)

# redirect_slashes off: a path with a trailing slash is a JSON 404 naming it, not a 307 with an empty body
app = FastAPI(title="dspark-serve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)


def error_response(err: ErrorItem, retry_after_s: int = 1) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if err.status == 503 else None
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404) and wrong methods (405) in the OpenAI error shape, headers (``Allow``) kept."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = error_body(ErrorItem(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


@app.exception_handler(Exception)
async def server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug in a route: a JSON 500 in the OpenAI error shape instead of Starlette's plain text (logged)."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    err = ErrorItem(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
    return JSONResponse(error_body(err), status_code=500)


def admission_limit(config: AppConfig) -> int:
    """Target requests one ingress replica lets in flight: every target replica's KV slots and queue
    (``max_num_seqs + max_queued_requests``; with autoscaling, at the most replicas), shared by the ingress replicas."""
    slo = config.autoscaling
    targets = slo.max_target_replicas if slo.enabled else config.target.num_replicas
    capacity = (config.max_num_seqs + config.max_queued_requests) * targets
    return max(1, math.ceil(capacity / config.ingress.num_replicas))


def _responses_item(err: ErrorItem, req: ResponsesRequest) -> ErrorItem:
    """A chat error with its ``param`` named as the Responses request's field (``responses_param``), and the fields
    its message names too (all but ``messages``, a word messages use)."""
    message = err.message
    for chat_name in ("max_completion_tokens", "response_format"):
        message = message.replace(chat_name, PARAMS[chat_name])
    return dataclasses.replace(err, message=message, param=responses_param(err.param, req))


def _responses_error(answer: JSONResponse, req: ResponsesRequest) -> JSONResponse:
    """A chat error answer as ``_responses_item`` names it."""
    error = json.loads(answer.body)["error"]
    item = _responses_item(ErrorItem(answer.status_code, error["message"], error["type"], error["param"],
                                     error["code"]), req)
    return error_response(item, int(answer.headers.get("retry-after", 1)))


async def _response_events(chat_events: AsyncIterator[str], shape: ResponseShape) -> AsyncIterator[str]:
    """A streamed chat completion's server-sent events as the Responses API's (``ResponseEvents``)."""
    events = ResponseEvents(shape)

    def sse(batch: list[dict]) -> str:
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in batch)

    try:
        yield sse(events.start())
        async for line in chat_events:
            if line.startswith("data: {"):
                body = json.loads(line[len("data: "):])
                if batch := events.error(body) if "error" in body else events.chunk(body):
                    yield sse(batch)
    finally:
        await chat_events.aclose()


def _target_lost(err: Exception, message: str) -> ErrorItem:
    """The 503 ``unavailable`` answer (``message``) of a request whose target replica died or hung (Serve raises
    ``err``, a ``RayActorError`` or ``RayTaskError``); logged with its cause."""
    log.error("%s: %s", message, err)
    return ErrorItem(503, message, type="server_error", code="unavailable")


# /tokenize and /detokenize calls one ingress replica lets in flight (the target replicas' Serve margin,
# ``builder.SERVE_QUEUE_MARGIN``, takes them beside their generate requests)
TOKENIZE_LIMIT = 8
_SHUTTING_DOWN = ErrorItem(503, "server shutting down: not accepting new requests, retry on another server",
                           type="server_error", code="unavailable")
_OVERLOADED = ErrorItem(503, "server overloaded: the target replicas' request queues are full",
                        type="server_overloaded", code="overloaded")  # Serve's back pressure on a Target call


def _own_serve_context(request_id: str) -> None:
    """Give the calls this task makes from now on Serve request ids of their own (``request_id``, a fresh internal
    id): Serve keys a handle call's bookkeeping by the caller's request id, and concurrent calls of one HTTP request
    sharing it sometimes never got their answer (n = 2 on the mock engine: about 1 request in 6 hung)."""
    context = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(
        context, request_id=request_id, _internal_request_id=uuid.uuid4().hex))


@dataclass
class _Choice:
    """One choice of an HTTP request: its target stream and what it has produced."""

    index: int
    stream: object  # Serve's DeploymentResponseGenerator
    first: TextChunk | ErrorItem
    echo: str = ""  # the prompt, sent before the completion (completions' ``echo``)
    chunks: list[TextChunk] = field(default_factory=list)
    done: bool = False


def _prompt_alone(first: TextChunk | ErrorItem) -> TextChunk | ErrorItem:
    """The first chunk of a prompt-only choice (completions' ``max_tokens: 0``: ``CompletionRequest.prompt_only``) as
    the response shows it: without the token the engine sampled (its text, id and logprob), finished for ``length``
    as the request's 0 tokens were (the engine's request of 1 token ends with its first chunk)."""
    if isinstance(first, ErrorItem):
        return first
    return dataclasses.replace(first, text="", token_ids=[], logprobs=None if first.logprobs is None else [],
                               finish_reason=first.finish_reason and "length", stop_reason=None)


class _InFlight:
    """The target streams of one HTTP request and its admission slots: ``close`` (idempotent) cancels the streams
    still running and gives the slots back."""

    def __init__(self, ingress: "Ingress", slots: int) -> None:
        self._ingress, self._slots = ingress, slots
        self.choices: list[_Choice] = []

    def close(self) -> None:
        for choice in self.choices:
            if not choice.done:
                choice.done = True
                choice.stream.cancel()
        self._ingress._inflight -= self._slots
        self._slots = 0


class Ingress:
    """The Ingress deployment class (``FastAPIIngress`` below is it wrapped with ``serve.ingress(app)``)."""

    def __init__(self, config: AppConfig, target, router) -> None:
        self.config = config
        self.target = target
        self.router = router
        self.api_key = config.resolved_api_key
        self.created = int(time.time())
        self.limit = admission_limit(config)
        self._inflight = 0
        self._tokenizing = 0  # /tokenize and /detokenize calls in flight

    @app.get("/health")
    async def health(self):
        """200 ``{"status": "ok"}``; 503 ``{"status": "draining"}`` once a graceful shutdown drains the server (the
        Router says so; a Router that does not answer is soft state and leaves the answer at 200, logged)."""
        if await self._draining("/health"):
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version(self):
        """vLLM's: the server's version (this package's), open like ``/health``."""
        return {"version": importlib.metadata.version("dspark-serve")}

    @app.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        if model_id != self.config.served_model_name:
            return error_response(self._unknown_model(model_id))
        return self._model_card()

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        """The target replicas' counters and request gauges (as the Router last heard them), Prometheus text."""
        counters, snapshot = await asyncio.gather(self.router.counters.remote(), self.router.snapshot.remote())
        text = prometheus_text(counters, model_name=self.config.served_model_name, positions=self.config.gamma,
                               running=snapshot["active"], waiting=snapshot["waiting"])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/snapshot")
    async def snapshot(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        return await self.router.snapshot.remote()

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API as vLLM offers it: one chat completion, in the Responses shapes
        (``responses.py``); errors name the Responses fields."""
        if (denied := self._auth(request)) is not None:
            return denied
        if (full := self._overloaded(1)) is not None:
            return full
        req = await self._validated(request, ResponsesRequest)
        if isinstance(req, ErrorItem):
            return error_response(req)
        try:
            chat = req.chat()
        except ValidationError as err:
            return error_response(_responses_item(validation_error(err), req))
        except ValueError as err:  # a json_schema format without its name and schema
            return error_response(ErrorItem(400, str(err), param="text.format"))
        if (refused := self._priority_refused(chat) or self._auto_tools_refused(chat)) is not None:
            return error_response(refused)
        shape = ResponseShape(req, self.config.served_model_name)
        answer = await self._serve(chat, chat=True, request_id=shape.id, shape=shape)
        if isinstance(answer, JSONResponse) and answer.status_code >= 400:
            return _responses_error(answer, req)
        return answer

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's: a prompt's or chat's token ids as the completions endpoints take them, their count and the
        context limit (``max_model_len``); with ``return_token_strs``, each token's vocabulary string."""
        if (denied := self._auth(request)) is not None:
            return denied
        req = await self._validated(request, TokenizeRequest)
        if isinstance(req, ErrorItem):
            return error_response(req)
        chat = req.messages is not None
        call = TokenizeCall(prompt=req.prompt, messages=req.chat_messages(), token_strs=req.return_token_strs,
                            add_special_tokens=not chat if req.add_special_tokens is None else req.add_special_tokens,
                            template=self._template(req))
        answer = await self._tokenizer_call("/tokenize", lambda: self.target.tokenize.remote(call))
        if isinstance(answer, ErrorItem):
            return error_response(answer, self.config.retry_after_s)
        ids, strs = answer
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        """vLLM's: token ids as text (special tokens kept)."""
        if (denied := self._auth(request)) is not None:
            return denied
        req = await self._validated(request, DetokenizeRequest)
        if isinstance(req, ErrorItem):
            return error_response(req)
        answer = await self._tokenizer_call("/detokenize", lambda: self.target.detokenize.remote(req.tokens))
        if isinstance(answer, ErrorItem):
            return error_response(answer, self.config.retry_after_s)
        return {"prompt": answer}

    # ------------------------------------------------------------------ helpers

    def _priority_refused(self, req: ChatCompletionRequest | CompletionRequest) -> ErrorItem | None:
        """vLLM's rule: a ``priority`` other than 0 needs the server's priority scheduling."""
        if req.priority == 0 or self.config.scheduling_policy == "priority":
            return None
        return ErrorItem(400, f"priority {req.priority} needs the server's priority scheduling (scheduling_policy: "
                         "priority); this server admits requests in arrival order", param="priority")

    def _auto_tools_refused(self, req: ChatCompletionRequest) -> ErrorItem | None:
        """vLLM's rule: calls the model chooses (``tool_choice`` auto, the default with tools) need the server's
        ``enable_auto_tool_choice`` and ``tool_call_parser``."""
        if req.tool_mode != "auto" or self.config.enable_auto_tool_choice:
            return None
        return ErrorItem(400, '"auto" tool choice needs the server\'s enable_auto_tool_choice and tool_call_parser '
                         "(vLLM's --enable-auto-tool-choice, --tool-call-parser), and a chat template that shows the "
                         "tools (docs/serving.md, \"Tool calling\"); without them send tool_choice \"required\", a "
                         "named function or \"none\"", param="tool_choice")

    def _tools(self, req: ChatCompletionRequest | CompletionRequest, *, chat: bool) -> ToolReader | None:
        """How a chat's answers' tool calls are read (``tools.py``); None for completions and answers without."""
        return req.tool_reader(self.config.tool_call_parser) if chat else None

    def _reasoning(self, req: ChatCompletionRequest | CompletionRequest, *, chat: bool) -> ReasoningParser | None:
        """The parser of a chat's reasoning (``reasoning_parser``), starting where a message the client started left
        off (``continue_final_message``); None for completions, and for structured output, whose grammar constrains
        the whole output: the answer."""
        if not chat or self.config.reasoning_parser is None or req.guided() is not None:
            return None
        return ReasoningParser(self.config.reasoning_parser,
                               prefill=req.messages[-1].text if req.continue_final_message else None)

    def _template(self, req: ChatCompletionRequest | TokenizeRequest) -> ChatTemplateOptions:
        """How the chat template renders the request's messages: its fields, and this server's sanitizing."""
        return dataclasses.replace(req.template_options(),
                                   sanitize_control_tokens=self.config.sanitize_chat_control_tokens)

    async def _draining(self, route: str) -> bool:
        """Whether the Router says the server drains (a Router that does not answer is soft state: not draining,
        logged)."""
        try:
            return await asyncio.wait_for(self.router.is_draining.remote(), timeout=ROUTER_HEALTH_TIMEOUT_S)
        except (RayActorError, RayTaskError, asyncio.TimeoutError) as err:
            log.warning("%s: Router unavailable, answering as not draining: %r", route, err)
            return False

    async def _tokenizer_call(self, route: str, call: Callable[[], Any]) -> Any:
        """A target replica's answer to ``call()``, a call that holds no KV slot (tokenize, detokenize): at most
        ``TOKENIZE_LIMIT`` in flight, apart from the generate requests' admission limit (as in vLLM, they take no
        engine capacity, so a burst of them does not turn requests away); the 503 of that limit, of a drain, or of
        a replica lost or overloaded (an ``ErrorItem``)."""
        if self._tokenizing >= TOKENIZE_LIMIT:
            return ErrorItem(503, f"server overloaded: {self._tokenizing} tokenize calls in flight, the limit is "
                             f"{TOKENIZE_LIMIT}; retry after {self.config.retry_after_s} s", type="server_overloaded",
                             code="overloaded")
        self._tokenizing += 1
        try:
            if await self._draining(route):
                return _SHUTTING_DOWN
            return await call()
        except BackPressureError:
            return _OVERLOADED
        except (RayActorError, RayTaskError) as err:
            return _target_lost(err, "target replica unavailable, retry")
        finally:
            self._tokenizing -= 1

    def _model_card(self) -> dict:
        """A ``/v1/models`` entry shaped like vLLM's (``root``: the model served, ``max_model_len``)."""
        return {"id": self.config.served_model_name, "object": "model", "created": self.created,
                "owned_by": "dspark-serve", "root": self.config.model, "parent": None,
                "max_model_len": self.config.max_model_len}

    def _unknown_model(self, name: str) -> ErrorItem:
        return ErrorItem(404, f"model {name!r} does not exist; this server serves {self.config.served_model_name!r}",
                         type="not_found_error", param="model", code="model_not_found")

    def _auth(self, request: Request) -> JSONResponse | None:
        if self.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110 11.1), the key is not
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return error_response(ErrorItem(401, "invalid or missing API key", type="authentication_error",
                                        code="invalid_api_key"))

    async def _read_body(self, request: Request) -> bytes | ErrorItem:
        """The body, read no further than ``max_request_bytes`` (a 413 beyond it, whatever Content-Length says); a 415
        for a compressed one (any ``Content-Encoding`` but ``identity``)."""
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            return ErrorItem(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                             code="unsupported_content_encoding")
        limit = self.config.max_request_bytes
        too_large = ErrorItem(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return too_large
        body = bytearray()
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        return too_large
        except TimeoutError:
            return ErrorItem(408, f"request body not received within {BODY_TIMEOUT_S:g} s ({len(body)} bytes came)",
                             code="request_timeout")
        except ClientDisconnect:  # nobody reads the answer; no traceback for a client that left
            return ErrorItem(400, "client disconnected before sending the whole request body")
        return bytes(body)

    async def _validated(self, request: Request, schema: type[BaseModel]) -> BaseModel | ErrorItem:
        """The body validated as ``schema``, for the model this server serves (a body without ``model``: any)."""
        raw = await self._read_body(request)
        if isinstance(raw, ErrorItem):
            return raw
        too_deep = ErrorItem(400, f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return ErrorItem(400, f"request body is not valid JSON: {err}")
        except ValueError as err:  # valid JSON Python will not read: an integer of more than 4300 digits
            return ErrorItem(400, f"request body cannot be read: {str(err).split(';')[0]}")  # not its server-side hint
        except RecursionError:
            return too_deep
        if json_too_deep(body):
            return too_deep
        if not isinstance(body, dict):
            return ErrorItem(400, "request body must be a JSON object")
        try:
            req = schema.model_validate(body)
        except ValidationError as err:
            return validation_error(err)
        if req.model is not None and req.model != self.config.served_model_name:
            return self._unknown_model(req.model)
        return req

    async def _parse(self, request: Request, chat: bool) -> ChatCompletionRequest | CompletionRequest | ErrorItem:
        req = await self._validated(request, ChatCompletionRequest if chat else CompletionRequest)
        if isinstance(req, ErrorItem):
            return req
        if (refused := self._priority_refused(req)) is not None:
            return refused
        if chat and (refused := self._auto_tools_refused(req)) is not None:
            return refused
        if req.return_token_ids and (req.num_choices > 1 or not chat and len(req.prompts) > 1):
            return ErrorItem(400, "return_token_ids: needs a single choice (n = 1, one prompt)",
                             param="return_token_ids")
        return req

    def _generates(self, req, *, chat: bool, request_id: str) -> list[tuple[int, GenerateRequest, str]]:
        """One target request per choice: (choice index, request, echoed prompt: a text prompt's; a token-id
        prompt's text comes with its first chunk). Completions' choice ``i * n + j`` is prompt ``i``'s ``j``-th, as
        OpenAI orders them.

        Raises:
            ValueError: sampling settings ``SamplingParams`` refuses.
        """
        n = req.num_choices
        prompts = [None] if chat else req.prompts
        messages = req.chat_messages() if chat else None
        template = self._template(req) if chat else ChatTemplateOptions()
        out = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                rid = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
                echo = not chat and bool(req.echo)
                as_sent = isinstance(prompt, str) and req.truncate_prompt_tokens is None  # else the prompt's tokens
                out.append((index, GenerateRequest(request_id=rid, params=req.params(j), messages=messages,
                                                   template=template, prompt=prompt,
                                                   max_tokens_param=req.max_tokens_param,
                                                   max_tokens_default=req.max_tokens_default,
                                                   echo=("sent" if as_sent else "tokens") if echo else "no",
                                                   truncate_prompt_tokens=req.truncate_prompt_tokens,
                                                   priority=req.priority,
                                                   add_special_tokens=req.add_special_tokens,
                                                   guided_param=req.guided_param),
                            prompt if echo and as_sent else ""))
        return out

    async def _start(self, generate: GenerateRequest, *, own_context: bool):
        """Place one target request (the Router's choice) and await its first chunk; returns (stream, first).

        ``own_context``: one of several choices (run as its own task): its calls get their own Serve request ids
        (``_own_serve_context``).
        """
        if own_context:
            _own_serve_context(generate.request_id)
        try:
            key = await self.router.choose_target.remote()
        except (RayActorError, RayTaskError) as err:  # balance is lost, not the request: any replica will do
            log.warning("Router unavailable, default routing: %s", err)
            key = None
        if key == DRAINING:
            return None, _SHUTTING_DOWN
        stream = self.target.options(stream=True).generate.remote(generate, replica_key=key)
        try:
            return stream, await stream.__anext__()
        except asyncio.CancelledError:  # the client went away while the request waited for a slot or its prefill
            stream.cancel()  # Serve does not cancel a handle call the cancelled caller made; left, it would run
            raise
        except BackPressureError:
            stream.cancel()
            return stream, _OVERLOADED
        except (RayActorError, RayTaskError) as err:
            return stream, _target_lost(err, "target replica unavailable, retry")

    async def _check_prompts(self, generates: list[tuple[int, GenerateRequest, str]], req) -> ErrorItem | None:
        """The first refusal (``Target.check``) among the prompts of a completions request with several, checked
        before any starts: started together, a prompt over the context would be answered after the others had been
        admitted and prefilled, then cancelled."""
        async def check(generate: GenerateRequest) -> ErrorItem | None:
            _own_serve_context(generate.request_id)  # run as its own task (gather): as in _start
            return await self.target.check.remote(generate)

        firsts = [g for index, g, _ in generates if index % req.num_choices == 0]  # one choice per prompt
        try:
            refusals = await asyncio.gather(*[check(g) for g in firsts])
        except BackPressureError:
            return _OVERLOADED
        except (RayActorError, RayTaskError) as err:
            return _target_lost(err, "target replica unavailable, retry")
        return next((r for r in refusals if r is not None), None)

    def _overloaded(self, needed: int) -> JSONResponse | None:
        """The 503 answer when ``needed`` more target requests would pass the admission limit (None: room)."""
        if self._inflight + needed <= self.limit:
            return None
        cfg = self.config
        return error_response(ErrorItem(
            503, f"server overloaded: {self._inflight} requests in flight, the limit is {self.limit} "
            f"({cfg.max_num_seqs} running + {cfg.max_queued_requests} queued per target replica); retry after "
            f"{cfg.retry_after_s} s", type="server_overloaded", code="overloaded"), cfg.retry_after_s)

    async def _complete(self, request: Request, *, chat: bool):
        if (denied := self._auth(request)) is not None:
            return denied
        if (full := self._overloaded(1)) is not None:  # before reading the body: rejecting must stay cheap
            return full
        req = await self._parse(request, chat)
        if isinstance(req, ErrorItem):
            return error_response(req)
        return await self._serve(req, chat=chat, request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")

    async def _serve(self, req: ChatCompletionRequest | CompletionRequest, *, chat: bool, request_id: str,
                     shape: ResponseShape | None = None):
        """Run a validated request: its choices on target replicas, answered streamed or whole (as a Responses API
        ``response`` with ``shape``)."""
        try:
            generates = self._generates(req, chat=chat, request_id=request_id)
        except ValueError as err:
            param = openai_param(getattr(err, "param", None), chat=chat, max_tokens_param=req.max_tokens_param,
                                 guided_param=req.guided_param)
            return error_response(ErrorItem(400, str(err), param=param))
        if (full := self._overloaded(len(generates))) is not None:
            return full
        flight = _InFlight(self, len(generates))  # counted from here: the checks below wait, other requests go on
        self._inflight += len(generates)
        streaming = False
        try:
            refused = await self._check_prompts(generates, req) if not chat and len(req.prompts) > 1 else None
            if refused is not None:
                return error_response(refused, self.config.retry_after_s)
            started = await asyncio.gather(*[self._start(g, own_context=len(generates) > 1)
                                             for _, g, _ in generates])
            if not chat and req.prompt_only:
                started = [(stream, _prompt_alone(first)) for stream, first in started]
            flight.choices = [_Choice(index, stream, first, echo or getattr(first, "prompt_text", None) or "")
                              for (index, _, echo), (stream, first) in zip(generates, started)]
            for choice in flight.choices:
                if isinstance(choice.first, ErrorItem):
                    choice.done = True
            failed = next((c.first for c in flight.choices if isinstance(c.first, ErrorItem)), None)
            if failed is not None:
                return error_response(failed, self.config.retry_after_s)
            if req.stream:
                events = self._sse(flight, chat=chat, request_id=request_id, req=req)
                weakref.finalize(events, flight.close)  # a stream the server never starts still frees its slots
                streaming = True
                if shape is not None:
                    events = _response_events(events, shape)
                return StreamingResponse(events, media_type="text/event-stream")
            body = await self._body(flight, chat=chat, request_id=request_id, req=req)
            return body if shape is None or not isinstance(body, dict) else response_body(shape, body)
        finally:
            if not streaming:
                flight.close()

    async def _body(self, flight: _InFlight, *, chat: bool, request_id: str, req) -> JSONResponse | dict:
        """The non-streamed response: every choice read to its end (or the first error)."""
        async def read(choice: _Choice) -> ErrorItem | None:
            chunk = choice.first
            while True:
                choice.chunks.append(chunk)
                if chunk.finish_reason is not None:
                    choice.done = True
                    return None
                try:
                    chunk = await choice.stream.__anext__()
                except (RayActorError, RayTaskError) as err:
                    choice.done = True
                    return _target_lost(err, "target replica failed mid-request, retry")
                if isinstance(chunk, ErrorItem):  # the target failed the request after its first chunk
                    choice.done = True
                    return chunk

        errors = [e for e in await asyncio.gather(*[read(c) for c in flight.choices]) if e is not None]
        if errors:
            return error_response(errors[0], self.config.retry_after_s)
        choices, parser, tools = [], self._reasoning(req, chat=chat), self._tools(req, chat=chat)
        for c in flight.choices:
            entries = [e for chunk in c.chunks for e in chunk.logprobs or ()]
            logprobs = None
            if c.chunks[0].logprobs is not None:
                by_id = req.return_tokens_as_token_ids
                logprobs = chat_logprobs(entries, token_ids=by_id) if chat else completion_logprobs(
                    entries, offset=len(c.echo), prompt=echoed_prompt(c.chunks[0].prompt_logprobs, req.echoed_logprobs),
                    token_ids=by_id)
            text, reasoning = c.echo + "".join(x.text for x in c.chunks), None
            if parser is not None:
                reasoning, text = parser.split(text)
                reasoning = reasoning if req.include_reasoning else None
            finish_reason, calls = c.chunks[-1].finish_reason, None
            if tools is not None:
                text, read = tools.split(text or "")
                finish_reason, calls = tools.finish_reason(finish_reason, bool(read)), [x.body() for x in read] or None
            choices.append(choice_body(chat=chat, index=c.index, text=text, finish_reason=finish_reason,
                                       logprobs=logprobs, stop_reason=c.chunks[-1].stop_reason, reasoning=reasoning,
                                       tool_calls=calls))
            if not chat and req.prompt_logprobs is not None:  # vLLM's: per choice, a chat's for the whole response
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(c.chunks[0].prompt_logprobs, req.prompt_logprobs)
        token_ids = [t for chunk in flight.choices[0].chunks for t in chunk.token_ids]
        body = completion_body(
            chat=chat, request_id=request_id, model=self.config.served_model_name, choices=choices,
            prompt_tokens=self._prompt_tokens(flight, req), cached_tokens=self._cached_tokens(flight, req),
            completion_tokens=sum(x.num_tokens for c in flight.choices for x in c.chunks),
            spec=SpecStats.total([c.chunks[-1].spec or SpecStats() for c in flight.choices]) if req.spec_stats
            else None, token_ids=token_ids if req.return_token_ids else None,
        )
        if chat and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(flight.choices[0].first.prompt_logprobs, req.prompt_logprobs)
        return body

    @staticmethod
    def _prompt_tokens(flight: _InFlight, req) -> int:
        """Prompt tokens of the request: each prompt once, however many choices it has."""
        return sum(c.first.prompt_tokens for c in flight.choices if c.index % req.num_choices == 0)

    @staticmethod
    def _cached_tokens(flight: _InFlight, req) -> int:
        """Of ``_prompt_tokens``, those reused from the prefix cache."""
        return sum(c.first.cached_tokens for c in flight.choices if c.index % req.num_choices == 0)

    async def _sse(self, flight: _InFlight, *, chat: bool, request_id: str, req) -> AsyncIterator[str]:
        """The streamed response: the choices' chunks as they come, then usage (if asked) and ``[DONE]``."""
        model, created = self.config.served_model_name, int(time.time())
        queue: asyncio.Queue[tuple[_Choice, TextChunk | ErrorItem]] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            chunk = choice.first
            try:
                while True:
                    queue.put_nowait((choice, chunk))
                    if isinstance(chunk, ErrorItem) or chunk.finish_reason is not None:
                        return
                    chunk = await choice.stream.__anext__()
            except RequestCancelledError:  # the client went away: the response is being closed, nothing to send
                return
            except (RayActorError, RayTaskError) as err:
                queue.put_nowait((choice, _target_lost(err, "target replica failed mid-stream")))

        generated = {c.index: 0 for c in flight.choices}  # completion tokens sent per choice

        def event(body: dict, choice: _Choice | None = None) -> str:
            """An SSE event of ``body``, with ``usage`` where asked (``choice``: the choice the chunk is of)."""
            if choice is not None and req.continuous_usage:  # vLLM's: the choice's usage so far, no cache details
                prompt = choice.first.prompt_tokens  # a TextChunk: _serve answers an error before streaming
                body["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated[choice.index],
                                 "total_tokens": prompt + generated[choice.index]}
            elif req.include_usage and "choices" in body:  # OpenAI: every chunk but the last has "usage": null
                body.setdefault("usage", None)
            return f"data: {json.dumps(body)}\n\n"

        def logprobs(chunk: TextChunk, offset: int) -> dict | None:
            """The chunk's logprobs object (a choice's first chunk: the scored prompt's tokens first, if any)."""
            if chunk.logprobs is None:
                return None
            if chat:
                return chat_logprobs(chunk.logprobs, token_ids=req.return_tokens_as_token_ids)
            return completion_logprobs(chunk.logprobs, offset,
                                       prompt=echoed_prompt(chunk.prompt_logprobs, req.echoed_logprobs),
                                       token_ids=req.return_tokens_as_token_ids)

        tasks = [asyncio.create_task(pump(c)) for c in flight.choices]
        offsets = {c.index: 0 for c in flight.choices}  # characters sent per choice (completions' text_offset)
        parser, tools = self._reasoning(req, chat=chat), self._tools(req, chat=chat)
        splits = {c.index: parser.stream() for c in flight.choices} if parser is not None else {}
        calls = {c.index: tools.stream() for c in flight.choices} if tools is not None else {}
        remaining = len(flight.choices)
        try:
            if chat:
                for c in flight.choices:
                    yield event(chunk_body(chat=True, request_id=request_id, created=created, model=model, text="",
                                           index=c.index, role=True), c)
            while remaining:
                choice, chunk = await queue.get()
                if isinstance(chunk, ErrorItem):  # failed mid-stream: an error event ends the stream (as vLLM)
                    choice.done = True
                    yield event(error_body(chunk))
                    yield "data: [DONE]\n\n"
                    return
                generated[choice.index] += chunk.num_tokens
                text = chunk.text
                if chunk is choice.first and choice.echo:
                    text = choice.echo + text
                    offsets[choice.index] = len(choice.echo)
                reasoning = None
                if (split := splits.get(choice.index)) is not None:  # a chat's reasoning apart from its answer
                    reasoning, text = split.feed(text)
                    if chunk.finish_reason is not None:
                        reasoning, text = (x + y for x, y in zip((reasoning, text), split.finish()))
                    reasoning = reasoning if req.include_reasoning else ""
                deltas = []
                if (reader := calls.get(choice.index)) is not None:  # a chat's tool calls apart from its content
                    text, deltas = reader.feed(text)
                    if chunk.finish_reason is not None:
                        more, last = reader.finish()
                        text, deltas = text + more, deltas + last
                if text or reasoning or deltas or chunk.logprobs:
                    yield event(chunk_body(chat=chat, request_id=request_id, created=created, model=model,
                                           text=None if (reasoning or deltas) and not text else text,
                                           reasoning=reasoning or None, tool_calls=deltas or None,
                                           index=choice.index, logprobs=logprobs(chunk, offsets[choice.index])),
                                choice)
                    offsets[choice.index] += len(chunk.text)
                if chunk.finish_reason is not None:
                    choice.done, remaining = True, remaining - 1
                    finish_reason = chunk.finish_reason if reader is None else reader.reader.finish_reason(
                        chunk.finish_reason, bool(reader.calls))
                    final = chunk_body(chat=chat, request_id=request_id, created=created, model=model,
                                       text=None if chat else "", index=choice.index, finish_reason=finish_reason,
                                       stop_reason=chunk.stop_reason)
                    if req.spec_stats and chunk.spec is not None:
                        final["spec_stats"] = chunk.spec.to_json()
                    yield event(final, choice)
            if req.include_usage:
                body = chunk_body(chat=chat, request_id=request_id, created=created, model=model, text=None)
                body["choices"] = []
                body["usage"] = usage(self._prompt_tokens(flight, req), sum(generated.values()),
                                      self._cached_tokens(flight, req))
                yield event(body)
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            flight.close()  # the client went away, or the stream ended: stop what still runs, free the slots


# Applied at import time so every process that imports this module sees the same class-based routes (Serve
# rewrites ``app``'s routes in place; a wrapper built elsewhere would leave the replica's ``app`` untouched).
FastAPIIngress = serve.ingress(app)(Ingress)
