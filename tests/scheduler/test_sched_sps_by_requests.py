"""SPS tables by request count: selection, JSON, and that the scheduled policies price each round with its R's table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scheduler.algorithm import DraftCost
from scheduler.async_capacity import AsyncCapacityScheduler, plan_capacity
from scheduler.draft_gate import DraftGate
from scheduler.policy import DSparkAsync, DSparkScheduled, make_policy
from scheduler.sps import RequestSPS, SPSTable, check_sps_source, load_sps, load_sps_file

GAMMA = 7
COST = DraftCost(fixed_s=2.3e-3, per_request_s=0.01e-3)
NO_DRAFT = DraftCost(fixed_s=0.3e-3)


def _token_table() -> SPSTable:
    """The shape of the H200 graph-step token table: flat to ~128 tokens, then rising."""
    step_ms = np.array([3.95, 4.11, 4.84, 6.15, 9.93, 15.82])
    return SPSTable([1, 32, 128, 256, 512, 1024], (1000.0 / step_ms).tolist(), model="m", device="d", dtype="bf16")


def _flat() -> SPSTable:
    """A step that costs 10 ms whatever it holds: drafting is nearly free, verify everything."""
    return SPSTable([1, 2048], [100.0, 100.0])


def _steep() -> SPSTable:
    """A step of B ms: a verified draft costs as much as an anchor, so a plain round wins."""
    return SPSTable([1], [1000.0])


def _caps(num_requests: int) -> np.ndarray:
    return np.full(num_requests, GAMMA, dtype=np.int64)


def _confidences(num_requests: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.2, 0.95, (num_requests, GAMMA))


def test_table_for_picks_the_smallest_profiled_count_at_least_r() -> None:
    small, mid, large = _flat(), _token_table(), _steep()
    by_requests = RequestSPS({128: large, 8: small, 32: mid})
    assert by_requests.request_counts == (8, 32, 128)
    picks = {r: by_requests.table_for(r) for r in (1, 8, 9, 32, 33, 100, 128, 129, 1000)}
    assert [picks[r] for r in (1, 8)] == [small, small]
    assert [picks[r] for r in (9, 32)] == [mid, mid]
    assert [picks[r] for r in (33, 100, 128, 129, 1000)] == [large] * 5  # above all: the largest
    token = _token_table()
    assert token.table_for(1) is token and token.table_for(500) is token


def test_json_round_trip() -> None:
    by_requests = RequestSPS({32: _token_table(), 128: _flat()})
    loaded = load_sps(json.loads(json.dumps(by_requests.to_dict())))
    assert isinstance(loaded, RequestSPS) and loaded.request_counts == (32, 128)
    for count in (32, 128):
        assert loaded.tables[count].to_dict() == by_requests.tables[count].to_dict()
    token = load_sps(json.loads(json.dumps(_token_table().to_dict())))
    assert isinstance(token, SPSTable) and token.to_dict() == _token_table().to_dict()


def test_files_of_either_format_load(tmp_path) -> None:
    (tmp_path / "by_requests.json").write_text(json.dumps(RequestSPS({4: _flat(), 64: _steep()}).to_dict()))
    loaded = load_sps_file(tmp_path / "by_requests.json")
    assert isinstance(loaded, RequestSPS) and loaded.request_counts == (4, 64)
    token = load_sps_file(_token_table().save(tmp_path / "token.json"))
    assert isinstance(token, SPSTable) and token.to_dict() == _token_table().to_dict()
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_sps_file(tmp_path / "broken.json")


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        RequestSPS({})
    for count in (0, -1, True, 2.5, "8"):
        with pytest.raises(ValueError, match="integers >= 1"):
            RequestSPS({count: _flat()})
    with pytest.raises(ValueError, match="must be an SPSTable"):
        RequestSPS({8: {"batch_sizes": [1], "steps_per_s": [1.0]}})
    good = RequestSPS({8: _flat()}).to_dict()
    with pytest.raises(ValueError, match="expected format"):
        RequestSPS.from_dict(_flat().to_dict())
    with pytest.raises(ValueError, match="'tables'"):
        RequestSPS.from_dict({"format": good["format"], "tables": {"8": good["tables"][0]["sps"]}})
    with pytest.raises(ValueError, match="lacks 'sps'"):
        RequestSPS.from_dict({"format": good["format"], "tables": [{"requests": 8}]})
    with pytest.raises(ValueError, match="repeats a request count"):
        RequestSPS.from_dict({**good, "tables": good["tables"] * 2})
    with pytest.raises(ValueError, match="not an SPS table"):
        RequestSPS.from_dict({**good, "tables": [{"requests": 8, "sps": {"format": "other"}}]})
    with pytest.raises(ValueError, match="SPSTable or a RequestSPS"):
        check_sps_source({8: _flat()})
    with pytest.raises(ValueError, match="SPSTable or a RequestSPS"):
        DSparkScheduled("table.json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SPSTable or a RequestSPS"):
        DraftGate([1, 2], DraftCost())  # type: ignore[arg-type]


def _policies(policy_cls: type, sps_a: object, sps_b: object) -> tuple[object, object]:
    def build(sps: object) -> object:
        return policy_cls(sps, draft_cost=COST, gate=DraftGate(sps, COST, NO_DRAFT))

    return build(sps_a), build(sps_b)


@pytest.mark.parametrize("policy_cls", [DSparkScheduled, DSparkAsync])
def test_the_same_table_at_every_count_decides_exactly_as_that_table(policy_cls: type) -> None:
    shared = _token_table()  # one instance behind every count: its memo serves them all
    plain, by_requests = _policies(policy_cls, _token_table(), RequestSPS({4: shared, 32: shared, 128: shared}))
    for round_index, r in enumerate([1, 3, 4, 20, 32, 100, 128, 128, 200, 64, 128, 7] * 3):
        caps = np.minimum(_caps(r), np.random.default_rng(round_index).integers(0, GAMMA + 3, r))
        drafted = plain.should_draft(caps)
        assert by_requests.should_draft(caps) == drafted
        if drafted:
            conf = _confidences(r, round_index)
            np.testing.assert_array_equal(by_requests.lengths(conf, caps), plain.lengths(conf, caps))
    assert plain.gate.skipped == by_requests.gate.skipped > 0  # the gate did skip rounds: both at once


@pytest.mark.parametrize("policy_cls", [DSparkScheduled, DSparkAsync])
def test_rounds_at_different_counts_use_their_own_table(policy_cls: type) -> None:
    by_requests = RequestSPS({8: _flat(), 128: _steep()})
    for r, table in [(1, _flat()), (5, _flat()), (8, _flat()), (9, _steep()), (128, _steep()), (300, _steep())]:
        other = _steep() if table.steps_per_s.size == 2 else _flat()
        conf = _confidences(r, r)
        expected, policy = _policies(policy_cls, table, by_requests)
        wrong, _ = _policies(policy_cls, other, other)
        for candidate in (expected, policy, wrong):  # a drafted round first: the gates have seen confidences
            assert candidate.should_draft(_caps(r))
            candidate.lengths(conf, _caps(r))
        lengths = policy.lengths(conf, _caps(r))
        np.testing.assert_array_equal(lengths, expected.lengths(conf, _caps(r)))
        assert not np.array_equal(lengths, wrong.lengths(conf, _caps(r)))  # the tables do disagree here
        decision = policy.should_draft(_caps(r))
        assert decision == expected.should_draft(_caps(r)) != wrong.should_draft(_caps(r))
        assert decision == (table.steps_per_s.size == 2)  # flat table: draft; steep table: skip


def test_async_capacity_plans_with_the_planning_rounds_table() -> None:
    by_requests = AsyncCapacityScheduler(RequestSPS({8: _flat(), 128: _steep()}), lag=1, draft_cost=COST)
    flat = AsyncCapacityScheduler(_flat(), lag=1, draft_cost=COST)
    small, large = _confidences(8, 0), _confidences(128, 1)
    np.testing.assert_array_equal(by_requests.step(small), flat.step(small))  # warm-up: Algorithm 1 at R = 8
    assert by_requests.next_capacity == flat.next_capacity == plan_capacity(small, _flat(), draft_cost=COST)
    # The large round admits the capacity planned at R = 8, and plans the next one with R = 128's table.
    np.testing.assert_array_equal(by_requests.step(large), flat.step(large))
    assert by_requests.next_capacity == plan_capacity(large, _steep(), draft_cost=COST)
    assert by_requests.next_capacity != flat.next_capacity


def test_make_policy_accepts_tables_by_request_count() -> None:
    by_requests = RequestSPS({8: _flat(), 128: _steep()})
    for spec in ("dspark", "dspark-async"):
        for cost in ("none", "measured"):
            policy = make_policy(spec, by_requests, GAMMA, cost)
            assert policy.should_draft(_caps(8))
            assert policy.lengths(_confidences(8, 2), _caps(8)).shape == (8,)


def test_scaled_tables_price_steps_factor_times_longer() -> None:
    table = SPSTable([1, 8, 64], [300.0, 280.0, 200.0], model="m", device="d", dtype="bf16")
    slow = table.scaled(1.5)
    np.testing.assert_allclose(slow.steps_per_s, table.steps_per_s / 1.5)
    assert (slow.model, slow.device, slow.dtype) == ("m", "d", "bf16")
    np.testing.assert_allclose(slow.dense_step_time(64)[:65], 1.5 * table.dense_step_time(64)[:65])
    by_requests = RequestSPS({1: table, 8: table.scaled(0.5)}).scaled(2.0)
    assert by_requests.request_counts == (1, 8)
    np.testing.assert_allclose(by_requests.table_for(8).steps_per_s, table.steps_per_s)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="scale factor"):
            table.scaled(bad)  # type: ignore[arg-type]
