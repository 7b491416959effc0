"""Profiler CLI: measure the engine's throughput profile and write ``profiles/<engine>-<model>-<hardware>.json``.

Usage::

    python -m app.scheduling.profiler [--model smollm2-135m] [--load-format auto|dummy]
        [--drafter checkpoints/dspark-smollm2-135m | --dummy-drafter]
        [--batch-sizes 1,2,4,8,16,32] [--tokens-per-request 1,2,3,4,5,6,7,8,10,12,16] [--out profiles]
        [--verify-step ragged|bucketed|cuda_graphs] [--no-sampled]

For each (batch size B, tokens per request t) it times one verify step of B requests each bringing their
pending token plus ``t - 1`` drafts (median of repeats after warm-up, ``app/engine/timing.py``), greedy and, unless
``--no-sampled``, sampled (every request at temperature 1: ``sampled_verify_ms``, how the policies price sampled
rows), and for each B one drafter step (``propose`` for B requests; 0 ms without a drafter). Measured rows may
wiggle by a few percent on a shared machine; each row is made non-decreasing in t (a running maximum) before it is
written, since a verify step never gets cheaper by adding tokens and the schema rejects rows that do.

With ``--verify-step bucketed`` or ``cuda_graphs`` every step is padded to the engine's buckets; the profile records
the verify step and is looked up by ceiling (``app/scheduling/profile.py``, "Padded steps"). Time it at the
buckets (batch sizes 1, 2, 4, ... up to the engine's slots, tokens per request 1, 2, 4, ... up to gamma + 1): each
cell is then exactly what every step padded to it costs.

Without weights: ``--load-format dummy`` times the target on random weights (``app/engine/loader.py``; ``--model``
then needs only a ``config.json`` and tokenizer files), and ``--dummy-drafter`` times a randomly initialised
DSpark drafter sized for the target (``dummy_proposer``) where no trained checkpoint exists. Step costs do not
depend on weight values. A dummy-weights profile names its model ``<name of --model>-dummy`` (name the directory
after the model it stands for) and matches that model (``app/scheduling/profile.py``, "Dummy weights").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Callable, get_args

import numpy as np
import torch
from tqdm import tqdm

from app.argtypes import int_list, positive_int
from app.drafters.checkpoint import load_checkpoint
from app.drafters.config import DrafterConfig, target_shape
from app.drafters.dspark import DSparkDrafter
from app.drafters.proposer import DSparkProposer
from app.engine.config import LOAD_FORMATS, Attention, EngineConfig, VerifyStep
from app.engine.engine import TargetEngine
from app.engine.hardware import hardware_name
from app.engine.timing import time_draft_step, time_verify_step
from app.engine.contract import Proposer
from app.scheduling.profile import DUMMY_SUFFIX, Provenance, ThroughputProfile, check_grid, write_profile

ENGINE_NAME = "dspark-engine"
SAMPLED_TEMPERATURE = 1.0  # of the sampled table's requests (a sampled row's cost does not depend on it)


def dummy_proposer(engine: TargetEngine) -> DSparkProposer:
    """A DSpark proposer over a randomly initialised drafter sized for ``engine``'s target (``target_shape``; the
    other fields are ``DrafterConfig``'s defaults: 2 layers, Markov head, K = 7), made on the engine's device in
    its dtype, for timing a drafter step where no trained checkpoint exists."""
    config = DrafterConfig.model_validate(target_shape(engine.model, name=engine.config.model))
    embed = engine.model.embed_tokens.weight
    with torch.device(engine.device):
        drafter = DSparkDrafter(config, embed)
    return DSparkProposer(drafter.to(dtype=embed.dtype).eval())


def default_grid(*, max_batch: int, gamma: int) -> tuple[list[int], list[int]]:
    """The grid a server with ``max_batch`` KV slots and draft blocks of ``gamma`` tokens can reach: batch sizes 1, 2,
    4, ... up to ``max_batch`` (always included) and tokens per request 1 .. ``gamma + 1``."""
    batches = [b for b in (1 << i for i in range(max_batch.bit_length())) if b < max_batch] + [max_batch]
    return batches, list(range(1, gamma + 2))


def measure_profile(
    engine: TargetEngine,
    *,
    batch_sizes: list[int],
    tokens_per_request: list[int],
    proposer: Proposer | None,
    provenance: Provenance,
    context: int,
    repeats: int,
    sampled: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> ThroughputProfile:
    """Time the verify grid, greedy and with ``sampled`` also every request sampled (``SAMPLED_TEMPERATURE``), and
    one drafter step per batch size with ``proposer`` (0 ms without) on ``engine``.

    Each row is made non-decreasing in tokens per request (a running maximum, module docstring), a sampled cell at
    least its greedy one. ``progress`` is called with (cells done, cells in all) after each cell.

    Raises:
        ValueError: the grid needs more slots or draft tokens than ``engine`` has (``time_verify_step``).
    """
    temperatures = [0.0, SAMPLED_TEMPERATURE] if sampled else [0.0]
    tables: list[list[list[float]]] = [[] for _ in temperatures]
    draft_ms = []
    cells, done = len(batch_sizes) * len(tokens_per_request) * len(temperatures), 0
    for b in batch_sizes:
        for table, temperature in zip(tables, temperatures):
            row = []
            for t in tokens_per_request:
                row.append(time_verify_step(engine, batch=b, tokens_per_request=t, context=context, repeats=repeats,
                                            temperature=temperature))
                done += 1
                if progress is not None:
                    progress(done, cells)
            table.append(np.maximum.accumulate(np.array(row)))
        if sampled:
            tables[1][-1] = np.maximum(tables[1][-1], tables[0][-1])
        draft_ms.append(round(time_draft_step(engine, proposer, batch=b, context=context), 3) if proposer else 0.0)
    verify_ms, *sampled_ms = [[row.round(3).tolist() for row in table] for table in tables]
    gamma = getattr(proposer, "gamma", None) or tokens_per_request[-1] - 1
    return ThroughputProfile(provenance=provenance, batch_sizes=batch_sizes, tokens_per_request=tokens_per_request,
                             verify_ms=verify_ms, sampled_verify_ms=sampled_ms[0] if sampled_ms else None,
                             draft_ms=draft_ms, draft_gamma=gamma, verify_step=engine.config.verify_step)


def engine_provenance(
    engine: TargetEngine, *, model: str, context: int, notes: str, hardware: str | None = None
) -> Provenance:
    """Provenance of a profile measured now on ``engine``: this process's torch version, ``hardware`` (default:
    ``hardware_name`` of the engine's device at this process's torch threads)."""
    return Provenance(
        engine=ENGINE_NAME, model=model, dtype=str(engine.cache.k.dtype).removeprefix("torch."),
        torch_version=torch.__version__, hardware=hardware or hardware_name(engine.device), date=dt.date.today(),
        source="measured", context_tokens=context, notes=notes,
    )


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                    help="auto: the checkpoint's weights; dummy: random weights (module docstring)")
    ap.add_argument("--dtype", default="auto")
    drafters = ap.add_mutually_exclusive_group()
    drafters.add_argument("--drafter", default=None, help="drafter checkpoint dir whose propose() step is timed")
    drafters.add_argument("--dummy-drafter", action="store_true",
                          help="time a randomly initialised DSpark drafter sized for the target")
    ap.add_argument("--verify-step", choices=get_args(VerifyStep), default="ragged",
                    help="verify steps in exact shapes, bucketed static shapes, or bucketed CUDA graphs "
                    "(EngineConfig.verify_step)")
    ap.add_argument("--attention", choices=get_args(Attention), default="auto",
                    help="attention backend (EngineConfig.attention)")
    ap.add_argument("--compile-elementwise", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the decoder's elementwise work (EngineConfig.compile_elementwise; default: "
                    "where Triton runs)")
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32],
                    help="the profile's batch sizes B (comma-separated)")
    ap.add_argument("--tokens-per-request", type=int_list, default=[1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16],
                    help="the profile's tokens verified per request (comma-separated)")
    ap.add_argument("--context", type=positive_int, default=200, help="KV cache tokens per request while timing")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed steps per cell (median)")
    ap.add_argument("--sampled", action=argparse.BooleanOptionalAction, default=True,
                    help="also time every request sampled (sampled_verify_ms; --no-sampled: greedy only)")
    ap.add_argument("--out", default="profiles")
    args = ap.parse_args(argv)
    batch_sizes, tokens = sorted(args.batch_sizes), sorted(args.tokens_per_request)  # the grid's order
    try:
        check_grid(batch_sizes, tokens)
    except ValueError as e:
        ap.error(f"--batch-sizes / --tokens-per-request: {e}")
    try:
        engine = TargetEngine(EngineConfig(
            model=args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=max(batch_sizes),
            max_draft_len=max(tokens) - 1, verify_step=args.verify_step, attention=args.attention,
            compile_elementwise=args.compile_elementwise,
        ))
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"the engine refuses these flags: {e}")
    proposer = None
    if args.drafter:
        try:
            drafter, calibration, _ = load_checkpoint(args.drafter, engine.model.embed_tokens.weight)
        except (FileNotFoundError, ValueError) as e:
            ap.error(f"--drafter: {e}")
        proposer = DSparkProposer(drafter, calibration=calibration)
    elif args.dummy_drafter:
        proposer = dummy_proposer(engine)
    dummy = args.load_format == "dummy"
    drafter_note = "dummy DSpark (random weights, target-sized)" if args.dummy_drafter else args.drafter or "none"
    provenance = engine_provenance(
        engine, model=f"{Path(args.model).name}{DUMMY_SUFFIX}" if dummy else args.model, context=args.context,
        notes=f"median of {args.repeats} steps after 2 warm-up steps; rows made non-decreasing (running max); "
        + (f"weights: dummy (random, --load-format dummy) on the config of {args.model}; " if dummy else "")
        + f"drafter: {drafter_note}; verify step: {args.verify_step}; attention: {engine.attention}"
        + f"; elementwise work {'compiled' if engine.compile_elementwise else 'eager'}",
    )
    cells = tqdm(total=len(batch_sizes) * len(tokens) * (2 if args.sampled else 1), desc="profiling verify steps")
    profile = measure_profile(engine, batch_sizes=batch_sizes, tokens_per_request=tokens, proposer=proposer,
                              provenance=provenance, context=args.context, repeats=args.repeats, sampled=args.sampled,
                              progress=lambda done, total: cells.update())
    cells.close()
    verify_ms, sampled_ms, draft_ms = profile.verify_ms, profile.sampled_verify_ms, profile.draft_ms
    path = write_profile(directory=args.out, provenance=provenance, batch_sizes=batch_sizes,
                         tokens_per_request=tokens, verify_ms=verify_ms, sampled_verify_ms=sampled_ms,
                         draft_ms=draft_ms, draft_gamma=profile.draft_gamma, verify_step=profile.verify_step)
    print(f"{'batch':>6}" + "".join(f"{t:>8}" for t in tokens) + f"{'draft':>8}")
    for i, (b, row, d) in enumerate(zip(batch_sizes, verify_ms, draft_ms)):
        print(f"{b:>6}" + "".join(f"{ms:>8.1f}" for ms in row) + f"{d:>8.1f}")
        if sampled_ms is not None:
            print(f"{'T1':>6}" + "".join(f"{ms:>8.1f}" for ms in sampled_ms[i]))
    print(json.dumps({"profile": str(path), "verify_ms": verify_ms, "sampled_verify_ms": sampled_ms,
                      "draft_ms": draft_ms}))
    return path


if __name__ == "__main__":
    main()
