"""The target transformer as a lean, pure ``nn.Module`` with a slot KV cache and ragged batched forward.

Owns: the decoder math of Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3: RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU MLP, optional q/k norm and qkv bias), the KV cache layout and
the capture of hidden states at chosen layers. Does not own: loading weights (``loader.py``), tokens,
sampling or request bookkeeping (``engine.py``). No I/O here.

Why not the transformers model: one decode step of SmolLM2-135M through it costs ~66 ms on 2 CPU cores,
mostly per-module Python overhead (MEASURED.md); this module runs the same math with fused projections and
a few attention calls per layer for the whole ragged batch.

KV cache layout: per layer ``[S, Hkv, Tmax, Dh]`` (S slots, one request per slot), or token-major
``[S, Tmax, Hkv, Dh]`` (``KVCache``, ``attention: flash`` on CUDA). A step of one token per request over a
token-major cache attends in one FlashAttention variable-length call (``VarlenKeys``), each request over its own keys
without a mask. Otherwise each attention call of a step is SDPA over a *view* of the rows ``[lo, hi)`` spanning some
of its requests' slots, so no request's cache is ever copied; a call pads its rows to its longest context and query
run, so on a CPU a ragged step is split into calls where one request's context is far longer than its neighbours'
(``attention_chunks``). Rows of a call's range that are not in the step get masked dummy queries.

Shape symbols: see ``app/engine/types.py``; also S slots, Tmax cache capacity per slot, H query heads,
Hkv key/value heads, G = H / Hkv, Dh head dim, Dm hidden size, Lq the longest query run of an attention call, Tk
its key length.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from app.engine.config import MAX_DRAFT_LEN

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# Attention kernels a CUDA step may use, in PyTorch's order of preference. cuDNN's is left out: with this module's
# attention mask PyTorch picked it on an H200, and each call then cost 1.25-1.5 ms of host time (its kernels ran
# 32-185 us), 39-45 ms of a 60 ms step of Llama-3.1-8B or SmolLM2-135M (torch.profiler, docs/scheduling.md).
CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding scaling as a transformers config's ``rope_parameters`` (or legacy ``rope_scaling``) gives it.

    ``rope_type``: ``default`` (none), ``linear`` (positions divided by ``factor``), ``dynamic`` (NTK: the base grows
    only for sequences longer than ``max_position_embeddings``, which the engine never runs, so inside the context
    limit it equals ``default``), ``llama3`` (Llama 3.1+: low frequencies divided by ``factor``, a smooth ramp between
    ``low_freq_factor`` and ``high_freq_factor`` wavelengths of ``original_max_position_embeddings``) and ``yarn``
    (frequencies blended between interpolation and extrapolation over a ramp of rotation counts ``beta_slow`` ..
    ``beta_fast``, cos/sin multiplied by ``attention_factor``).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: scale of cos/sin, resolved from factor / mscale when the config omits it
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions

    @classmethod
    def from_dict(cls, rope: dict, *, max_position_embeddings: int) -> "RopeScaling":
        """Read a ``rope_parameters`` / ``rope_scaling`` dict.

        Raises:
            ValueError: an unsupported ``rope_type``, a partial rotary factor, or a missing field the type needs.
        """
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor {rope['partial_rotary_factor']!r} (only 1.0)")
        if rope_type == "default":
            return cls()
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn") and original is None:
            raise ValueError(f"rope_type {rope_type!r} needs original_max_position_embeddings in {rope}")
        if factor is None and rope_type == "yarn":
            factor = max_position_embeddings / original
        if factor is None:
            raise ValueError(f"rope_type {rope_type!r} needs a factor in {rope}")
        attention = 1.0
        if rope_type == "yarn":
            attention = rope.get("attention_factor")
            if attention is None:
                mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
                attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                             else _yarn_mscale(factor, 1.0))
        return cls(
            rope_type=rope_type, factor=float(factor), original_max_position_embeddings=original,
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
            attention_factor=float(attention), truncate=bool(rope.get("truncate", True)),
        )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term: 1 + 0.1 * mscale * ln(factor), 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters of a Llama-family decoder (read from a transformers config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # context limit the engine may use (capped at a sliding window, see from_hf_config)
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling = RopeScaling()

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        """Build from a ``transformers.PretrainedConfig`` (Llama 1/2/3.x, Mistral, Qwen2, Qwen3).

        A sliding attention window (Mistral's ``sliding_window``, Qwen's with ``use_sliding_window``) is not
        implemented: the context limit is capped at the window, where windowed attention equals full attention.

        Raises:
            ValueError: for an architecture, activation, bias or rope scaling this module does not implement (Llama's
                and Qwen3's ``attention_bias`` put a bias on the output projection too, ``mlp_bias`` on the MLP's).
        """
        archs = tuple(getattr(config, "architectures", None) or ())
        model_type = config.model_type
        if model_type not in ("llama", "mistral", "qwen2", "qwen3") and not set(archs) & set(
            SUPPORTED_ARCHITECTURES
        ):
            raise ValueError(
                f"unsupported target architecture {archs or model_type!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        # transformers reads these two for Llama (both) and Qwen3 (attention_bias) only: Qwen2 and Mistral ignore them
        read = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",)}.get(model_type, ())
        unsupported = {name: getattr(config, name) for name in read if getattr(config, name, False)}
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):  # transformers: both are SiLU
            unsupported["hidden_act"] = config.hidden_act
        if unsupported:
            raise ValueError(f"unsupported target config {unsupported}: this engine implements the SwiGLU (silu) MLP "
                             "and attention without output-projection or MLP biases (Qwen2's q/k/v biases are "
                             "supported)")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        scaling = RopeScaling.from_dict(rope, max_position_embeddings=config.max_position_embeddings)
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        max_positions = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if window and (model_type == "mistral" or getattr(config, "use_sliding_window", False)):
            max_positions = min(max_positions, window)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
        )


# The attention cost model that splits a ragged step into calls (``attention_chunks``), in units of one row's key read
# (one row of the cache view, one key, all its heads): one more call costs what reading CHUNK_CALL_COST such keys does
# (dispatch, output copies), and every further query row a key meets adds CHUNK_QUERY_COST of its read. Fitted on a
# CPU (bfloat16 SmolLM2-135M, 16 requests, short and 1,700-token contexts mixed), and used on CPUs only
# (``StepLayout.build``); the split only needs their ratio roughly right: it matters where one request's context is
# far longer than its neighbours'.
CHUNK_CALL_COST = 480.0
CHUNK_QUERY_COST = 0.03
CHUNK_MAX_ROWS = 32  # requests one run of a split may hold: bounds its search to O(requests * CHUNK_MAX_ROWS)
# A step is split only where the model predicts it saves at least this share of one call's cost: the model is rough,
# and a row's bfloat16 attention can round differently over another key length, so near-even batches keep one call.
CHUNK_MIN_SAVING = 0.25


def attention_chunks(
    slots: list[int], key_lens: list[int], query_lens: list[int], *, groups: int
) -> list[tuple[int, int]]:
    """Split a step's requests, in slot order, into runs that each get one attention call, minimising the modelled
    cost: per call CHUNK_CALL_COST + rows x Tk x (1 + CHUNK_QUERY_COST x G x (Lq - 1)), where rows is the call's span
    of cache rows (slots between its requests included), Tk its longest key length and Lq its longest query run. One
    call pads every row to the step's longest context; a request whose context is far longer than its neighbours' is
    worth a call of its own. Exact dynamic programming over contiguous runs of at most CHUNK_MAX_ROWS requests; the
    split is kept only if it saves CHUNK_MIN_SAVING of one call's modelled cost (one call otherwise).

    Args:
        slots: [B] cache slots, strictly increasing. key_lens: [B] keys each request attends over (cached + new).
        query_lens: [B] new tokens per request. groups: G = H / Hkv.

    Returns:
        (first, end) index ranges into the B requests, in order, covering all of them.
    """
    n = len(slots)
    best = [0.0] + [math.inf] * n  # best[j]: cost of the first j requests
    cut = [0] * (n + 1)

    def cost(rows: int, key_len: int, query_len: int) -> float:
        return CHUNK_CALL_COST + rows * key_len * (1.0 + CHUNK_QUERY_COST * groups * (query_len - 1))

    for j in range(1, n + 1):
        key_len = query_len = 0
        for i in range(j - 1, max(0, j - CHUNK_MAX_ROWS) - 1, -1):
            key_len, query_len = max(key_len, key_lens[i]), max(query_len, query_lens[i])
            total = best[i] + cost(slots[j - 1] - slots[i] + 1, key_len, query_len)
            if total < best[j]:
                best[j], cut[j] = total, i
    if best[n] > (1.0 - CHUNK_MIN_SAVING) * cost(slots[-1] - slots[0] + 1, max(key_lens), max(query_lens)):
        return [(0, n)]
    runs, j = [], n
    while j > 0:
        runs.append((cut[j], j))
        j = cut[j]
    return runs[::-1]


def _additive(allowed: torch.Tensor, dtype: torch.dtype, *, optional: bool) -> torch.Tensor | None:
    """A boolean attention mask as the additive one SDPA adds to the scores, on its device: 0 / -inf in ``dtype``,
    which is what SDPA itself turns a boolean mask into on every call. With ``optional`` (a host mask), None where
    every key is allowed (on a CPU SDPA's output is then bit-identical; on CUDA an unmasked call may take another
    kernel)."""
    if optional and bool(allowed.all()):
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True)
class VarlenKeys:
    """A step's attention as one call of FlashAttention-2's variable-length kernel over a token-major slot cache
    (``KVCache`` with ``token_major``, read as [S * Tmax, Hkv, Dh] rows): request b's queries are rows
    ``cu_queries[b] .. cu_queries[b + 1]`` of the step's [N, H, Dh], its keys the first ``key_lens[b]`` rows from
    row ``key_offsets[b]`` (slot_b * Tmax), causal from the bottom right (query i of a run of n sees keys up to
    key_lens[b] - n + i: its cache and the run's earlier tokens). No mask; each request reads its own keys only."""

    cu_queries: torch.Tensor  # [B + 1] int32, increasing: every run at least one token
    key_offsets: torch.Tensor  # [B + 1] int32 (the last entry unused)
    key_lens: torch.Tensor  # [B] int32: cached plus new tokens per request
    max_queries: int  # the longest run
    # must bound every key_lens: the kernel sizes its key blocks (and splits) by it, and keys past it are dropped
    max_keys: int


# Longest run of new tokens per request a step over a token-major cache attends by ``flash_varlen`` (SDPA with a mask
# beyond). One token: the kernel packs a key/value head's G query heads into one tile and splits long key ranges
# over blocks; with runs of t > 1 it gives each query head its own tile of t rows and reads the keys G times. On
# one H200 at Llama-3.1-8B shapes (G = 4, context 1024) a 64 x 8 step's attention took 468 us a layer there
# against 202 us for SDPA's memory-efficient kernel over the grouped queries, a 1 x 1 step's 6 us (plus a 6 us
# combine) against 65 us.
FLASH_MAX_RUN = 1


def flash_varlen(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, varlen: VarlenKeys) -> torch.Tensor:
    """Causal attention of ``varlen``'s requests by FlashAttention-2's variable-length kernel (PyTorch's own build,
    ``aten._flash_attention_forward`` with ``seqused_k``), grouped-query natively, scale 1 / sqrt(Dh).

    Args:
        q: [N, H, Dh] the step's queries, request-major. keys, values: [S * Tmax, Hkv, Dh] a layer's token-major
            cache rows (a view). varlen: the requests' query runs and key ranges.

    Returns:
        [N, H, Dh] in q's dtype (float16 or bfloat16, on CUDA).
    """
    return torch.ops.aten._flash_attention_forward(
        q, keys, values, varlen.cu_queries, varlen.key_offsets, varlen.max_queries, varlen.max_keys, 0.0, True,
        False, seqused_k=varlen.key_lens,
    )[0]


PROBE_TOLERANCE = 1e-2  # largest |difference| the start-up probe allows (its outputs are ~0.3-0.7)


def flash_varlen_problem(args: "ModelArgs", *, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``flash_varlen`` cannot serve this model here (None: it can): it needs CUDA, float16 or bfloat16, a head
    dim that is a multiple of 8 up to 256, and a kernel that runs and agrees with math attention on a probe of steps
    as the engine runs them (``varlen_probe_error`` within ``PROBE_TOLERANCE``)."""
    if torch.device(device).type != "cuda":
        return f"FlashAttention's variable-length kernel needs CUDA, the engine runs on {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention needs float16 or bfloat16, the model runs in {dtype}"
    if args.head_dim % 8 or args.head_dim > 256:
        return f"FlashAttention needs a head dim that is a multiple of 8 up to 256, the model's is {args.head_dim}"
    try:
        error = varlen_probe_error(args, device=torch.device(device), dtype=dtype)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"FlashAttention's variable-length kernel failed on a probe: {e}"
    if not error < PROBE_TOLERANCE:
        return f"FlashAttention's variable-length kernel disagrees with math attention on a probe (max |diff| {error})"
    return None


def varlen_attention_math(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, varlen: VarlenKeys
                          ) -> torch.Tensor:
    """``flash_varlen``'s contract in math attention (SDPA per request, in the inputs' dtype, any device): request b's
    queries over its first key_lens[b] cache rows from key_offsets[b], query i of a run of n seeing keys up to
    key_lens[b] - n + i. The reference the start-up probe checks the kernel against. Shapes as ``flash_varlen``.

    Raises:
        ValueError: a run longer than ``max_queries`` or a key length above ``max_keys`` (bounds the kernel relies on).
    """
    out = torch.empty_like(q)
    cu, offsets, lens = varlen.cu_queries.tolist(), varlen.key_offsets.tolist(), varlen.key_lens.tolist()
    groups = q.shape[1] // keys.shape[1]
    for b, length in enumerate(lens):
        n = cu[b + 1] - cu[b]
        if n > varlen.max_queries or length > varlen.max_keys:
            raise ValueError(f"request {b}: a run of {n} over {length} keys exceeds max_queries "
                             f"{varlen.max_queries} or max_keys {varlen.max_keys}")
        k, v = (t[offsets[b] : offsets[b] + length].repeat_interleave(groups, dim=1).transpose(0, 1)
                for t in (keys, values))
        allowed = (torch.arange(length, device=q.device)[None, :]
                   <= length - n + torch.arange(n, device=q.device)[:, None])
        out[cu[b] : cu[b + 1]] = F.scaled_dot_product_attention(
            q[cu[b] : cu[b + 1]].transpose(0, 1), k, v, attn_mask=allowed).transpose(0, 1)
    return out


def varlen_probe_error(args: "ModelArgs", *, device: torch.device, dtype: torch.dtype, kernel=None) -> float:
    """The largest |difference| between ``kernel`` (default ``flash_varlen``) and float32 ``varlen_attention_math``
    on a step as the engine sends it: the model's head counts, one query per request (``FLASH_MAX_RUN``), three
    requests in slots given out of order (2, 0, 1) of 1024 rows, over 700, 1 and 300 keys (several key blocks, so a
    kernel that splits long key ranges is exercised). Scores are small, so each query averages its keys' values nearly
    evenly, and the values rise with the key's position: a kernel that drops or adds a block of keys moves the output
    by ~0.05 or more."""
    kernel = kernel or flash_varlen
    h, hkv, dh, slot_len = args.num_heads, args.num_kv_heads, args.head_dim, 1024
    gen = torch.Generator(device).manual_seed(0)
    q = (0.1 * torch.randn(3, h, dh, device=device, generator=gen)).to(dtype)
    keys = torch.randn(3 * slot_len, hkv, dh, device=device, generator=gen).to(dtype)
    ramp = (torch.arange(3 * slot_len, device=device) % slot_len / slot_len)[:, None, None]
    values = (ramp + 0.05 * torch.randn(3 * slot_len, hkv, dh, device=device, generator=gen)).to(dtype)
    lens = (700, 1, 300)  # slots 2, 0, 1
    i32 = dict(device=device, dtype=torch.int32)
    varlen = VarlenKeys(cu_queries=torch.arange(4, **i32), key_offsets=torch.tensor([2048, 0, 1024, 0], **i32),
                        key_lens=torch.tensor(lens, **i32), max_queries=1, max_keys=max(lens))
    out = kernel(q, keys, values, varlen).float()
    ref = varlen_attention_math(q.float(), keys.float(), values.float(), varlen)
    return float((ref - out).abs().max())


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a step: the queries of the cache rows [lo, lo + rows), padded to Lq per row, over their
    first Tk keys.

    Tokens are the step's flattened [N] order; ``tokens`` picks this call's (None: all of them, a slice: a contiguous
    run, an index tensor otherwise).
    """

    tokens: torch.Tensor | slice | None
    # [n] row of each of this call's tokens in its padded query block (slot - lo); None when ``dense``
    token_rows: torch.Tensor | None
    # [n] offset of each token inside its request's run of new tokens; None when ``dense``
    token_offsets: torch.Tensor | None
    # [R, 1, G * Lq, Tk] additive (0 where attention is allowed, -inf elsewhere) in the model's dtype; None (on a CPU):
    # all allowed
    mask: torch.Tensor | None
    lo: int  # first cache row of the attention view
    rows: int  # R
    max_len: int  # Lq
    key_len: int  # Tk
    # the tokens fill the padded query block [R, Lq] in order: attention reshapes, no scatter/gather
    dense: bool = False


@dataclass(frozen=True)
class StepLayout:
    """Where each token of a ragged step goes and how its attention runs; built once per step, shared by all layers.

    Request i of the step owns cache slot ``slots[i]``, already holds ``starts[i]`` tokens in it and
    brings ``lengths[i]`` new ones. Tokens are flattened request-major into ``[N]``.
    """

    # [N] absolute position of each new token
    positions: torch.Tensor
    # [N] cache slot of each new token
    token_slots: torch.Tensor
    # the step's attention calls (``attention_chunks``); together they cover every token once. Empty with ``varlen``
    calls: tuple[AttentionCall, ...]
    # set instead of ``calls`` for a step of single tokens over a token-major cache: one FlashAttention call
    varlen: VarlenKeys | None = None

    @classmethod
    def grid(
        cls, starts: torch.Tensor, *, tokens: int, key_len: int, groups: int, dtype: torch.dtype,
        slot_len: int | None = None,
    ) -> "StepLayout":
        """The layout of a static-shape step (``app/engine/static_step.py``): row r is cache slot r, which holds
        ``starts[r]`` tokens and gets ``tokens`` new ones (a request's real tokens first, padding after), flattened
        row-major into [N = R * t], in one attention call. Built from ``starts`` ([R] int64) on its device without a
        host round-trip, so the same code runs inside a captured CUDA graph; only R, t and Tk = ``key_len`` fix the
        shapes. ``dtype``: the model's (the additive mask's). ``slot_len``: set for a token-major cache (``KVCache``)
        of that many positions per slot; a step of one token per row then attends by ``flash_varlen``, no mask
        (``FLASH_MAX_RUN``).

        Query i of row r may see keys j <= starts[r] + i among the first ``key_len``. Padding queries (past a
        request's run, or rows of slots outside the step) are valid too: they see at least key 0, so their output is
        finite, and it is discarded. Their keys/values land past each row's real run, where they stay masked until
        overwritten, like rejected drafts: no real query ever sees them.
        """
        rows, device = starts.shape[0], starts.device
        offsets = torch.arange(tokens, device=device)
        row_of = torch.arange(rows, device=device)[:, None].expand(rows, tokens).reshape(-1)
        positions = (starts[:, None] + offsets).reshape(-1)
        if slot_len is not None and tokens <= FLASH_MAX_RUN:
            row = torch.arange(rows + 1, device=device, dtype=torch.int32)
            # A row's causal offset counts its padding tokens too (query i sees keys up to key_lens - t + i), which
            # may reach past key_len. A real row has starts + its run <= key_len; a row outside the step (starts at
            # its slot's tail, past key_len unless key_len is the whole slot) reads only its first t keys, its output
            # dropped.
            key_lens = torch.where(starts <= key_len, starts + tokens, tokens).to(torch.int32)
            varlen = VarlenKeys(cu_queries=row * tokens, key_offsets=row * slot_len, key_lens=key_lens,
                                max_queries=tokens, max_keys=key_len + tokens)
            return cls(positions=positions, token_slots=row_of, calls=(), varlen=varlen)
        keys = torch.arange(key_len, device=device)
        allowed = keys[None, None, :] <= starts[:, None, None] + offsets[None, :, None]  # [R, t, Tk]
        mask = _additive(allowed[:, None].repeat(1, 1, groups, 1), dtype, optional=False)
        call = AttentionCall(tokens=None, token_rows=None, token_offsets=None, mask=mask, lo=0, rows=rows,
                             max_len=tokens, key_len=key_len, dense=True)
        return cls(positions=positions, token_slots=row_of, calls=(call,))

    @classmethod
    def build(
        cls, *, slots: list[int], starts: list[int], lengths: list[int], groups: int, device: torch.device,
        dtype: torch.dtype, key_len: int | None = None, slot_len: int | None = None,
    ) -> "StepLayout":
        """Compute the layout of a step (see class docstring); ``groups`` is G = H / Hkv, ``dtype`` the model's.
        On a CPU the requests are split into attention calls by ``attention_chunks``, each over its rows' longest
        context; elsewhere one call (its cost model is fitted on a CPU; on a GPU a call's kernel launches cost far
        more keys than that). ``key_len`` (Tk) fixes one call over every row attending over that many cache rows
        (masked beyond each query's position; at least max(starts + lengths)), so the step's shapes do not depend on
        the other requests' contexts. ``slot_len``: set for a token-major cache (``KVCache``) of that many positions per
        slot; a step of one token per request then attends in one ``flash_varlen`` call, no mask (``key_len`` then
        only bounds the keys; ``FLASH_MAX_RUN``).

        Raises:
            ValueError: ``key_len`` below max(starts + lengths), a slot given twice, or a request without tokens.
        """
        if min(lengths) < 1:
            raise ValueError(f"every request of a step brings at least one token, got lengths {lengths}")
        needed = max(s + n for s, n in zip(starts, lengths))
        if key_len is not None and key_len < needed:
            raise ValueError(f"key_len {key_len} is below the {needed} keys the step needs")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {slots}")
        len_t = torch.tensor(lengths, dtype=torch.long)
        token_req = torch.repeat_interleave(torch.arange(len(slots)), len_t)
        first = torch.cumsum(len_t, 0) - len_t
        offsets = torch.arange(int(len_t.sum())) - first[token_req]
        ends = [s + n for s, n in zip(starts, lengths)]
        positions = (torch.tensor(starts, dtype=torch.long)[token_req] + offsets).to(device)
        token_slots = torch.tensor(slots, dtype=torch.long)[token_req].to(device)
        if slot_len is not None and max(lengths) <= FLASH_MAX_RUN:
            cu = [0] + torch.cumsum(len_t, 0).tolist()
            varlen = VarlenKeys(
                cu_queries=torch.tensor(cu, dtype=torch.int32).to(device),
                key_offsets=torch.tensor([s * slot_len for s in slots] + [0], dtype=torch.int32).to(device),
                key_lens=torch.tensor(ends, dtype=torch.int32).to(device),
                max_queries=max(lengths), max_keys=key_len if key_len is not None else needed,
            )
            return cls(positions=positions, token_slots=token_slots, calls=(), varlen=varlen)
        order = sorted(range(len(slots)), key=slots.__getitem__)
        on_cpu = torch.device(device).type == "cpu"
        if key_len is None and on_cpu:
            runs = attention_chunks([slots[r] for r in order], [ends[r] for r in order],
                                    [lengths[r] for r in order], groups=groups)
        else:
            runs = [(0, len(order))]
        calls, firsts = [], first.tolist()
        for i, j in runs:
            members = order[i:j]
            calls.append(cls._call(members, slots=slots, starts=starts, lengths=lengths, first=firsts,
                                   token_req=token_req, offsets=offsets, groups=groups, device=device, dtype=dtype,
                                   key_len=key_len if key_len is not None else max(ends[r] for r in members),
                                   whole=len(runs) == 1, on_cpu=on_cpu))
        return cls(positions=positions, token_slots=token_slots, calls=tuple(calls))

    @staticmethod
    def _call(
        members: list[int], *, slots: list[int], starts: list[int], lengths: list[int], first: list[int],
        token_req: torch.Tensor, offsets: torch.Tensor, groups: int, device: torch.device, dtype: torch.dtype,
        key_len: int, whole: bool, on_cpu: bool,
    ) -> AttentionCall:
        """The attention call of the requests ``members`` (indices into the step's requests, in slot order); ``whole``:
        the step's only call; ``on_cpu``: a CPU step (its mask may be left out, ``_additive``)."""
        lo = slots[members[0]]
        rows, max_len = slots[members[-1]] - lo + 1, max(lengths[r] for r in members)
        # Per cache row of the view: how many cached tokens precede the queries and how many queries.
        row_start = torch.zeros(rows, dtype=torch.long)
        row_len = torch.zeros(rows, dtype=torch.long)
        for r in members:
            row_start[slots[r] - lo], row_len[slots[r] - lo] = starts[r], lengths[r]
        q_idx = torch.arange(max_len)
        k_idx = torch.arange(key_len)
        # Query i of a row may see keys j <= start + i (causal within the new run, full over the cache).
        allowed = k_idx[None, None, :] <= (row_start[:, None, None] + q_idx[None, :, None])
        valid_q = q_idx[None, :] < row_len[:, None]
        # Padded or dummy queries see only key 0 so softmax stays finite; their output is discarded.
        allowed = torch.where(valid_q[:, :, None], allowed, k_idx[None, None, :] == 0)
        mask = _additive(allowed[:, None].repeat(1, 1, groups, 1), dtype, optional=on_cpu)
        mask = mask.to(device) if mask is not None else None
        if len(members) == 1:  # one request: its tokens are one contiguous run that fills the block in order
            r = members[0]
            tokens = None if whole else slice(first[r], first[r] + lengths[r])
            return AttentionCall(tokens=tokens, token_rows=None, token_offsets=None, mask=mask, lo=lo, rows=1,
                                 max_len=max_len, key_len=key_len, dense=True)
        picked = torch.isin(token_req, torch.tensor(members))
        index = picked.nonzero().squeeze(1)
        rows_of = torch.tensor(slots, dtype=torch.long)[token_req[index]] - lo
        return AttentionCall(
            tokens=None if whole else index.to(device), token_rows=rows_of.to(device),
            token_offsets=offsets[index].to(device), mask=mask, lo=lo, rows=rows, max_len=max_len, key_len=key_len,
        )


def lazy_zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor that, on the CPU, takes memory only as it is written: an anonymous ``mmap`` of fresh pages
    that the kernel zero-fills on first touch (page-aligned), where ``torch.zeros`` writes every byte at once.
    Elsewhere ``torch.zeros``.

    A KV cache sized for ``max_num_seqs`` full contexts is mostly never written; this keeps its unused part out of
    the process's resident memory and out of start-up time.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVCache(nn.Module):
    """Slot KV cache, one slot per request, zero at the start (``lazy_zeros``: on the CPU, resident only as slots are
    written). ``k``/``v`` are head-major, ``[layers, S, Hkv, Tmax, Dh]`` (SDPA reads a slot's [Hkv, Tk, Dh] as it
    lies), or with ``token_major`` ``[layers, S, Tmax, Hkv, Dh]``: a layer's cache is then [S * Tmax, Hkv, Dh] rows, as
    FlashAttention's variable-length kernel reads it (``flash_varlen``; steps built with ``slot_len=max_len``), and
    SDPA reads a slot's keys as a transposed view."""

    def __init__(self, args: ModelArgs, *, num_slots: int, max_len: int, dtype: torch.dtype, device,
                 token_major: bool = False) -> None:
        super().__init__()
        self.token_major = token_major
        per_slot = (max_len, args.num_kv_heads) if token_major else (args.num_kv_heads, max_len)
        shape = (args.num_layers, num_slots, *per_slot, args.head_dim)
        self.register_buffer("k", lazy_zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", lazy_zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2 if self.token_major else 3]

    @property
    def slot_len(self) -> int | None:
        """What ``StepLayout.build``/``grid`` take as ``slot_len`` for this cache: Tmax when token-major, else None."""
        return self.max_len if self.token_major else None

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        """Store a step's keys and values ([N, Hkv, Dh] each) of ``layer`` at cache ``slots`` [N], ``positions`` [N]."""
        if self.token_major:
            self.k[layer, slots, positions] = k
            self.v[layer, slots, positions] = v
        else:
            self.k[layer, slots, :, positions] = k
            self.v[layer, slots, :, positions] = v

    def rows(self, layer: int, lo: int, count: int, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer``'s slots [lo, lo + count), first ``key_len`` positions: [R, Hkv, Tk, Dh] views
        each, as SDPA takes them (transposed views of a token-major cache)."""
        if self.token_major:
            return (self.k[layer, lo : lo + count, :key_len].transpose(1, 2),
                    self.v[layer, lo : lo + count, :key_len].transpose(1, 2))
        return self.k[layer, lo : lo + count, :, :key_len], self.v[layer, lo : lo + count, :, :key_len]

    def slot_tokens(self, slot: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first ``count`` positions of ``slot``, [layers, Hkv, count, Dh] each in either
        layout (views)."""
        if self.token_major:
            return self.k[:, slot, :count].transpose(1, 2), self.v[:, slot, :count].transpose(1, 2)
        return self.k[:, slot, :, :count], self.v[:, slot, :, :count]

    def copy_prefixes(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy the keys and values of the first ``count`` positions of slot ``src`` to slot ``dst``, every layer, for
        each ``(src, dst, count)``; every source is read before any destination is written (a slot may be both: such
        a source is cloned first, the others are copied from in place)."""
        written = {dst for _, dst, _ in copies}
        staged = []
        for src, dst, n in copies:
            k, v = self.k[self._prefix_index(src, n)], self.v[self._prefix_index(src, n)]
            staged.append((self._prefix_index(dst, n), k.clone() if src in written else k,
                           v.clone() if src in written else v))
        for where, k, v in staged:
            self.k[where] = k
            self.v[where] = v

    def _prefix_index(self, slot: int, count: int) -> tuple:
        """Index of the first ``count`` positions of ``slot`` in ``k`` / ``v``, every layer and head."""
        if self.token_major:
            return slice(None), slot, slice(None, count)
        return slice(None), slot, slice(None), slice(None, count)

    def bytes_per_token(self) -> int:
        """KV bytes one cached token costs over all layers (k and v)."""
        layers, dh = self.k.shape[0], self.k.shape[-1]
        kv_heads = self.k.shape[3 if self.token_major else 2]
        return 2 * layers * kv_heads * dh * self.k.element_size()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as the reference implementations do."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(*, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """float32 inverse frequencies [Dh / 2] of the rotary embedding with ``scaling`` (``RopeScaling``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    s = scaling or RopeScaling()
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        wavelen = 2 * math.pi / inv_freq
        old_len = s.original_max_position_embeddings
        # 1 for high frequencies (kept), 0 for low ones (divided by factor), a linear ramp in between.
        keep = ((old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0.0, 1.0)
        return (1 - keep) * inv_freq / s.factor + keep * inv_freq
    if s.rope_type == "yarn":
        def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the old context
            return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2).float() - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
        # ramp 0: extrapolate (keep the frequency), ramp 1: interpolate (divide by factor)
        return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)
    return inv_freq  # default, and dynamic inside max_position_embeddings (RopeScaling docstring)


def rope_tables(
    *, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables [max_positions, Dh] of the rotary embedding (target and drafters), with ``scaling``'s
    frequencies and, for yarn, its attention factor."""
    inv_freq = rope_inv_freq(head_dim=head_dim, theta=theta, scaling=scaling)
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    factor = scaling.attention_factor if scaling is not None else 1.0
    return angles.cos() * factor, angles.sin() * factor


def target_rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's rotary tables ([max_position_embeddings + MAX_DRAFT_LEN, Dh] float32 cos, sin): its context and a
    draft block's room past it (a KV slot holds ``max_draft_len`` positions past ``max_model_len``, where the padding
    of a verify step's last rows lands)."""
    return rope_tables(head_dim=args.head_dim, theta=args.rope_theta,
                       max_positions=args.max_position_embeddings + MAX_DRAFT_LEN, scaling=args.rope_scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split convention of transformers' Llama. x: [N, H, Dh]; cos/sin: [N, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope`` on queries [N, H, Dh] and keys [N, Hkv, Dh] at the same positions (cos/sin [N, 1, Dh])."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update and the next norm: (x + delta, ``rms_norm(x + delta)``), [N, Dm] each."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: [N, 2 I] (gate, up) -> [N, I] silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Elementwise:
    """The decoder's work between its matmuls and attention (norms, rotary embedding, residual, SwiGLU gate) as
    functions: eager PyTorch (``EAGER``), or each compiled by ``torch.compile`` into fused kernels (``compiled``).

    Eager, each is several small kernels (rms_norm alone: upcast, square, mean, add, rsqrt, multiply, downcast, the
    weight), each a launch and a pass over memory: ~5 ms of a 64 x 8 verify step of Llama-3.1-8B's shapes on an H200
    (docs/scheduling.md). Compiled, each function is one or two fused kernels of the same math (rounding may differ
    from eager in the last bit; a row's result does not depend on the other rows: every function works row by row).
    """

    rms_norm: Callable = rms_norm
    rope_qk: Callable = rope_qk
    add_rms_norm: Callable = add_rms_norm
    silu_mul: Callable = silu_mul

    @classmethod
    @functools.cache
    def compiled(cls) -> "Elementwise":
        """The same functions through ``torch.compile(dynamic=True, fullgraph=True)`` (Inductor's Triton kernels on
        CUDA); each compiles at its first call (dynamic in the token count, so step shapes do not recompile). One
        instance a process: the functions hold no state, so every engine of the process shares their compilations."""
        compile_ = functools.partial(torch.compile, dynamic=True, fullgraph=True)
        return cls(rms_norm=compile_(rms_norm), rope_qk=compile_(rope_qk), add_rms_norm=compile_(add_rms_norm),
                   silu_mul=compile_(silu_mul))


EAGER = Elementwise()


def compile_problem(ops: Elementwise, args: ModelArgs, *, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the compiled ``ops`` (``Elementwise.compiled``) cannot run for this model on ``device`` (None: they can).
    Inductor's kernels need Triton: the triton package, a CUDA device of compute capability 7.0 or above, and a C
    compiler when Triton builds its launcher (on a CPU Inductor would need a C++ compiler at run time, which a
    serving machine need not have). A probe then runs each function as the decoder calls it (per-head norms too when
    the model has them) on one row and on two, which compiles them (dynamic shapes specialise a single row): a missing
    compiler or a failing compilation shows here, at start-up, and the first requests do not wait for compilation."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"compiled elementwise kernels need a CUDA device, the engine runs on {device}"
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 7:
        return f"Triton needs compute capability 7.0 or above, the device has {major}.{minor}"
    eps, like = args.rms_norm_eps, dict(device=device, dtype=dtype)
    try:
        for rows in (1, 2):
            x = torch.randn(rows, args.hidden_size, **like)
            weight = torch.ones(args.hidden_size, **like)
            q = torch.randn(rows, args.num_heads, args.head_dim, **like)
            k = torch.randn(rows, args.num_kv_heads, args.head_dim, **like)
            cos = torch.ones(rows, 1, args.head_dim, **like)
            ops.rms_norm(x, weight, eps)
            if args.qk_norm:
                ops.rms_norm(q, torch.ones(args.head_dim, **like), eps)
            ops.add_rms_norm(x, x, weight, eps)
            ops.rope_qk(q, k, cos, torch.zeros_like(cos))
            ops.silu_mul(torch.randn(rows, 2 * args.intermediate_size, **like))
    except Exception as e:  # compilation errors come as many types (Inductor, Triton, a missing compiler, OS errors)
        return f"compiling the elementwise kernels failed on a probe: {type(e).__name__}: {e}"
    return None


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer with fused qkv and gate/up projections."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        q_out = args.num_heads * args.head_dim
        kv_out = args.num_kv_heads * args.head_dim
        self.qkv = nn.Linear(args.hidden_size, q_out + 2 * kv_out, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_out, args.hidden_size, bias=False)
        self.gate_up = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.input_norm = nn.Parameter(torch.ones(args.hidden_size))
        self.post_attn_norm = nn.Parameter(torch.ones(args.hidden_size))
        if args.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(args.head_dim))
            self.k_norm = nn.Parameter(torch.ones(args.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        *,
        layer: int,
        cache: KVCache,
        layout: StepLayout,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ops: Elementwise = EAGER,
    ) -> torch.Tensor:
        """x: [N, Dm] -> [N, Dm]; writes this step's keys/values into ``cache`` at their slots; ``ops`` does the
        elementwise work."""
        a = self.args
        n = x.shape[0]
        h = ops.rms_norm(x, self.input_norm, a.rms_norm_eps)
        qkv = self.qkv(h)
        q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q = qkv[:, :q_out].view(n, a.num_heads, a.head_dim)
        k = qkv[:, q_out : q_out + kv_out].view(n, a.num_kv_heads, a.head_dim)
        v = qkv[:, q_out + kv_out :].view(n, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = ops.rms_norm(q, self.q_norm, a.rms_norm_eps)
            k = ops.rms_norm(k, self.k_norm, a.rms_norm_eps)
        q, k = ops.rope_qk(q, k, cos, sin)
        cache.write(layer, layout.token_slots, layout.positions, k, v)
        if layout.varlen is not None:
            attn = flash_varlen(q, cache.k[layer].flatten(0, 1), cache.v[layer].flatten(0, 1), layout.varlen)
        else:
            attn = self._attend(q, cache=cache, layer=layer, layout=layout)
        x, h = ops.add_rms_norm(x, self.o_proj(attn.reshape(n, q_out)), self.post_attn_norm, a.rms_norm_eps)
        return x + self.down_proj(ops.silu_mul(self.gate_up(h)))

    def _attend(self, q: torch.Tensor, *, cache: KVCache, layer: int, layout: StepLayout) -> torch.Tensor:
        """The step's attention, one call per ``layout.calls`` entry. q: [N, H, Dh] -> [N, H, Dh]."""
        if len(layout.calls) == 1 and layout.calls[0].tokens is None:
            return self._attend_call(q, cache=cache, layer=layer, call=layout.calls[0])
        out = torch.empty_like(q)
        for call in layout.calls:
            out[call.tokens] = self._attend_call(q[call.tokens], cache=cache, layer=layer, call=call)
        return out

    def _attend_call(self, q: torch.Tensor, *, cache: KVCache, layer: int, call: AttentionCall) -> torch.Tensor:
        """Masked attention of one call's queries ([n, H, Dh], its tokens in order) over the cache rows
        [lo, lo + R) -> [n, H, Dh]."""
        a = self.args
        groups = a.num_heads // a.num_kv_heads
        rows, lq = call.rows, call.max_len
        if call.dense:
            padded = q.view(rows, lq, a.num_heads, a.head_dim)
        else:
            padded = q.new_zeros(rows, lq, a.num_heads, a.head_dim)
            padded[call.token_rows, call.token_offsets] = q
        # [R, Lq, Hkv, G, Dh] -> [R, Hkv, G * Lq, Dh]: query heads sharing a kv head share one attention call.
        grouped = padded.view(rows, lq, a.num_kv_heads, groups, a.head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(rows, a.num_kv_heads, groups * lq, a.head_dim)
        keys, values = cache.rows(layer, call.lo, rows, call.key_len)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=call.mask)
        out = out.view(rows, a.num_kv_heads, groups, lq, a.head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(rows, lq, a.num_heads, a.head_dim)
        if call.dense:
            return out.reshape(rows * lq, a.num_heads, a.head_dim)
        return out[call.token_rows, call.token_offsets]


class TargetModel(nn.Module):
    """Llama-family decoder over a slot KV cache.

    ``forward`` runs one ragged step; ``feature_layers`` are the decoder layers (0-based) whose output
    hidden states are returned, concatenated, as the drafter's conditioning features ([N, F],
    F = len(feature_layers) * Dm), as in EAGLE-3 / DFlash / DSpark.
    """

    def __init__(self, args: ModelArgs, *, feature_layers: tuple[int, ...]) -> None:
        super().__init__()
        bad = [i for i in feature_layers if not 0 <= i < args.num_layers]
        if bad or not feature_layers:
            raise ValueError(f"feature_layers must be non-empty, in [0, {args.num_layers}), got {feature_layers}")
        self.args = args
        self.feature_layers = tuple(feature_layers)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = target_rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def feature_dim(self) -> int:
        return len(self.feature_layers) * self.args.hidden_size

    def forward(
        self, tokens: torch.Tensor, *, cache: KVCache, layout: StepLayout, logits_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ragged step.

        Args:
            tokens: [N] int64 new tokens, flattened request-major as described by ``layout``.
            cache: the KV cache; this step's keys/values are written at ``layout``'s positions.
            layout: per-token slots/positions and the attention mask.
            logits_index: [M] indices into [N] of the tokens whose next-token logits are wanted.

        Returns:
            logits: [M, V] float32; features: [N, F] hidden states at ``feature_layers``.
        """
        hidden, features = self.hidden_states(tokens, cache=cache, layout=layout, index=logits_index)
        return self.logits_from_final_hidden(hidden), features

    def hidden_states(
        self, tokens: torch.Tensor, *, cache: KVCache, layout: StepLayout, index: torch.Tensor | None,
        ops: Elementwise = EAGER,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ragged step as ``forward``, without the LM head; ``ops`` does the layers' elementwise work.

        Returns:
            hidden: [M, Dm] last-layer hidden states (before the final norm) at ``index`` (None: every row,
            M = N); features: [N, F].
        """
        x = self.embed_tokens(tokens)
        cos = self.rope_cos[layout.positions].to(x.dtype)[:, None, :]
        sin = self.rope_sin[layout.positions].to(x.dtype)[:, None, :]
        captured = []
        backends = sdpa_kernel(CUDA_ATTENTION_BACKENDS) if x.is_cuda else contextlib.nullcontext()
        with backends:
            for i, layer in enumerate(self.layers):
                x = layer(x, layer=i, cache=cache, layout=layout, cos=cos, sin=sin, ops=ops)
                if i in self.feature_layers:
                    captured.append(x)
        return (x if index is None else x[index]), torch.cat(captured, dim=-1)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., Dm] last-layer hidden states -> [..., Dm] normed, in the LM head's dtype (the head's input)."""
        return rms_norm(hidden, self.norm, self.args.rms_norm_eps).to(self.lm_head.weight.dtype)

    def logits_from_final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., Dm] last-layer hidden states (before the final norm) -> [..., V] float32 logits.

        The LM head runs in its own dtype (float32 by default, see ``loader.load_target``): bfloat16 logits
        sit on a grid of 0.125 at magnitude ~20, where exact top-2 ties are common and greedy decoding would
        depend on batch shape.
        """
        return self.lm_head(self.final_norm(hidden)).float()
