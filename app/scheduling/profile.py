"""Throughput profiles: what one verify step and one drafter step cost on a given engine and machine.

This module owns the profile schema (pydantic, validated on load), its JSON I/O and the interpolation
between grid points. It does not measure anything: the profiler CLI times the real engine and hands the
numbers to :func:`write_profile`; the policies and the simulator only read profiles.

Shape symbols: B batch (requests in one verify step), K gamma (draft block size), N total tokens in one
ragged verify step, ``N = sum_r (1 + l_r)``.

Grid. Verify-step times are stored on a rectangular grid over batch size B (``batch_sizes``) and tokens
per request (``tokens_per_request``, 1 = plain decoding, 1 + l = verify l draft tokens); the total tokens
of grid cell (i, j) is ``N = batch_sizes[i] * tokens_per_request[j]``. A ragged step with N tokens over B
requests is looked up at ``N / B`` tokens per request.

Interpolation (:meth:`ThroughputProfile.verify_time_ms`): piecewise linear in tokens per request at each grid
batch size -- hence linear in N at fixed B -- then linear in B between the two neighbouring grid batch
sizes. There is no clamping and no extrapolation: a batch size or tokens-per-request value outside the
grid raises :class:`ProfileRangeError`, since an extrapolated cost silently steers every policy.

Padded steps. An engine with ``verify_step: bucketed`` or ``cuda_graphs`` (``app/engine/static_step.py``) pads every
step up to a bucketed shape: rows to the next row bucket, every request's run to the next token bucket above the
step's longest run. Its profile (``verify_step`` other than ``ragged``) is looked up by ceiling instead: a step costs
the grid cell at the smallest grid batch size >= B and the smallest grid tokens per request >= its longest run, no
interpolation (measured at the engine's own buckets, each cell is what every step padded to it costs; on another
grid the ceiling is an upper bound). :meth:`ThroughputProfile.step_tokens` gives the N to look a step up at under
either layout: ``B + sum l`` ragged, ``B (1 + max l)`` padded.

Dummy weights. A profile timed on random weights (the profiler's ``--load-format dummy``) names its model
``<name>-dummy``; a step's cost does not depend on the weight values, so it stands for the model ``<name>`` in
every model check (:func:`model_matches`), after any profile of ``<name>`` measured on its real weights.

Sampled rows. A row of a sampled request (or of a greedy one with a logits control or logprobs) needs its logits
over the whole vocabulary from the float32 LM head, where a plain greedy row takes the greedy screen
(``app/engine/greedy_head.py``); on a CPU that makes an all-sampled step of many rows 10-20% dearer. A profile may
carry ``sampled_verify_ms``, the same grid timed with every request sampled; a step whose fraction f of rows is
sampled then costs ``greedy + f (sampled - greedy)`` at its cell (the surcharge is about proportional to the sampled
rows). Without that table sampled rows are priced as greedy ones (``has_sampled``).

SPS (steps per second) is the quantity the DSpark objective ``Theta = tau * SPS(N)`` uses
(DSpark, arXiv 2607.05147, Sec. 3, "throughput-aware verification").
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.engine.config import VerifyStep

DUMMY_SUFFIX = "-dummy"  # Provenance.model of a profile timed on random weights: "<name>-dummy"


class ProfileRangeError(ValueError):
    """A lookup outside the profile's measured grid (batch size or tokens per request)."""


class ProfileMismatchError(ValueError):
    """A profile measured for another model, dtype or engine than the one running."""


