"""Training batches for the drafter from datagen shards (``datagen.py`` documents the shard layout).

Owns: loading shards into memory, the held-out split, and building a batch of blocks with the exact alignment of
inference: for an anchor at token a (a >= P, a response token), the context is feature rows 0..a-1 (the tokens
in the target's cache when a is pending), the block inputs are [x_a, mask x (K-1)] at positions a..a+K-1, the
labels are tokens a+1..a+K and the target distribution of label a+k is the target's logits at row a+k-1.

Shape symbols: B sequences, M anchors per sequence, K block size, T longest sequence, F feature width.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm


@dataclass(frozen=True)
class Sequence_:
    """One prompt + response."""

    # [L] int64 token ids
    tokens: torch.Tensor
    # [L, F] target features (row L-1 unused)
    features: torch.Tensor
    prompt_len: int
    # [L, Kt] int64 the target's top-Kt tokens at each row (distribution of the next token), see ``TargetTopK``
    topk_ids: torch.Tensor | None = None
    # [L, Kt] float32 their target probabilities
    topk_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class Batch:
    """B sequences x M anchors, padded to T context rows."""

    # [B, T, F] context features (zero padded)
    features: torch.Tensor
    # [B, T] int64 token ids (zero padded); the autoregressive drafter's context rows read x_{j+1} from it
    tokens: torch.Tensor
    # [B, T] positions 0..T-1
    ctx_positions: torch.Tensor
    # [B, M] anchor tokens x_a
    anchors: torch.Tensor
    # [B, M * K] absolute positions of the block inputs
    positions: torch.Tensor
    # [B, M * K, T + M * K] bool attention mask (context rows < a, own block)
    mask: torch.Tensor
    # [B, M, K] labels x_{a+k}
    labels: torch.Tensor
    # [B, M, K] teacher-forced previous tokens x_{a+k-1}
    prev: torch.Tensor
    # [B, M, K] feature rows a+k-1 whose target logits give label k's target distribution
    target_rows: torch.Tensor
    # [B, M, K] bool, label exists (a + k <= L - 1)
    valid: torch.Tensor
    # [B, M, K, Kt] target top-Kt token ids of label k's distribution (None without ``TargetTopK``)
    topk_ids: torch.Tensor | None = None
    # [B, M, K, Kt] their target probabilities
    topk_probs: torch.Tensor | None = None


def data_meta(folder: Path | str) -> dict:
    """What datagen recorded of the run that wrote ``folder`` (its ``meta.json``: the target ``model``, the
    ``temperature``, counts); {} for a folder without one."""
    meta = Path(folder) / "meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


def shard_paths(folders: Path | str | list[Path] | list[str]) -> list[Path]:
    """``folder/shard-*.safetensors`` for each folder, in folder then shard order.

    Raises:
        FileNotFoundError: a folder without shards (or no folder at that path).
        ValueError: a folder given twice (compared after resolving the path): its sequences would count twice, and
            the held-out split (every n-th sequence) would then hold out one copy and train on the other.
    """
    folders = [Path(f) for f in (folders if isinstance(folders, list) else [folders])]
    seen: set[Path] = set()
    paths = []
    for folder in folders:
        resolved = folder.resolve()
        if resolved in seen:
            raise ValueError(f"data folder {folder} is given twice")
        seen.add(resolved)
        found = sorted(folder.glob("shard-*.safetensors"))
        if not found:
            raise FileNotFoundError(f"no shard-*.safetensors in {folder}")
        paths += found
    return paths


@dataclass(frozen=True)
class TargetTopK:
    """The target's top-``k`` next-token distribution of every stored row, for the TV loss (``load_shards``).

    Computed once per shard from the stored final-layer slice of the features and kept beside the shard
    (``topk_path``), so a resumed or repeated training run does not run the target's LM head over the vocabulary
    again; a cache made for another ``model`` or ``k``, or for other tokens (a shard generated again), is recomputed.
    """

    logits_fn: Callable[[torch.Tensor], torch.Tensor]  # [N, Dm] final hidden -> [N, V] float32 logits
    k: int
    hidden_size: int  # Dm: the features' last Dm columns are the final layer's hidden state
    device: torch.device
    model: str  # names the target in the cache
    chunk_rows: int = 2048

    def topk_path(self, shard: Path) -> Path:
        """``topk<k>-<shard name>`` beside ``shard`` (outside the ``shard-*`` pattern datagen and training read)."""
        return shard.with_name(f"topk{self.k}-{shard.name}")

    @torch.no_grad()
    def of_shard(self, shard: Path, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, k] int64 ids, [R, k] float32 probabilities) of the shard's R rows (``features`` [R, F], ``tokens``
        [R] the shard's token ids, whose SHA-256 identifies the shard's content in the cache), from the cache when it
        matches.

        p_j = exp(l_j - logsumexp(l)) of the k largest logits l_j: the softmax's top-k without materialising it.
        """
        path = self.topk_path(shard)
        digest = hashlib.sha256(tokens.contiguous().numpy().tobytes()).hexdigest()
        meta = {"model": self.model, "k": str(self.k), "rows": str(features.shape[0]), "tokens_sha256": digest}
        if path.is_file():
            with safe_open(str(path), framework="pt") as f:
                if f.metadata() == meta:
                    return f.get_tensor("ids").long(), f.get_tensor("probs")
        ids, probs = [], []
        for lo in range(0, features.shape[0], self.chunk_rows):
            logits = self.logits_fn(features[lo : lo + self.chunk_rows, -self.hidden_size :].to(self.device))
            top = logits.topk(self.k, dim=-1)
            ids.append(top.indices.int().cpu())
            probs.append(torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).float().cpu())
        tensors = {"ids": torch.cat(ids), "probs": torch.cat(probs)}
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        return tensors["ids"].long(), tensors["probs"]


