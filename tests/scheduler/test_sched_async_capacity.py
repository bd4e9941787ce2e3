"""Asynchronous capacity variant: global-search planning, top-K admission, lag bookkeeping, causality."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.algorithm import greedy_path, schedule_lengths
from scheduler.async_capacity import AsyncCapacityScheduler, admit_top_k, plan_capacity
from scheduler.sps import SPSTable

GRID = 64
SIZES = np.array([1, 4, 16, 64, 256])
SPS = SPSTable(SIZES, 1.0 / (0.01 + 1e-3 * SIZES))


@st.composite
def confidence_arrays(draw: st.DrawFn) -> np.ndarray:
    num_requests = draw(st.integers(1, 6))
    gamma = draw(st.integers(1, 6))
    ticks = draw(st.lists(st.integers(0, GRID), min_size=num_requests * gamma, max_size=num_requests * gamma))
    return np.array(ticks, dtype=np.float64).reshape(num_requests, gamma) / GRID


@settings(max_examples=200, deadline=None)
@given(confidence_arrays())
def test_plan_is_the_global_argmax_and_never_below_the_early_stop(conf: np.ndarray) -> None:
    path = greedy_path(conf, SPS)
    capacity = plan_capacity(conf, SPS)
    assert path.theta[capacity] == path.theta.max()
    assert np.all(path.theta[:capacity] < path.theta[capacity])  # the first maximum
    assert capacity >= path.stop


@settings(max_examples=200, deadline=None)
@given(confidence_arrays(), st.integers(0, 40))
def test_top_k_admits_valid_prefixes_of_the_walk(conf: np.ndarray, capacity: int) -> None:
    lengths = admit_top_k(conf, capacity)
    path = greedy_path(conf, SPS)
    admitted = min(capacity, path.requests.size)  # only positive-survival tokens can be admitted
    assert lengths.sum() == admitted
    np.testing.assert_array_equal(np.bincount(path.requests[:admitted], minlength=conf.shape[0]), lengths)
    survival = np.cumprod(conf, axis=1)
    for r, length in enumerate(lengths):
        assert np.all(survival[r, :length] > 0)


@settings(max_examples=200, deadline=None)
@given(confidence_arrays(), st.integers(0, 40), st.data())
def test_top_k_admission_ignores_everything_drafted_after_a_token(
    conf: np.ndarray, capacity: int, data: st.DataObject
) -> None:
    num_requests, gamma = conf.shape
    r = data.draw(st.integers(0, num_requests - 1))
    j = data.draw(st.integers(1, gamma))
    changed = conf.copy()
    tail = data.draw(st.lists(st.integers(0, GRID), min_size=gamma - j, max_size=gamma - j))
    changed[r, j:] = np.array(tail, dtype=np.float64) / GRID
    assert (admit_top_k(changed, capacity)[r] >= j) == (admit_top_k(conf, capacity)[r] >= j)


def test_rounds_use_the_capacity_planned_lag_rounds_earlier() -> None:
    rng = np.random.default_rng(3)
    rounds = [rng.beta(4, 1.5, size=(int(rng.integers(2, 30)), 8)) for _ in range(12)]
    lag = 2
    scheduler = AsyncCapacityScheduler(SPS, lag=lag)
    for t, conf in enumerate(rounds):
        expected_capacity = scheduler.next_capacity
        lengths = scheduler.step(conf)
        if t < lag:  # warm-up: Algorithm 1 on the round's own confidences
            assert expected_capacity is None
            np.testing.assert_array_equal(lengths, schedule_lengths(conf, SPS))
        else:
            assert expected_capacity == plan_capacity(rounds[t - lag], SPS)
            np.testing.assert_array_equal(lengths, admit_top_k(conf, expected_capacity))


def test_edge_cases_and_bad_input() -> None:
    assert plan_capacity(np.zeros((0, 4)), SPS) == 0
    assert admit_top_k(np.zeros((0, 4)), 5).shape == (0,)
    assert admit_top_k(np.ones((3, 0)), 5).tolist() == [0, 0, 0]
    assert admit_top_k(np.full((2, 3), 0.5), 0).tolist() == [0, 0]
    assert admit_top_k(np.array([[0.5, 0.0, 0.5], [0.0, 1.0, 1.0]]), 100).tolist() == [1, 0]
    for capacity in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="capacity"):
            admit_top_k(np.ones((1, 1)), capacity)  # type: ignore[arg-type]
    for lag in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="lag"):
            AsyncCapacityScheduler(SPS, lag=lag)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AsyncCapacityScheduler(SPS).step(np.array([[0.5, np.nan]]))
    with pytest.raises(ValueError):
        plan_capacity(np.array([[2.0]]), SPS)
