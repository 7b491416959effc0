"""How a target replica reaches its drafter: transport, timeout, by-reference payloads, failure classification.

Owns: the call to the Drafter replica (pinned to this target replica by its replica key, ``router.py``) or to the
colocated ``DrafterCore`` on the replica's torch thread; the call's transport: the Drafter replica's Unix socket
(``channel.py``) when ``drafter_channel`` is on and it runs on this node, else Serve's handle, choosing Ray's object
store over Serve's gRPC data plane for a call whose message or answer could pass the transport's limit; the call's
timeout; turning every way a call can fail into one of ``DRAFTER_FAILURES`` with a cause label (``fallback_cause``);
and backing off a Drafter replica that stopped answering (a call timed out, found it gone, or was refused by back
pressure): ``reachable`` turns False and a background probe calls the replica, at growing intervals, until it
answers, so that rounds do not each wait out a timeout while the replica is restarted. Does not own: what a call
carries (``app.loop.DraftCall``, assembled by the loop) or what a failure or a backoff does to requests (the
replica's fail-over).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from app.loop import DraftCall, DraftRound
from app.serving.channel import ChannelClient, ChannelClosedError
from app.serving.drafter import DrafterCore
from app.serving.protocol import DraftReplyTooLargeError, call_bytes, reply_bytes_bound

# A drafter call whose message (``protocol.call_bytes``) or answer (``protocol.reply_bytes_bound``) may exceed this
# goes through Ray's object store instead of Serve's gRPC data plane (``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``), whose
# replica messages stop at 4 MiB by default (``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH``): a long prompt's features
# alone take 6 MB on SmolLM2-135M. A quarter of the limit leaves room for what the bounds do not model.
BY_REFERENCE_BYTES = 1 << 20

# A failed call of these causes says the Drafter replica does not answer (dead, restarting, hung or overloaded): the
# client backs off. The others (``transport``, ``reply_too_large``, ``drafter_error``, ``cancelled``) concern one call.
BACKOFF_CAUSES = frozenset({"timeout", "drafter_unavailable", "drafter_overloaded"})
# While backing off, the first probe goes out after PROBE_FIRST_S seconds; each probe that fails doubles the wait, up
# to PROBE_MAX_S, which bounds how long a replaced replica stays unused once it is ready.
PROBE_FIRST_S = 0.5
PROBE_MAX_S = 10.0

log = logging.getLogger("ray.serve")


class ColocatedDrafterError(RuntimeError):
    """The colocated drafter raised (the cause is chained)."""


class RemoteDrafterError(RuntimeError):
    """A call to the Drafter replica raised what Ray's own error types do not cover (the cause is chained): over
    Serve's gRPC data plane (``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``) the drafter's exception arrives as itself instead of
    a ``RayTaskError``, and a transport failure (a message over gRPC's size limit) as ``grpc.aio.AioRpcError``."""


# A drafter call fails over to plain decoding on these (replica died or was restarted, call timed out or was
# rejected, the channel to it broke, or the drafter raised).
DRAFTER_FAILURES = (RayActorError, RayTaskError, asyncio.TimeoutError, BackPressureError, RequestCancelledError,
                    ChannelClosedError, ColocatedDrafterError, RemoteDrafterError)


def goes_by_reference(call: DraftCall, *, gamma: int) -> bool:
    """Whether a drafter call or its answer may exceed ``BY_REFERENCE_BYTES`` (then both go by reference)."""
    return call_bytes(call) > BY_REFERENCE_BYTES or reply_bytes_bound(len(call.propose), gamma) > BY_REFERENCE_BYTES


def fallback_cause(err: BaseException) -> str:
    """The cause label of a failed drafter call (``dspark_fallbacks``, ``SpecStats.fallback_cause``): ``transport``
    (gRPC refused the message, e.g. over its size limit), ``timeout``, ``drafter_unavailable`` (replica dead or
    restarting, or its channel closed), ``drafter_overloaded`` (back pressure), ``cancelled``, ``reply_too_large`` or
    ``drafter_error`` (all in ``protocol.FALLBACK_CAUSES``)."""
    cause = err.__cause__ if isinstance(err, RemoteDrafterError) else None
    if isinstance(cause, grpc.aio.AioRpcError) or isinstance(err, grpc.aio.AioRpcError):
        return "transport"
    if isinstance(err, asyncio.TimeoutError):
        return "timeout"
    if isinstance(err, (RayActorError, ChannelClosedError)):
        return "drafter_unavailable"
    if isinstance(err, BackPressureError):
        return "drafter_overloaded"
    if isinstance(err, RequestCancelledError):
        return "cancelled"
    if isinstance(cause, DraftReplyTooLargeError) or "DraftReplyTooLargeError" in str(err):
        return "reply_too_large"
    return "drafter_error"


def failure_text(err: BaseException, *, timeout_s: float) -> str:
    """A failed drafter call's error for a log line (a timeout's own message is empty)."""
    if isinstance(err, asyncio.TimeoutError) and not str(err):
        return f"no answer within {timeout_s:g} s (drafter_timeout_s)"
    return f"{type(err).__name__}: {err}"


class DrafterClient:
    """A target replica's drafter (module docstring): exactly one of ``handle`` and ``colocated``.

    Args:
        handle: the Drafter deployment's handle (``drafter_placement: separate``), or None.
        colocated: the drafter in this process (``drafter_placement: colocated``), or None.
        run: runs a function on the replica's torch thread and awaits it (the colocated drafter's calls).
        replica_id: this target replica's id, the routing key that pins its calls to one Drafter replica.
        gamma: the block size (the bound on an answer's size).
        timeout_s: a Drafter replica call's limit, and a probe's (seconds).
        stats: counts calls that went by reference (``by_reference_calls``).
        on_reachable: called (on the event loop) when a probe finds the replica answering again after a backoff.
        channel: send calls over the Drafter replica's Unix socket when it is on this node (``drafter_channel``).
        node_id: this process's Ray node id (``channel.node_id()``), compared with the Drafter replica's.
    """

    def __init__(self, *, handle, colocated: DrafterCore | None, run: Callable[..., Awaitable], replica_id: str,
                 gamma: int, timeout_s: float, stats, on_reachable: Callable[[], None] | None = None,
                 channel: bool = False, node_id: str | None = None) -> None:
        if (handle is None) == (colocated is None):
            raise ValueError("a drafter client needs exactly one of a Drafter handle and a colocated drafter")
        self.colocated = colocated
        self._handle = handle
        # for calls over BY_REFERENCE_BYTES (without the gRPC data plane every call already goes by reference)
        self._by_reference = handle.options(_by_reference=True) if handle is not None else None
        self._run, self._key = run, f"target:{replica_id}"
        self._gamma, self._timeout_s, self._stats = gamma, timeout_s, stats
        self._on_reachable = on_reachable
        self._probe: asyncio.Task | None = None  # runs while backing off
        self.backoff_cause: str | None = None  # the cause of the failure that started the backoff under way
        self._wants_channel = channel and handle is not None  # False once the channel proved out of reach
        self._node_id = node_id
        self._channel: ChannelClient | None = None  # open from the first call; closed after a failed one

    @property
    def transport(self) -> str:
        """How calls go now: ``colocated``, ``channel`` (the Drafter replica's Unix socket) or ``handle`` (Serve's;
        before the first call, with the channel wanted, ``channel`` too)."""
        if self.colocated is not None:
            return "colocated"
        return "channel" if self._wants_channel else "handle"

    @property
    def reachable(self) -> bool:
        """False while backing off from a Drafter replica that stopped answering (module docstring): do not call."""
        return self.backoff_cause is None

    async def draft(self, call: DraftCall) -> DraftRound:
        """One drafter call; a failure of one of ``BACKOFF_CAUSES`` starts a backoff (``reachable`` False).

        Raises:
            One of ``DRAFTER_FAILURES`` (the cancelled remote call is abandoned).
            RuntimeError: called while backing off.
        """
        if self.colocated is not None:  # same process: no message, no size limit
            try:
                return await self._run(self.colocated.draft, call)
            except Exception as err:  # a drafter bug must not take the batch's requests down with it
                raise ColocatedDrafterError(f"{type(err).__name__}: {err}") from err
        if not self.reachable:
            raise RuntimeError(f"drafter call while backing off ({self.backoff_cause}): check `reachable` first")
        if self._wants_channel:
            try:
                channel = self._channel or await self._open_channel()
                if channel is not None:
                    return await asyncio.wait_for(channel.call(call, self._key), timeout=self._timeout_s)
            except DRAFTER_FAILURES as err:
                self._close_channel()
                self._back_off(err)
                raise
            except asyncio.CancelledError:
                self._close_channel()  # its answer could still arrive, as the next call's
                raise
            except Exception as err:  # the drafter's own exception, sent back as itself
                raise RemoteDrafterError(f"{type(err).__name__}: {err}") from err
        by_reference = goes_by_reference(call, gamma=self._gamma)
        self._stats.by_reference_calls += by_reference
        handle = self._by_reference if by_reference else self._handle
        response = handle.draft.remote(call, replica_key=self._key)
        try:
            return await asyncio.wait_for(response, timeout=self._timeout_s)
        except DRAFTER_FAILURES as err:
            response.cancel()
            self._back_off(err)
            raise
        except Exception as err:
            response.cancel()
            raise RemoteDrafterError(f"{type(err).__name__}: {err}") from err

    async def _open_channel(self) -> ChannelClient | None:
        """Ask the pinned Drafter replica (through the handle) where its channel listens and connect. None, and the
        handle from then on, where the replica runs on another node or could not open a channel (logged once).

        Raises:
            One of ``BACKOFF_CAUSES``' errors: the ask failed as a call would (the replica is dead, hung or
                overloaded), or nothing listens at the path it gave (``ChannelClosedError``: it stopped since).
        """
        response = self._handle.channel.remote(replica_key=self._key)
        try:
            address = await asyncio.wait_for(response, timeout=self._timeout_s)
        except Exception as err:
            response.cancel()
            if isinstance(err, DRAFTER_FAILURES) and fallback_cause(err) in BACKOFF_CAUSES:
                raise
            return self._keep_handle(logging.WARNING, "the Drafter replica could not open its channel (%s: %s)",
                                     type(err).__name__, err)
        if address.node_id != self._node_id:
            return self._keep_handle(logging.INFO, "the Drafter replica runs on node %s, this target on %s",
                                     address.node_id, self._node_id)
        self._channel = await ChannelClient.connect(address.path)
        return self._channel

    def _keep_handle(self, level: int, why: str, *args) -> None:
        """Send this client's calls through Serve's handle from now on, saying why once."""
        self._wants_channel = False
        log.log(level, why + ": drafter calls go through Serve's handle", *args)

    def _close_channel(self) -> None:
        """Drop the channel after a failed call: the next call asks the pinned replica again (after any backoff)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _back_off(self, err: BaseException) -> None:
        """Stop calling after a failure that says the replica does not answer, and probe it until it does."""
        cause = fallback_cause(err)
        if cause not in BACKOFF_CAUSES:
            return
        self.backoff_cause = cause
        log.warning("Drafter replica does not answer (%s: %s); requests decode without it until a probe gets an "
                    "answer (counted as drafter_backoff in dspark_fallbacks)", cause,
                    failure_text(err, timeout_s=self._timeout_s))
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_answered())

    async def _probe_until_answered(self) -> None:
        """Call the replica's ``ping`` (answered on its torch thread) at doubling intervals until one answers in
        time; then end the backoff."""
        started, wait = time.monotonic(), PROBE_FIRST_S
        while True:
            await asyncio.sleep(wait)
            response = self._handle.ping.remote(replica_key=self._key)
            try:
                await asyncio.wait_for(response, timeout=self._timeout_s)
                break
            except Exception as err:  # any failure means the same here: not answering yet
                response.cancel()
                log.debug("Drafter probe failed: %s: %s", type(err).__name__, err)
                wait = min(2 * wait, PROBE_MAX_S)
        log.warning("Drafter replica answers again after %.1f s of backoff (%s); new requests speculate",
                    time.monotonic() - started, self.backoff_cause)
        self.backoff_cause, self._probe = None, None
        if self._on_reachable is not None:
            self._on_reachable()

    async def forget_colocated(self, request_ids: list[str]) -> None:
        """Drop requests' state from the colocated drafter (after a failed call that may have raised half-way).

        Raises:
            Whatever the drafter raises.
        """
        await self._run(self.colocated.forget, request_ids)
