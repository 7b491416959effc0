"""Offline evaluator of a drafter checkpoint (any kind): real speculative decoding through the engine on the
evaluation sets.

Owns: running ``generate`` with the drafter's proposer on mt-bench (first turns), humaneval and gsm8k lines
701+ at a fixed block size, greedy and sampled (by default T = 0.7 and 1.0, each under both accept rules: rejection
sampling, the rule of unseeded requests, and Gumbel-max coupling, the rule of seeded ones, app/engine/coupling.py),
and reporting per set, temperature and rule: tau (tokens committed per
round, accepted drafts + the bonus/recovered token), per-position conditional acceptance rates P(draft k
accepted | drafts < k accepted), the ECE and AUC of the confidence head's survival probability prod_{j<=k} c_j
against the observed prefix acceptance before and after calibration, and drafter time per round (propose +
context update) against verify time per round. Writes ``report.json`` and ``report.md``; prints the table and
one JSON line.

Usage:
    python -m app.eval.evaluate --checkpoint checkpoints/dspark-smollm2-135m --limit 32 --out runs/eval
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from app.argtypes import non_negative_float, positive_int
from app.drafters.calibration import auc, ece, prefix_survival
from app.drafters.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, read_checkpoint_config
from app.drafters.lookup import LookupHybridProposer, read_lookup_rates
from app.drafters.registry import make_proposer
from app.engine.contract import Proposer
from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.loader import check_target
from app.engine.types import DraftBlock, SamplingParams, StepOutput, batch_accepted_length
from app.datasets import DEFAULT_DATASETS_DIR, EVAL_SETS, load_prompts
from app.sim.acceptance import row_name



RULES = ("rejection", "coupling")  # accept rules of sampled requests (``evaluate_set``)

@dataclass
class RoundRecord:
    """One request's round: its confidences (raw and calibrated, [K]) and what the engine did with the block."""

    raw: torch.Tensor
    calibrated: torch.Tensor
    num_draft: int
    num_accepted: int


@dataclass
class RecordingProposer:
    """Wraps a proposer that leaves ``last_proposal`` (confidences, raw_confidences [B, K]) after each ``propose``
    (every trained drafter, n-gram): times it and pairs each round's confidences with the verify outcome."""

    inner: Proposer
    records: list[RoundRecord] = field(default_factory=list)
    draft_s: float = 0.0
    _pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def start(self, request_id: str, prompt_ids: Sequence[int], first: StepOutput) -> None:
        # the drafter's prompt projection pairs with the target's prefill, which verify time excludes too
        self.inner.start(request_id, prompt_ids, first)

    def propose(self, request_ids: Sequence[str]) -> list[DraftBlock]:
        t0 = time.perf_counter()
        blocks = self.inner.propose(request_ids)
        self.draft_s += time.perf_counter() - t0
        p = self.inner.last_proposal
        for i, rid in enumerate(request_ids):
            self._pending[rid] = (p.raw_confidences[i], p.confidences[i])
        return blocks

    def update(self, outputs: Sequence[StepOutput]) -> None:
        t0 = time.perf_counter()
        self.inner.update(outputs)
        self.draft_s += time.perf_counter() - t0
        for out in outputs:
            raw, cal = self._pending.pop(out.request_id)
            if not out.finished:  # a finished round's acceptance is cut at EOS / max_tokens: outcome censored
                self.records.append(RoundRecord(raw, cal, out.num_draft, out.num_accepted))

    def finish(self, request_id: str) -> None:
        self.inner.finish(request_id)


