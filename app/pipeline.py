"""One command from a target to a calibrated, evaluated drafter checkpoint: datagen -> train -> draft vocabulary ->
calibrate -> lookup table -> eval.

Owns: running the stages in one process under one wall-clock budget per stage and the folder layout below; each
stage is the module of its own name with the same flags (``datagen.py``, ``trainer.py``, ``calibrate.py``,
``draft_vocab.py``, ``calibrate_lookup.py``, ``app/eval/evaluate.py``), so a stage can be re-run alone on the same
folders. Device picked automatically.

Layout under ``--out``:
    data-greedy/     greedy answers to every training prompt (``datagen.py``)
    data-sampled/    ``--samples`` sampled answers per prompt, only while the datagen budget lasts
    checkpoint/      the trained, calibrated drafter (``config.json`` + ``model.safetensors``, with the
                     ``--draft-vocab`` most frequent answer tokens of data-greedy/ as its draft vocabulary and
                     the prompt-lookup acceptance table of data-greedy/ and data-sampled/)
    eval/            ``evaluate.py``'s JSON and Markdown report (with ``--eval-limit``)
    eval-lookup/     the same with prompt lookup beside the drafter (``evaluate.py --lookup``)

Usage (the committed SmolLM2-135M checkpoint's GPU recipe is in ``docs/drafter.md``):
    python -m app.pipeline --out runs/drafter --datagen-minutes 3 --train-minutes 4 --eval-limit 40
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Sequence

from app.drafters.train import calibrate, calibrate_lookup, datagen, draft_vocab, trainer
from app.eval import evaluate
from app.datasets import DEFAULT_DATASETS_DIR


def _stage(name: str, main: Callable[[list[str]], None], argv: list[str], timings: dict[str, float]) -> None:
    print(f"== {name}: {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    main(argv)
    timings[name] = round(time.perf_counter() - start, 1)
    print(f"== {name} done in {timings[name]:.0f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for data, checkpoint and report (layout above)")
    ap.add_argument("--model", default="smollm2-135m", help="target model reference")
    ap.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    ap.add_argument("--per-set", nargs="+", default=["gsm8k-train=700", "math500=500", "mbpp=257", "chat=200"],
                    help="NAME=COUNT training prompts per set (datagen.py)")
    ap.add_argument("--max-tokens", type=int, default=384, help="answer length limit while generating data")
    ap.add_argument("--max-batch", type=int, default=64, help="concurrent requests while generating / evaluating")
    ap.add_argument("--samples", type=int, default=2, help="sampled answers per prompt after the greedy pass (0: none)")
    ap.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled answers")
    ap.add_argument("--datagen-minutes", type=float, default=30.0, help="budget of both datagen passes together")
    ap.add_argument("--kind", default="dspark", help="drafter kind (trainer.py)")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue training from this checkpoint (trainer.py --init; --kind and --config must match "
                         "it)")
    ap.add_argument("--config", default="{}", help="JSON overrides of the drafter config (trainer.py)")
    ap.add_argument("--steps", type=int, default=20000, help="step cap; the time budget usually ends training")
    ap.add_argument("--train-minutes", type=float, default=30.0, help="training budget (the schedule fits into it)")
    ap.add_argument("--batch-seqs", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="draft vocabulary size V' (draft_vocab.py; DSpark kind only); 0 keeps the full vocabulary")
    ap.add_argument("--eval-limit", type=int, default=None, help="evaluate on the first N prompts of each set")
    ap.add_argument("--eval-max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    common = ["--model", args.model, "--datasets-dir", str(args.datasets_dir), "--per-set", *args.per_set,
              "--max-tokens", str(args.max_tokens), "--max-batch", str(args.max_batch), "--seed", str(args.seed),
              "--shard-size", str(2 * args.max_batch)]  # whole shards keep the batch full between shard tails
    data = [args.out / "data-greedy"]
    _stage("datagen-greedy", datagen.main,
           ["--out", str(data[0]), "--max-minutes", str(args.datagen_minutes), *common], timings)
    left = args.datagen_minutes - (time.perf_counter() - start) / 60
    if args.samples > 0 and left > 0.25:
        data.append(args.out / "data-sampled")
        _stage("datagen-sampled", datagen.main,
               ["--out", str(data[1]), "--max-minutes", f"{left:.2f}", "--samples", str(args.samples),
                "--temperature", str(args.temperature), *common], timings)
    ckpt = args.out / "checkpoint"
    data_args = [str(d) for d in data]
    _stage("train", trainer.main,
           ["--data", *data_args, "--out", str(ckpt), "--model", args.model, "--kind", args.kind, "--config",
            args.config, "--steps", str(args.steps), "--max-minutes", str(args.train_minutes), "--batch-seqs",
            str(args.batch_seqs), "--anchors", str(args.anchors), "--lr", str(args.lr), "--seed", str(args.seed),
            *(["--init", str(args.init)] if args.init is not None else [])],
           timings)
    if args.draft_vocab and args.kind == "dspark":  # before calibration, which measures the drafter over its V'
        _stage("draft-vocab", draft_vocab.main,
               ["--data", data_args[0], "--checkpoint", str(ckpt), "--size", str(args.draft_vocab)], timings)
    _stage("calibrate", calibrate.main, ["--checkpoint", str(ckpt), "--data", *data_args], timings)
    _stage("lookup-table", calibrate_lookup.main,
           ["--checkpoint", str(ckpt), "--greedy-data", data_args[0], "--sampled-data", *data_args[1:]], timings)
    if args.eval_limit:
        for name, extra in (("evaluate", []), ("evaluate-lookup", ["--lookup"])):
            _stage(name, evaluate.main,
                   ["--checkpoint", str(ckpt), "--out", str(args.out / name.replace("evaluate", "eval")), "--limit",
                    str(args.eval_limit), "--max-tokens", str(args.eval_max_tokens), "--max-batch",
                    str(args.max_batch), "--temperatures", "0", "--datasets-dir", str(args.datasets_dir), *extra],
                   timings)
    summary = {"out": str(args.out), "seconds": timings, "total_s": round(time.perf_counter() - start, 1)}
    (args.out / "pipeline.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
