"""Prompt sets of this project and their train / evaluation split.

Owns: reading the shared prompt files (``{"turns": [...]}`` one a line) and the split rule of
``shared/datasets/README.md``: gsm8k lines 1-700, math500, mbpp and the three prompt files shipped with the
drafter (``chat``: 200 template chat prompts; ``chat-mt``: 320 hand-written chat prompts, 40 in each of MT-Bench's
8 categories; ``code-fn``: 240 hand-written Python function problems in HumanEval's prompt frame, with function
names disjoint from HumanEval's) are for training; mt-bench (first turns), humaneval and gsm8k lines 701+ are
for evaluation. No prompt used to train a drafter is used to report an acceptance length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATASETS_DIR = Path(__file__).resolve().parents[2] / "shared" / "datasets"
_TRAIN_DIR = Path(__file__).resolve().parent / "drafters" / "train"
CHAT_PROMPTS = _TRAIN_DIR / "chat_prompts.jsonl"
# Lines 1-40 writing, 41-80 roleplay, 81-120 reasoning, 121-160 math, 161-200 coding, 201-240 extraction,
# 241-280 stem, 281-320 humanities.
CHAT_MT_PROMPTS = _TRAIN_DIR / "chat_prompts_mt.jsonl"
CODE_FN_PROMPTS = _TRAIN_DIR / "code_prompts.jsonl"
# HumanEval's prompts (and code-fn's) all open with this frame; it is not part of any one problem.
CODE_FRAME = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
OPENING_CHARS = 60  # an evaluation prompt's opening: its first 60 characters, ``normalized``


@dataclass(frozen=True)
class PromptSet:
    """A named slice of a prompt file: 1-based inclusive ``first``..``last`` lines (``last`` None: to the end)."""

    name: str
    file: str
    first: int = 1
    last: int | None = None


TRAIN_SETS = {
    "gsm8k-train": PromptSet("gsm8k-train", "gsm8k.jsonl", 1, 700),
    "math500": PromptSet("math500", "math500.jsonl"),
    "mbpp": PromptSet("mbpp", "mbpp.jsonl"),
    "chat": PromptSet("chat", str(CHAT_PROMPTS)),
    "chat-mt": PromptSet("chat-mt", str(CHAT_MT_PROMPTS)),
    "code-fn": PromptSet("code-fn", str(CODE_FN_PROMPTS)),
}
EVAL_SETS = {
    "mt-bench": PromptSet("mt-bench", "mt-bench.jsonl"),
    "humaneval": PromptSet("humaneval", "humaneval.jsonl"),
    "gsm8k-eval": PromptSet("gsm8k-eval", "gsm8k.jsonl", 701),
}


def load_conversations(prompt_set: PromptSet, datasets_dir: Path = DEFAULT_DATASETS_DIR) -> list[list[str]]:
    """Every user turn of ``prompt_set``'s lines, one list a line (mt-bench has two turns a line, the others one).

    Raises:
        FileNotFoundError: the prompt file is missing.
    """
    path = Path(prompt_set.file)
    if not path.is_absolute():
        path = datasets_dir / path
    lines = path.read_text().splitlines()
    last = len(lines) if prompt_set.last is None else prompt_set.last
    return [list(json.loads(line)["turns"]) for line in lines[prompt_set.first - 1 : last] if line.strip()]


def load_prompts(prompt_set: PromptSet, datasets_dir: Path = DEFAULT_DATASETS_DIR) -> list[str]:
    """First user turns of ``prompt_set``'s lines.

    Raises:
        FileNotFoundError: the prompt file is missing.
    """
    return [turns[0] for turns in load_conversations(prompt_set, datasets_dir)]


def normalized(text: str) -> str:
    """``text`` as prompts are compared for overlap: ``CODE_FRAME`` removed, whitespace collapsed, lowercased."""
    return " ".join(text.removeprefix(CODE_FRAME).split()).lower()


def eval_openings(datasets_dir: Path = DEFAULT_DATASETS_DIR) -> set[str]:
    """The opening (first ``OPENING_CHARS`` characters, ``normalized``) of every evaluation prompt: a training prompt
    whose normalized text contains one overlaps the evaluation sets.

    Raises:
        FileNotFoundError: an evaluation prompt file is missing.
    """
    return {normalized(p)[:OPENING_CHARS] for s in EVAL_SETS.values() for p in load_prompts(s, datasets_dir)}


def overlaps(prompt: str, openings: set[str]) -> bool:
    """Whether ``prompt`` contains any of ``openings`` (``eval_openings``)."""
    text = normalized(prompt)
    return any(head in text for head in openings)
