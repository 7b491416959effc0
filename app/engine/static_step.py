"""Verify steps in static, bucketed shapes, their layout built on the device; on CUDA, one captured graph per shape.

A ragged verify step (``StepLayout.build``) runs in its exact shape, with its positions, slots and mask built on the
host every step: its kernels cannot be recorded once and replayed, and on a GPU the step pays every launch from the
host. A bucketed step runs a grid of R x t tokens instead (``StepLayout.grid``): row r is cache slot r, R the next
row bucket above the highest slot of the step, t the next token bucket above its longest run (pending token plus
drafts), attending over the next key-length bucket Tk. Two small tensors cross to the device: the [R, t] token grid
and the [R] cache lengths; positions, slots and the mask are computed from them there. Padding (rows of slots outside
the step, tokens past a request's run) writes keys/values past each row's real run, where nothing committed lies
(a row outside the step writes at its slot's tail: a slot holds ``max_draft_len`` positions past the context limit,
where nothing is ever committed), and its outputs are dropped: a request's rows see exactly what a ragged step shows
them, so padding changes no output beyond floating-point rounding of a differently shaped step.

With ``cuda_graphs`` every (R, t, Tk) shape is captured as a CUDA graph once, at construction (largest first), and
replayed afterwards (one launch for the whole decoder), on one stream of the engine's device; all graphs share one
memory pool for their temporaries and one output buffer sized for the largest grid (a step's outputs are gathered
out of it before the next replay). The buckets bound the number of graphs: rows and tokens per request in powers of
two plus their limit, key lengths from 128 in steps of at most 1.5x plus the cache's capacity.

Shape symbols: see ``app/engine/types.py`` and ``app/engine/model.py``; R grid rows (slots), t tokens per row,
Tk key length.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from app.engine.model import EAGER, Elementwise, KVCache, StepLayout, TargetModel

log = logging.getLogger(__name__)

MIN_KEY_BUCKET = 128


def bucket_sizes(limit: int) -> list[int]:
    """Powers of two below ``limit``, then ``limit`` itself: ``bucket_sizes(9) == [1, 2, 4, 8, 9]``.

    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


def key_buckets(limit: int) -> list[int]:
    """Key-length buckets up to a cache capacity of ``limit`` tokens: 128, 192, 256, 384, 512, 768, ... (powers of two
    and 1.5x powers of two, so padding adds at most half the keys), those below ``limit``, then ``limit``."""
    sizes, size = [], MIN_KEY_BUCKET
    while size < limit:
        sizes.append(size)
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 2^k -> 1.5 * 2^k -> 2^(k+1)
    return sizes + [limit]


def ceil_bucket(value: int, sizes: list[int]) -> int:
    """The smallest of ``sizes`` (increasing) that is >= ``value``.

    Raises:
        ValueError: ``value`` exceeds the largest bucket.
    """
    for size in sizes:
        if size >= value:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {sizes[-1]}")


@dataclass
class _Graph:
    """One captured shape: its static input buffers, its graph, and the outputs the graph writes on replay."""

    tokens: torch.Tensor  # [R, t] int64
    starts: torch.Tensor  # [R] int64
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [R * t, Dm], a view of the step's shared output buffer
    features: torch.Tensor  # [R * t, F], likewise