def summarize(records: list[RoundRecord], gamma: int) -> dict:
    """Per-position conditional acceptance and survival ECE / AUC (raw and calibrated) over ``records``."""
    reached, accepted = [0] * gamma, [0] * gamma
    preds_raw, preds_cal, outcomes = [], [], []
    for r in records:
        for k in range(min(r.num_draft, gamma)):
            if r.num_accepted >= k:
                reached[k] += 1
                accepted[k] += int(r.num_accepted > k)
        n = min(r.num_draft, gamma)
        preds_raw.append(prefix_survival(r.raw[None, :n].float())[0])
        preds_cal.append(prefix_survival(r.calibrated[None, :n].float())[0])
        outcomes.append(torch.arange(n) < r.num_accepted)
    if not outcomes:  # every round ended its request (tiny budgets): nothing to score
        return {"accept_rate_per_position": [None] * gamma, "ece_before": None, "ece_after": None,
                "auc_before": None, "auc_after": None, "mean_survival_after": None, "observed_survival": None}
    raw, cal, hit = torch.cat(preds_raw), torch.cat(preds_cal), torch.cat(outcomes)
    return {
        "accept_rate_per_position": [round(a / n, 4) if n else None for a, n in zip(accepted, reached)],
        "ece_before": ece(raw, hit.float()), "ece_after": ece(cal, hit.float()),
        # AUC is undefined (nan) when every draft was accepted, or none: JSON's null, not NaN (no JSON at all)
        "auc_before": _finite(auc(raw, hit)), "auc_after": _finite(auc(cal, hit)),
        "mean_survival_after": float(cal.mean()), "observed_survival": float(hit.float().mean()),
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def evaluate_set(
    engine: TargetEngine, proposer_factory, prompts: list[list[int]], *, temperature: float, max_tokens: int,
    gamma: int, seed: int, rule: str = "coupling",
) -> dict:
    """Speculative decoding of ``prompts`` at one temperature; the figures of the module docstring.

    ``rule`` (sampled requests): ``coupling`` seeds request i with ``seed + i`` (seeded requests are verified by
    Gumbel-max coupling and drafted with the same noise); ``rejection`` leaves them unseeded (rejection sampling; the
    engine draws their generators' seeds from the OS, so these figures vary a little from run to run).

    Raises:
        ValueError: an unknown ``rule``.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    proposer = proposer_factory(temperature)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                             seed=seed + i if rule == "coupling" else None) for i in range(len(prompts))]
    if hasattr(proposer, "set_params"):  # the drafter sees each request's params, as in serving
        for i, p in enumerate(params):
            proposer.set_params(f"req-{i}", p)
    rec = RecordingProposer(proposer)
    results, stats = generate(engine, prompts, params, proposer=rec, id_prefix="req")
    return {
        "prompts": len(prompts),
        "tau": batch_accepted_length(results),
        "rounds": stats.rounds,
        "tokens": sum(len(r.token_ids) for r in results),
        "draft_ms_per_round": 1e3 * rec.draft_s / max(stats.rounds, 1),
        "verify_ms_per_round": 1e3 * stats.verify_s / max(stats.rounds, 1),
        "draft_share": rec.draft_s / max(rec.draft_s + stats.verify_s, 1e-9),
        "tok_s": sum(len(r.token_ids) for r in results) / stats.wall_s,
        # request-rounds drafted by prompt lookup (LookupHybridProposer), None without it
        "lookup_share": (rec.inner.lookup_rounds / max(rec.inner.rounds, 1)
                         if isinstance(rec.inner, LookupHybridProposer) else None),
        **summarize(rec.records, gamma),
    }


def markdown(rows: list[dict], gamma: int) -> str:
    head = (["set", "T", "n", "tau"] + [f"a{k + 1}" for k in range(gamma)]
            + ["ECE raw", "ECE cal", "AUC raw", "AUC cal", "draft ms/rd", "verify ms/rd", "draft share", "lookup share",
               "rule"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["set"], f"{r['temperature']:g}", str(r["prompts"]), f"{r['tau']:.2f}"]
        cells += ["-" if a is None else f"{a:.2f}" for a in r["accept_rate_per_position"]]
        cells += ["-" if r[k] is None else f"{100 * r[k]:.1f}%" for k in ("ece_before", "ece_after")]
        cells += ["-" if r[k] is None else f"{r[k]:.3f}" for k in ("auc_before", "auc_after")]
        cells += [f"{r['draft_ms_per_round']:.1f}", f"{r['verify_ms_per_round']:.1f}", f"{100 * r['draft_share']:.1f}%"]
        cells += ["-" if r.get("lookup_share") is None else f"{100 * r['lookup_share']:.0f}%"]
        cells += [r.get("rule") or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--sets", nargs="+", default=list(EVAL_SETS), choices=list(EVAL_SETS))
    ap.add_argument("--temperatures", nargs="+", type=non_negative_float, default=[0.0, 0.7, 1.0])
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES),
                    help="accept rules of the sampled rows: rejection (unseeded requests), coupling (seeded ones)")
    ap.add_argument("--gamma", type=positive_int, default=7, help="draft tokens per round")
    ap.add_argument("--limit", type=positive_int, default=None, help="first N prompts of each set")
    ap.add_argument("--max-tokens", type=positive_int, default=256)
    ap.add_argument("--max-batch", type=positive_int, default=16, help="concurrent requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/eval"))
    ap.add_argument("--datasets-dir", type=Path, default=DEFAULT_DATASETS_DIR)
    ap.add_argument("--lookup", action="store_true",
                    help="draft with prompt lookup beside the drafter (app/drafters/lookup.py; needs the "
                         "checkpoint's lookup table)")
    args = ap.parse_args(argv)
    try:
        doc = read_checkpoint_config(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--checkpoint: {e}")
    try:
        limit = check_target(doc["config"]["target"])[2].max_position_embeddings
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--checkpoint: its target: {e}")
    engine = TargetEngine(EngineConfig(model=doc["config"]["target"], max_num_seqs=args.max_batch,
                                       max_model_len=min(EngineConfig().max_model_len, limit),
                                       max_draft_len=max(8, args.gamma),
                                       feature_layers=tuple(doc["config"]["feature_layers"])))
    drafter, calibration, _ = load_checkpoint(args.checkpoint, engine.model.embed_tokens.weight)

    rates = read_lookup_rates(args.checkpoint) if args.lookup else None
    if args.lookup and rates is None:
        ap.error(f"--lookup: {args.checkpoint} has no lookup table (python -m app.drafters.train.calibrate_lookup)")

    def factory(temperature: float) -> Proposer:
        proposer = make_proposer(drafter, calibration, temperature=temperature, seed=args.seed, gamma=args.gamma)
        return proposer if rates is None else LookupHybridProposer(proposer, rates)

    gamma = min(args.gamma, drafter.config.block_size)  # MTP-1 drafts one token whatever --gamma says
    if gamma < args.gamma:
        print(f"--gamma {args.gamma}: {args.checkpoint} drafts at most {gamma} tokens a round; evaluated at {gamma}",
              file=sys.stderr)
    rows = []
    jobs = [(s, t, rule) for s in args.sets for t in args.temperatures for rule in (args.rules if t > 0 else [None])]
    for set_name, temperature, rule in tqdm(jobs, desc="evaluate"):
        texts = load_prompts(EVAL_SETS[set_name], args.datasets_dir)[: args.limit]
        prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in texts]
        row = evaluate_set(engine, factory, prompts, temperature=temperature, max_tokens=args.max_tokens,
                           gamma=gamma, seed=args.seed, rule=rule or "coupling")
        rows.append({"set": set_name, "temperature": temperature, "rule": rule or "greedy", **row})
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": str(args.checkpoint), "gamma": gamma, "max_tokens": args.max_tokens,
              "limit": args.limit, "max_batch": args.max_batch, "rows": rows}
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(rows, gamma)
    (args.out / "report.md").write_text(table)
    print(table)
    print(json.dumps({f"tau/{row_name(r)}": round(r["tau"], 3) for r in rows}))  # the simulator reads rows by name


if __name__ == "__main__":
    main()
