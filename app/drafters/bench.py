"""Drafter benchmark: where one DSpark ``propose`` round spends its time, against one verify round.

Usage: ``python -m app.drafters.bench [--checkpoint checkpoints/dspark-smollm2-135m] [--batches 1 8]``

Drives the real target: ``--context``-token random prompts per request, then rounds of propose -> verify ->
context update. Each round runs the stages of ``DSparkProposer.propose`` one by one and times each (median over
``--repeats`` rounds, ms):

    gather     right-padded batch of the requests' context keys/values (``_batch_context``)
    backbone   block inputs + the parallel backbone layers
    lm_head    base logits over the drafting vocabulary, [B, K, Dm] x [Dm, V'] (the target's tied embedding)
    head       the sequential head, K steps (markov: W1 lookup, the [B, r] x [r, V'] bias, its add, confidence)
    sample     argmax / top-k softmax / inverse-CDF draw over V', K steps, and the map back to token ids
    assemble   the round's ``DraftProposal`` (stack, draft distributions scattered to [K, V] on the CPU,
               calibration)
    update     the context update with the round's verify output (pending token + accepted drafts)

``propose`` is the measured whole call (for the stages' sum to be checked against), and ``verify`` the engine's
verify of the round's K drafts per request (greedy or sampled acceptance, like the drafts). Modes: greedy
(temperature 0) and sampled (temperature 1). Each ``--draft-vocab`` size V' (0: the full vocabulary V) drafts
with its own copy of the drafter, and all sizes take turns within every round, on the same requests, next to the
same verify step, so load on a shared machine hits them alike; the engine verifies the first size's drafts and
every size's context takes the same verify output. The draft vocabulary is the V' lowest ids (the timing does
not depend on which ids). Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from app.argtypes import positive_int
from app.drafters.checkpoint import load_checkpoint
from app.drafters.dspark import DSparkDrafter
from app.drafters.proposer import DSparkProposer, draw, make_proposal, round_sampling
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.errors import ContextLengthError
from app.engine.types import DraftBlock, SamplingParams
from app.drafters.checkpoint import DEFAULT_CHECKPOINT

STAGES = ("gather", "backbone", "lm_head", "head", "sample", "assemble", "update")
VOCAB_STAGES = ("lm_head", "head", "sample")  # the work that scales with the vocabulary


@torch.inference_mode()
def time_round(proposer: DSparkProposer, ids: list[str]) -> tuple[dict[str, float], list[DraftBlock]]:
    """ms per propose stage (module docstring) of one round over the started requests ``ids``, then of one whole
    ``propose`` call, and that call's blocks."""
    d, gamma = proposer.drafter, proposer.gamma
    states = [proposer._state[rid] for rid in ids]
    t0 = time.perf_counter()
    ctx, valid = proposer._batch_context(states)
    t1 = time.perf_counter()
    k = d.config.block_size
    anchors = torch.tensor([[s.anchor] for s in states])
    positions = torch.tensor([s.length for s in states])[:, None] + torch.arange(k)
    mask = torch.cat([valid[:, None, :].expand(-1, k, -1), torch.ones(len(ids), k, k, dtype=torch.bool)], 2)
    hidden = d.backbone(d.block_inputs(anchors), positions=positions, ctx=ctx, mask=mask)
    t2 = time.perf_counter()
    base = d.base_logits(hidden[:, :gamma], draft=True)
    t3 = time.perf_counter()
    temps, draws, uniform = round_sampling(states, gamma, torch.device("cpu"))
    prev, state, tokens, probs, conf = anchors[:, 0], None, [], [], []
    head_s = sample_s = 0.0
    for i in range(gamma):
        a = time.perf_counter()
        step = d.head_step(base[:, i], hidden[:, i], prev, state, draft=True)
        b = time.perf_counter()
        index, q = draw(step.logits, temps, draws, uniform[:, i])
        prev = d.draft_token_ids(index)
        c = time.perf_counter()
        head_s, sample_s = head_s + b - a, sample_s + c - b
        state = step.state
        tokens.append(prev)
        probs.append(q)
        conf.append(step.conf_logit)
    t4 = time.perf_counter()
    make_proposal(ids, states, tokens, probs, conf, proposer.calibration, vocab=d.draft_vocab)
    t5 = time.perf_counter()
    blocks = proposer.propose(ids)
    t6 = time.perf_counter()
    seconds = {"gather": t1 - t0, "backbone": t2 - t1, "lm_head": t3 - t2, "head": head_s, "sample": sample_s,
               "assemble": t5 - t4, "propose": t6 - t5}
    return {name: 1e3 * v for name, v in seconds.items()}, blocks


