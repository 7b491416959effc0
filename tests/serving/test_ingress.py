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
