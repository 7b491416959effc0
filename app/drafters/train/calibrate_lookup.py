"""Fit the prompt-lookup acceptance table of a checkpoint (``app/drafters/lookup.py``) on the target's answers.

Owns: reading the token ids of datagen folders (greedy answers for the ``greedy`` table, sampled answers for the
``sampled`` one), ``fit_lookup_rates`` over them, and writing the table into the checkpoint's config.json
(``lookup_rates``), with the data and the number of lookup drafts per match length in its metadata. A
checkpoint with the table drafts with lookup when the serving config or the evaluator asks for it.

Usage:
    python -m app.drafters.train.calibrate_lookup --checkpoint runs/dspark-ckpt --greedy-data runs/dspark-data
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from app.argtypes import positive_int
from app.drafters.checkpoint import CONFIG, read_checkpoint_config
from app.drafters.lookup import LOOKUP_RATES, LookupRates, fit_lookup_rates
from app.drafters.train.data import data_meta, token_sequences


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (config.json updated)")
    ap.add_argument("--greedy-data", type=Path, nargs="+", required=True, help="datagen folders of greedy answers")
    ap.add_argument("--sampled-data", type=Path, nargs="*", default=[],
                    help="datagen folders of sampled answers (none: sampled requests use the greedy table)")
    ap.add_argument("--max-ngram", type=positive_int, default=8, help="longest suffix matched (N)")
    ap.add_argument("--positions", type=positive_int, default=40, help="random response positions per sequence")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        doc = read_checkpoint_config(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--checkpoint: {e}")
    gamma = int(doc["config"]["block_size"])
    rates, report = {}, {}
    for mode, folders in (("greedy", args.greedy_data), ("sampled", args.sampled_data)):
        if not folders:
            continue
        try:
            seqs = token_sequences(folders)
        except (FileNotFoundError, ValueError) as e:
            ap.error(f"--{mode}-data: {e}")
        for folder in folders:  # greedy and sampled answers repeat differently: each table from its own kind
            temperature = data_meta(folder).get("temperature")
            if temperature is not None and (temperature > 0) != (mode == "sampled"):
                ap.error(f"--{mode}-data {folder} holds {'sampled' if temperature > 0 else 'greedy'} answers "
                         f"(its meta.json: temperature {temperature})")
        rates[mode] = fit_lookup_rates(tqdm(seqs, desc=f"lookup {mode}", unit="seq"), max_ngram=args.max_ngram,
                                       gamma=gamma, positions_per_seq=args.positions, seed=args.seed)
        report[mode] = {"data": [str(f) for f in folders], "sequences": len(seqs)}
    doc[LOOKUP_RATES] = LookupRates(rates).to_json()
    doc.setdefault("metadata", {})["lookup"] = {"max_ngram": args.max_ngram, "positions": args.positions, **report}
    (args.checkpoint / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    for mode, table in rates.items():
        print(f"{mode}: n=1..{args.max_ngram} x k=1..{gamma}")
        for n, row in enumerate(table, 1):
            print(f"  n={n}: " + " ".join(f"{r:.2f}" for r in row))
    return doc[LOOKUP_RATES]


if __name__ == "__main__":
    main()
