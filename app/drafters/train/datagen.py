"""Training data for the drafter: the target answers training prompts itself (self-distillation).

Owns: choosing training prompts (``app/datasets.py`` training sets only), plain decoding through the engine
(greedy, or sampled with ``--temperature``), and writing each sequence's token ids and per-token target features
to safetensors shards. The features come for free from decoding: the prefill returns the prompt's rows, each
verify step the rows of the tokens that entered the cache. Row j of a sequence is the target's hidden state at
token j (it predicted token j+1); the final token never enters the cache, so its row is zero and never used.

Shard layout (``shard-XXXX.safetensors``; S sequences, L_s tokens each, sum over the shard = Ltot):
    tokens      [Ltot] int32   prompt + response ids, sequences concatenated
    features    [Ltot, F]      target features (the engine's dtype), row j of a sequence as above
    offsets     [S + 1] int64  sequence boundaries into ``tokens``
    prompt_lens [S] int64      prompt length P of each sequence (the first anchor is token P)

Greedy answers (the default) match what greedy serving drafts against; ``--samples N --temperature T`` adds N
sampled answers per prompt (seeded per answer), more and more varied sequences from the same prompts. The target
features are those of whatever sequence was decoded, so sampled sequences are as exact as greedy ones.

Usage:
    python -m app.drafters.train.datagen --out runs/dspark-data --per-set gsm8k-train=160 math500=80 ...
    python -m app.drafters.train.datagen --out runs/dspark-data-t08 --samples 2 --temperature 0.8 --max-minutes 5
    python -m app.drafters.train.datagen --out runs/dspark-data-t08 --samples 2 --temperature 0.8 --resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Sequence, get_args

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from app.argtypes import non_negative_float, positive_int
from app.loop import generate
from app.engine.config import EngineConfig, VerifyStep
from app.engine.engine import TargetEngine
from app.engine.loader import check_target, model_reference
from app.engine.types import DraftBlock, SamplingParams, StepOutput
from app.datasets import DEFAULT_DATASETS_DIR, TRAIN_SETS, PromptSet, load_prompts


class FeatureRecorder:
    """A proposer that drafts nothing and records every request's target features (plain decoding)."""

    def __init__(self) -> None:
        self.features: dict[str, list[torch.Tensor]] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        self.features[request_id] = [first.features.cpu()]

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        return [DraftBlock(rid, torch.zeros(0, dtype=torch.long)) for rid in request_ids]

    def update(self, outputs: Sequence[StepOutput]) -> None:
        for out in outputs:
            self.features[out.request_id].append(out.features.cpu())

    def finish(self, request_id: str) -> None:
        pass


def pick_prompts(per_set: dict[str, int], *, seed: int, datasets_dir: Path) -> list[tuple[str, str]]:
    """``(set name, prompt)`` pairs: a seeded random sample of ``per_set[name]`` prompts from each training set; a
    name ending in ``.jsonl`` is a prompt file of its own (``{"turns": [...]}`` one a line, e.g. ``self_prompts.py``'s).

    Raises:
        ValueError: an unknown set name or a count above the set's size.
        FileNotFoundError: a prompt file is missing.
    """
    rng = random.Random(seed)
    picked = []
    for name, count in per_set.items():
        if name.endswith(".jsonl"):
            prompt_set = PromptSet(name, str(Path(name).resolve()))
        elif name in TRAIN_SETS:
            prompt_set = TRAIN_SETS[name]
        else:
            raise ValueError(f"unknown training set {name!r}; choose from {sorted(TRAIN_SETS)} or a .jsonl file")
        prompts = load_prompts(prompt_set, datasets_dir)
        if count > len(prompts):
            raise ValueError(f"{name} has {len(prompts)} prompts, {count} requested")
        picked += [(name, p) for p in rng.sample(prompts, count)]
    rng.shuffle(picked)
    return picked


