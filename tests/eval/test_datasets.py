"""The hand-written training prompt files: counts, shape, and no overlap with the evaluation prompts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app.datasets import (CHAT_MT_PROMPTS, CODE_FN_PROMPTS, CODE_FRAME, EVAL_SETS, TRAIN_SETS, eval_openings,
                          load_prompts, overlaps)
DEF_NAME = re.compile(r"^def (\w+)\(", re.MULTILINE)

NEW_FILES = {"chat-mt": (CHAT_MT_PROMPTS, 320), "code-fn": (CODE_FN_PROMPTS, 240)}

@pytest.fixture
def eval_dir(shared_datasets: Path) -> Path:
    """The evaluation prompt files' folder; skips the test where they are missing."""
    if not all((shared_datasets / s.file).exists() for s in EVAL_SETS.values()):
        pytest.skip(f"evaluation prompts not in {shared_datasets}")
    return shared_datasets


@pytest.mark.parametrize("name", sorted(NEW_FILES))
def test_new_training_file_loads_with_one_non_empty_turn_a_line(name):
    path, count = NEW_FILES[name]
    lines = path.read_text().splitlines()
    assert len(lines) == count
    turns = [json.loads(line)["turns"] for line in lines]
    assert all(len(t) == 1 and isinstance(t[0], str) and t[0].strip() for t in turns)
    assert len({t[0] for t in turns}) == count  # no repeated prompt
    assert TRAIN_SETS[name].file == str(path)
    assert load_prompts(TRAIN_SETS[name]) == [t[0] for t in turns]


@pytest.mark.parametrize("name", sorted(NEW_FILES))
def test_no_training_prompt_contains_an_evaluation_prompts_opening(name, eval_dir):
    heads = eval_openings(eval_dir)
    assert len(heads) > 500  # mt-bench 80 + humaneval 164 + gsm8k 619, less any shared openings
    for prompt in load_prompts(TRAIN_SETS[name]):
        assert not overlaps(prompt, heads), f"{name} prompt {prompt[:80]!r} contains an evaluation opening"


def test_code_fn_problems_use_humanevals_frame():
    for prompt in load_prompts(TRAIN_SETS["code-fn"]):
        assert prompt.startswith(CODE_FRAME) and prompt.endswith('    """\n\n```')
        assert len(DEF_NAME.findall(prompt)) == 1 and ">>> " in prompt


def test_code_fn_function_names_are_unique_and_disjoint_from_humaneval(eval_dir):
    ours = [DEF_NAME.findall(p)[0] for p in load_prompts(TRAIN_SETS["code-fn"])]
    assert len(set(ours)) == len(ours)
    humaneval = {n for p in load_prompts(EVAL_SETS["humaneval"], eval_dir) for n in DEF_NAME.findall(p)}
    assert len(humaneval) > 150
    assert not set(ours) & humaneval