@torch.inference_mode()
def profile(engine: TargetEngine, drafters: dict[int, DSparkDrafter], calibration, *, batch: int,
            temperature: float, context: int, repeats: int) -> dict[int, dict[str, float]]:
    """Median ms per stage (with ``update`` and the round's ``verify``) per draft vocabulary size (``drafters``:
    V' -> drafter, 0 = full V), for ``batch`` requests with random ``context``-token prompts at ``temperature``."""
    proposers = {size: DSparkProposer(d, calibration, temperature=temperature) for size, d in drafters.items()}
    times: dict[int, dict[str, list[float]]] = {size: defaultdict(list) for size in drafters}
    prompt = torch.randint(engine.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=8 * (repeats + 2), temperature=temperature, seed=0, ignore_eos=True)
    ids = [f"bench-{i}" for i in range(batch)]
    try:
        firsts = [engine.add_request(rid, prompt, params) for rid in ids]
        for proposer in proposers.values():
            for first in firsts:
                proposer.start(first.request_id, prompt, first)
        for r in range(repeats + 1):  # round 0 warms up
            rounds = {size: time_round(proposer, ids) for size, proposer in proposers.items()}
            t0 = time.perf_counter()
            outputs = engine.verify(next(iter(rounds.values()))[1])
            verify_ms = 1e3 * (time.perf_counter() - t0)
            for size, proposer in proposers.items():
                t0 = time.perf_counter()
                proposer.update(outputs)
                rounds[size][0].update(update=1e3 * (time.perf_counter() - t0), verify=verify_ms)
                if r:
                    for name, ms in rounds[size][0].items():
                        times[size][name].append(ms)
    finally:
        for rid in ids:
            if engine.has_request(rid):
                engine.release(rid)
    return {size: {name: statistics.median(v) for name, v in t.items()} for size, t in times.items()}


def table(results: list[dict]) -> str:
    """Readable table: ms per stage, the vocabulary share of the stages' sum, propose, verify, and the drafter's
    round (propose + update) against the verify step of the same rounds."""
    head = ["B", "mode", "V'", *STAGES, "sum", "V-work%", "propose", "verify", "draft/verify"]
    lines = ["  ".join(f"{h:>8}" for h in head)]
    for r in results:
        t = r["ms"]
        total = sum(t[s] for s in STAGES)
        cells = [str(r["batch"]), r["mode"], str(r["draft_vocab"] or "full"), *(f"{t[s]:.2f}" for s in STAGES),
                 f"{total:.2f}", f"{100 * sum(t[s] for s in VOCAB_STAGES) / total:.1f}", f"{t['propose']:.2f}",
                 f"{t['verify']:.2f}", f"{(t['propose'] + t['update']) / t['verify']:.3f}"]
        lines.append("  ".join(f"{c:>8}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8], help="requests per round B")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[0], help="V' sizes to time (0: full vocabulary)")
    ap.add_argument("--context", type=positive_int, default=256, help="prompt tokens per request")
    ap.add_argument("--repeats", type=positive_int, default=15, help="timed rounds per figure (median)")
    args = ap.parse_args(argv)
    if not (args.checkpoint / "config.json").is_file():
        ap.error(f"--checkpoint: no checkpoint (config.json) in {args.checkpoint}")
    torch.manual_seed(0)
    engine = TargetEngine(EngineConfig(max_num_seqs=max(args.batches), max_draft_len=8))
    try:  # the requests ``profile`` adds: --context prompt tokens, max_tokens 8 a round
        engine.check_context(args.context, 8 * (args.repeats + 2))
    except ContextLengthError as e:
        ap.error(f"--context {args.context} / --repeats {args.repeats}: {e}")
    drafters = {}
    for size in args.draft_vocab:  # one drafter (its own weight copies) per size, so no size reuses another's cache
        drafter, calibration, _ = load_checkpoint(args.checkpoint, engine.model.embed_tokens.weight)
        if not isinstance(drafter, DSparkDrafter):
            ap.error(f"--checkpoint: {args.checkpoint} is not a DSpark drafter")
        if not 0 <= size <= drafter.config.vocab_size:
            ap.error(f"--draft-vocab: {size} is outside [0, {drafter.config.vocab_size}]")
        drafter.set_draft_vocab(torch.arange(size) if size else None)
        drafters[size] = drafter
    results = []
    for batch in args.batches:
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            by_size = profile(engine, drafters, calibration, batch=batch, temperature=temperature,
                              context=args.context, repeats=args.repeats)
            results += [{"batch": batch, "mode": mode, "draft_vocab": size, "ms": ms} for size, ms in by_size.items()]
    print(f"DSpark propose stages, ms (median of {args.repeats}), context {args.context}, "
          f"{platform.machine()}, {torch.get_num_threads()} threads")
    print(table(results))
    print(json.dumps({"context": args.context, "threads": torch.get_num_threads(), "results": results}))
    return results


if __name__ == "__main__":
    main()
