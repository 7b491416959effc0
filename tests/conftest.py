"""Shared fixtures: the real default target (loaded once per session), a tiny weightless Llama checkpoint directory
(for dummy weights) and evaluation prompts; the served autoscaling test runs with the serving tests."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

SHARED_SERVE_MODULES = (  # run just before the rest of tests/serving/
    "tests/autoscale/test_autoscale_serve.py", "tests/serving/test_startup_profile.py",
)


MAX_WORKERS = 4  # each pytest-xdist worker holds its own copies of the real target (~3 GB at its peak)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, else the CPU count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one pytest-xdist worker per usable CPU (a container's share, not the host's), at most
    ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, usable_cpus()))


def pytest_configure(config) -> None:
    """In a pytest-xdist worker, torch gets the usable CPUs divided among the workers (one each on 2 cores): the
    CPU-bound engine tests then run side by side, each on its own core, instead of one at a time over all of them
    through OpenMP, which splits steps of a few dozen rows into pieces too small to keep every core busy."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, usable_cpus() // int(workers)))


def pytest_collection_modifyitems(config, items) -> None:
    """Move the tests of ``SHARED_SERVE_MODULES`` to just before the first other test of tests/serving/, so that
    every test deploying on the shared local Ray (``tests/serving/helpers.shared_serve``) runs in one stretch, before
    the modules that start a Ray of their own: Ray starts once and idles through no other tests."""
    moved = [item for item in items if item.nodeid.split("::")[0] in SHARED_SERVE_MODULES]
    rest = [item for item in items if item not in moved]
    at = next((i for i, item in enumerate(rest) if item.nodeid.startswith("tests/serving/")), len(rest))
    items[:] = rest[:at] + moved + rest[at:]


@pytest.fixture(autouse=True)
def _reproducible_randomness(request, monkeypatch) -> None:
    """Every test's body and function-scoped fixtures draw, in this process, from streams keyed by the test's id,
    whatever ran before: torch's global generator, and the seeds the engine gives unseeded requests
    (``secrets.randbits``, the OS's entropy in the product). The sampled chi-square tests (0.999 quantile) then pass
    or fail for their code, not for the draw of the day."""
    import random
    import secrets
    import sys
    import zlib

    key = zlib.crc32(request.node.nodeid.encode())
    monkeypatch.setattr(secrets, "randbits", random.Random(key).getrandbits)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(key)


# The project's shared folder lies beside the repository (CI lays a copy there); DSPARK_SHARED_DIR overrides.
SHARED = Path(os.environ.get("DSPARK_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))

TINY_LLAMA = {  # a 2-layer Llama over SmolLM2's tokenizer (V = 49152): loads in well under a second with dummy weights
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_model_dir(directory: Path, config: dict, *, tokenizer: bool = True) -> Path:
    """A checkpoint directory without weights: ``config`` as config.json, and the embedded SmolLM2's tokenizer
    files (``copy_tokenizer``) when ``tokenizer``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer:
        copy_tokenizer(directory)
    return directory


def copy_tokenizer(directory: Path) -> None:
    """Copy the embedded SmolLM2's tokenizer files (from ``local_checkpoint()``) into ``directory``."""
    from app.engine.loader import local_checkpoint

    for src in local_checkpoint().iterdir():
        if src.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(src, Path(directory) / src.name)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """``tiny-llama/``: ``TINY_LLAMA``'s config.json and tokenizer files, no weights (for ``load_format="dummy"``)."""
    return write_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama", TINY_LLAMA)


def save_tiny_model(directory: Path, config_class: str, config: dict, *, tokenizer: bool = True):
    """A tiny random transformers model of ``config_class`` (e.g. "LlamaConfig") built from ``config``, every weight
    drawn at a visible scale (biases and norm scales too, so a missed qkv bias or q/k norm shows), saved to
    ``directory`` with SmolLM2's tokenizer (``tokenizer``; else the directory's own tokenizer files stay); returns
    the float32 model (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**config))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    if tokenizer:
        copy_tokenizer(directory)
    return model


def load_prompts(name: str, *, start: int = 0, count: int = 10) -> list[str]:
    """First user turns of ``shared/datasets/<name>.jsonl`` lines [start, start + count)."""
    lines = (SHARED / "datasets" / f"{name}.jsonl").read_text().splitlines()[start : start + count]
    return [json.loads(line)["turns"][0] for line in lines]


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """``shared/datasets`` (the prompt sets of ``shared/datasets/README.md``)."""
    return SHARED / "datasets"


@pytest.fixture(scope="session")
def engine():
    """The real target (dtype 'auto'), prefix caching off: many tests compare two runs of one prompt token for token,
    and a prefill reusing a prefix runs in another shape than one that does not (which earlier tests decide), which
    in bfloat16 can move a token at a near-tie. ``engine32`` and ``tests/engine/test_prefix_cache.py`` run with it."""
    from app.engine.config import EngineConfig
    from app.engine.engine import TargetEngine

    return TargetEngine(EngineConfig(max_num_seqs=24, max_model_len=1024, enable_prefix_caching=False))


@pytest.fixture(scope="session")
def engine32(engine):
    """The real target in float32, for the sampled-distribution tests that compare outputs with a teacher-forced exact
    joint: its verify steps round as that joint does to ~1e-5 logits, far below the gaps at top-k, top-p and min-p
    cuts. bfloat16 steps of other shapes (batch mix, verify length, padding) move logits by up to ~0.3, which flips
    tokens at such cuts on some CPUs and fails a chi-square test although plain decoding flips them alike.
    With prefix caching: these tests admit hundreds of copies of one prompt, and reuse it. It shares ``engine``'s
    weights where dtype 'auto' is float32 (a CPU without bfloat16 kernels)."""
    import torch

    from app.engine.config import EngineConfig
    from app.engine.engine import TargetEngine

    config = EngineConfig(dtype="float32", max_num_seqs=24, max_model_len=512)
    return TargetEngine(config, loaded=engine.target if engine.cache.k.dtype == torch.float32 else None)


@pytest.fixture(scope="session")
def bf16_engine(engine):
    """The real target in bfloat16 (what the greedy screen needs): ``engine`` itself where dtype 'auto' is bfloat16,
    else (a CPU without bfloat16 kernels, where 'auto' is float32) a bfloat16 engine of 4 slots."""
    import torch

    from app.engine.config import EngineConfig
    from app.engine.engine import TargetEngine

    if engine.cache.k.dtype == torch.bfloat16:
        return engine
    return TargetEngine(EngineConfig(dtype="bfloat16", max_num_seqs=4, max_model_len=1024))


@pytest.fixture(scope="session")
def eval_prompts() -> list[str]:
    """20 evaluation prompts across chat, code and math (never used for drafter training)."""
    return load_prompts("mt-bench", count=7) + load_prompts("humaneval", count=6) + load_prompts(
        "gsm8k", start=700, count=7
    )