class BucketedStep:
    """Runs verify steps of a target over its slot cache in bucketed shapes (module docstring).

    Attributes:
        row_buckets, token_buckets, key_buckets: the grid sizes R, t and Tk a step is padded up to.
        capture_s: seconds spent capturing CUDA graphs (0 without ``cuda_graphs``).
        ops: the decoder's elementwise functions (``model.Elementwise``; compiled ones compile in the first capture's
            warm-up run, outside any graph).

    Construction: ``max_tokens`` per row (pending token and drafts), ``max_keys`` keys a real row attends to (the
    context limit: a slot's positions past it hold only padding).

    Raises (construction):
        ValueError: ``cuda_graphs`` on a cache that is not on a CUDA device.
    """

    def __init__(self, model: TargetModel, cache: KVCache, *, max_tokens: int, max_keys: int, cuda_graphs: bool,
                 ops: Elementwise = EAGER) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.device = cache.k.device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"verify_step cuda_graphs needs a CUDA device, the engine runs on {self.device}")
        self.row_buckets = bucket_sizes(cache.num_slots)
        self.token_buckets = bucket_sizes(max_tokens)
        self.key_buckets = key_buckets(max_keys)
        self._groups = model.args.num_heads // model.args.num_kv_heads
        self._graphs: dict[tuple[int, int, int], _Graph] | None = None
        self._pool = None
        self.capture_s = 0.0
        if cuda_graphs:
            self._graphs = {}
            self._stream = torch.cuda.Stream(self.device)  # every warm-up and capture, on the engine's own device
            # every graph writes its outputs here (outside the pool), so they take memory once, not once per shape
            most = self.row_buckets[-1] * self.token_buckets[-1]
            dtype = model.embed_tokens.weight.dtype
            self._hidden = torch.empty(most, model.args.hidden_size, dtype=dtype, device=self.device)
            self._features = torch.empty(most, model.feature_dim, dtype=dtype, device=self.device)
            self._capture_all()

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured (one per bucketed shape with ``cuda_graphs``, else 0)."""
        return len(self._graphs) if self._graphs is not None else 0

    def _capture_all(self) -> None:
        """Capture the graph of every bucketed shape, largest grid first (the shared pool grows to the largest step's
        temporaries once), and log how many and how long (at construction, before any request holds a slot)."""
        shapes = sorted(itertools.product(self.row_buckets, self.token_buckets, self.key_buckets),
                        key=lambda s: (s[0] * s[1] * s[2], s), reverse=True)
        began = time.perf_counter()
        with torch.cuda.device(self.device), torch.inference_mode():
            for shape in shapes:
                self._capture(shape)
        log.info("captured %d verify-step shapes as CUDA graphs in %.1f s", len(self._graphs),
                 time.perf_counter() - began)

    def shape(self, *, rows: int, tokens: int, keys: int) -> tuple[int, int, int]:
        """The bucketed (R, t, Tk) of a step over slots below ``rows``, runs of at most ``tokens`` tokens, and at
        most ``keys`` cached plus new tokens per request."""
        return (ceil_bucket(rows, self.row_buckets), ceil_bucket(tokens, self.token_buckets),
                ceil_bucket(keys, self.key_buckets))

    def forward(
        self, slots: list[int], tokens: list[torch.Tensor], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One verify step: request i brings ``tokens[i]`` ([n_i] int64, its pending token and drafts) to cache slot
        ``slots[i]``, which holds ``starts[i]`` tokens.

        Returns:
            hidden: [sum n_i, Dm] last-layer hidden states (before the final norm) and features [sum n_i, F] of the
            real tokens, request-major in the order given (as ``TargetModel.hidden_states`` returns them for a
            ragged step).
        """
        lengths = [len(t) for t in tokens]
        rows, width, key_len = self.shape(rows=max(slots) + 1, tokens=max(lengths),
                                          keys=max(s + n for s, n in zip(starts, lengths)))
        grid = torch.zeros(rows, width, dtype=torch.long)
        grid_starts = torch.full((rows,), self.cache.max_len - width, dtype=torch.long)  # rows outside: slot tails
        index = []
        for slot, run, start in zip(slots, tokens, starts):
            grid[slot, : len(run)] = run
            grid_starts[slot] = start
            index.append(torch.arange(slot * width, slot * width + len(run)))
        hidden, features = self._run(grid, grid_starts, key_len)
        index = torch.cat(index).to(self.device)
        return hidden[index], features[index]

    def _run(self, grid: torch.Tensor, starts: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The grid's hidden states and features ([R * t, Dm], [R * t, F]): eagerly, or by replaying its graph (whose
        outputs are overwritten by the next replay of any graph)."""
        if self._graphs is None:
            return self._eager(grid.to(self.device), starts.to(self.device), key_len)
        shape = (grid.shape[0], grid.shape[1], key_len)
        with torch.cuda.device(self.device):
            graph = self._graphs[shape]
            graph.tokens.copy_(grid)
            graph.starts.copy_(starts)
            graph.graph.replay()
        return graph.hidden, graph.features

    def _eager(self, tokens: torch.Tensor, starts: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [R, t], starts: [R] int64 on the device -> hidden [R * t, Dm], features [R * t, F]."""
        layout = StepLayout.grid(starts, tokens=tokens.shape[1], key_len=key_len, groups=self._groups,
                                 dtype=self.cache.k.dtype, slot_len=self.cache.slot_len)
        return self.model.hidden_states(tokens.reshape(-1), cache=self.cache, layout=layout, index=None, ops=self.ops)

    def _capture(self, shape: tuple[int, int, int]) -> _Graph:
        """Record the step of ``shape`` as a CUDA graph on the engine's device (after one eager warm-up run on a side
        stream, as capture requires; the caller makes that device current). Both runs write keys/values only at the
        tails of the grid's slots (free in every slot)."""
        rows, width, key_len = shape
        began = time.perf_counter()
        tokens = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        starts = torch.full((rows,), self.cache.max_len - width, dtype=torch.long, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._eager(tokens, starts, key_len)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        graph, n = torch.cuda.CUDAGraph(), rows * width
        # thread_local: CUDA calls from the process's other threads (HTTP, Ray) do not invalidate the capture
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            hidden, features = self._eager(tokens, starts, key_len)
            self._hidden[:n].copy_(hidden)
            self._features[:n].copy_(features)
        self._pool = graph.pool()
        captured = _Graph(tokens=tokens, starts=starts, graph=graph, hidden=self._hidden[:n],
                          features=self._features[:n])
        self._graphs[shape] = captured
        self.capture_s += time.perf_counter() - began
        log.debug("captured the verify step of %d rows x %d tokens over %d keys as a CUDA graph in %.0f ms",
                  rows, width, key_len, 1000 * (time.perf_counter() - began))
        return captured
