"""The HTTP ingress: OpenAI-compatible routes on FastAPI, in front of the target replicas.

Owns: ``/v1/chat/completions`` and ``/v1/completions`` (streaming SSE and non-streaming), ``/v1/models``,
``/health``; the API key check (``Authorization: Bearer``; health stays open); parsing and validation (every
failure is an OpenAI-style JSON error with a 4xx, overload a 503 with ``Retry-After``); asking the Router for
a target replica (once per request) and relaying the target's chunks. The first chunk is awaited before any
byte is sent, so errors found at admission (context length, overload) still get their status code. A client
that disconnects cancels the target stream, which frees the request's KV slot and drafter state.
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.serving.config import AppConfig
from app.serving.openai_api import (
    ChatCompletionRequest, CompletionRequest, chunk_body, completion_body, error_body, usage, validation_error,
)
from app.serving.protocol import ErrorItem, GenerateRequest, TextChunk

log = logging.getLogger("ray.serve")

app = FastAPI(title="dspark-serve", docs_url=None, redoc_url=None, openapi_url=None)


def error_response(err: ErrorItem, retry_after_s: int = 1) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if err.status == 503 else None
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404) and wrong methods (405) in the OpenAI error shape, headers (``Allow``) kept."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = error_body(ErrorItem(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


class Ingress:
    """The Ingress deployment class (``FastAPIIngress`` below is it wrapped with ``serve.ingress(app)``)."""

    def __init__(self, config: AppConfig, target, router) -> None:
        self.config = config
        self.target = target
        self.router = router
        self.api_key = config.resolved_api_key

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        return {"object": "list", "data": [
            {"id": self.config.served_model_name, "object": "model", "owned_by": "dspark-serve"}]}

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

    # ------------------------------------------------------------------ helpers

    def _auth(self, request: Request) -> JSONResponse | None:
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return None
        return error_response(ErrorItem(401, "invalid or missing API key", type="authentication_error",
                                        code="invalid_api_key"))

    async def _read_body(self, request: Request) -> bytes | ErrorItem:
        """The body, read no further than ``max_request_bytes`` (a 413 beyond it, whatever Content-Length says)."""
        limit = self.config.max_request_bytes
        too_large = ErrorItem(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return too_large
        return bytes(body)

    async def _parse(self, request: Request, chat: bool) -> ChatCompletionRequest | CompletionRequest | ErrorItem:
        raw = await self._read_body(request)
        if isinstance(raw, ErrorItem):
            return raw
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return ErrorItem(400, f"request body is not valid JSON: {err}")
        if not isinstance(body, dict):
            return ErrorItem(400, "request body must be a JSON object")
        try:
            req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as err:
            return validation_error(err)
        if req.model != self.config.served_model_name:
            return ErrorItem(404, f"model {req.model!r} does not exist; this server serves "
                                  f"{self.config.served_model_name!r}", param="model", code="model_not_found")
        return req

    async def _complete(self, request: Request, *, chat: bool):
        if (denied := self._auth(request)) is not None:
            return denied
        req = await self._parse(request, chat)
        if isinstance(req, ErrorItem):
            return error_response(req)
        try:
            params = req.params()
        except ValueError as err:
            return error_response(ErrorItem(400, str(err)))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        generate = GenerateRequest(
            request_id=request_id, params=params,
            messages=[m.model_dump() for m in req.messages] if chat else None,
            prompt=None if chat else req.prompt_text,
        )
        try:
            key = await self.router.choose_target.remote()
        except (RayActorError, RayTaskError) as err:  # balance is lost, not the request: any replica will do
            log.warning("Router unavailable, default routing: %s", err)
            key = None
        stream = self.target.options(stream=True).generate.remote(generate, replica_key=key)
        try:
            first = await stream.__anext__()
        except BackPressureError:
            stream.cancel()
            first = ErrorItem(503, "server overloaded", type="server_overloaded", code="overloaded")
        except (RayActorError, RayTaskError) as err:
            log.error("target replica failed: %s", err)
            first = ErrorItem(503, "target replica unavailable, retry", type="server_error", code="unavailable")
        if isinstance(first, ErrorItem):
            return error_response(first, self.config.retry_after_s)
        model = self.config.served_model_name
        if req.stream:
            return StreamingResponse(
                self._sse(stream, first, chat=chat, request_id=request_id, model=model,
                          include_usage=req.include_usage, spec_stats=req.spec_stats),
                media_type="text/event-stream",
            )
        text, token_ids, last = [first.text], list(first.token_ids), first
        finished = first.finish_reason is not None
        try:
            while not finished:
                last = await stream.__anext__()
                if isinstance(last, ErrorItem):  # the target failed the request after its first chunk
                    finished = True
                    return error_response(last, self.config.retry_after_s)
                text.append(last.text)
                token_ids.extend(last.token_ids)
                finished = last.finish_reason is not None
        finally:
            if not finished:  # the client went away: stop the target stream (frees its state)
                stream.cancel()
        return completion_body(
            chat=chat, request_id=request_id, model=model, text="".join(text), finish_reason=last.finish_reason,
            prompt_tokens=first.prompt_tokens, completion_tokens=len(token_ids),
            spec=last.spec if req.spec_stats else None, token_ids=token_ids if req.return_token_ids else None,
        )

    async def _sse(
        self, stream, first: TextChunk, *, chat: bool, request_id: str, model: str, include_usage: bool,
        spec_stats: bool,
    ) -> AsyncIterator[str]:
        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        completion_tokens, last, finished = 0, first, False
        try:
            if chat:
                yield event(chunk_body(chat=True, request_id=request_id, model=model, text="", role=True))
            chunk: TextChunk = first
            while True:
                completion_tokens += chunk.num_tokens
                last = chunk
                if chunk.text:
                    yield event(chunk_body(chat=chat, request_id=request_id, model=model, text=chunk.text))
                if chunk.finish_reason is not None:
                    finished = True
                    break
                chunk = await stream.__anext__()
                if isinstance(chunk, ErrorItem):  # failed mid-stream: an error event ends the stream (as vLLM)
                    finished = True
                    yield event(error_body(chunk))
                    yield "data: [DONE]\n\n"
                    return
            final = chunk_body(chat=chat, request_id=request_id, model=model, text=None if chat else "",
                               finish_reason=last.finish_reason)
            if spec_stats and last.spec is not None:
                final["spec_stats"] = last.spec.to_json()
            yield event(final)
            if include_usage:
                body = chunk_body(chat=chat, request_id=request_id, model=model, text=None)
                body["choices"], body["usage"] = [], usage(first.prompt_tokens, completion_tokens)
                yield event(body)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: stop the target stream (frees its state)
                stream.cancel()



# Applied at import time so every process that imports this module sees the same class-based routes (Serve
# rewrites ``app``'s routes in place; a wrapper built elsewhere would leave the replica's ``app`` untouched).
FastAPIIngress = serve.ingress(app)(Ingress)
