"""A draft vocabulary for a DSpark checkpoint: the V' most frequent tokens of the target's own answers.

Owns: counting the response tokens (each sequence's tokens from its prompt length on, i.e. the target's next
tokens) of datagen shards (layout in ``datagen.py``; only ``tokens``, ``offsets`` and ``prompt_lens`` are read),
choosing the V' most frequent ids plus the target tokenizer's special ids (EOS and the chat markers, always
kept), and writing the sorted ids into the checkpoint (``checkpoint.write_draft_vocab``). The drafter then
computes its logits over V' only (``DSparkDrafter.set_draft_vocab``); no retraining.

Usage:
    python -m app.drafters.train.draft_vocab --data runs/dspark-data [more folders] \
        --checkpoint checkpoints/dspark-smollm2-135m --size 8192
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from app.drafters.checkpoint import CONFIG, write_draft_vocab
from app.drafters.config import DrafterConfig
from app.drafters.train.data import shard_paths


def response_token_counts(shards: Iterable[Path], vocab_size: int) -> tuple[torch.Tensor, int]:
    """Occurrences of each token id among the response tokens of datagen ``shards``.

    Returns:
        counts [V] int64 and the number of sequences read.

    Raises:
        ValueError: a token id outside [0, vocab_size) (shards of another target).
    """
    counts, sequences = torch.zeros(vocab_size, dtype=torch.long), 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            tokens, offsets, prompt_lens = (f.get_tensor(n).long() for n in ("tokens", "offsets", "prompt_lens"))
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
            raise ValueError(f"{shard}: token ids in [{int(tokens.min())}, {int(tokens.max())}] are outside the "
                             f"drafter's vocabulary [0, {vocab_size})")
        for s in range(prompt_lens.numel()):
            counts += torch.bincount(tokens[int(offsets[s]) + int(prompt_lens[s]) : int(offsets[s + 1])],
                                     minlength=vocab_size)
        sequences += prompt_lens.numel()
    return counts, sequences


def choose_draft_vocab(counts: torch.Tensor, size: int, always: Sequence[int]) -> torch.Tensor:
    """The ``size`` ids to draft over: every id of ``always``, then the most frequent by ``counts`` [V] (ties and
    unseen ids by lowest id).

    Returns:
        sorted distinct ids [size] int64.

    Raises:
        ValueError: ``size`` outside [len(set(always)), V], or an ``always`` id outside [0, V).
    """
    vocab_size = counts.numel()
    keep = sorted({int(i) for i in always})
    if keep and (keep[0] < 0 or keep[-1] >= vocab_size):
        raise ValueError(f"always-kept ids {keep} must lie in [0, {vocab_size})")
    low = max(len(keep), 1)
    if not low <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [{low}, {vocab_size}], got {size}")
    score = counts.clone()
    score[keep] = -1  # taken already: rank them last so they are not picked twice
    order = torch.argsort(-score, stable=True)
    return torch.sort(torch.cat([torch.tensor(keep, dtype=torch.long), order[: size - len(keep)]])).values


def special_token_ids(target: str) -> list[int]:
    """The target tokenizer's special ids and its config's EOS ids (local files only)."""
    from transformers import AutoConfig, AutoTokenizer

    from app.engine.loader import local_checkpoint

    src = local_checkpoint(target)
    eos = AutoConfig.from_pretrained(src, local_files_only=True).eos_token_id
    eos_ids = eos if isinstance(eos, (list, tuple)) else [eos]
    special = AutoTokenizer.from_pretrained(src, local_files_only=True).all_special_ids
    return sorted({*special, *(i for i in eos_ids if i is not None)})


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True,
                    help="datagen output folder(s) (shard-*.safetensors)")
    ap.add_argument("--checkpoint", type=Path, required=True, help="DSpark checkpoint folder, modified in place")
    ap.add_argument("--size", type=int, required=True, help="V': token ids to draft over (special ids included)")
    args = ap.parse_args(argv)
    try:
        shards = shard_paths(args.data)
    except (FileNotFoundError, ValueError) as err:
        ap.error(f"--data: {err}")
    if not (args.checkpoint / CONFIG).is_file():
        ap.error(f"--checkpoint: no checkpoint ({CONFIG}) in {args.checkpoint}")
    doc = json.loads((args.checkpoint / CONFIG).read_text())
    if doc.get("kind", "dspark") != "dspark":
        ap.error(f"--checkpoint: {args.checkpoint} is a {doc['kind']!r} drafter; a draft vocabulary needs 'dspark'")
    config = DrafterConfig.model_validate(doc["config"])
    counts, sequences = response_token_counts(shards, config.vocab_size)
    special = special_token_ids(config.target)
    try:
        ids = choose_draft_vocab(counts, args.size, special)
    except ValueError as err:
        ap.error(f"--size: {err}")
    total = int(counts.sum())
    info = {"size": args.size, "data": [str(folder) for folder in args.data], "shards": len(shards),
            "sequences": sequences, "response_tokens": total, "distinct_tokens": int((counts > 0).sum()),
            "special_ids": special, "coverage": round(int(counts[ids].sum()) / max(total, 1), 5)}
    write_draft_vocab(args.checkpoint, ids, info=info)
    print(json.dumps(info))
    return info


if __name__ == "__main__":
    main()
