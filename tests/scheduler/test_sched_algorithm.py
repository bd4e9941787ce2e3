"""Algorithm 1: exactness against a plain walk, prefix validity, brute force, zeros, causality, bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scheduler.algorithm import DraftCost, greedy_path, schedule_lengths
from scheduler.sps import SPSTable

# Confidences on a 1/64 grid: every prefix product is exact in float64, so the vectorised sort and a plain
# Python sort see exactly the same values (ties included: they are frequent on this grid).
GRID = 64


@st.composite
def confidence_arrays(draw: st.DrawFn, max_requests: int = 6, max_gamma: int = 6) -> np.ndarray:
    num_requests = draw(st.integers(1, max_requests))
    gamma = draw(st.integers(1, max_gamma))
    ticks = draw(st.lists(st.integers(0, GRID), min_size=num_requests * gamma, max_size=num_requests * gamma))
    return np.array(ticks, dtype=np.float64).reshape(num_requests, gamma) / GRID


@st.composite
def sps_tables(draw: st.DrawFn) -> SPSTable:
    """Monotone tables: a latency floor plus a per-token cost, on a random grid."""
    sizes = sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=8)))
    floor = draw(st.floats(1e-3, 1e-1))
    per_token = draw(st.floats(0.0, 2e-2))
    times = floor + per_token * np.asarray(sizes, dtype=np.float64)
    return SPSTable(sizes, np.minimum.accumulate(1.0 / times))


draft_costs = st.one_of(
    st.none(),
    st.builds(DraftCost, st.floats(0.0, 0.2), st.floats(0.0, 0.01), st.floats(0.0, 0.01)),
)


def plain_walk(conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None = None) -> np.ndarray:
    """Algorithm 1 exactly as the paper lists it, one Python step per token (the reference)."""
    num_requests, gamma = conf.shape
    survival = np.cumprod(conf, axis=1)
    items = [(survival[r, j], j, r) for r in range(num_requests) for j in range(gamma) if survival[r, j] > 0]
    items.sort(key=lambda item: (-item[0], item[1], item[2]))
    dense = sps.dense(num_requests * (gamma + 1))
    step_time = sps.dense_step_time(num_requests * (gamma + 1))

    def objective(tau: float, batch: int) -> float:
        if draft_cost is None:
            return tau * dense[batch]
        return tau / (step_time[batch] + float(draft_cost.seconds(num_requests, np.float64(batch))))

    lengths = np.zeros(num_requests, dtype=np.int64)
    batch, tau = num_requests, float(num_requests)
    best = objective(tau, batch)
    for a, j, r in items:
        theta = objective(tau + a, batch + 1)
        if not theta > best:
            break
        best, tau, batch = theta, tau + a, batch + 1
        lengths[r] = j + 1
    return lengths


def theta_of(lengths: np.ndarray, conf: np.ndarray, sps: SPSTable) -> float:
    survival = np.cumprod(conf, axis=1)
    tau = len(lengths) + sum(survival[r, : lengths[r]].sum() for r in range(len(lengths)))
    return tau * float(sps.dense(int(lengths.sum()) + len(lengths))[len(lengths) + int(lengths.sum())])


@settings(max_examples=300, deadline=None)
@given(confidence_arrays(), sps_tables(), draft_costs)
def test_matches_the_plain_walk(conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None) -> None:
    np.testing.assert_array_equal(
        schedule_lengths(conf, sps, draft_cost=draft_cost), plain_walk(conf, sps, draft_cost)
    )


@settings(max_examples=300, deadline=None)
@given(confidence_arrays(), sps_tables(), draft_costs)
def test_lengths_are_valid_prefixes_of_the_walk(
    conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None
) -> None:
    lengths = schedule_lengths(conf, sps, draft_cost=draft_cost)
    num_requests, gamma = conf.shape
    assert lengths.shape == (num_requests,) and lengths.dtype == np.int64
    assert np.all((lengths >= 0) & (lengths <= gamma))
    survival = np.cumprod(conf, axis=1)
    for r in range(num_requests):
        assert np.all(survival[r, : lengths[r]] > 0), "a zero-survival token was admitted"
    path = greedy_path(conf, sps, draft_cost=draft_cost)
    # The lemma that makes the vectorised form valid: in walk order, each request's positions come as 1, 2, 3,
    # ...
    for r in range(num_requests):
        positions = path.positions[path.requests == r]
        np.testing.assert_array_equal(positions, np.arange(1, positions.size + 1))
    # The admitted set is exactly the first n* items of the walk, and n* is the first non-improving step.
    assert lengths.sum() == path.stop
    np.testing.assert_array_equal(np.bincount(path.requests[: path.stop], minlength=num_requests), lengths)
    assert np.all(np.diff(path.theta[: path.stop + 1]) > 0)
    if path.stop < path.theta.size - 1:
        assert path.theta[path.stop + 1] <= path.theta[path.stop]


@settings(max_examples=300, deadline=None)
@given(confidence_arrays(max_requests=3, max_gamma=4), sps_tables())
def test_early_stop_equals_brute_force_when_theta_is_unimodal(conf: np.ndarray, sps: SPSTable) -> None:
    theta = greedy_path(conf, sps).theta
    peak = int(np.argmax(theta))
    unimodal = np.all(np.diff(theta[: peak + 1]) > 0) and np.all(np.diff(theta[peak:]) <= 0)
    assume(unimodal)
    num_requests, gamma = conf.shape
    best = max(
        theta_of(np.array(choice), conf, sps)
        for choice in itertools.product(range(gamma + 1), repeat=num_requests)
    )
    assert theta_of(schedule_lengths(conf, sps), conf, sps) == pytest.approx(best, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(confidence_arrays(), sps_tables(), draft_costs, st.data())
def test_zero_confidence_is_never_verified(
    conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None, data: st.DataObject
) -> None:
    num_requests, gamma = conf.shape
    zero_at = data.draw(st.lists(st.integers(-1, gamma - 1), min_size=num_requests, max_size=num_requests))
    for r, j in enumerate(zero_at):
        if j >= 0:
            conf[r, j] = 0.0
    lengths = schedule_lengths(conf, sps, draft_cost=draft_cost)
    for r, j in enumerate(zero_at):
        if j >= 0:
            assert lengths[r] <= j  # position j + 1 (1-based) and beyond are never verified
    flat = SPSTable([1], [1.0])  # verification is free: every positive prefix is worth verifying
    assert np.all(schedule_lengths(np.zeros((num_requests, gamma)), flat) == 0)


@settings(max_examples=200, deadline=None)
@given(confidence_arrays(), sps_tables(), draft_costs, st.data())
def test_admission_of_a_token_ignores_everything_drafted_after_it(
    conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None, data: st.DataObject
) -> None:
    """Losslessness, as a property: verifying x[r, j] cannot depend on c[r, j+1:] (which read x[r, j])."""
    num_requests, gamma = conf.shape
    lengths = schedule_lengths(conf, sps, draft_cost=draft_cost)
    r = data.draw(st.integers(0, num_requests - 1))
    j = data.draw(st.integers(1, gamma))
    changed = conf.copy()
    tail = data.draw(st.lists(st.integers(0, GRID), min_size=gamma - j, max_size=gamma - j))
    changed[r, j:] = np.array(tail, dtype=np.float64) / GRID
    assert (schedule_lengths(changed, sps, draft_cost=draft_cost)[r] >= j) == (lengths[r] >= j)


@settings(max_examples=150, deadline=None)
@given(confidence_arrays(), sps_tables(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_a_longer_draft_time_never_shortens_verification(
    conf: np.ndarray, sps: SPSTable, small: float, extra: float
) -> None:
    shorter = schedule_lengths(conf, sps, draft_cost=DraftCost(fixed_s=small))
    longer = schedule_lengths(conf, sps, draft_cost=DraftCost(fixed_s=small + extra))
    assert longer.sum() >= shorter.sum()
    np.testing.assert_array_equal(
        schedule_lengths(conf, sps, draft_cost=DraftCost()), schedule_lengths(conf, sps)
    )


def test_papers_example_stops_after_the_first_token() -> None:
    sps = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
    path = greedy_path(np.array([[0.8, 0.9]]), sps)
    np.testing.assert_allclose(path.theta, [1.0, 0.9, (1.8 + 0.72) * 0.45])
    assert path.stop == 0  # Theta drops at x1, although verifying both would score higher
    assert schedule_lengths(np.array([[0.8, 0.9]]), sps).tolist() == [0]


def test_ties_go_to_the_lower_position_then_the_lower_request() -> None:
    # Flat steps/s up to B = 7, then 20x slower: exactly 4 draft tokens fit for R = 3 requests of certain
    # drafts.
    sps = SPSTable([7, 8], [1.0, 0.05])
    lengths = schedule_lengths(np.ones((3, 4)), sps)
    assert lengths.tolist() == [2, 1, 1]  # walk: (r0,1), (r1,1), (r2,1), (r0,2)
    assert schedule_lengths(np.ones((3, 4), dtype=np.float32), sps).tolist() == [2, 1, 1]


def test_free_verification_admits_every_positive_prefix() -> None:
    conf = np.array([[0.9, 0.0, 0.5], [0.3, 0.2, 0.1], [0.0, 1.0, 1.0]])
    assert schedule_lengths(conf, SPSTable([1, 100], [5.0, 5.0])).tolist() == [1, 3, 0]
    # And a prohibitive per-token price admits nothing.
    assert schedule_lengths(conf, SPSTable([3, 4], [1.0, 1e-6])).tolist() == [0, 0, 0]


def test_large_batch_matches_the_plain_walk_and_reuses_buffers() -> None:
    rng = np.random.default_rng(7)
    sizes = np.array([1, 64, 256, 1024, 4096])
    sps = SPSTable(sizes, 1.0 / (0.01 + 2e-6 * sizes))
    for num_requests, gamma in ((256, 16), (700, 8), (3, 16), (256, 16)):
        conf = rng.beta(5, 1.2, size=(num_requests, gamma))
        lengths = schedule_lengths(conf, sps)
        np.testing.assert_array_equal(lengths, plain_walk(conf, sps))
        assert 0 < lengths.sum() <= conf.size


def test_empty_and_degenerate_batches() -> None:
    sps = SPSTable([1, 8], [2.0, 1.0])
    empty = schedule_lengths(np.zeros((0, 7)), sps)
    assert empty.shape == (0,) and empty.dtype == np.int64
    assert schedule_lengths(np.zeros((4, 0)), sps).tolist() == [0, 0, 0, 0]
    assert greedy_path(np.zeros((0, 3)), sps).stop == 0


@pytest.mark.parametrize(
    "conf",
    [
        np.array([[0.5, np.nan]]),
        np.array([[0.5, np.inf]]),
        np.array([[-0.1, 0.5]]),
        np.array([[0.5, 1.0 + 1e-9]]),
        np.array([0.5, 0.4]),
        np.zeros((2, 2, 2)),
        np.array([[True, False]]),
        np.array([["0.5"]]),
        np.array([[0.5 + 0j]]),
    ],
)
def test_bad_confidences_raise(conf: np.ndarray) -> None:
    with pytest.raises(ValueError):
        schedule_lengths(conf, SPSTable([1], [1.0]))


def test_bad_sps_and_draft_cost_raise() -> None:
    with pytest.raises(ValueError, match="SPSTable"):
        schedule_lengths(np.ones((1, 1)), {1: 1.0})  # type: ignore[arg-type]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="DraftCost"):
            DraftCost(fixed_s=bad)
    with pytest.raises(ValueError, match="DraftCost"):
        DraftCost(per_token_s="1")  # type: ignore[arg-type]
