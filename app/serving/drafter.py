"""The drafter side of a round: ``DrafterCore`` (the configured proposer in a ``ProposerHost``, one call per
target batch per round, with its metrics) and the Drafter deployment that hosts it on its own resource group.

Any ``Proposer`` (``app/engine/contract.py``: ``start``, ``propose``, ``update``, ``finish``) plugs in; it leaves the
round's confidences ``[B, K]`` in ``last_proposal.confidences`` (every trained drafter, n-gram and the mock do).
One ``draft`` call per round carries the target batch's new requests, the outputs since the last call (only the
newly committed tokens' features), finished requests and the ids to draft, applied in that order by the same
``ProposerHost`` the offline ``generate`` uses (``app/loop.py``).

Placement (``AppConfig.drafter_placement``): ``separate`` (default) runs ``DrafterCore`` in Drafter replicas; a
target replica always reaches the same drafter replica (``PinnedReplicaRouter``), so a request's state lives on
one drafter replica for its life. ``colocated`` runs a ``DrafterCore`` inside each target replica, on the
engine's torch thread (no Drafter deployment, no call between processes: on a small CPU host each drafter call
between replicas costs more than drafting itself, see docs/serving.md).

A Drafter replica also keeps track of which target replica (the call's ``replica_key``) started each request: a
target that dies cannot tell it to forget its requests, so the state of a target not heard from (no call, no probe)
for ``drafter_state_ttl_s`` is dropped.

Does not own: deciding how much of a draft is verified (the target replica's scheduler).

Shape symbols: B requests in a call, K block size (gamma).
"""

from __future__ import annotations

import logging
import time

import torch
from ray import serve

from app.engine.contract import Proposer
from app.loop import DraftCall, DraftRound, ProposerHost
from app.serving.channel import ChannelAddress, ChannelServer, node_id
from app.serving.config import AppConfig
from app.serving.metrics import DrafterMetrics
from app.serving.protocol import check_reply
from app.serving.torch_thread import (
    HeapTrimmer, TorchThread, bound_onednn_caches, intra_op_threads, stuck_thread,
)

log = logging.getLogger("ray.serve")

# entries of each cache of oneDNN primitives of a Drafter replica's process (``bound_onednn_caches``): above the
# shapes one replica's rounds reuse, a quarter of the default
DRAFTER_ONEDNN_PRIMITIVES = 256


def make_proposer(config: AppConfig, embed_weight: torch.Tensor | None = None) -> Proposer:
    """Build the configured drafter; a trained one shares ``embed_weight`` [V, Dm] (the target's input embedding,
    read alone from ``config.model``'s files when None).

    Raises:
        FileNotFoundError: drafter 'dspark' without a checkpoint at ``drafter_checkpoint``.
    """
    if config.drafter == "ngram":
        from app.drafters.ngram import NgramProposer

        return NgramProposer(gamma=config.gamma, max_ngram=config.ngram_max, min_ngram=config.ngram_min)
    if config.drafter == "mock":
        from app.serving.mock import MockProposer

        return MockProposer(vocab_size=config.mock_vocab_size, gamma=config.gamma, fails=config.mock_drafter_fails)
    return load_checkpoint_proposer(config, embed_weight)


def load_checkpoint_proposer(config: AppConfig, embed_weight: torch.Tensor | None = None) -> Proposer:
    """The trained drafter at ``drafter_checkpoint``, of any kind (DSpark, DFlash-style, EAGLE-3-style, MTP-1),
    on the target's embedding / LM head (``embed_weight``, else only that tensor is read from the target's files:
    ``loader.load_embedding``, never the whole target); it drafts at most ``gamma`` tokens per round (prompt lookup,
    when on, runs on the target replica: ``target.py``). Logs this process's resident memory before and after."""
    from app.drafters.registry import load_proposer
    from app.engine.loader import load_embedding

    config.check_files()
    before = resident_mib()
    if embed_weight is None:
        e = config.engine
        embed_weight = load_embedding(e.model, dtype=e.dtype, device=e.device, load_format=e.load_format)
    proposer = load_proposer(config.drafter_checkpoint, embed_weight.detach(), gamma=config.gamma)
    log.info("drafter %s on %s: resident memory %.0f MiB before loading, %.0f MiB after (embedding %s)",
             config.drafter_checkpoint, config.model, before, resident_mib(), tuple(embed_weight.shape))
    return proposer


