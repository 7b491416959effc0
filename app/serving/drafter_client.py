"""How a target replica reaches its drafter: transport, timeout, by-reference payloads, failure classification.

Owns: the call to the Drafter replica (pinned to this target replica by its replica key, ``router.py``) or to the
colocated ``DrafterCore`` on the replica's torch thread; the call's timeout; choosing Ray's object store over Serve's
gRPC data plane for a call whose message or answer could pass the transport's limit; and turning every way a call
can fail into one of ``DRAFTER_FAILURES`` with a cause label (``fallback_cause``). Does not own: what a call carries
(``app.loop.DraftCall``, assembled by the loop) or what a failure does to requests (the replica's fail-over).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import grpc
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from app.loop import DraftCall, DraftRound
from app.serving.drafter import DrafterCore
from app.serving.protocol import DraftReplyTooLargeError, call_bytes, reply_bytes_bound

# A drafter call whose message (``protocol.call_bytes``) or answer (``protocol.reply_bytes_bound``) may exceed this
# goes through Ray's object store instead of Serve's gRPC data plane (``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``), whose
# replica messages stop at 4 MiB by default (``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH``): a long prompt's features
# alone take 6 MB on SmolLM2-135M. A quarter of the limit leaves room for what the bounds do not model.
BY_REFERENCE_BYTES = 1 << 20


class ColocatedDrafterError(RuntimeError):
    """The colocated drafter raised (the cause is chained)."""


class RemoteDrafterError(RuntimeError):
    """A call to the Drafter replica raised what Ray's own error types do not cover (the cause is chained): over
    Serve's gRPC data plane (``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``) the drafter's exception arrives as itself instead of
    a ``RayTaskError``, and a transport failure (a message over gRPC's size limit) as ``grpc.aio.AioRpcError``."""


# A drafter call fails over to plain decoding on these (replica died or was restarted, call timed out or was
# rejected, or the drafter raised).
DRAFTER_FAILURES = (RayActorError, RayTaskError, asyncio.TimeoutError, BackPressureError, RequestCancelledError,
                    ColocatedDrafterError, RemoteDrafterError)


def goes_by_reference(call: DraftCall, *, gamma: int) -> bool:
    """Whether a drafter call or its answer may exceed ``BY_REFERENCE_BYTES`` (then both go by reference)."""
    return call_bytes(call) > BY_REFERENCE_BYTES or reply_bytes_bound(len(call.propose), gamma) > BY_REFERENCE_BYTES


def fallback_cause(err: BaseException) -> str:
    """The cause label of a failed drafter call (``dspark_fallbacks``, ``SpecStats.fallback_cause``): ``transport``
    (gRPC refused the message, e.g. over its size limit), ``timeout``, ``drafter_unavailable`` (replica dead or
    restarting), ``drafter_overloaded`` (back pressure), ``cancelled``, ``reply_too_large`` or ``drafter_error`` (all
    in ``protocol.FALLBACK_CAUSES``)."""
    cause = err.__cause__ if isinstance(err, RemoteDrafterError) else None
    if isinstance(cause, grpc.aio.AioRpcError) or isinstance(err, grpc.aio.AioRpcError):
        return "transport"
    if isinstance(err, asyncio.TimeoutError):
        return "timeout"
    if isinstance(err, RayActorError):
        return "drafter_unavailable"
    if isinstance(err, BackPressureError):
        return "drafter_overloaded"
    if isinstance(err, RequestCancelledError):
        return "cancelled"
    if isinstance(cause, DraftReplyTooLargeError) or "DraftReplyTooLargeError" in str(err):
        return "reply_too_large"
    return "drafter_error"


class DrafterClient:
    """A target replica's drafter (module docstring): exactly one of ``handle`` and ``colocated``.

    Args:
        handle: the Drafter deployment's handle (``drafter_placement: separate``), or None.
        colocated: the drafter in this process (``drafter_placement: colocated``), or None.
        run: runs a function on the replica's torch thread and awaits it (the colocated drafter's calls).
        replica_id: this target replica's id, the routing key that pins its calls to one Drafter replica.
        gamma: the block size (the bound on an answer's size).
        timeout_s: a Drafter replica call's limit (seconds).
        stats: counts calls that went by reference (``by_reference_calls``).
    """

    def __init__(self, *, handle, colocated: DrafterCore | None, run: Callable[..., Awaitable], replica_id: str,
                 gamma: int, timeout_s: float, stats) -> None:
        if (handle is None) == (colocated is None):
            raise ValueError("a drafter client needs exactly one of a Drafter handle and a colocated drafter")
        self.colocated = colocated
        self._handle = handle
        # for calls over BY_REFERENCE_BYTES (without the gRPC data plane every call already goes by reference)
        self._by_reference = handle.options(_by_reference=True) if handle is not None else None
        self._run, self._key = run, f"target:{replica_id}"
        self._gamma, self._timeout_s, self._stats = gamma, timeout_s, stats

    async def draft(self, call: DraftCall) -> DraftRound:
        """One drafter call.

        Raises:
            One of ``DRAFTER_FAILURES`` (the cancelled remote call is abandoned).
        """
        if self.colocated is not None:  # same process: no message, no size limit
            try:
                return await self._run(self.colocated.draft, call)
            except Exception as err:  # a drafter bug must not take the batch's requests down with it
                raise ColocatedDrafterError(f"{type(err).__name__}: {err}") from err
        by_reference = goes_by_reference(call, gamma=self._gamma)
        self._stats.by_reference_calls += by_reference
        handle = self._by_reference if by_reference else self._handle
        response = handle.draft.remote(call, replica_key=self._key)
        try:
            return await asyncio.wait_for(response, timeout=self._timeout_s)
        except DRAFTER_FAILURES:
            response.cancel()
            raise
        except Exception as err:
            response.cancel()
            raise RemoteDrafterError(f"{type(err).__name__}: {err}") from err

    async def forget_colocated(self, request_ids: list[str]) -> None:
        """Drop requests' state from the colocated drafter (after a failed call that may have raised half-way).

        Raises:
            Whatever the drafter raises.
        """
        await self._run(self.colocated.forget, request_ids)
