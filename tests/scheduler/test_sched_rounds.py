"""Algorithm 1 on a stack of rounds (schedule_lengths_rounds) decides what schedule_lengths decides round by round.

Every comparison is exact: the batched walk is what the cluster simulator runs for its many small rounds, and it
must not move a single length of any round (random confidences, ties, zeros and tiny survivals, caps, padding,
both objectives, SPS tables by request count, the recorded decoding traces the simulator replays).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scheduler.algorithm import (
    DraftCost,
    RecordedConfidences,
    schedule_lengths,
    schedule_lengths_rounds,
    schedule_recorded_rounds,
)
from scheduler.policy import DSparkScheduled, FixedLength
from scheduler.sps import RequestSPS, SPSTable

ROOT = Path(__file__).resolve().parents[2]


def h200_like(slope: float) -> SPSTable:
    sizes = np.array([1, 8, 16, 32, 64, 128, 256, 512, 1024])
    return SPSTable(sizes, 1.0 / (0.003 + slope * sizes + 1e-6 * np.maximum(sizes - 64, 0)))


TABLES = [h200_like(0.0), h200_like(1e-7), h200_like(2e-6), h200_like(5e-5), SPSTable([1, 8], [300.0, 300.0])]
BY_REQUESTS = RequestSPS({1: h200_like(1e-6), 2: h200_like(3e-6), 4: h200_like(2e-5), 16: h200_like(5e-5)})
COSTS = [None, DraftCost(0.0005, 0.00001, 0.000002)]


def per_round(conf: np.ndarray, counts: np.ndarray, table_for, draft_cost) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = np.zeros(conf.shape[:2], dtype=np.int64)
    for k, count in enumerate(counts.tolist()):
        out[k, :count] = schedule_lengths(conf[k, :count], table_for(count), draft_cost=draft_cost)
    return out


def random_stack(rng: np.random.Generator, rounds: int, width: int, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    conf = rng.beta(4.0, 1.5, size=(rounds, width, gamma))
    kind = rng.integers(0, 6, size=(rounds, width, gamma))
    conf[kind == 0] = 1.0  # ties of survival
    conf[kind == 1] = 0.0
    conf[(kind == 2) & (rng.random(conf.shape) < 0.1)] = 1e-300  # survivals below 2^-960 flush to zero
    if width > 1:
        conf[:, 1] = conf[:, 0]  # two requests with the same row: equal survivals at every position
    counts = rng.integers(0, width + 1, size=rounds)
    pad = np.arange(width)[None, :] >= counts[:, None]
    conf[pad] = rng.random((int(pad.sum()), gamma))  # padding is ignored, whatever it holds
    return conf, counts


@pytest.mark.parametrize("draft_cost", COSTS)
@pytest.mark.parametrize("table", range(len(TABLES)))
def test_rounds_equal_the_per_round_walk(table: int, draft_cost: DraftCost | None) -> None:
    rng = np.random.default_rng(table)
    for width, gamma in ((1, 7), (3, 7), (4, 7), (9, 7), (40, 5), (2, 1)):
        conf, counts = random_stack(rng, 60, width, gamma)
        got = schedule_lengths_rounds(conf, counts, TABLES[table].table_for, draft_cost=draft_cost)
        np.testing.assert_array_equal(got, per_round(conf, counts, TABLES[table].table_for, draft_cost))


@pytest.mark.parametrize("draft_cost", COSTS)
def test_rounds_price_each_round_with_its_own_table(draft_cost: DraftCost | None) -> None:
    rng = np.random.default_rng(7)
    conf, counts = random_stack(rng, 200, 20, 7)
    got = schedule_lengths_rounds(conf, counts, BY_REQUESTS.table_for, draft_cost=draft_cost)
    np.testing.assert_array_equal(got, per_round(conf, counts, BY_REQUESTS.table_for, draft_cost))


def test_rounds_near_ties_and_large_rounds_walk_alone() -> None:
    rng = np.random.default_rng(3)
    conf = rng.beta(4.0, 1.5, size=(30, 3, 7))
    conf[:, 1, 0] = conf[:, 0, 0] * (1.0 + 2.0**-45)  # unequal survivals the packed key may tie
    conf[conf > 1.0] = 1.0
    counts = np.full(30, 3)
    table = TABLES[2].table_for
    np.testing.assert_array_equal(schedule_lengths_rounds(conf, counts, table), per_round(conf, counts, table, None))
    big = rng.beta(8.0, 1.0, size=(2, 700, 7))
    counts = np.array([700, 650])
    np.testing.assert_array_equal(schedule_lengths_rounds(big, counts, table), per_round(big, counts, table, None))


def test_rounds_of_the_recorded_traces() -> None:
    from cluster.simulator.traces import load_traces
    from scheduler.sts import STSCalibration

    trace = load_traces(
        ROOT / "tests" / "data" / "sim_traces_demo_mbpp.npz",
        STSCalibration.load(ROOT / "models" / "demo" / "draft_dspark" / "sts.json"),
    )
    rng = np.random.default_rng(0)
    rows = rng.integers(0, trace.confidences.shape[0], size=(500, 6))
    conf = trace.confidences[rows]
    counts = rng.integers(1, 7, size=500)
    for draft_cost in COSTS:
        got = schedule_lengths_rounds(conf, counts, BY_REQUESTS.table_for, draft_cost=draft_cost)
        np.testing.assert_array_equal(got, per_round(conf, counts, BY_REQUESTS.table_for, draft_cost))


def test_rounds_validate_like_the_walk() -> None:
    table = TABLES[0].table_for
    assert schedule_lengths_rounds(np.zeros((0, 3, 7)), np.zeros(0, dtype=np.int64), table).shape == (0, 3)
    bad = np.full((2, 2, 7), 0.5)
    bad[1, 0, 3] = np.nan
    with pytest.raises(ValueError, match="finite and in"):
        schedule_lengths_rounds(bad, np.array([2, 2]), table)
    bad[1, 0, 3] = 0.5
    bad[1, 1, 3] = np.nan  # padding: ignored
    assert schedule_lengths_rounds(bad, np.array([2, 1]), table).shape == (2, 2)
    with pytest.raises(ValueError, match="num_requests"):
        schedule_lengths_rounds(bad, np.array([3, 1]), table)


@pytest.mark.parametrize("policy", [DSparkScheduled(BY_REQUESTS), FixedLength(3), FixedLength(7)])
def test_policy_lengths_of_rounds_equal_its_lengths(policy: DSparkScheduled | FixedLength) -> None:
    rng = np.random.default_rng(11)
    conf, counts = random_stack(rng, 120, 5, 7)
    caps = rng.integers(0, 9, size=(120, 5))
    caps[rng.random((120, 5)) < 0.6] = 7
    assert policy.decides_rounds_alone
    got = policy.lengths_of_rounds(conf, caps, counts)
    for k, count in enumerate(counts.tolist()):
        np.testing.assert_array_equal(got[k, :count], policy.lengths(conf[k, :count], caps[k, :count]))
        assert not got[k, count:].any()


@pytest.mark.parametrize("draft_cost", COSTS)
@pytest.mark.parametrize("table", [*range(len(TABLES)), "by-requests"])
def test_recorded_rounds_equal_the_per_round_walk_of_capped_confidences(
    table: int | str, draft_cost: DraftCost | None
) -> None:
    table_for = BY_REQUESTS.table_for if table == "by-requests" else TABLES[int(table)].table_for  # type: ignore[arg-type]
    rng = np.random.default_rng(5)
    for width, gamma in ((1, 7), (3, 7), (4, 7), (9, 7), (2, 1)):
        conf, _ = random_stack(rng, 400, 1, gamma)
        recorded = RecordedConfidences(conf[:, 0])
        rows = rng.integers(0, 400, size=(80, width))
        rows[:, -1] = rows[:, 0]  # the same recorded row twice in a round: equal survivals
        caps = rng.integers(0, gamma + 2, size=(80, width))
        caps[rng.random((80, width)) < 0.5] = gamma
        counts = rng.integers(0, width + 1, size=80)
        got = schedule_recorded_rounds(recorded, rows, caps, counts, table_for, draft_cost=draft_cost)
        for k, count in enumerate(counts.tolist()):
            capped = np.where(np.arange(gamma)[None, :] < caps[k, :count, None], recorded.table[rows[k, :count]], 0.0)
            want = schedule_lengths(capped, table_for(count), draft_cost=draft_cost)
            np.testing.assert_array_equal(got[k, :count], want)
            assert not got[k, count:].any()


@pytest.mark.parametrize("policy", [DSparkScheduled(BY_REQUESTS), FixedLength(3), FixedLength(7)])
def test_policy_lengths_of_recorded_rounds_equal_its_lengths(policy: DSparkScheduled | FixedLength) -> None:
    rng = np.random.default_rng(13)
    conf, _ = random_stack(rng, 300, 1, 7)
    recorded = RecordedConfidences(conf[:, 0])
    rows = rng.integers(0, 300, size=(120, 5))
    caps = rng.integers(0, 9, size=(120, 5))
    caps[rng.random((120, 5)) < 0.6] = 7
    counts = rng.integers(0, 6, size=120)
    got = policy.lengths_of_recorded_rounds(recorded, rows, caps, counts)
    for k, count in enumerate(counts.tolist()):
        np.testing.assert_array_equal(got[k, :count], policy.lengths(recorded.table[rows[k, :count]], caps[k, :count]))
        assert not got[k, count:].any()