class Provenance(BaseModel):
    """Where a profile's numbers come from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str = Field(description="Engine that ran the verify steps, e.g. 'dspark-hf' or 'roofline'.")
    model: str = Field(description="Target model name as the engine reports it, e.g. 'SmolLM2-135M-Instruct'.")
    dtype: str = Field(description="Target weights/activation dtype, e.g. 'bfloat16'.")
    torch_version: str = Field(description="torch.__version__ of the measuring process ('n/a' if derived).")
    hardware: str = Field(description="CPU or GPU name the profile was measured or derived for.")
    date: _dt.date = Field(description="Day the profile was measured or derived (ISO 8601).")
    source: Literal["measured", "derived"] = Field(
        description="'measured' by the profiler on the engine, or 'derived' from a model of the hardware."
    )
    context_tokens: int = Field(ge=0, description="KV-cache length per request during the timed steps (tokens).")
    notes: str = Field(default="", description="Free text: method, repeats, caveats, derivation reference.")


class ThroughputProfile(BaseModel):
    """Verify-step times over (batch size, tokens per request) and drafter-step times per batch size.

    Raises (on construction / load):
        pydantic.ValidationError: unknown keys, non-increasing grids, ragged ``verify_ms``, non-positive
            times, or a step time that decreases as tokens per request grow.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = Field(default=1, description="Version of this schema.")
    provenance: Provenance = Field(description="Engine, model, dtype, versions, hardware and date.")
    batch_sizes: list[int] = Field(
        min_length=1, description="Grid batch sizes B (requests per step), strictly increasing, >= 1."
    )
    tokens_per_request: list[int] = Field(
        min_length=2,
        description="Grid tokens per request (1 + verified draft tokens), strictly increasing, starting at 1.",
    )
    verify_ms: list[list[float]] = Field(
        description="Median verify-step time in ms, [len(batch_sizes)][len(tokens_per_request)]; the cell "
        "(i, j) times batch_sizes[i] requests of tokens_per_request[j] tokens each."
    )
    sampled_verify_ms: list[list[float]] | None = Field(
        default=None, description="The grid of verify_ms timed with every request sampled (temperature 1, rows "
        "with float32 logits over the whole vocabulary), or null where not measured (module docstring, 'Sampled "
        "rows')."
    )
    draft_ms: list[float] = Field(
        description="Median drafter-step time in ms per grid batch size (one block of draft_gamma tokens)."
    )
    draft_gamma: int = Field(ge=1, description="Draft block size K the drafter step was timed at (tokens).")
    verify_step: VerifyStep = Field(
        default="ragged", description="How the measured engine shaped verify steps (EngineConfig.verify_step): "
        "'ragged' steps are looked up by interpolation, padded ones ('bucketed', 'cuda_graphs') by ceiling "
        "(module docstring)."
    )

    @model_validator(mode="after")
    def _check_grid(self) -> ThroughputProfile:
        check_grid(self.batch_sizes, self.tokens_per_request)
        n_b, n_t = len(self.batch_sizes), len(self.tokens_per_request)
        tables = [("verify_ms", self.verify_ms)]
        if self.sampled_verify_ms is not None:
            tables.append(("sampled_verify_ms", self.sampled_verify_ms))
        for name, table in tables:
            if len(table) != n_b or any(len(row) != n_t for row in table):
                shape = [len(row) for row in table]
                raise ValueError(f"{name} must be [{n_b}][{n_t}] (batch_sizes x tokens_per_request), got rows {shape}")
            for b, row in zip(self.batch_sizes, table, strict=True):
                if any(not t > 0 for t in row):
                    raise ValueError(f"{name} must be > 0 ms, got {row} at batch size {b}")
                if any(t1 < t0 for t0, t1 in zip(row, row[1:])):
                    raise ValueError(f"{name} must not decrease with tokens per request, got {row} at batch size {b}")
        if len(self.draft_ms) != n_b:
            raise ValueError(f"draft_ms must have {n_b} entries (one per batch size), got {len(self.draft_ms)}")
        if any(not t >= 0 for t in self.draft_ms):
            raise ValueError(f"draft_ms must be >= 0 ms, got {self.draft_ms}")
        return self

    @functools.cached_property
    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Grid as float64 arrays: tokens per request [nT], verify ms [nB, nT], sampled verify ms [nB, nT] (the
        greedy table where none was measured)."""
        sampled = self.verify_ms if self.sampled_verify_ms is None else self.sampled_verify_ms
        return (np.array(self.tokens_per_request, dtype=np.float64), np.array(self.verify_ms, dtype=np.float64),
                np.array(sampled, dtype=np.float64))

    @property
    def has_sampled(self) -> bool:
        """Whether sampled rows have their own timing (``sampled_verify_ms``); without it they are priced as greedy."""
        return self.sampled_verify_ms is not None

    @property
    def padded(self) -> bool:
        """Whether verify steps were padded to bucketed shapes (looked up by ceiling, module docstring)."""
        return self.verify_step != "ragged"

    def step_tokens(self, *, batch: int, verified: int, longest: int) -> int:
        """N to look up a step of ``batch`` requests verifying ``verified`` draft tokens in all, at most ``longest``
        for one request: ``batch + verified`` ragged, ``batch * (1 + longest)`` padded (every run padded to the
        longest)."""
        return batch * (1 + longest) if self.padded else batch + verified

    def sampled_fraction(self, sampled: Sequence[bool], verified: Sequence[int]) -> float:
        """The ``sampled`` fraction :meth:`verify_time_ms` prices a step at: of its rows (``1 + verified[r]`` for
        request r; ``sampled[r]``: whether r samples), the sampled requests' share; on a padded profile, where every
        run is padded to the longest, the sampled requests' share. 0 for an empty step.

        Raises:
            ValueError: ``sampled`` and ``verified`` of different lengths.
        """
        if len(sampled) != len(verified):
            raise ValueError(f"need one verify length per request, got {len(verified)} for {len(sampled)}")
        if not sampled:
            return 0.0
        rows = [1] * len(sampled) if self.padded else [1 + v for v in verified]
        return sum(n for n, s in zip(rows, sampled) if s) / sum(rows)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_verify_len(self) -> int:
        """Largest verify length l the grid covers (tokens per request minus the bonus/plain token)."""
        return self.tokens_per_request[-1] - 1

    def _batch_weights(self, batch: int, *, ceiling: bool = False) -> tuple[int, int, float]:
        """Neighbouring grid rows (i0, i1) and the weight of i1 for ``batch`` requests (with ``ceiling``: the row at
        or above ``batch`` alone)."""
        sizes = self.batch_sizes
        if not sizes[0] <= batch <= sizes[-1]:
            raise ProfileRangeError(f"batch size {batch} is outside the profile grid [{sizes[0]}, {sizes[-1]}]")
        i1 = next(i for i, b in enumerate(sizes) if b >= batch)
        if sizes[i1] == batch or ceiling:
            return i1, i1, 0.0
        i0 = i1 - 1
        return i0, i1, (batch - sizes[i0]) / (sizes[i1] - sizes[i0])

    def verify_row(self, batch: int, *, sampled: bool = False) -> np.ndarray:
        """Verify-step time at ``batch`` requests for each grid tokens-per-request value, every request greedy (or
        with ``sampled``, every request sampled: ``sampled_verify_ms``, the greedy row where not measured).

        Returns:
            ms: [nT] float64 array, linear in batch size between grid rows (padded: the row at or above ``batch``).
        Raises:
            ProfileRangeError: ``batch`` outside ``[batch_sizes[0], batch_sizes[-1]]``.
        """
        i0, i1, w = self._batch_weights(batch, ceiling=self.padded)
        table = self._tables[2 if sampled else 1]
        return (1.0 - w) * table[i0] + w * table[i1]

    def verify_time_ms(self, tokens: ArrayLike, *, batch: int, sampled: ArrayLike = 0.0) -> np.ndarray:
        """Verify-step time of ``tokens`` total tokens over ``batch`` requests (ms).

        Args:
            tokens: N, a number or an array of any shape (a CPU torch tensor too), total tokens of the step
                (``batch <= N <= batch * tokens_per_request[-1]``; for a padded profile ``B (1 + max l)``, as
                :meth:`step_tokens` gives it).
            batch: B, requests in the step.
            sampled: f in [0, 1], the fraction of the step's rows that are sampled (module docstring, "Sampled
                rows"), a number or an array broadcastable against ``tokens``.
        Returns:
            ms: float64 array of the broadcast shape; interpolated (ragged) or the cell at or above (padded).
        Raises:
            ProfileRangeError: batch or N / B outside the grid.
            ValueError: ``sampled`` outside [0, 1].
        """
        f = np.asarray(sampled, dtype=np.float64)
        if f.size and not ((f >= 0) & (f <= 1)).all():
            raise ValueError(f"sampled must be a fraction in [0, 1], got {f.min()}..{f.max()}")
        n = np.asarray(tokens, dtype=np.float64)
        per_request = n / batch
        low, high = float(per_request.min()), float(per_request.max())
        if low < 1.0 - 1e-9 or high > self.tokens_per_request[-1] + 1e-9:
            raise ProfileRangeError(
                f"tokens per request {low:.3g}..{high:.3g} (N={n.min():.0f}..{n.max():.0f}, "
                f"B={batch}) outside the profile grid [1, {self.tokens_per_request[-1]}]"
            )
        greedy, sampled_row = self.verify_row(batch), self.verify_row(batch, sampled=True)
        if self.padded:  # the first grid column at or above (a hair of slack for N / B's rounding)
            column = np.searchsorted(self._tables[0], per_request - 1e-9, side="left")
            low_ms, high_ms = greedy[column], sampled_row[column]
        else:
            low_ms = np.interp(per_request, self._tables[0], greedy)
            high_ms = np.interp(per_request, self._tables[0], sampled_row)
        return np.asarray(low_ms + f * (high_ms - low_ms))

    def draft_time_ms(self, batch: int) -> float:
        """Drafter-step time for ``batch`` requests (ms), linear in batch size between grid rows.

        Raises:
            ProfileRangeError: ``batch`` outside the grid.
        """
        i0, i1, w = self._batch_weights(batch)
        return (1.0 - w) * self.draft_ms[i0] + w * self.draft_ms[i1]

    def step_time_ms(self, tokens: ArrayLike, *, batch: int, with_draft: bool = True,
                     sampled: ArrayLike = 0.0) -> np.ndarray:
        """One decoding round: verify step (``sampled`` as in :meth:`verify_time_ms`), plus the drafter step when the
        round runs the drafter (ms).

        The drafter runs before the verify lengths are known, so a round that called it pays it whatever
        lengths the policy picks; plain decoding (policy ``none``) and a round of prompt-lookup drafts do not.
        """
        ms = self.verify_time_ms(tokens, batch=batch, sampled=sampled)
        return ms + self.draft_time_ms(batch) if with_draft else ms

    def steps_per_second(self, tokens: ArrayLike, *, batch: int, with_draft: bool = True,
                         sampled: ArrayLike = 0.0) -> np.ndarray:
        """SPS(N) = 1000 / step_time_ms(N) (steps/s), the throughput term of ``Theta = tau * SPS`` (DSpark Sec. 3)."""
        return 1000.0 / self.step_time_ms(tokens, batch=batch, with_draft=with_draft, sampled=sampled)

    def ensure_covers(self, *, max_batch: int, gamma: int) -> None:
        """Raise unless every step of up to ``max_batch`` requests verifying up to ``gamma`` tokens is on the grid.

        Raises:
            ProfileRangeError: naming the batch size or gamma the grid does not reach.
        """
        self._batch_weights(max_batch)
        if gamma > self.max_verify_len:
            raise ProfileRangeError(
                f"gamma {gamma} needs tokens_per_request up to {gamma + 1}, profile stops at {self.tokens_per_request[-1]}"
            )

    def ensure_matches(self, model_name: str, *, dtype: str | None = None, engine: str | None = None) -> None:
        """Raise unless this profile was made for ``model_name`` (and ``dtype`` / ``engine`` when given).

        Models compare as :func:`model_matches` does.

        Raises:
            ProfileMismatchError: naming the field, the profile's value and the running value.
        """
        prov = self.provenance
        checks = [("model", _name_key(prov.model), _name_key(model_name), prov.model, model_name)]
        if dtype is not None:
            checks.append(("dtype", prov.dtype.lower(), dtype.lower(), prov.dtype, dtype))
        if engine is not None:
            checks.append(("engine", prov.engine.lower(), engine.lower(), prov.engine, engine))
        for field, have, want, shown_have, shown_want in checks:
            if have != want:
                raise ProfileMismatchError(
                    f"profile {field} {shown_have!r} does not match the running {field} {shown_want!r}; "
                    "measure a profile for this setup with the profiler CLI"
                )


def check_grid(batch_sizes: list[int], tokens_per_request: list[int]) -> None:
    """Raise ValueError unless ``batch_sizes`` and ``tokens_per_request`` make a profile's grid: strictly increasing
    integers >= 1, the tokens starting at 1 (plain decoding)."""
    _check_increasing("batch_sizes", batch_sizes, minimum=1)
    _check_increasing("tokens_per_request", tokens_per_request, minimum=1)
    if tokens_per_request[0] != 1:
        raise ValueError(f"tokens_per_request must start at 1 (plain decoding), got {tokens_per_request[0]}")


def _check_increasing(name: str, values: list[int], *, minimum: int) -> None:
    if values[0] < minimum or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be strictly increasing integers >= {minimum}, got {values}")


def _model_key(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def model_matches(profile_model: str, model: str) -> bool:
    """Whether a profile of ``profile_model`` (``Provenance.model``) applies to ``model``: names compare
    case-insensitively on their last path component, so 'HuggingFaceTB/SmolLM2-135M' matches 'smollm2-135m', and
    without a ``DUMMY_SUFFIX``, so a dummy-weights profile '<name>-dummy' matches '<name>' (module docstring)."""
    return _name_key(profile_model) == _name_key(model)


def _is_dummy(name: str) -> bool:
    return _model_key(name).endswith(DUMMY_SUFFIX)


def _name_key(name: str) -> str:
    return _model_key(name).removesuffix(DUMMY_SUFFIX)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def profile_filename(provenance: Provenance, verify_step: VerifyStep = "ragged") -> str:
    """``<engine>-<model>-<hardware>.json``, lower-case, non-alphanumerics turned into '-'; a padded engine's profile
    (``verify_step`` bucketed or cuda_graphs) ends ``-<verify_step>.json``, so it sits beside the ragged one."""
    step = "" if verify_step == "ragged" else f"-{_slug(verify_step)}"
    return f"{_slug(provenance.engine)}-{_slug(_model_key(provenance.model))}-{_slug(provenance.hardware)}{step}.json"


def measured_profiles(directory: str | Path, *, model: str, verify_step: VerifyStep | None = None
                      ) -> list[tuple[Provenance, Path]]:
    """The measured profiles in ``directory`` that apply to ``model`` (``model_matches``), and when given were
    measured with ``verify_step``: those timed on its real weights first, then the dummy-weights ones, each newest
    first. Derived profiles are left out.

    Raises:
        pydantic.ValidationError: a JSON file in ``directory`` that is not a valid profile.
    """
    found = [(profile.provenance, path) for path in sorted(Path(directory).glob("*.json"))
             for profile in [load_profile(path)]
             if profile.provenance.source == "measured" and model_matches(profile.provenance.model, model)
             and verify_step in (None, profile.verify_step)]
    return sorted(found, key=lambda item: (not _is_dummy(item[0].model), item[0].date), reverse=True)


def load_profile(path: str | Path) -> ThroughputProfile:
    """Read and validate a profile JSON file.

    Raises:
        FileNotFoundError: no such file.
        pydantic.ValidationError: the file does not match the schema (the message names the field).
    """
    return ThroughputProfile.model_validate_json(Path(path).read_text())


def save_profile(profile: ThroughputProfile, path: str | Path) -> Path:
    """Write ``profile`` as indented JSON to ``path`` (parent folders created; written beside it, then renamed, so a
    concurrent reader never sees half a file; a table not measured is left out, not written as null); returns the
    path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.model_dump(mode="json", exclude_none=True), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def write_profile(
    *,
    directory: str | Path,
    provenance: Provenance,
    batch_sizes: list[int],
    tokens_per_request: list[int],
    verify_ms: list[list[float]],
    draft_ms: list[float],
    draft_gamma: int,
    verify_step: VerifyStep = "ragged",
    sampled_verify_ms: list[list[float]] | None = None,
) -> Path:
    """Validate measured (or derived) step times and write ``directory/<engine>-<model>-<hardware>.json``
    (``profile_filename``: padded engines' profiles get their ``verify_step`` appended).

    Entry point for the profiler CLI: it times the grid, then calls this with plain lists.

    Returns:
        The written path.
    Raises:
        pydantic.ValidationError: the numbers do not form a valid profile (see :class:`ThroughputProfile`).
    """
    profile = ThroughputProfile(
        provenance=provenance,
        batch_sizes=batch_sizes,
        tokens_per_request=tokens_per_request,
        verify_ms=verify_ms,
        sampled_verify_ms=sampled_verify_ms,
        draft_ms=draft_ms,
        draft_gamma=draft_gamma,
        verify_step=verify_step,
    )
    return save_profile(profile, Path(directory) / profile_filename(provenance, verify_step))
