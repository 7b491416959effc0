"""Chat prompts written by the target itself, for drafter training data with more variety than the shipped sets.

Owns: asking the target for user questions (it continues the opening of a list of requests of an MT-Bench category
about a seed topic, sampled, up to the end of the first item), cleaning its items into single prompts (``clean_prompt``), dropping duplicates and any prompt that contains an evaluation
prompt's opening (``app.datasets.overlaps``), and writing them one a line as ``{"turns": [prompt]}``, the
format of the shared prompt sets. ``datagen --per-set PATH=COUNT`` then answers them like any training set.

Usage:
    python -m app.drafters.train.self_prompts --out runs/self-prompts.jsonl --per-pair 4
    python -m app.drafters.train.datagen --out runs/data-self --per-set runs/self-prompts.jsonl=1500
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from app.datasets import DEFAULT_DATASETS_DIR, eval_openings, normalized, overlaps
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.types import SamplingParams
from app.loop import generate

# MT-Bench's eight categories, each as the kind of request the target is asked to list.
CATEGORIES = {
    "writing": "writing requests",
    "roleplay": "role-play requests",
    "reasoning": "reasoning puzzles",
    "math": "math word problems",
    "coding": "Python coding tasks",
    "extraction": "requests to extract facts from a given text",
    "stem": "science questions",
    "humanities": "history and philosophy questions",
}
SEED_TOPICS = (
    "cooking", "travel", "gardening", "personal finance", "space exploration", "climate", "sports", "music",
    "movies", "health", "sleep", "pets", "cars", "city planning", "education", "job interviews", "startups",
    "chess", "photography", "oceans", "volcanoes", "ancient Rome", "the printing press", "electricity",
    "vaccines", "social media", "robots", "board games", "weddings", "birthdays", "hiking", "coffee", "bridges",
    "languages", "friendship", "time management", "painting", "trains", "recycling", "the moon",
)
def list_opening(topic: str, category: str) -> str:
    """The text the target continues (no chat template: a small instruct model continues a list far more reliably
    than it follows an instruction to write a prompt): a list's title and its first item number."""
    return f"A list of {CATEGORIES[category]} about {topic} that users sent to an AI assistant:\n1."


def clean_prompt(text: str, *, min_chars: int, max_chars: int = 600) -> str | None:
    """The target's list item as one prompt: its first line, without surrounding quotes or bold marks, a leading
    "Question:" / "Request:" / "User input:" label or list numbering; None when it holds a link or is shorter than
    ``min_chars`` or longer than ``max_chars`` characters."""
    text = text.strip().split("\n")[0]
    text = text.lstrip("0123456789.-) ").replace("**", "").strip().strip('"').strip()
    for label in ("request:", "question:", "prompt:", "user input:", "user:"):
        if text.lower().startswith(label):
            text = text[len(label):].strip().strip('"').strip()
    text = " ".join(text.split())
    return text if min_chars <= len(text) <= max_chars and "http" not in text else None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    ap.add_argument("--per-pair", type=int, default=4, help="requests per (seed topic, category) pair")
    ap.add_argument("--limit", type=int, default=None, help="ask only this many requests (a quick look)")
    ap.add_argument("--max-tokens", type=int, default=80, help="length limit of each written prompt (tokens)")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the target")
    ap.add_argument("--min-chars", type=int, default=15, help="shorter answers are dropped")
    ap.add_argument("--max-batch", type=int, default=64, help="concurrent requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="target model reference (EngineConfig.model)")
    ap.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR,
                    help="the evaluation prompts are read from here: prompts containing the opening of one are dropped")
    args = ap.parse_args(argv)
    counts = (args.per_pair, args.min_chars, args.max_batch, args.max_tokens, args.limit or 1)
    if min(counts) < 1 or args.temperature <= 0:
        ap.error("--per-pair, --limit, --max-tokens, --min-chars and --max-batch must be >= 1 and --temperature > 0")
    try:
        banned = eval_openings(args.datasets_dir)
    except FileNotFoundError as e:
        ap.error(f"--datasets-dir: {e}")
    engine = TargetEngine(EngineConfig(model=args.model, max_num_seqs=args.max_batch, max_model_len=512))
    asks = [list_opening(t, c) for t in SEED_TOPICS for c in CATEGORIES for _ in range(args.per_pair)]
    random.Random(args.seed).shuffle(asks)
    asks = asks[: args.limit]
    ids = [engine.encode(a, add_special_tokens=True) for a in asks]  # a raw prompt, as completions tokenizes one
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=0.95, stop=("\n",),
                             seed=args.seed * 1_000_003 + i) for i in range(len(ids))]
    kept: set[str] = set()  # normalized texts written
    dropped = {"length": 0, "duplicate": 0, "evaluation": 0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out, tqdm(total=len(ids), desc="self-prompts", unit="prompt") as bar:
        for lo in range(0, len(ids), args.max_batch):  # written batch by batch: a stopped run keeps what it wrote
            results, _ = generate(engine, ids[lo : lo + args.max_batch], params[lo : lo + args.max_batch],
                                  max_batch=args.max_batch, id_prefix=f"p{lo}")
            for res in results:
                prompt = clean_prompt(engine.tokenizer.decode(res.token_ids, skip_special_tokens=True),
                                      min_chars=args.min_chars)
                key = None if prompt is None else normalized(prompt)
                cause = ("length" if prompt is None else "evaluation" if overlaps(prompt, banned)
                         else "duplicate" if key in kept else None)
                if cause is None:
                    kept.add(key)
                    out.write(json.dumps({"turns": [prompt]}) + "\n")
                else:
                    dropped[cause] += 1
            out.flush()
            bar.update(len(results))
            bar.set_postfix(kept=len(kept))
    print(json.dumps({"out": str(args.out), "asked": len(ids), "kept": len(kept), "dropped": dropped}))


if __name__ == "__main__":
    main()
