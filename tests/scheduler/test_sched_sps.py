"""SPS table: monotone fix-up, interpolation / clamping / extrapolation, dense view, JSON keyed by setup,
profiler.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from scheduler.sps import (
    SPSMonotonicityWarning,
    SPSTable,
    SPSTableMismatchWarning,
    cuda_event_timer,
    default_batch_grid,
    profile_sps,
    thread_clock_usable,
    thread_cpu_timer,
    wall_clock_timer,
)


def test_interpolates_clamps_and_extrapolates() -> None:
    table = SPSTable([4, 8, 16], [100.0, 80.0, 40.0])
    np.testing.assert_allclose(table.steps_per_second([1, 4, 6, 8, 12, 16]), [100, 100, 90, 80, 60, 40])
    # Beyond the grid the token throughput B * SPS(B) stays at 16 * 40 = 640 tokens/s.
    np.testing.assert_allclose(table.steps_per_second([32, 64]), [20.0, 10.0])
    assert float(table(12)) == pytest.approx(60.0)


def test_dense_view_matches_and_is_exactly_monotone() -> None:
    table = SPSTable([1, 3, 50, 200], [50.0, 49.0, 20.0, 7.0])
    dense = table.dense(5000)
    assert dense.size > 5000
    np.testing.assert_allclose(dense[1:5001], table.steps_per_second(np.arange(1, 5001)), rtol=1e-12)
    assert np.all(np.diff(dense) <= 0)
    np.testing.assert_allclose(table.dense_step_time(10)[1:11], 1.0 / dense[1:11])
    assert table.dense(20_000).size > 20_000  # grows on demand


def test_non_monotone_table_is_fixed_by_running_minimum_with_a_warning() -> None:
    with pytest.warns(SPSMonotonicityWarning, match=r"B=\[32\]"):
        table = SPSTable([32, 8, 16], [70.0, 100.0, 60.0])  # unsorted input, faster at 32 than at 16
    np.testing.assert_array_equal(table.batch_sizes, [8, 16, 32])
    np.testing.assert_array_equal(table.steps_per_s, [100.0, 60.0, 60.0])
    np.testing.assert_array_equal(table.measured_steps_per_s, [100.0, 60.0, 70.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SPSTable([1, 2], [5.0, 5.0])  # flat is monotone: no warning


@pytest.mark.parametrize(
    ("sizes", "rates", "match"),
    [
        ([], [], "empty"),
        ([1, 2], [1.0], "equal length"),
        ([[1, 2]], [[1.0, 2.0]], "1-D"),
        ([0, 2], [1.0, 1.0], ">= 1"),
        ([1, 1], [1.0, 1.0], "unique"),
        ([1.5], [1.0], "integers"),
        ([1, 2], [1.0, float("nan")], "finite"),
        ([1, 2], [1.0, 0.0], "> 0"),
        (["a"], [1.0], "numbers"),
        ([1], [None], "finite"),
    ],
)
def test_bad_tables_raise(sizes: list, rates: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SPSTable(sizes, rates)


def test_bad_batch_tokens_raise() -> None:
    with pytest.raises(ValueError):
        SPSTable([1], [1.0]).steps_per_second([0])


def test_json_round_trip_and_setup_mismatch_warning(tmp_path: Path) -> None:
    with pytest.warns(SPSMonotonicityWarning):
        table = SPSTable([1, 8, 64], [90.0, 95.0, 30.0], model="qwen3-4b", device="H200", dtype="bfloat16")
    path = table.save(tmp_path / "sps" / "table.json")
    with pytest.warns(SPSMonotonicityWarning):  # raw measurements are stored; the fix-up is re-applied
        loaded = SPSTable.load(path, model="qwen3-4b", device="H200", dtype="bfloat16")
    np.testing.assert_array_equal(loaded.steps_per_s, table.steps_per_s)
    np.testing.assert_array_equal(loaded.measured_steps_per_s, table.measured_steps_per_s)
    assert (loaded.model, loaded.device, loaded.dtype) == ("qwen3-4b", "H200", "bfloat16")
    with pytest.warns(SPSTableMismatchWarning, match="device 'H200' != 'cpu'"), warnings.catch_warnings():
        warnings.simplefilter("ignore", SPSMonotonicityWarning)
        SPSTable.load(path, model="qwen3-4b", device="cpu")


def test_bad_json_raises(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        SPSTable.load(tmp_path / "broken.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not an SPS table"):
        SPSTable.load(tmp_path / "other.json")
    (tmp_path / "partial.json").write_text(json.dumps({"format": "dspark-sps/1", "batch_sizes": [1]}))
    with pytest.raises(ValueError, match="lacks"):
        SPSTable.load(tmp_path / "partial.json")


def test_default_grid() -> None:
    assert default_batch_grid(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert default_batch_grid(64, min_batch_tokens=10) == [10, 12, 16, 24, 32, 48, 64]
    with pytest.raises(ValueError):
        default_batch_grid(0)


def test_profiler_uses_warmup_and_medians() -> None:
    calls: list[int] = []

    def run_step(batch: int) -> None:
        calls.append(batch)

    durations = {2: iter([0.010, 0.011, 5.0, 0.012, 0.009]), 4: iter([0.020, 0.021, 0.019, 0.02, 9.0])}

    def scripted_timer(thunk: Callable[[], object]) -> float:
        thunk()  # the step really runs; only its duration is scripted (like a CUDA-event timer's reading)
        return next(durations[calls[-1]])

    table = profile_sps(
        run_step, [2, 4], warmup=2, repeats=5, timer=scripted_timer, progress=False, model="m"
    )
    # Warm-up passes over every B, then timed passes alternating the order (a burst hits one pass of each B).
    assert calls == [2, 4] * 2 + [2, 4, 4, 2] * 2 + [2, 4]
    np.testing.assert_allclose(table.steps_per_s, [1 / 0.011, 1 / 0.020], rtol=0.1)  # outliers 5 s, 9 s ignored
    assert table.model == "m"


def test_profiler_measures_a_real_step() -> None:
    weight = torch.randn(64, 64)

    def run_step(batch: int) -> None:
        torch.randn(batch, 64) @ weight

    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", SPSMonotonicityWarning
        )  # timing noise on a shared CPU may need fixing
        table = profile_sps(
            run_step, [1, 16, 256], warmup=1, repeats=3, timer=wall_clock_timer, progress=False
        )
    assert table.batch_sizes.tolist() == [1, 16, 256]
    assert np.all(np.isfinite(table.measured_steps_per_s)) and np.all(table.measured_steps_per_s > 0)


def test_thread_cpu_timer_profiles_a_real_step() -> None:
    """The CPU-time clock reads real work as positive seconds, so a whole profile by it is a valid table."""
    assert thread_clock_usable()  # Linux: clock_gettime(CLOCK_THREAD_CPUTIME_ID), nanoseconds
    weight = torch.randn(64, 64)

    def run_step(batch: int) -> None:
        torch.randn(batch, 64) @ weight

    assert thread_cpu_timer(lambda: run_step(256)) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SPSMonotonicityWarning)
        table = profile_sps(run_step, [1, 16, 256], warmup=1, repeats=3, timer=thread_cpu_timer, progress=False)
    assert np.all(np.isfinite(table.measured_steps_per_s)) and np.all(table.measured_steps_per_s > 0)


def test_profiler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        profile_sps(lambda b: None, [], progress=False)
    with pytest.raises(ValueError):
        profile_sps(lambda b: None, [0], progress=False)
    with pytest.raises(ValueError):
        profile_sps(lambda b: None, [1], repeats=0, progress=False)
    with pytest.raises(ValueError, match="non-positive"):
        profile_sps(lambda b: None, [1], timer=lambda thunk: 0.0, progress=False)


@pytest.mark.gpu
def test_cuda_event_timer_measures_gpu_work() -> None:
    x = torch.randn(2048, 2048, device="cuda")
    elapsed = cuda_event_timer()(lambda: x @ x)
    assert elapsed > 0
