"""Train a drafter on datagen shards (self-distillation from the target's own answers).

Every kind trains here on the same data and the same flags: ``--kind dspark`` (DSpark; DFlash-style with
``--config '{"head": "none"}'``) and ``--kind eagle`` (EAGLE-3-style, unrolled by training-time test; MTP-1 with
``--config '{"block_size": 1, "fused_layers": [29]}'``). A step draws ``--batch-seqs`` sequences and
``--anchors`` anchors in each; every anchor gives one block of K labels for every kind.

Owns: the loss (0.1 x cross-entropy to the target's token + 0.9 x total-variation distance to the target's
distribution + 1.0 x BCE of the confidence logit against the soft label 1 - TV, positions weighted by
exp(-(k-1)/gamma_decay); TV against the target's top-k, see ``dspark_loss``), the optimisation loop with a
progress bar, the held-out split and the final checkpoint (calibrated afterwards by ``calibrate.py``). Device picked
automatically (cuda if available).

Usage:
    python -m app.drafters.train.trainer --data runs/dspark-data --out runs/dspark-ckpt --steps 600
    python -m app.drafters.train.trainer --kind eagle --data runs/dspark-data --out runs/eagle3 --steps 420
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from tqdm import tqdm

from app.argtypes import fraction, positive_float, positive_int
from app.drafters.checkpoint import KINDS, Drafter, load_checkpoint, read_checkpoint_config, save_checkpoint
from app.drafters.config import target_shape
from app.drafters.dspark import DSparkDrafter
from app.drafters.train.data import Batch, Sequence_, TargetTopK, data_meta, load_shards, make_batch, shard_paths
from app.engine.hardware import cpu_has_bf16_kernels
from app.engine.loader import load_target, model_reference, resolve_device

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "bce": 1.0}
TIMING_SKIP = 5  # warm-up steps left out of the timing
TIMING_STEPS = 20  # steps timed before a wall-clock budget fixes the schedule's length
REFIT_FRACTION = 0.1  # the schedule's length is fitted once more after this fraction of the fitted schedule
HARD_STOP = 1.1  # training ends at this multiple of its wall-clock budget whatever the schedule says
STATE_FILE = "train-state.pt"  # in the output folder: what --resume continues from (``train``'s state_path)
RUN_FILE = "train-run.json"  # beside it: the flags of the run it belongs to


@dataclass(frozen=True)
class BlockOutputs:
    """Teacher-forced drafter outputs of a batch, flattened to N = B * M blocks."""

    # [N, K, V] float32 draft logits
    logits: torch.Tensor
    # [N, K] float32 confidence logits
    conf_logits: torch.Tensor


@dataclass
class TrainResult:
    """What ``train`` did."""

    # per-step stats (``dspark_loss``'s, and ``loss``)
    history: list[dict[str, float]]
    # held-out evaluations: ``step`` and ``evaluate_heldout``'s figures
    evals: list[dict[str, float]]
    # why training ended before its schedule's last step: None (it did not), "time" (the budget's hard stop) or
    # "plateau" (the held-out loss stopped falling)
    stopped: str | None = None


def forward_batch(drafter: Drafter, batch: Batch, device: torch.device, *, draft_vocab: bool = False) -> BlockOutputs:
    """The drafter's teacher-forced logits and confidence logits for every block of ``batch`` (for the
    autoregressive kind: the training-time-test unroll on its own hidden states). With ``draft_vocab`` (DSpark
    only) the logits are over the drafter's draft vocabulary V' ([N, K, V']), the softmax it drafts with."""
    k = drafter.config.block_size
    b, m = batch.anchors.shape
    if draft_vocab and not isinstance(drafter, DSparkDrafter):
        raise ValueError(f"draft-vocabulary training needs a DSpark drafter, got {type(drafter).__name__}")
    if not isinstance(drafter, DSparkDrafter):
        logits, conf_logits = drafter.unroll(batch.features.to(device), batch.tokens.to(device),
                                             batch.positions.view(b, m, k)[:, :, 0].to(device),
                                             batch.prev.to(device))
        return BlockOutputs(logits=logits, conf_logits=conf_logits)
    ctx = drafter.context_kv(batch.features.to(device), batch.ctx_positions.to(device))
    hidden = drafter.backbone(drafter.block_inputs(batch.anchors.to(device)), positions=batch.positions.to(device),
                              ctx=ctx, mask=batch.mask.to(device))  # [B, M * K, Dm]
    hidden = hidden.view(b * m, k, -1)
    logits, conf_logits = drafter.teacher_forced(drafter.base_logits(hidden, draft=draft_vocab), hidden,
                                                 batch.prev.to(device).view(b * m, k), draft=draft_vocab)
    return BlockOutputs(logits=logits, conf_logits=conf_logits)


def vocab_columns(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: the column of each token id in draft-vocabulary logits [..., V'], -1 for ids outside V'."""
    columns = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_vocab.device)
    columns[draft_vocab] = torch.arange(draft_vocab.numel(), device=draft_vocab.device)
    return columns


def dspark_loss(
    out: BlockOutputs, batch: Batch, *, gamma_decay: float, device: torch.device, columns: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The DSpark loss (module docstring) and its stats: the parts ``ce``, ``tv``, ``bce`` (weighted means over valid
    positions) and the teacher-forced greedy figures of the batch, ``tau`` (1 + mean accepted drafts per block) and
    ``a1`` .. ``aK`` (P(draft k accepted | drafts < k accepted)).

    TV uses the target's top-Kt tokens (``data.TargetTopK``) plus one lumped tail bucket:
    0.5 * (sum_{i in top} |p_i - q_i| + |p_tail - q_tail|), a lower bound of the full TV that is exact when the
    target's tail is small; it keeps each step to a few passes over the vocabulary.

    With ``columns`` (``vocab_columns``) the logits are over a draft vocabulary V' ([N, K, V']): a target token
    outside V' has draft probability 0 (it counts fully in TV), and a label outside V' is left out of the
    cross-entropy and counts as a miss.
    """
    n, k = out.conf_logits.shape
    labels = batch.labels.to(device).view(n, k)
    valid = batch.valid.to(device).view(n, k)
    top_ids = batch.topk_ids.to(device).view(n, k, -1)
    q = batch.topk_probs.to(device).view(n, k, -1)
    in_vocab, top_in = torch.ones_like(valid), torch.ones_like(top_ids, dtype=torch.bool)
    if columns is not None:
        labels, top_ids = columns[labels], columns[top_ids]
        in_vocab, top_in = labels >= 0, top_ids >= 0
        labels, top_ids = labels.clamp(min=0), top_ids.clamp(min=0)
    lse = torch.logsumexp(out.logits, dim=-1)  # [N, K]
    ce = lse - out.logits.gather(-1, labels[..., None]).squeeze(-1)
    p = torch.exp(out.logits.gather(-1, top_ids) - lse[..., None]) * top_in  # [N, K, Kt]
    tv = 0.5 * ((p - q).abs().sum(-1) + (q.sum(-1) - p.sum(-1)).abs())
    if torch.isposinf(out.conf_logits).all():  # no confidence head (confidence 1 everywhere): nothing to train
        bce = torch.zeros_like(tv)
    else:
        bce = F.binary_cross_entropy_with_logits(out.conf_logits, (1.0 - tv).detach(), reduction="none")
    w = torch.exp(-torch.arange(k, device=ce.device, dtype=torch.float32) / gamma_decay)[None] * valid
    norm = w.sum().clamp(min=1e-9)
    w_ce = w * in_vocab
    parts = {"ce": (w_ce * ce).sum() / w_ce.sum().clamp(min=1e-9), "tv": (w * tv).sum() / norm,
             "bce": (w * bce).sum() / norm}
    loss = sum(LOSS_WEIGHTS[name] * value for name, value in parts.items())
    with torch.no_grad():
        hit = (out.logits.gather(-1, labels[..., None]).squeeze(-1) >= out.logits.max(-1).values) & valid & in_vocab
        stats = {name: float(v) for name, v in parts.items()}
        survived = torch.cumprod(hit.float(), dim=1)  # [N, K] drafts 1..k all accepted
        reached = torch.cat([torch.ones_like(survived[:, :1]), survived[:, :-1]], dim=1) * valid  # [N, K]
        for j in range(k):  # a_k = P(draft k accepted | drafts < k accepted), over the batch's valid positions
            stats[f"a{j + 1}"] = float(survived[:, j].sum() / reached[:, j].sum().clamp(min=1))
        stats["tau"] = float(1 + survived.sum(1).mean())
    return loss, stats


def batch_loss(drafter: Drafter, batch: Batch, *, gamma_decay: float, device: torch.device,
               columns: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``dspark_loss`` of the drafter's teacher-forced outputs on ``batch`` (matmuls in bf16 autocast where bfloat16
    runs natively: a GPU, or a CPU with ``cpu_has_bf16_kernels``; the loss in float32), over the draft vocabulary
    when ``columns`` (``vocab_columns``) is given."""
    native = device.type != "cpu" or cpu_has_bf16_kernels()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=native):
        out = forward_batch(drafter, batch, device, draft_vocab=columns is not None)
    return dspark_loss(out, batch, gamma_decay=gamma_decay, device=device, columns=columns)


def split_heldout(seqs: list[Sequence_], fraction: float) -> tuple[list[Sequence_], list[Sequence_]]:
    """Deterministic split for calibration: every ``round(1 / fraction)``-th sequence is held out, and so is every
    other answer to the same prompt (several sampled answers per prompt never straddle the split; with one answer
    a prompt the split is the plain every-n-th one).

    Returns:
        (training sequences, held-out sequences), each in input order.
    """
    every = max(2, round(1 / fraction))
    prompt = [tuple(s.tokens[: s.prompt_len].tolist()) for s in seqs]
    held_prompts = {prompt[i] for i in range(0, len(seqs), every)}
    held = [i % every == 0 or prompt[i] in held_prompts for i in range(len(seqs))]
    return [s for s, h in zip(seqs, held) if not h], [s for s, h in zip(seqs, held) if h]


@dataclass(frozen=True)
class HeldOutEval:
    """Held-out evaluation during training: the same teacher-forced ``batches`` (drawn once from the held-out
    sequences) every ``every`` steps; training stops once the held-out loss has not fallen below its best by more than
    ``min_delta`` (relative) for ``patience`` evaluations in a row (None: never)."""

    batches: list[Batch]
    every: int
    patience: int | None = None
    min_delta: float = 0.002


def heldout_batches(seqs: list[Sequence_], *, count: int, block_size: int, batch_seqs: int, anchors_per_seq: int,
                    seed: int) -> list[Batch]:
    """``count`` fixed batches from held-out ``seqs`` (the same anchors at every evaluation).

    Raises:
        ValueError: no held-out sequences, or ``count`` < 1.
    """
    if not seqs or count < 1:
        raise ValueError(f"held-out evaluation needs sequences and count >= 1, got {len(seqs)} and {count}")
    gen = torch.Generator().manual_seed(seed)
    return [make_batch([seqs[i] for i in torch.randint(len(seqs), (batch_seqs,), generator=gen).tolist()],
                       block_size=block_size, anchors_per_seq=anchors_per_seq, generator=gen) for _ in range(count)]


@torch.no_grad()
def evaluate_heldout(drafter: Drafter, batches: list[Batch], *, gamma_decay: float, device: torch.device,
                     columns: torch.Tensor | None = None) -> dict[str, float]:
    """``dspark_loss``'s stats (loss, parts, teacher-forced tau and a_k) averaged over ``batches``, in eval mode."""
    training = drafter.training
    drafter.eval()
    totals: dict[str, float] = {}
    for batch in batches:
        loss, stats = batch_loss(drafter, batch, gamma_decay=gamma_decay, device=device, columns=columns)
        for name, value in {"loss": float(loss), **stats}.items():
            totals[name] = totals.get(name, 0.0) + value / len(batches)
    drafter.train(training)
    return totals


def plateaued(losses: list[float], *, patience: int | None, min_delta: float) -> bool:
    """Whether the last ``patience`` held-out losses all failed to fall below (1 - ``min_delta``) x the best one
    before them."""
    if patience is None or len(losses) <= patience:
        return False
    best = min(losses[:-patience])
    return min(losses[-patience:]) > best * (1 - min_delta)


def train(
    drafter: Drafter,
    seqs: list[Sequence_],
    *,
    steps: int,
    batch_seqs: int,
    anchors_per_seq: int,
    lr: float,
    gamma_decay: float,
    seed: int,
    device: torch.device,
    progress: bool = True,
    max_seconds: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    draft_vocab: bool = False,
    heldout: HeldOutEval | None = None,
    state_path: Path | None = None,
    save_every: int = 200,
) -> TrainResult:
    """AdamW with linear warm-up and cosine decay over ``steps``. With ``max_seconds`` (a wall-clock budget) the
    schedule is fitted into the budget: steps ``TIMING_SKIP`` .. ``TIMING_SKIP + TIMING_STEPS`` are timed (the first
    ones pay for warm-up: allocator, kernel selection) and the total becomes min(steps, steps done + time left /
    measured step time), so the learning rate still decays to zero when time runs out instead of training stopping
    mid-schedule. Early steps can run several times slower than later ones (warm-up on a GPU outlasts
    ``TIMING_SKIP``), so after ``REFIT_FRACTION`` of the steps the first fit left (at least ``TIMING_STEPS``, at most
    half of them) the length is fitted once more from the steps since, held-out evaluations and saves left out of
    their time (not after ``--resume``: a new process warms up again); where the first fit was far off, the learning
    rate moves with the new length. Steps that grow slower than timed stop at ``HARD_STOP`` x the budget. ``seqs``
    carry the target top-k; ``clock`` (seconds) is replaceable for tests. ``draft_vocab``: train the softmax over the
    drafter's draft vocabulary V' (the one it drafts with; on a CPU the LM head over the full vocabulary is most of a
    step's cost; see ``dspark_loss``). ``heldout``: evaluate every ``heldout.every`` steps (and after the last) and
    stop on a plateau.

    Resumable: with ``state_path``, everything a run needs to go on (weights, optimiser, schedule, sampling
    generator, schedule length, time spent, stats) is written there every ``save_every`` steps and at the end, and a
    run that finds the file continues from it: a run stopped and resumed ends with the same weights as one that never
    stopped (on the same device). The caller checks that the file belongs to the same run (``main`` does).

    Raises:
        ValueError: ``draft_vocab`` without a DSpark drafter that has a draft vocabulary; ``save_every`` < 1.
    """
    columns = None
    if draft_vocab:
        if not isinstance(drafter, DSparkDrafter) or drafter.draft_vocab is None:
            raise ValueError("draft-vocabulary training needs a DSpark drafter with a draft vocabulary "
                             "(--init a checkpoint that has one, or run draft_vocab first)")
        columns = vocab_columns(drafter.draft_vocab, drafter.config.vocab_size).to(device)
    if save_every < 1:
        raise ValueError(f"save_every must be >= 1, got {save_every}")
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    run = {"total": steps, "seconds": 0.0, "fitted": max_seconds is None}  # the schedule's length, time spent
    warmup = max(1, min(50, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / run["total"]))))
    result = TrainResult(history=[], evals=[])
    if state_path is not None and Path(state_path).is_file():
        state = torch.load(state_path, map_location=device, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        gen.set_state(state["generator"])
        run, result = state["run"], TrainResult(**state["result"])
    # Kept by this process only (a resumed process warms up again, so the refit never spans a resume): seconds spent
    # in held-out evaluations and saves, and the one refit's step with the step, clock reading and pause total of the
    # first fit it times from.
    paused, refit_at, fit_step, fit_clock, fit_paused = 0.0, None, 0, 0.0, 0.0

    def save_state() -> None:
        nonlocal paused
        if state_path is None:
            return
        began = clock()
        run["seconds"] = began - start
        tmp = Path(state_path).with_suffix(".tmp")
        torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "generator": gen.get_state(), "run": run, "result": asdict(result)}, tmp)
        tmp.replace(state_path)  # a run killed while saving keeps the previous state
        paused += clock() - began

    def evaluate() -> bool:
        """One held-out evaluation; True on a plateau."""
        nonlocal paused
        began = clock()
        figures = evaluate_heldout(drafter, heldout.batches, gamma_decay=gamma_decay, device=device, columns=columns)
        result.evals.append({"step": len(history), **figures})
        bar.write(f"held-out @ {len(history)}: loss {figures['loss']:.4f} tau {figures['tau']:.3f} "
                  + " ".join(f"{figures[f'a{j + 1}']:.2f}" for j in range(drafter.config.block_size)))
        paused += clock() - began
        return plateaued([e["loss"] for e in result.evals], patience=heldout.patience, min_delta=heldout.min_delta)

    def fit_schedule(timed_from: float, timed_steps: int, paused: float = 0.0) -> float:
        """Fits the schedule's length from the steps since ``timed_from`` (a clock reading; ``paused`` seconds of
        it went to held-out evaluations and saves) and the time left; returns the clock reading it used."""
        now = clock()
        per_step = (now - timed_from - paused) / timed_steps
        run["total"] = max(len(history) + 1, min(steps, len(history) + int((max_seconds - (now - start)) / per_step)))
        bar.total = run["total"]
        bar.refresh()
        return now

    history = result.history
    bar = tqdm(total=run["total"], initial=len(history), desc="train", disable=not progress)
    drafter.train()
    start = clock() - run["seconds"]
    timing_from = max(TIMING_SKIP, len(history))  # a run resumed before its schedule was fitted times afresh
    while len(history) < run["total"] and result.stopped is None:
        if max_seconds is not None and clock() - start > HARD_STOP * max_seconds:
            result.stopped = "time"  # steps grew slower than timed (a shared machine): keep the budget
            break
        if len(history) == timing_from and not run["fitted"]:
            timed_from = clock()
        if len(history) == timing_from + TIMING_STEPS and not run["fitted"]:
            fit_step, fit_clock, fit_paused = len(history), fit_schedule(timed_from, TIMING_STEPS), paused
            left = run["total"] - fit_step
            run["fitted"] = True
            refit_at = fit_step + max(math.ceil(REFIT_FRACTION * left), min(TIMING_STEPS, left // 2))
        if len(history) == refit_at:
            fit_schedule(fit_clock, len(history) - fit_step, paused - fit_paused)
            refit_at = None
        pick = torch.randint(len(seqs), (batch_seqs,), generator=gen).tolist()
        batch = make_batch([seqs[i] for i in pick], block_size=drafter.config.block_size,
                           anchors_per_seq=anchors_per_seq, generator=gen)
        loss, stats = batch_loss(drafter, batch, gamma_decay=gamma_decay, device=device, columns=columns)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        stats["loss"] = float(loss.detach())
        history.append(stats)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", tv=f"{stats['tv']:.3f}", a1=f"{stats['a1']:.2f}",
                        tau=f"{stats['tau']:.2f}")
        if heldout is not None and len(history) % heldout.every == 0 and evaluate():
            result.stopped = "plateau"
        if len(history) % save_every == 0:
            save_state()
    if heldout is not None and (not result.evals or result.evals[-1]["step"] != len(history)):
        evaluate()
    save_state()
    bar.close()
    drafter.eval()
    if isinstance(drafter, DSparkDrafter) and drafter.draft_vocab is not None:
        drafter.set_draft_vocab(drafter.draft_vocab)  # re-slice W2's draft rows from the trained weights
    return result


def json_object(text: str) -> dict:
    """argparse type: a JSON object (``--config``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or JSON but not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def data_model(folders: Sequence[Path], model: str | None) -> str:
    """The target the datagen ``folders`` were generated with (their ``meta.json``), which features and tokens of
    the data belong to; ``model``, when given, must name the same one (the same string, or the same directory).
    Returned as ``loader.model_reference`` records it (a local path made absolute): it goes into the checkpoint.

    Raises:
        ValueError: the folders record different targets, or not ``model``.
    """
    recorded = {data_meta(f).get("model") for f in folders} - {None}
    if len(recorded) > 1:
        raise ValueError(f"--data folders were generated with different targets: {sorted(recorded)}")
    if model is None:
        return model_reference(recorded.pop()) if recorded else "smollm2-135m"

    def same(a: str, b: str) -> bool:
        return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()

    if recorded and not same(model, next(iter(recorded))):
        raise ValueError(f"--model {model} is not the target the --data was generated with ({recorded.pop()}); "
                         "leave --model out to use that one")
    return model_reference(model)


PATH_FLAGS = ("data", "out", "init")  # the trainer's path flags, kept absolute in the run's flags


def _run_flags(flags: dict) -> dict:
    """The flags that identify a run (``RUN_FILE``; ``--resume`` compares them): JSON values, the paths absolute (a
    local model as ``model_reference`` records it), so that a relative and an absolute path to one folder, or runs
    from different directories, compare equal."""
    flags = json.loads(json.dumps({k: v for k, v in flags.items() if k != "resume"}, default=str))
    if flags.get("model"):
        flags["model"] = model_reference(flags["model"])
    for key in PATH_FLAGS:
        value = flags.get(key)
        if isinstance(value, list):
            flags[key] = [str(Path(v).resolve()) for v in value]
        elif value is not None:
            flags[key] = str(Path(value).resolve())
    return flags


def finished_steps(state_path: Path) -> int | None:
    """The steps a training state (``train``'s ``state_path``) did when its run has ended: its schedule done, or
    stopped on time or a plateau; None while it has steps left."""
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    done = len(state["result"]["history"])
    return done if state["result"]["stopped"] is not None or done >= state["run"]["total"] else None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="datagen output folder(s)")
    ap.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    ap.add_argument("--steps", type=positive_int, default=600)
    ap.add_argument("--batch-seqs", type=positive_int, default=4, help="sequences per step")
    ap.add_argument("--anchors", type=positive_int, default=32, help="anchors (blocks) per sequence")
    ap.add_argument("--max-minutes", type=positive_float, default=None,
                    help="wall-clock budget; the lr schedule is fitted into it (see train)")
    ap.add_argument("--lr", type=positive_float, default=1e-3)
    ap.add_argument("--gamma-decay", type=positive_float, default=5.0, help="position weight exp(-(k-1)/gamma_decay)")
    ap.add_argument("--target-topk", type=positive_int, default=32,
                    help="target tokens kept per position for the TV loss (at most the vocabulary)")
    ap.add_argument("--heldout", type=fraction(0.5), default=0.05,
                    help="fraction of sequences held out for calibration (every round(1 / f)-th; at most 0.5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None,
                    help="target model reference (default: the one the --data folders were generated with, from "
                         "their meta.json)")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this checkpoint's weights and architecture (continued training; --config "
                         "may only repeat it)")
    ap.add_argument("--train-vocab", choices=("full", "draft"), default="full",
                    help="softmax over the full vocabulary, or over the --init checkpoint's draft vocabulary (the "
                         "one it drafts with; dspark only; on a CPU about 2x faster steps)")
    ap.add_argument("--eval-every", type=int, default=200,
                    help="steps between held-out evaluations (loss, teacher-forced tau and a_k; printed and kept in "
                         "the checkpoint's metadata)")
    ap.add_argument("--eval-batches", type=int, default=4, help="fixed held-out batches per evaluation")
    ap.add_argument("--patience", type=int, default=None,
                    help="stop when this many evaluations in a row did not improve the held-out loss (default: "
                         "never)")
    ap.add_argument("--save-every", type=int, default=200,
                    help="steps between saves of the training state (OUT/train-state.pt)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run whose training state is in OUT/train-state.pt (same flags; the weights "
                         "come from the state, not from --init)")
    ap.add_argument("--kind", choices=sorted(KINDS), default="dspark", help="drafter kind (module docstring)")
    ap.add_argument("--config", type=json_object, default={},
                    help="JSON overrides of the kind's config fields, e.g. '{\"head\": \"rnn\"}'")
    args = ap.parse_args(argv)
    for name in ("eval_every", "eval_batches", "save_every", "patience"):
        if (value := getattr(args, name)) is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    try:
        shard_paths(args.data)  # each folder holds shards, none is given twice
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--data: {e}")
    try:
        args.model = data_model(args.data, args.model)
    except ValueError as e:
        ap.error(str(e))
    state_path, run_path = args.out / STATE_FILE, args.out / RUN_FILE
    run_flags = _run_flags(vars(args))
    if args.resume:
        if not state_path.is_file():
            ap.error(f"--resume: no training state at {state_path}")
        if (saved := _run_flags(json.loads(run_path.read_text())) if run_path.is_file() else {}) != run_flags:
            diff = {k: (saved.get(k), run_flags.get(k)) for k in saved.keys() | run_flags.keys()
                    if saved.get(k) != run_flags.get(k)}
            ap.error(f"--resume: flags differ from the run in {args.out} (saved, given): {diff}")
        if (args.out / "config.json").is_file() and (done := finished_steps(state_path)) is not None:
            print(f"--resume: the run in {args.out} finished ({done} steps); its checkpoint is left as it is "
                  "(with any calibration, draft vocabulary and lookup table written into it since)")
            return
    else:
        state_path.unlink(missing_ok=True)  # a new run
    init_doc: dict = {}
    if args.init is not None:  # the architecture comes from the checkpoint; --kind/--config may only agree with it
        try:
            init_doc = read_checkpoint_config(args.init)
        except (FileNotFoundError, ValueError) as e:
            ap.error(f"--init: {e}")
        if init_doc.get("kind", "dspark") != args.kind:
            ap.error(f"--init {args.init} is a {init_doc.get('kind', 'dspark')} checkpoint, not --kind {args.kind}")
    if args.train_vocab == "draft" and (args.kind != "dspark" or args.init is None):
        ap.error("--train-vocab draft needs --kind dspark and --init with a checkpoint that has a draft vocabulary")
    torch.manual_seed(args.seed)
    device = resolve_device("auto")
    target = load_target(args.model, device=str(device)).model
    a = target.args
    config_cls, drafter_cls = KINDS[args.kind]
    try:
        config = config_cls.model_validate({**target_shape(target, name=args.model), **init_doc.get("config", {}),
                                            **args.config})
    except ValidationError as e:
        ap.error(f"--config: {e}")
    if args.init is not None:
        drafter, _, _ = load_checkpoint(args.init, target.embed_tokens.weight, dtype=torch.float32)
        if drafter.config != config:
            ap.error(f"--init {args.init} has config {drafter.config}; --config asks for {config}")
        drafter.to(device)
    else:
        drafter = drafter_cls(config, target.embed_tokens.weight).to(device)
    if args.train_vocab == "draft" and getattr(drafter, "draft_vocab", None) is None:
        ap.error("--train-vocab draft needs --init with a dspark checkpoint that has a draft vocabulary")
    if args.target_topk > a.vocab_size:
        ap.error(f"--target-topk {args.target_topk} exceeds the target's vocabulary of {a.vocab_size} tokens")
    topk = TargetTopK(target.logits_from_final_hidden, k=args.target_topk, hidden_size=a.hidden_size, device=device,
                      model=args.model)
    seqs, heldout = split_heldout(load_shards(args.data, topk=topk), args.heldout)
    print(f"drafter {drafter.num_trainable_params() / 1e6:.1f}M params; {len(seqs)} train / {len(heldout)} held-out "
          f"sequences; device {device}")
    evaluation = None
    if heldout:
        evaluation = HeldOutEval(
            batches=heldout_batches(heldout, count=args.eval_batches, block_size=drafter.config.block_size,
                                    batch_seqs=args.batch_seqs, anchors_per_seq=args.anchors, seed=args.seed),
            every=args.eval_every, patience=args.patience)
    args.out.mkdir(parents=True, exist_ok=True)
    run_path.write_text(json.dumps(run_flags, indent=1))
    start = time.perf_counter()
    result = train(drafter, seqs, steps=args.steps, batch_seqs=args.batch_seqs, anchors_per_seq=args.anchors,
                   lr=args.lr, gamma_decay=args.gamma_decay, seed=args.seed, device=device,
                   max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
                   draft_vocab=args.train_vocab == "draft", heldout=evaluation, state_path=state_path,
                   save_every=args.save_every)
    history = result.history
    tail = history[-max(1, len(history) // 10):]
    summary = {k: round(sum(h[k] for h in tail) / len(tail), 4) for k in tail[0]}
    meta = {"train": {**run_flags, "train_seqs": len(seqs), "heldout_seqs": len(heldout), "steps_done": len(history),
                      "stopped": result.stopped, "seconds": round(time.perf_counter() - start, 1), "final": summary,
                      "heldout_evals": [{k: round(v, 4) for k, v in e.items()} for e in result.evals]}}
    if getattr(drafter, "draft_vocab", None) is not None and "draft_vocab" in init_doc.get("metadata", {}):
        meta["draft_vocab"] = init_doc["metadata"]["draft_vocab"]  # the V' carried from --init, and its record
    if init_doc:
        meta["init_train"] = init_doc.get("metadata", {}).get("train")
    save_checkpoint(args.out, drafter, metadata=meta)
    print(json.dumps(meta["train"], default=str))


if __name__ == "__main__":
    main()
