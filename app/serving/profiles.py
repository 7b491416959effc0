"""The throughput profile a target replica schedules with: committed, cached, or measured at start-up.

Owns: resolving ``AppConfig.profile`` on a target replica once its engine is loaded. A profile named explicitly is
loaded as it is (``AppConfig.check_files`` has already checked it against the model and dtype). ``auto`` takes, in
order: the measured profile in ``profiles/`` of this model on this hardware; a profile this host measured before,
cached under ``<cache_dir>/profiles`` keyed by model, dtype, hardware, torch version and drafter (one cached
before the profile had a sampled table is measured again); else it measures one now with timing steps on the
loaded engine over the batch sizes and verify lengths the config can reach, greedy and sampled, within about
``profile_budget_s``, and caches it.

Does not own: the profile schema and interpolation (``app/scheduling/profile.py``), the timing of one step
(``app/engine/timing.py``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import torch

from app.engine.hardware import hardware_name
from app.engine.loader import cache_dir
from app.engine.static_step import bucket_sizes
from app.scheduling.profile import ThroughputProfile, load_profile, save_profile
from app.scheduling.profiler import (
    SAMPLED_TEMPERATURE,
    default_grid,
    dummy_proposer,
    engine_provenance,
    measure_profile,
)
from app.serving.config import AppConfig

log = logging.getLogger("ray.serve")
STARTUP_CONTEXT = 128  # KV-cache tokens per request while a start-up profile is timed
MAX_REPEATS = 3  # timed steps per grid cell when the budget allows (after one warm-up step)


def profile_cache_path(config: AppConfig, *, hardware: str, dtype: str) -> Path:
    """Where this host caches the start-up profile of ``config``'s model: ``<cache_dir>/profiles/<model>-<key>.json``,
    the key a hash of the model reference, dtype, hardware, torch version, drafter kind and the engine's
    ``verify_step``, ``attention`` and ``compile_elementwise`` (each in the key only when set away from its default,
    so a default engine's key is what it was before the engine had the choice)."""
    drafter = config.drafter if config.speculates else "none"
    parts = [config.model, dtype, hardware, torch.__version__, drafter]
    if config.engine.verify_step != "ragged":
        parts.append(config.engine.verify_step)
    if config.engine.attention != "auto":
        parts.append(f"attention={config.engine.attention}")
    if config.engine.compile_elementwise is not None:
        parts.append(f"compile_elementwise={config.engine.compile_elementwise}")
    key = "|".join(parts)
    name = Path(config.model.rstrip("/")).name.lower()
    return cache_dir() / "profiles" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def serving_profile(config: AppConfig, engine) -> ThroughputProfile:
    """The profile a target replica with ``engine`` (a loaded ``TargetEngine``) schedules with (module docstring).

    Raises:
        FileNotFoundError: an explicit profile file is missing.
        ValueError: the timing steps do not fit the engine (``measure_profile``).
    """
    committed = config.committed_profile_path()
    if committed is not None:
        return load_profile(committed)
    dtype = str(engine.cache.k.dtype).removeprefix("torch.")
    hardware = hardware_name(engine.device, config.torch_threads)
    path = profile_cache_path(config, hardware=hardware, dtype=dtype)
    if path.is_file():
        profile = load_profile(path)
        covers = profile.max_batch_size >= config.max_num_seqs and profile.max_verify_len >= config.gamma
        if profile.padded:  # its cells are the buckets it was padded to: only the same buckets read them right
            covers = (profile.batch_sizes, profile.tokens_per_request) == padded_grid(config)
        if covers and profile.has_sampled:
            log.info("profile: reusing %s, measured at start-up on %s on %s", path, hardware, profile.provenance.date)
            return profile
        log.info("profile: %s does not cover %d requests x gamma %d%s; measuring again", path, config.max_num_seqs,
                 config.gamma, "" if profile.has_sampled else " with sampled requests")
    profile = measure_startup_profile(config, engine, hardware=hardware)
    save_profile(profile, path)
    log.info("profile: cached at %s", path)
    return profile


def padded_grid(config: AppConfig) -> tuple[list[int], list[int]]:
    """The grid a padded engine (``verify_step`` bucketed or cuda_graphs) of ``config`` is timed at: its row buckets
    (``default_grid``'s batch sizes) and its token buckets 1, 2, 4, ... gamma + 1."""
    return default_grid(max_batch=config.max_num_seqs, gamma=config.gamma)[0], bucket_sizes(config.gamma + 1)


def measure_startup_profile(config: AppConfig, engine, *, hardware: str) -> ThroughputProfile:
    """Time a grid of ``default_grid(max_batch=max_num_seqs, gamma=gamma)`` on ``engine``, greedy and sampled
    (``measure_profile``), within about ``profile_budget_s``, a progress line per row of cells.

    After one warm-up step, a probe of the largest cell, sampled (its prefill and two steps), bounds what one cell
    costs; when all cells do not fit the budget, the verify lengths are thinned to evenly spaced ones (always 1 and
    gamma + 1; the profile interpolates linearly between them, never below 2), then each cell gets as many timed
    steps (1 .. ``MAX_REPEATS``) as fit. An engine with padded verify steps (``verify_step`` bucketed or
    cuda_graphs) is timed at its own token buckets (1, 2, 4, ..., gamma + 1) instead, the cells its steps are
    padded to, and its profile is looked up by ceiling (``app/scheduling/profile.py``).
    The drafter step is timed with the n-gram drafter for ``drafter: ngram`` and with a randomly initialised DSpark
    drafter sized for the target (``dummy_proposer``) for ``drafter: dspark``; 0 ms without speculation.
    """
    from app.engine.timing import time_verify_step

    padded = engine.config.verify_step != "ragged"
    batches, tokens = padded_grid(config) if padded else default_grid(max_batch=config.max_num_seqs,
                                                                          gamma=config.gamma)
    t0 = time.perf_counter()
    # the first steps of a fresh engine pay one-time costs (kernel selection, allocations) that no cell pays again
    time_verify_step(engine, batch=1, tokens_per_request=1, context=STARTUP_CONTEXT, repeats=1, warmup=1)
    probe = time.perf_counter()
    largest = time_verify_step(engine, batch=batches[-1], tokens_per_request=tokens[-1], context=STARTUP_CONTEXT,
                               repeats=1, warmup=1, temperature=SAMPLED_TEMPERATURE)  # sampled: the dearer table
    cell_s = time.perf_counter() - probe  # prefill + 2 steps of the largest cell: a bound on any cell at 1 repeat
    drafting = config.speculates and config.drafter in ("ngram", "dspark")
    tables = 2  # greedy and sampled verify steps (``measure_profile``)
    per_row = max(2, int((config.profile_budget_s / cell_s / len(batches) - drafting) / tables))
    if not padded and per_row < len(tokens):
        tokens = sorted({tokens[round(i * (len(tokens) - 1) / (per_row - 1))] for i in range(per_row)})
    cells = len(batches) * (tables * len(tokens) + drafting)
    spare_s = config.profile_budget_s / cells - cell_s
    repeats = max(1, min(MAX_REPEATS, int(spare_s * 1000 / largest)))
    estimate_s = cells * (cell_s + repeats * largest / 1000)
    log.info("profile: no measured profile of %s on %s; measuring batch sizes %s x tokens per request %s, %d "
             "repeats (largest cell %.1f s; about %.0f s of a %.0f s budget)", config.model, hardware, batches, tokens,
             repeats, cell_s, estimate_s, config.profile_budget_s)
    if estimate_s > config.profile_budget_s:
        log.warning("profile: the grid is estimated at %.0f s, over profile_budget_s %.0f s (a larger "
                    "model or a loaded host); commit a profile with python -m app.scheduling.profiler instead",
                    estimate_s, config.profile_budget_s)
    if config.drafter == "ngram" and config.speculates:
        from app.drafters.ngram import NgramProposer

        proposer = NgramProposer(gamma=config.gamma, max_ngram=config.ngram_max, min_ngram=config.ngram_min)
    elif config.drafter == "dspark" and config.speculates:
        proposer = dummy_proposer(engine)
    else:
        proposer = None

    def progress(done: int, total: int) -> None:
        if done % len(tokens) == 0:
            log.info("profile: %d/%d cells measured (%.1f s)", done, total, time.perf_counter() - t0)

    provenance = engine_provenance(
        engine, model=config.model, context=STARTUP_CONTEXT, hardware=hardware,
        notes=f"measured at start-up: median of {repeats} steps after 2 warm-up steps per cell; rows made "
        f"non-decreasing (running max); drafter: {proposer.__class__.__name__ if proposer else 'none'}",
    )
    profile = measure_profile(engine, batch_sizes=batches, tokens_per_request=tokens, proposer=proposer,
                              provenance=provenance, context=STARTUP_CONTEXT, repeats=repeats, progress=progress)
    log.info("profile: measured in %.1f s", time.perf_counter() - t0)
    return profile
