"""The Ingress's answers where the target replica fails, without Serve: fake target streams."""

from __future__ import annotations

import asyncio
import json

from ray.exceptions import ActorDiedError

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