def generate_shard(
    engine: TargetEngine, prompts: list[list[int]], params: list[SamplingParams], *, max_batch: int, id_prefix: str
) -> dict[str, torch.Tensor]:
    """Answers to ``prompts`` (one ``SamplingParams`` each) with their features, as one shard's tensors (module
    docstring)."""
    recorder = FeatureRecorder()
    results, _ = generate(engine, prompts, params, proposer=recorder, max_batch=max_batch, id_prefix=id_prefix)
    tokens, feats, lens = [], [], []
    for prompt, res in zip(prompts, results):
        seq = list(prompt) + res.token_ids
        rows = torch.cat(recorder.features[res.request_id])
        assert rows.shape[0] == len(seq) - 1, (rows.shape, len(seq))
        tokens.append(torch.tensor(seq, dtype=torch.int32))
        feats.append(torch.cat([rows, rows.new_zeros(1, rows.shape[1])]))
        lens.append(len(seq))
    offsets = torch.zeros(len(lens) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    return {
        "tokens": torch.cat(tokens),
        "features": torch.cat(feats).contiguous(),
        "offsets": offsets,
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.long),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder for shards and meta.json")
    ap.add_argument("--per-set", nargs="+", default=["gsm8k-train=160", "math500=80", "mbpp=100", "chat=200"],
                    help="NAME=COUNT prompts drawn from each training set (NAME: a set, or a .jsonl prompt file)")
    ap.add_argument("--max-tokens", type=positive_int, default=256, help="response length limit")
    ap.add_argument("--shard-size", type=int, default=64, help="answers per shard")
    ap.add_argument("--max-shards", type=int, default=None, help="stop after this many shards (a time budget)")
    ap.add_argument("--first-shard", type=int, default=0,
                    help="skip the shards before this one: continues a run that stopped at its budget in another "
                         "folder (--resume continues in the same one), on the prompts it did not reach; needs that "
                         "run's --per-set, --seed, --max-tokens, --samples, --shard-size and --model, and N = its "
                         "first_shard + ceil(sequences / shard_size) from its meta.json (a shard holds --shard-size "
                         "answers)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="start no new shard after this wall-clock budget (shards already written are kept)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out (same flags but the budgets): shards already there are kept "
                         "and not generated again")
    ap.add_argument("--samples", type=int, default=1, help="answers per prompt (> 1 needs --temperature > 0)")
    ap.add_argument("--temperature", type=non_negative_float, default=0.0,
                    help="0: greedy answers; > 0: sampled answers")
    ap.add_argument("--max-batch", type=positive_int, default=32, help="concurrent requests while decoding")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="target model reference (EngineConfig.model)")
    ap.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    ap.add_argument("--verify-step", choices=get_args(VerifyStep), default="ragged",
                    help="the engine's decode steps (EngineConfig.verify_step; cuda_graphs: CUDA only); the answers "
                         "do not depend on it")
    args = ap.parse_args(argv)
    if args.samples < 1 or (args.samples > 1 and args.temperature <= 0):
        ap.error("--samples must be >= 1, and > 1 only with --temperature > 0 (greedy answers are all the same)")
    if args.first_shard < 0:
        ap.error("--first-shard must be >= 0")
    for name in ("shard_size", "max_shards", "max_minutes"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    per_set = {k: int(v) for k, v in (item.split("=", 1) for item in args.per_set)}
    args.model = model_reference(args.model)
    plan = {"model": args.model, "per_set": per_set, "max_tokens": args.max_tokens, "shard_size": args.shard_size,
            "first_shard": args.first_shard, "samples": args.samples, "temperature": args.temperature,
            "seed": args.seed, "datasets_dir": str(args.datasets_dir)}
    meta_path = args.out / "meta.json"  # the plan at the start, with the counts at the end
    earlier_s = 0.0  # generation time of the runs this one resumes
    if args.resume:
        saved = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if saved.get("model"):  # recorded as written by an older run
            saved["model"] = model_reference(saved["model"])
        if {k: saved.get(k) for k in plan} != plan:
            diff = {k: (saved.get(k), plan[k]) for k in plan if saved.get(k) != plan[k]}
            ap.error(f"--resume: {args.out} holds no run with these flags (saved, given): "
                     f"{diff if saved else 'no meta.json'}")
        earlier_s = float(saved.get("seconds") or 0.0)
    elif old_shards := sorted(args.out.glob("shard-*.safetensors")):  # training would read them beside the new ones
        ap.error(f"--out {args.out} holds {len(old_shards)} shards of an earlier run: --resume continues that run "
                 "(same flags); to start anew, remove its shard-* and topk*-shard-* files or choose another folder")
    try:
        picked = pick_prompts(per_set, seed=args.seed, datasets_dir=args.datasets_dir)
    except (ValueError, FileNotFoundError) as e:
        ap.error(f"--per-set: {e}")
    try:
        limit = check_target(args.model)[2].max_position_embeddings
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--model: {e}")
    engine = TargetEngine(EngineConfig(model=args.model, max_num_seqs=args.max_batch, max_model_len=min(1536, limit),
                                       verify_step=args.verify_step))
    args.out.mkdir(parents=True, exist_ok=True)
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for _, p in picked]
    ids = [x for x in ids if len(x) + args.max_tokens <= engine.config.max_model_len]
    ids = [x for x in ids for _ in range(args.samples)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=None if args.temperature == 0 else args.seed * 1_000_003 + j)
              for j in range(len(ids))]
    if args.max_shards is not None:
        ids = ids[: (args.first_shard + args.max_shards) * args.shard_size]
    first = args.first_shard * args.shard_size
    if first >= len(ids):
        ap.error(f"--first-shard {args.first_shard}: these flags give only "
                 f"{math.ceil(len(ids) / args.shard_size)} shards of {args.shard_size} answers")
    def running(seconds: float) -> None:  # sequences None: still running; seconds so far, resumed runs' included
        meta_path.write_text(json.dumps({**plan, "sequences": None, "seconds": round(seconds, 3)}, indent=2))

    running(earlier_s)
    bar = tqdm(total=len(ids) - first, desc="datagen", unit="answer")
    new_tokens, run_tokens, done, start = 0, 0, 0, time.perf_counter()
    for i in range(first, len(ids), args.shard_size):
        path = args.out / f"shard-{i // args.shard_size:04d}.safetensors"
        if args.resume and path.is_file():  # written before the run stopped
            with safe_open(str(path), framework="pt") as f:
                offsets, prompt_lens = f.get_tensor("offsets"), f.get_tensor("prompt_lens")
            done += len(prompt_lens)
            new_tokens += int(offsets[-1]) - int(prompt_lens.sum())
            bar.update(len(prompt_lens))
            continue
        if args.max_minutes is not None and time.perf_counter() - start > 60 * args.max_minutes:
            break
        chunk = ids[i : i + args.shard_size]
        shard = generate_shard(engine, chunk, params[i : i + args.shard_size], max_batch=args.max_batch,
                               id_prefix=f"s{i}")
        done += len(chunk)
        tmp = path.with_name(f"{path.name}.tmp")  # a run stopped while writing leaves no half shard for --resume
        save_file(shard, str(tmp))
        os.replace(tmp, path)
        shard_tokens = int(shard["offsets"][-1]) - int(shard["prompt_lens"].sum())
        new_tokens, run_tokens = new_tokens + shard_tokens, run_tokens + shard_tokens
        running(earlier_s + time.perf_counter() - start)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{run_tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    meta = {**plan, "sequences": done, "new_tokens": new_tokens, "feature_layers": list(engine.model.feature_layers),
            "verify_step": args.verify_step, "seconds": round(earlier_s + time.perf_counter() - start, 3)}
    meta_path.write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
