"""Profile schema: round trip, validation errors, interpolation, range and model checks."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch

from app.scheduling.profile import (
    ProfileMismatchError,
    ProfileRangeError,
    ThroughputProfile,
    load_profile,
    measured_profiles,
    model_matches,
    save_profile,
    write_profile,
)
from tests.scheduling.helpers import make_profile, provenance


def linear(b: int, n: int) -> float:
    return 10.0 + 2.0 * b + 0.5 * n


def test_round_trip_via_write_profile(tmp_path):
    profile = make_profile(linear, draft=3.0)
    path = write_profile(
        directory=tmp_path, provenance=profile.provenance, batch_sizes=profile.batch_sizes,
        tokens_per_request=profile.tokens_per_request, verify_ms=profile.verify_ms,
        draft_ms=profile.draft_ms, draft_gamma=7,
    )
    assert path.name == "test-smollm2-135m-instruct-test-cpu.json"
    assert load_profile(path) == profile


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"verify_ms": [[1.0, 2.0]]}, "verify_ms must be"),
        ({"draft_ms": [1.0]}, "draft_ms must have"),
        ({"batch_sizes": [2, 1, 3, 4, 8]}, "strictly increasing"),
        ({"tokens_per_request": [2, 3, 4, 5, 6, 7, 8, 9]}, "must start at 1"),
        ({"unknown_key": 1}, "unknown_key"),
    ],
)
def test_bad_profiles_name_the_problem(tmp_path, change, message):
    data = {**make_profile(linear).model_dump(mode="json"), **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(pydantic.ValidationError, match=message):
        load_profile(path)


def test_decreasing_and_non_positive_times_rejected():
    with pytest.raises(pydantic.ValidationError, match="must not decrease"):
        make_profile(lambda b, n: 100.0 - n)
    with pytest.raises(pydantic.ValidationError, match="> 0 ms"):
        make_profile(lambda b, n: 0.0)


def test_interpolation_linear_in_tokens_and_batch():
    profile = make_profile(linear, batch_sizes=(1, 4), tokens_per_request=(1, 2, 8))
    # batch 4 grid row: N = 4, 8, 32 -> 20, 22, 34 ms; N = 20 lies between tpr 2 and 8: 22 + 12 * 0.5 = 28.
    assert profile.verify_time_ms(20, batch=4).item() == pytest.approx(28.0)
    # batch 2 blends rows 1 and 4 at equal tokens per request: tpr 1.5 -> row1 12.75, row4 21 -> 1/3 weight.
    expected = (2 / 3) * 12.75 + (1 / 3) * 21.0
    assert profile.verify_time_ms(3, batch=2).item() == pytest.approx(expected)
    sps = profile.steps_per_second(torch.tensor([4.0, 8.0]), batch=4, with_draft=False)  # a tensor reads as an array
    np.testing.assert_allclose(sps, [50.0, 1000 / 22])


def test_padded_profiles_look_up_by_ceiling(tmp_path):
    """An engine that pads steps to buckets costs the grid cell at or above B and the longest run: no blend."""
    grid = dict(batch_sizes=(1, 2, 4, 8), tokens_per_request=(1, 2, 4, 8))
    padded = make_profile(lambda b, n: 100.0 * b + n // b, verify_step="bucketed", **grid)  # cell (B, t) = 100 B + t
    ragged = make_profile(lambda b, n: 100.0 * b + n // b, **grid)
    assert padded.padded and not ragged.padded
    for b, t in [(1, 1), (2, 4), (8, 8)]:  # grid points: both layouts read the cell
        cell = 100 * b + t
        assert padded.verify_time_ms(b * t, batch=b).item() == ragged.verify_time_ms(b * t, batch=b).item() == cell
    np.testing.assert_array_equal(padded.verify_time_ms(np.array([3, 9, 15, 24]), batch=3), [401, 404, 408, 408])
    np.testing.assert_array_equal(padded.verify_row(5), [801, 802, 804, 808])
    assert isinstance(padded.verify_time_ms(6, batch=3), np.ndarray)  # as the ragged lookup gives it
    assert ragged.verify_time_ms(9, batch=3).item() == pytest.approx(303.0)  # interpolated in t, then in B
    assert padded.draft_time_ms(3) == ragged.draft_time_ms(3)  # the drafter is not padded
    with pytest.raises(ProfileRangeError, match="tokens per request"):
        padded.verify_time_ms(27, batch=3)
    with pytest.raises(ProfileRangeError, match="batch size 9"):
        padded.verify_time_ms(9, batch=9)
    # the N to look a step up at: every run padded to the longest, or the tokens themselves
    assert padded.step_tokens(batch=3, verified=5, longest=3) == 12
    assert ragged.step_tokens(batch=3, verified=5, longest=3) == 8
    # the layout travels with the file; a file written before the field reads as ragged
    path = write_profile(
        directory=tmp_path, provenance=padded.provenance, batch_sizes=padded.batch_sizes,
        tokens_per_request=padded.tokens_per_request, verify_ms=padded.verify_ms, draft_ms=padded.draft_ms,
        draft_gamma=7, verify_step="cuda_graphs",
    )
    assert load_profile(path).verify_step == "cuda_graphs"
    # beside the ragged profile of the same engine, model and hardware, not over it
    assert path.name == "test-smollm2-135m-instruct-test-cpu-cuda-graphs.json"
    old = ragged.model_dump(mode="json")
    del old["verify_step"]
    path.write_text(json.dumps(old))
    assert load_profile(path).verify_step == "ragged"
    with pytest.raises(pydantic.ValidationError, match="verify_step"):
        make_profile(linear, verify_step="padded")


def test_sampled_rows_are_priced_from_their_own_table(tmp_path):
    """A step whose fraction f of rows is sampled costs greedy + f (sampled - greedy) at its cell; without a sampled
    table every row is priced as greedy; the table travels with the file and is checked like verify_ms."""
    grid = dict(batch_sizes=(1, 4), tokens_per_request=(1, 2, 8))
    profile = make_profile(linear, sampled=lambda b, n: linear(b, n) + 0.25 * n, **grid)
    assert profile.has_sampled and not make_profile(linear, **grid).has_sampled
    greedy, all_sampled = profile.verify_time_ms(20, batch=4).item(), 28.0 + 0.25 * 20
    assert greedy == pytest.approx(28.0)
    assert profile.verify_time_ms(20, batch=4, sampled=1.0).item() == pytest.approx(all_sampled)
    np.testing.assert_allclose(profile.verify_time_ms(np.array([20, 20]), batch=4, sampled=np.array([0.0, 0.5])),
                               [greedy, (greedy + all_sampled) / 2])
    assert profile.step_time_ms(4, batch=4, with_draft=False, sampled=1.0).item() == pytest.approx(20.0 + 1.0)
    assert make_profile(linear, **grid).verify_time_ms(20, batch=4, sampled=1.0).item() == pytest.approx(greedy)
    padded = make_profile(linear, sampled=lambda b, n: linear(b, n) + 1.0, verify_step="bucketed", **grid)
    assert padded.verify_time_ms(12, batch=4, sampled=0.5).item() == pytest.approx(linear(4, 32) + 0.5)
    # the fraction a step is priced at: its sampled rows, or on a padded engine its sampled requests
    assert profile.sampled_fraction([True, False], [3, 1]) == pytest.approx(4 / 6)
    assert padded.sampled_fraction([True, False], [3, 1]) == pytest.approx(1 / 2)
    assert profile.sampled_fraction([], []) == 0.0
    with pytest.raises(ValueError, match="one verify length per request"):
        profile.sampled_fraction([True], [1, 2])
    with pytest.raises(ValueError, match="sampled must be a fraction"):
        profile.verify_time_ms(20, batch=4, sampled=1.5)
    path = write_profile(
        directory=tmp_path, provenance=profile.provenance, batch_sizes=profile.batch_sizes,
        tokens_per_request=profile.tokens_per_request, verify_ms=profile.verify_ms,
        sampled_verify_ms=profile.sampled_verify_ms, draft_ms=profile.draft_ms, draft_gamma=7,
    )
    assert load_profile(path) == profile
    unsampled = make_profile(linear, **grid)
    path = save_profile(unsampled, tmp_path / "greedy.json")
    assert "sampled_verify_ms" not in json.loads(path.read_text())  # not measured: left out, not null
    for table, message in [([[1.0, 2.0]], "sampled_verify_ms must be"),
                           ([[3.0, 2.0, 4.0], [3.0, 4.0, 5.0]], "sampled_verify_ms must not decrease")]:
        with pytest.raises(pydantic.ValidationError, match=message):
            ThroughputProfile(**{**unsampled.model_dump(), "sampled_verify_ms": table})


def test_range_errors():
    profile = make_profile(linear)
    with pytest.raises(ProfileRangeError, match="batch size 9"):
        profile.verify_time_ms(9, batch=9)
    with pytest.raises(ProfileRangeError, match="tokens per request"):
        profile.verify_time_ms(9 * 2, batch=2)
    with pytest.raises(ProfileRangeError, match="gamma 8"):
        profile.ensure_covers(max_batch=8, gamma=8)
    profile.ensure_covers(max_batch=8, gamma=7)


def test_ensure_matches():
    profile = make_profile(linear)
    profile.ensure_matches("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="BFloat16")
    with pytest.raises(ProfileMismatchError, match="model 'SmolLM2-135M-Instruct'.*'Llama-3.1-8B'"):
        profile.ensure_matches("Llama-3.1-8B")
    with pytest.raises(ProfileMismatchError, match="dtype"):
        profile.ensure_matches("SmolLM2-135M-Instruct", dtype="float32")


def test_dummy_weights_profiles_match_their_model(tmp_path):
    assert model_matches("smollm2-135m-dummy", "smollm2-135m")
    assert model_matches("llama-3.1-8b-dummy", "/models/Llama-3.1-8B/")
    assert not model_matches("llama-3.1-8b-dummy", "Llama-3.1-8B-Instruct")
    assert not model_matches("smollm2-135m", "smollm2")
    dummy = make_profile(linear).model_copy(update={"provenance": provenance(model="SmolLM2-135M-Instruct-dummy")})
    dummy.ensure_matches("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ProfileMismatchError, match="'SmolLM2-135M-Instruct-dummy'.*'Llama-3.1-8B'"):
        dummy.ensure_matches("Llama-3.1-8B")


def test_measured_profiles_list_real_weights_before_dummy_ones(tmp_path):
    def write(name: str, model: str, day: int) -> Path:
        prov = provenance(model=model, source="measured", date=dt.date(2026, 1, day), hardware=name)
        return save_profile(make_profile(linear).model_copy(update={"provenance": prov}), tmp_path / f"{name}.json")

    newest_dummy = write("a", "smollm2-135m-dummy", 30)
    old_real = write("b", "smollm2-135m", 1)
    new_real = write("c", "SmolLM2-135M", 20)
    old_dummy = write("d", "smollm2-135m-dummy", 10)
    write("e", "llama-3.1-8b-dummy", 31)
    found = [path for _, path in measured_profiles(tmp_path, model="smollm2-135m")]
    assert found == [new_real, old_real, newest_dummy, old_dummy]
    graphs = save_profile(make_profile(linear, verify_step="cuda_graphs").model_copy(update={"provenance": provenance(
        model="smollm2-135m", source="measured", hardware="f")}), tmp_path / "f.json")
    found = measured_profiles(tmp_path, model="smollm2-135m", verify_step="cuda_graphs")
    assert [path for _, path in found] == [graphs]
    assert graphs not in [path for _, path in measured_profiles(tmp_path, model="smollm2-135m", verify_step="ragged")]
    assert graphs in [path for _, path in measured_profiles(tmp_path, model="smollm2-135m")]


def test_committed_profiles_load():
    paths = sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.json"))
    assert paths
    for path in paths:
        assert isinstance(load_profile(path), ThroughputProfile)


def test_provenance_forbids_unknown_fields():
    with pytest.raises(pydantic.ValidationError, match="gpu"):
        provenance(gpu="x")
