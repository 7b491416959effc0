"""Calibrate a trained drafter's (any kind's) confidence head on held-out sequences (sequential temperature scaling).

Owns: teacher-forced drafting of the held-out split (the sequences ``trainer.py`` did not train on), the
outcomes per mode (greedy: draft k equals the target's argmax token; sampled: the analytic acceptance rate
1 - TV at temperature 1), fitting one temperature per position per mode (``calibration.py``) and writing them into
the checkpoint's config.json, with the ECE / AUC of the survival probability before and after.

Usage:
    python -m app.drafters.train.calibrate --checkpoint runs/dspark-ckpt --data runs/dspark-data
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from app.argtypes import positive_int
from app.drafters.calibration import Calibration, auc, ece, fit_sequential_temperatures, prefix_survival
from app.drafters.checkpoint import CONFIG, Drafter, load_checkpoint, read_checkpoint_config
from app.drafters.dspark import DSparkDrafter
from app.drafters.train.data import Sequence_, load_shards, make_batch, shard_paths
from app.drafters.train.trainer import forward_batch, split_heldout
from app.engine.loader import load_target, resolve_device
from app.engine.model import TargetModel


@torch.no_grad()
def collect_outcomes(
    drafter: Drafter, target: TargetModel, seqs: list[Sequence_], *, anchors_per_seq: int, seed: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Teacher-forced blocks of ``seqs``: conf_logits, greedy hits, acceptance rates 1 - TV, valid (all [N, K]).

    A DSpark drafter with a draft vocabulary V' is measured as it drafts: softmax and argmax over V' only (the
    draft probability of every token outside V' is 0)."""
    gen = torch.Generator().manual_seed(seed)
    draft_vocab = drafter.draft_vocab if isinstance(drafter, DSparkDrafter) else None
    parts: dict[str, list[torch.Tensor]] = {"conf_logits": [], "hit": [], "accept": [], "valid": []}
    for s in tqdm(seqs, desc="calibrate"):
        batch = make_batch([s], block_size=drafter.config.block_size, anchors_per_seq=anchors_per_seq, generator=gen)
        out = forward_batch(drafter, batch, device, draft_vocab=draft_vocab is not None)
        n, k = out.conf_logits.shape
        rows = batch.features[0, batch.target_rows[0]].view(n, k, -1)  # exact target distributions, full vocab
        target_probs = torch.softmax(target.logits_from_final_hidden(rows[..., -target.args.hidden_size :].to(device)), -1)
        logits = out.logits
        if draft_vocab is not None:  # [N, K, V'] -> [N, K, V], -inf outside V'
            logits = logits.new_full((n, k, target_probs.shape[-1]), float("-inf")).index_copy_(-1, draft_vocab, logits)
        probs = torch.softmax(logits, dim=-1)
        labels = batch.labels.view(n, k).to(device)
        parts["conf_logits"].append(out.conf_logits.float().cpu())
        parts["hit"].append((logits.argmax(-1) == labels).float().cpu())
        parts["accept"].append((1.0 - 0.5 * (probs - target_probs).abs().sum(-1)).clamp(0.0, 1.0).float().cpu())
        parts["valid"].append(batch.valid.view(n, k))
    return {k: torch.cat(v) for k, v in parts.items()}


def fit(outcomes: dict[str, torch.Tensor]) -> tuple[Calibration, dict]:
    """Temperatures per mode and the held-out survival ECE / AUC before and after."""
    z, valid = outcomes["conf_logits"], outcomes["valid"].bool()
    # a block whose label runs past the sequence end has no outcome from there on
    valid = torch.cumprod(valid.float(), dim=1).bool()
    temps, report = {}, {}
    for mode, key in (("greedy", "hit"), ("sampled", "accept")):
        survived = prefix_survival(outcomes[key])
        temps[mode] = fit_sequential_temperatures(z, survived, valid)
        before = prefix_survival(torch.sigmoid(z))
        after = prefix_survival(Calibration({mode: temps[mode]}).confidences(z, mode))
        hard = survived > 0.5 if mode == "greedy" else torch.bernoulli(survived, generator=torch.Generator().manual_seed(0)).bool()
        report[mode] = {
            "ece_before": ece(before[valid], survived[valid]), "ece_after": ece(after[valid], survived[valid]),
            "auc_before": auc(before[valid], hard[valid]), "auc_after": auc(after[valid], hard[valid]),
            "tau_teacher_forced": float(1 + (survived * valid).sum() / valid[:, 0].sum()),
            "temperatures": [round(t, 4) for t in temps[mode]],
        }
    return Calibration(temperatures=temps), report


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (updated in place)")
    ap.add_argument("--data", type=Path, nargs="+", required=True,
                    help="the datagen folder(s) the checkpoint was trained on, in the same order")
    ap.add_argument("--anchors", type=positive_int, default=64, help="anchors per held-out sequence")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        doc = read_checkpoint_config(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--checkpoint: {e}")
    try:
        shard_paths(args.data)
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--data: {e}")
    trained = (doc.get("metadata") or {}).get("train", {}).get("data")
    if trained and [Path(f).resolve() for f in trained] != [Path(f).resolve() for f in args.data]:
        problem = (f"--data {' '.join(map(str, args.data))} is not what {args.checkpoint} was trained on "
                   f"({' '.join(trained)}): its held-out split would hold other sequences, some of them trained on")
        if all(Path(f).is_dir() for f in trained):
            ap.error(problem)
        print(f"warning: {problem} (or the folders moved: they are not there)", file=sys.stderr)
    device = resolve_device("auto")
    target = load_target(doc["config"]["target"], device=str(device)).model
    drafter, _, meta = load_checkpoint(args.checkpoint, target.embed_tokens.weight, dtype=torch.float32)
    _, heldout = split_heldout(load_shards(args.data), meta["train"]["heldout"])
    outcomes = collect_outcomes(drafter, target, heldout, anchors_per_seq=args.anchors, seed=args.seed, device=device)
    calibration, report = fit(outcomes)
    doc["calibration"] = calibration.to_json()
    doc["metadata"]["calibration"] = {"heldout_seqs": len(heldout), "blocks": int(outcomes["valid"].shape[0]),
                                      **report}
    (args.checkpoint / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["metadata"]["calibration"]))


if __name__ == "__main__":
    main()