def load_shards(folders: Path | str | list[Path] | list[str], *, topk: TargetTopK | None = None,
                progress: bool = True) -> list[Sequence_]:
    """All sequences of ``folder/shard-*.safetensors`` for each folder, in folder then shard order, with the
    target's top-k distribution of every row when ``topk`` is given (cached beside each shard; a progress bar
    over the shards).

    Raises:
        FileNotFoundError / ValueError: from :func:`shard_paths`.
    """
    paths = shard_paths(folders)
    seqs = []
    for path in tqdm(paths, desc="shards", disable=not progress or topk is None):
        shard = load_file(str(path))
        off = shard["offsets"].tolist()
        ids = probs = None
        if topk is not None:
            ids, probs = topk.of_shard(path, shard["features"], shard["tokens"])
        for i, p in enumerate(shard["prompt_lens"].tolist()):
            lo, hi = off[i], off[i + 1]
            if hi - lo - p >= 2:  # at least one anchor with a label
                seqs.append(Sequence_(shard["tokens"][lo:hi].long(), shard["features"][lo:hi], p,
                                      None if ids is None else ids[lo:hi], None if probs is None else probs[lo:hi]))
    return seqs


def token_sequences(folders: Path | str | list[Path] | list[str]) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of every sequence of the folders' shards, in ``load_shards`` order, reading no
    features (a pass over the tokens of gigabytes of shards in seconds).

    Raises:
        FileNotFoundError / ValueError: from :func:`shard_paths`.
    """
    out = []
    for path in shard_paths(folders):
        with safe_open(str(path), framework="pt") as f:
            tokens, off, plens = (f.get_tensor(n).tolist() for n in ("tokens", "offsets", "prompt_lens"))
        out += [(tokens[off[i] : off[i + 1]], p) for i, p in enumerate(plens)]
    return out


def make_batch(seqs: list[Sequence_], *, block_size: int, anchors_per_seq: int, generator: torch.Generator) -> Batch:
    """Random anchors in each sequence's response (module docstring)."""
    k, m, b = block_size, anchors_per_seq, len(seqs)
    t = max(len(s.tokens) for s in seqs)
    features = seqs[0].features.new_zeros(b, t, seqs[0].features.shape[1])
    anchors_idx = torch.empty(b, m, dtype=torch.long)
    tokens = torch.zeros(b, t + k, dtype=torch.long)
    lengths = torch.tensor([len(s.tokens) for s in seqs])
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        features[i, :n] = s.features
        tokens[i, :n] = s.tokens
        anchors_idx[i] = torch.randint(s.prompt_len, n - 1, (m,), generator=generator)
    offs = torch.arange(k)
    rows = anchors_idx[:, :, None] + offs  # [B, M, K] a + k - 1 for k = 1..K
    labels = torch.gather(tokens, 1, (rows + 1).flatten(1)).view(b, m, k)
    prev = torch.gather(tokens, 1, rows.flatten(1)).view(b, m, k)
    valid = (rows + 1) <= (lengths[:, None, None] - 1)
    q_block = torch.arange(m)[:, None].expand(m, k).flatten()  # [Q] block of each query
    ctx_ok = torch.arange(t)[None, None, :] < anchors_idx.repeat_interleave(k, dim=1)[:, :, None]  # [B, Q, T]
    own = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    topk_ids = topk_probs = None
    if seqs[0].topk_ids is not None:
        kt = seqs[0].topk_ids.shape[1]
        topk_ids = torch.zeros(b, t, kt, dtype=torch.long)
        topk_probs = torch.zeros(b, t, kt)
        for i, s in enumerate(seqs):
            topk_ids[i, : len(s.tokens)] = s.topk_ids
            topk_probs[i, : len(s.tokens)] = s.topk_probs
        idx = rows.clamp(max=t - 1)
        topk_ids = topk_ids[torch.arange(b)[:, None, None], idx]
        topk_probs = topk_probs[torch.arange(b)[:, None, None], idx]
    return Batch(
        topk_ids=topk_ids,
        topk_probs=topk_probs,
        features=features,
        tokens=tokens[:, :t],
        ctx_positions=torch.arange(t)[None].expand(b, -1),
        anchors=torch.gather(tokens, 1, anchors_idx),
        positions=rows.flatten(1),
        mask=torch.cat([ctx_ok, own], dim=2),
        labels=labels,
        prev=prev,
        target_rows=rows.clamp(max=t - 1),
        valid=valid,
    )
