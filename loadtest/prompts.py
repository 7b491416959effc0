"""Prompts for the load test: the project's evaluation prompt sets or any JSONL of the same shape.

A prompt spec is a comma-separated list of evaluation set names (``gsm8k-eval``, ``mt-bench``, ``humaneval``;
see ``app/datasets.py``) or paths to JSONL files with one ``{"turns": ["first user turn", ...]}`` a line.
First turns are sent; with ``--multi-turn`` every turn of a line, in order, each after the answers to the earlier
ones (one conversation). Training sets are refused by name: the load test reports acceptance lengths, and
no prompt a drafter was trained on may be used for that (``shared/datasets/README.md``).
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from app.datasets import DEFAULT_DATASETS_DIR, EVAL_SETS, TRAIN_SETS, PromptSet, load_conversations

DEFAULT_PROMPTS = "gsm8k-eval"
T = TypeVar("T")
SHARED_ENV = "DSPARK_SHARED_DIR"  # the project's shared folder (its datasets/ holds the prompt sets)


def datasets_dir() -> Path:
    shared = os.environ.get(SHARED_ENV)
    return Path(shared) / "datasets" if shared else DEFAULT_DATASETS_DIR


def load_prompt_spec(spec: str) -> list[str]:
    """All first turns named by ``spec`` in order (``load_conversation_spec``'s first turns).

    Raises:
        ValueError, FileNotFoundError: as ``load_conversation_spec``.
    """
    return [turns[0] for turns in load_conversation_spec(spec)]


def load_conversation_spec(spec: str) -> list[list[str]]:
    """Every line named by ``spec`` in order, as its list of user turns.

    Raises:
        ValueError: a training set name, an unknown name, or a spec naming no prompt.
        FileNotFoundError: a named file is missing.
    """
    conversations: list[list[str]] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in TRAIN_SETS:
            raise ValueError(f"prompt set {item!r} is a drafter training set; use {sorted(EVAL_SETS)} or a file")
        if item in EVAL_SETS:
            conversations += load_conversations(EVAL_SETS[item], datasets_dir())
        elif item.endswith(".jsonl"):
            path = Path(item).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"prompts: no such file {item}")
            conversations += load_conversations(PromptSet(path.stem, str(path.resolve())))
        else:
            raise ValueError(f"prompts: {item!r} is neither an evaluation set {sorted(EVAL_SETS)} nor a .jsonl path")
    if not conversations:
        raise ValueError(f"prompts: {spec!r} names no prompt")
    return conversations


def max_tokens_plan(max_tokens: int, range_ratio: float, seed: int) -> Iterator[int]:
    """Each request's ``max_tokens``, in request order: ``max_tokens`` every time when ``range_ratio`` is 0, else an
    integer drawn uniformly from ``[max_tokens (1 - range_ratio), max_tokens (1 + range_ratio)]`` (rounded; at least
    1) by a generator seeded with ``seed``, so every run and every policy sends the same sequence (vLLM's
    ``benchmark_serving --random-range-ratio`` draws output lengths the same way).

    Answers of one length that start together also end together: closed-loop users then arrive in cohorts, their
    prompts prefilled in one forward between decoding steps. Varied lengths spread the arrivals as real traffic does.

    Raises:
        ValueError: max_tokens < 1, or range_ratio outside [0, 1) (at the call, before the first draw).
    """
    if max_tokens < 1 or not 0 <= range_ratio < 1:
        raise ValueError(f"need max_tokens >= 1 and 0 <= range_ratio < 1, got {max_tokens}, {range_ratio}")
    low, high = max(1, round(max_tokens * (1 - range_ratio))), round(max_tokens * (1 + range_ratio))
    rng = random.Random(seed)
    return (rng.randint(low, high) for _ in itertools.count())


def chat_messages(prompt: str, system_prompt: str = "", history: Sequence[tuple[str, str]] = ()
                  ) -> list[dict[str, str]]:
    """The chat ``messages`` of one request: ``prompt`` as the user turn, after the earlier turns of its conversation
    (``history``: (user turn, answer) pairs, oldest first), after ``system_prompt`` as a system message when it is
    not empty (the same for every request: a shared prefix, what prefix caching reuses)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for user, answer in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": prompt}]


def level_offsets(count: int, levels: int) -> list[int]:
    """Where each of ``levels`` load levels starts in a sequence of ``count`` prompt lines: level i at
    ``i * (count // levels)`` (a step of at least 1, wrapping past the end), so each level has its own slice of the
    sequence, the same for every policy, and a server does not meet a level's prompts before that level (unless a level
    sends more lines than its slice holds, or there are fewer lines than levels)."""
    step = max(1, count // levels)
    return [i * step % count for i in range(levels)]


def rotated(items: list[T], offset: int) -> list[T]:
    """``items`` starting at ``offset`` (modulo their count), the ones before it at the end."""
    offset %= len(items)
    return items[offset:] + items[:offset]


def shuffled(prompts: list[T], seed: int) -> list[T]:
    """A seeded permutation: every run (and every policy) draws prompts (or conversations) in the same order."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return order