def resident_mib() -> float:
    """This process's resident set size (MiB)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class DrafterCore:
    """The configured proposer in a ``ProposerHost`` (``app/loop.py``), with its metrics and torch threads. Not
    thread-safe: build it and call ``draft`` / ``forget`` on one torch thread (``num_states`` is a plain read).

    Args:
        config: the application config (drafter kind, checkpoint, gamma, policy label).
        replica: the hosting replica's id (metrics label).
        embed_weight: the target's input embedding [V, Dm] when it is already loaded in this process.
    Raises:
        FileNotFoundError: drafter 'dspark' without a checkpoint at ``drafter_checkpoint``.
    """

    def __init__(self, config: AppConfig, *, replica: str, embed_weight: torch.Tensor | None = None) -> None:
        self.config = config
        self.host = ProposerHost(make_proposer(config, embed_weight), gamma=config.gamma)
        self.metrics = DrafterMetrics(policy=config.policy, replica=replica)

    @property
    def proposer(self):
        """The configured drafter."""
        return self.host.proposer

    @property
    def num_states(self) -> int:
        """Requests this core holds drafter state for (leak checks)."""
        return self.host.num_states

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of these requests (``ProposerHost.forget``)."""
        self.host.forget(request_ids)

    def draft(self, call: DraftCall) -> DraftRound:
        """``ProposerHost.draft`` with ``drafter_threads`` torch threads, timed in the drafter metrics.

        Raises:
            Whatever the proposer raises.
        """
        with intra_op_threads(self.config.drafter_threads):
            reply = self.host.draft(call)
        self.metrics.call(ms=reply.drafter_ms, batch=len(reply.blocks))
        return reply


class DrafterReplica:
    """The Drafter deployment class (bound undecorated by ``builder.py``): a ``DrafterCore`` on a torch thread."""

    def __init__(self, config: AppConfig) -> None:
        self._channel = ChannelServer(self.draft)  # first: ``__del__`` closes it; listens once asked (``channel``)
        self._node_id = node_id()
        bound_onednn_caches(DRAFTER_ONEDNN_PRIMITIVES)  # before any torch work of this process
        self._torch = TorchThread("drafter", config.torch_threads)
        replica = serve.get_replica_context().replica_id.unique_id
        self.core = self._torch.call(lambda: DrafterCore(config, replica=replica))
        self._owned: dict[str, set[str]] = {}  # replica_key -> ids of the requests its calls started
        self._heard: dict[str, float] = {}  # replica_key -> time.monotonic() of its last call or probe
        self._trimmer = HeapTrimmer()

    async def draft(self, call: DraftCall, replica_key: str | None = None) -> DraftRound:
        """``DrafterCore.draft`` on the replica's torch thread (calls applied one at a time, in arrival order).

        ``replica_key`` steers routing and names the calling target replica (whose state ``drafter_state_ttl_s``
        ends).

        Raises:
            DraftReplyTooLargeError: the answer exceeds the size the target chose its transport by
                (``protocol.reply_bytes_bound``).
        """
        owned = self._owned.setdefault(replica_key or "", set())
        owned.update(start.request_id for start in call.starts)
        owned.difference_update(call.finished)
        await self._heard_from(replica_key)
        reply = await self._torch.run(self._draft, call)
        return check_reply(reply, gamma=self.core.config.gamma)

    def _draft(self, call: DraftCall) -> DraftRound:
        """``DrafterCore.draft`` on the torch thread; once requests end, their freed memory goes back to the OS
        (``HeapTrimmer``)."""
        reply = self.core.draft(call)
        if call.finished:
            self._trimmer.maybe_trim()
        return reply

    async def _heard_from(self, replica_key: str | None) -> None:
        """Note a call or probe from ``replica_key``; drop the state of targets silent for ``drafter_state_ttl_s``."""
        now = time.monotonic()
        self._heard[replica_key or ""] = now
        for key in [k for k, at in self._heard.items() if now - at > self.core.config.drafter_state_ttl_s]:
            del self._heard[key]
            gone = sorted(self._owned.pop(key, set()))
            if gone:
                log.warning("no call from %s for over %g s (drafter_state_ttl_s): dropping the state of its %d "
                            "requests", key or "a target", self.core.config.drafter_state_ttl_s, len(gone))
                await self._torch.run(self.core.forget, gone)

    def check_health(self) -> None:
        """Serve's health check: unhealthy (the replica is replaced) while its torch thread is stuck in one call for
        longer than ``step_timeout_s``.

        Raises:
            RuntimeError: the torch thread is stuck.
        """
        if (stuck := stuck_thread(self._torch, "drafter", self.core.config.step_timeout_s)) is not None:
            raise RuntimeError(stuck)

    async def channel(self, replica_key: str | None = None) -> ChannelAddress:
        """Where this replica answers ``draft`` calls over a Unix socket (``channel.py``), listening from the first ask
        on. ``replica_key`` steers routing (the caller's own Drafter replica answers), as in ``draft``.

        Raises:
            OSError: no socket could be made (``ChannelServer.start``).
        """
        return ChannelAddress(node_id=self._node_id, path=await self._channel.start())

    def __del__(self) -> None:
        """Serve's shutdown hook: stop listening on the channel and remove its socket."""
        self._channel.close()

    async def ping(self, replica_key: str | None = None) -> int:
        """The number of requests this replica holds state for, answered from its torch thread (so a replica whose
        thread is stuck does not answer): a target's drafter client probes a replica that stopped answering with it.
        ``replica_key`` steers routing and names the calling target replica, as in ``draft``."""
        await self._heard_from(replica_key)
        return await self._torch.run(lambda: self.core.num_states)

    def debug_state(self) -> dict:
        """Requests this replica holds drafter state for (leak checks), where it runs (placement checks) and the
        path its channel listens on (None until a target asks)."""
        return {"states": self.core.num_states, "node_id": self._node_id,
                "channel": self._channel.path}
