"""The drafter side of a round: ``DrafterCore`` (a proposer and its per-request state, one call per target batch
per round) and the Drafter deployment that hosts it on its own resource group.

Any ``Proposer`` (``app/engine/decode.py``: ``start``, ``propose``, ``update``, ``finish``) plugs in, provided
it leaves the round's confidences ``[B, K]`` in ``last_proposal.confidences`` (every trained drafter, n-gram and
the mock do). One ``draft`` call per round carries the target batch's new requests, last round's outputs (only the
newly committed tokens' features), finished requests and the ids to draft, in that order, exactly as the
offline loop drives the hooks.

Placement (``AppConfig.drafter_placement``): ``separate`` (default) runs ``DrafterCore`` in Drafter replicas; a
target replica always reaches the same drafter replica (``PinnedReplicaRouter``), so a request's state lives on
one drafter replica for its life. ``colocated`` runs a ``DrafterCore`` inside each target replica, on the
engine's torch thread (no Drafter deployment, no call between processes: on a small CPU host each drafter call
between replicas costs more than drafting itself, see docs/serving.md).

Does not own: deciding how much of a draft is verified (the target replica's scheduler).

Shape symbols: B requests in a call, K block size (gamma).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, runtime_checkable

import ray
import torch
from ray import serve

from app.engine.decode import Proposer
from app.engine.types import SamplingParams
from app.serving.config import AppConfig
from app.serving.metrics import DrafterMetrics
from app.serving.protocol import DraftCall, DraftRound, check_reply
from app.serving.torch_thread import TorchThread, intra_op_threads

log = logging.getLogger("ray.serve")


@runtime_checkable
class TakesParams(Protocol):
    """A proposer that drafts each request at its own temperature (the trained drafters)."""

    def set_params(self, request_id: str, params: SamplingParams) -> None: ...


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
    """The configured proposer and the set of requests it holds state for. Not thread-safe: build it and call
    ``draft`` / ``forget`` on one torch thread (``num_states`` is a plain read).

    Args:
        config: the application config (drafter kind, checkpoint, gamma, policy label).
        replica: the hosting replica's id (metrics label).
        embed_weight: the target's input embedding [V, Dm] when it is already loaded in this process.
    Raises:
        FileNotFoundError: drafter 'dspark' without a checkpoint at ``drafter_checkpoint``.
    """

    def __init__(self, config: AppConfig, *, replica: str, embed_weight: torch.Tensor | None = None) -> None:
        self.config = config
        self.proposer = make_proposer(config, embed_weight)
        self._live: set[str] = set()
        self.metrics = DrafterMetrics(policy=config.policy, replica=replica)

    @property
    def num_states(self) -> int:
        """Requests this core holds drafter state for (leak checks)."""
        return len(self._live)

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of these requests (finished, cancelled or failed over; unknown ids are ignored).

        An id stays counted in ``num_states`` until the proposer has dropped it, so a leak stays visible.
        """
        for rid in request_ids:
            if rid in self._live:
                self.proposer.finish(rid)
                self._live.discard(rid)

    def draft(self, call: DraftCall) -> DraftRound:
        """Apply the hooks gathered since the last call, then draft ``call.propose``.

        A call may carry several rounds (the target skips the drafter while its draft gate is closed), so a
        request can start, step and finish within one call: starts are applied first, then the steps in
        order, then the finishes; a request that starts and finishes in the same call is never started.

        Returns:
            blocks and confidences ``[B, K]`` for the proposed ids this core holds state for; the others are
            listed in ``missing``.
        """
        t0 = time.perf_counter()
        with intra_op_threads(self.config.drafter_threads):
            finished = set(call.finished)
            for s in call.starts:
                if s.request_id in finished:
                    continue
                self._live.add(s.request_id)  # before start: a start that raises half-way is still forgotten
                if isinstance(self.proposer, TakesParams):
                    self.proposer.set_params(s.request_id, s.params)
                self.proposer.start(s.request_id, s.prompt_ids, s.first)
            self.proposer.update([out for out in call.updates if out.request_id in self._live])
            self.forget(call.finished)
            missing = [rid for rid in call.propose if rid not in self._live]
            ids = [rid for rid in call.propose if rid in self._live]
            blocks = self.proposer.propose(ids) if ids else []
            confidences = self.proposer.last_proposal.confidences if ids else torch.zeros(0, self.config.gamma)
            confidences = confidences.float()
        ms = (time.perf_counter() - t0) * 1000
        self.metrics.call(ms=ms, batch=len(ids))
        return DraftRound(blocks=blocks, confidences=confidences, missing=missing, drafter_ms=ms)


class DrafterReplica:
    """The Drafter deployment class (bound undecorated by ``builder.py``): a ``DrafterCore`` on a torch thread."""

    def __init__(self, config: AppConfig) -> None:
        self._torch = TorchThread("drafter", config.torch_threads)
        replica = serve.get_replica_context().replica_id.unique_id
        self.core = self._torch.call(lambda: DrafterCore(config, replica=replica))

    async def draft(self, call: DraftCall, replica_key: str | None = None) -> DraftRound:
        """``DrafterCore.draft`` on the replica's torch thread (calls applied one at a time, in arrival order).

        ``replica_key`` only steers routing.

        Raises:
            DraftReplyTooLargeError: the answer exceeds the size the target chose its transport by
                (``protocol.reply_bytes_bound``).
        """
        reply = await self._torch.run(self.core.draft, call)
        return check_reply(reply, gamma=self.core.config.gamma)

    def debug_state(self) -> dict:
        """Requests this replica holds drafter state for (leak checks) and where it runs (placement checks)."""
        return {"states": self.core.num_states, "node_id": ray.get_runtime_context().get_node_id()}
