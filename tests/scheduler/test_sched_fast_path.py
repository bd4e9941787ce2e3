"""The scheduler's small-R fast paths decide exactly what the previous implementation decided, bit for bit.

The reference below is the vectorised implementation as it was before the fast paths (Algorithm 1's walk, the
asynchronous planner and admission, the draft gate's curve and prediction, the policies' cap masking), frozen
here verbatim in its arithmetic. Every comparison is exact (array_equal / ==, never approx): the fast paths
must not move a single decision, and where they keep a float (Theta, the gate's rates) not a single bit.
"""

from __future__ import annotations

import pickle
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import algorithm
from scheduler.algorithm import DraftCost, greedy_path, schedule_lengths
from scheduler.async_capacity import AsyncCapacityScheduler, admit_top_k, plan_capacity
from scheduler.draft_gate import DraftGate
from scheduler.policy import DSparkAsync, DSparkScheduled
from scheduler.sps import SPSTable

_TINY = 2.0**-960


# ------------------------------------------------------------------------------------ the frozen reference
def ref_walk(conf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Survivals (flat j * R + r, tiny flushed) and the walk order, as the packed-key sort computed them."""
    num_requests, gamma = conf.shape
    n = num_requests * gamma
    survival = np.cumprod(conf.astype(np.float64), axis=1).T.ravel().copy()
    survival[survival < _TINY] = 0.0
    n_pos = int(np.count_nonzero(survival))
    shift = np.uint64(max(1, (n - 1).bit_length()))
    keys = ((~survival.view(np.uint64)) >> shift) << shift | np.arange(n, dtype=np.uint64)
    keys.sort()
    return survival, (keys[:n_pos] & np.uint64((1 << int(shift)) - 1)).astype(np.int64)


def ref_theta(conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None) -> tuple[np.ndarray, np.ndarray]:
    num_requests = conf.shape[0]
    survival, order = ref_walk(conf)
    theta = np.cumsum(np.concatenate([[float(num_requests)], survival[order]]))
    last_b = num_requests + order.size
    if draft_cost is None:
        theta = theta * sps.dense(last_b)[num_requests : last_b + 1]
    else:
        batch = np.arange(num_requests, last_b + 1, dtype=np.float64)
        theta = theta / (
            sps.dense_step_time(last_b)[num_requests : last_b + 1] + draft_cost.seconds(num_requests, batch)
        )
    return order, theta


def ref_early_stop(theta: np.ndarray) -> int:
    improving = theta[1:] > theta[:-1]
    if improving.size == 0:
        return 0
    first = int(improving.argmin())
    return improving.size if improving[first] else first


def ref_lengths_of_prefix(order: np.ndarray, count: int, num_requests: int) -> np.ndarray:
    return np.bincount(order[:count] % num_requests, minlength=num_requests)


def ref_schedule(conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None = None) -> np.ndarray:
    if conf.shape[0] == 0 or conf.shape[1] == 0:
        return np.zeros(conf.shape[0], dtype=np.int64)
    order, theta = ref_theta(conf, sps, draft_cost)
    return ref_lengths_of_prefix(order, ref_early_stop(theta), conf.shape[0])


def ref_plan(conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None = None) -> int:
    return 0 if conf.shape[0] == 0 else int(ref_theta(conf, sps, draft_cost)[1].argmax())


def ref_top_k(conf: np.ndarray, capacity: int) -> np.ndarray:
    if conf.shape[0] == 0 or conf.shape[1] == 0:
        return np.zeros(conf.shape[0], dtype=np.int64)
    _, order = ref_walk(conf)
    return ref_lengths_of_prefix(order, min(capacity, order.size), conf.shape[0])


def ref_capped(conf: np.ndarray, caps: np.ndarray) -> np.ndarray:
    return np.where(np.arange(conf.shape[1])[None, :] < caps[:, None], conf, 0.0)


class RefGate:
    """DraftGate's curve and prediction as before (probe bookkeeping is unchanged code, so it is not copied)."""

    def __init__(self, sps: SPSTable, draft_cost: DraftCost, no_draft_cost: DraftCost, points: int = 56) -> None:
        self.sps, self.draft_cost, self.no_draft_cost, self.points = sps, draft_cost, no_draft_cost, points
        self.curve: np.ndarray | None = None
        self.cumulative = np.zeros(points + 1)
        self.gamma = 0

    def observe(self, conf: np.ndarray, history_rows: int = 64) -> None:
        rows, gamma = conf.shape
        if rows == 0 or gamma == 0:
            return
        survival = np.sort(np.cumprod(conf, axis=1), axis=None)[::-1]
        ranks = ((np.arange(self.points) + 0.5) * (survival.size / self.points)).astype(np.int64)
        curve = survival[ranks]
        if self.curve is None or gamma != self.gamma:
            self.curve, self.gamma = curve, gamma
        else:
            weight = min(1.0, rows / history_rows)
            self.curve = (1.0 - weight) * self.curve + weight * curve
        np.cumsum(self.curve, out=self.cumulative[1:])

    def predicted_rates(self, caps: np.ndarray) -> tuple[float, float] | None:
        num_requests = caps.size
        if num_requests == 0 or self.curve is None:
            return None
        gamma, points = self.gamma, self.points
        admissible = int(np.minimum(caps, gamma).clip(min=0).sum()) / (num_requests * gamma)
        steps = round(admissible * points)
        share = num_requests * gamma / points
        tau = num_requests + share * self.cumulative[: steps + 1]
        batch = num_requests + share * np.arange(points + 1, dtype=np.float64)[: steps + 1]
        step_time = self.sps.dense_step_time(int(batch[-1]) + 1)
        round_time = self.draft_cost.seconds(num_requests, batch) + step_time[(batch + 0.5).astype(np.int64)]
        spec = float((tau / round_time).max())
        ar_time = float(self.no_draft_cost.seconds(num_requests, num_requests)) + float(step_time[num_requests])
        return spec, num_requests / ar_time


# --------------------------------------------------------------------------------------------- the inputs
def h200_like(slope_s: float, floor_s: float = 3.5e-3) -> SPSTable:
    """Flat-ish at small B like the H200 graph steps, with a jump past 16 tokens; slope 0 gives a flat table."""
    sizes = np.array([1, 2, 3, 4, 8, 16, 24, 64, 256, 1024])
    step_s = floor_s + slope_s * sizes + np.where(sizes >= 24, 400 * slope_s, 0.0)
    return SPSTable(sizes, 1.0 / step_s)


TABLES = [h200_like(0.0), h200_like(1e-7), h200_like(2e-6), h200_like(5e-5), SPSTable([1, 8], [300.0, 300.0])]
COSTS = [None, DraftCost(), DraftCost(fixed_s=2.2e-3), DraftCost(fixed_s=1e-3, per_request_s=2e-5, per_token_s=3e-6)]


@st.composite
def confidences(draw: st.DrawFn, max_requests: int = 40) -> np.ndarray:
    """Realistic and adversarial confidences: high (the fast path), mixed, exact 0 and 1, products near the
    2^-960 flush, increments too small to move tau in float64, and near ties (rows a few ulps apart, whose
    survivals share the packed sort key's high bits: its index decides their order, not their values)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_requests, gamma = draw(st.integers(1, max_requests)), draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["high", "beta", "uniform", "special", "near"]))
    if kind == "high":
        conf = 1.0 - rng.beta(1.0, 30.0, size=(num_requests, gamma))
    elif kind == "beta":
        conf = rng.beta(5.0, 1.2, size=(num_requests, gamma))
    else:
        conf = rng.random((num_requests, gamma))
    if kind == "special":
        specials = np.array([0.0, 1.0, 1.0, 1e-17, 1e-300, 2.0**-480, 0.5, np.nextafter(1.0, 0.0)])
        mask = rng.random(conf.shape) < 0.4
        conf[mask] = rng.choice(specials, size=int(mask.sum()))
    if kind == "near":
        ulps = rng.integers(-3, 4, size=conf.shape)
        conf = np.clip(conf[:1] * (1.0 + ulps * 2.0**-52), 0.0, 1.0)
    return conf


def caps_for(conf: np.ndarray, seed: int) -> np.ndarray:
    """Mostly no binding cap (the common round), sometimes random caps (a request's last rounds)."""
    rng = np.random.default_rng(seed)
    num_requests, gamma = conf.shape
    if seed % 3:
        return np.full(num_requests, gamma, dtype=np.int64)
    return rng.integers(0, gamma + 1, size=num_requests).astype(np.int64)


# ---------------------------------------------------------------------------------------------- the tests
@settings(max_examples=2000, deadline=None)
@given(confidences(), st.sampled_from(TABLES), st.sampled_from(COSTS))
def test_algorithm1_decides_exactly_as_before(conf: np.ndarray, sps: SPSTable, cost: DraftCost | None) -> None:
    lengths = schedule_lengths(conf, sps, draft_cost=cost)
    assert lengths.dtype == np.int64
    np.testing.assert_array_equal(lengths, ref_schedule(conf, sps, cost))
    path = greedy_path(conf, sps, draft_cost=cost)  # the inspection walk keeps every bit of Theta
    order, theta = ref_theta(conf, sps, cost)
    np.testing.assert_array_equal(path.theta, theta)
    np.testing.assert_array_equal(path.requests, order % conf.shape[0])
    np.testing.assert_array_equal(path.positions, order // conf.shape[0] + 1)
    assert path.stop == ref_early_stop(theta)


@settings(max_examples=1000, deadline=None)
@given(confidences(), st.sampled_from(TABLES), st.sampled_from(COSTS), st.integers(0, 400))
def test_async_planning_and_admission_decide_exactly_as_before(
    conf: np.ndarray, sps: SPSTable, cost: DraftCost | None, capacity: int
) -> None:
    assert plan_capacity(conf, sps, draft_cost=cost) == ref_plan(conf, sps, cost)
    np.testing.assert_array_equal(admit_top_k(conf, capacity), ref_top_k(conf, capacity))


@settings(max_examples=300, deadline=None)
@given(st.lists(confidences(max_requests=12), min_size=1, max_size=8), st.sampled_from(TABLES), st.integers(1, 3))
def test_async_rounds_decide_exactly_as_before(rounds: list[np.ndarray], sps: SPSTable, lag: int) -> None:
    cost = DraftCost(fixed_s=2.2e-3)
    scheduler = AsyncCapacityScheduler(sps, lag=lag, draft_cost=cost)
    plans: deque[int] = deque()
    for conf in rounds:
        expected = ref_top_k(conf, plans.popleft()) if len(plans) == lag else ref_schedule(conf, sps, cost)
        plans.append(ref_plan(conf, sps, cost))
        np.testing.assert_array_equal(scheduler.step(conf), expected)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(confidences(max_requests=40), min_size=1, max_size=10),
    st.sampled_from(TABLES),
    st.sampled_from(COSTS[1:]),
    st.integers(0, 2**16),
)
def test_gate_predicts_exactly_as_before(rounds: list[np.ndarray], sps: SPSTable, cost: DraftCost, seed: int) -> None:
    no_draft = DraftCost(fixed_s=6e-5)
    gate, ref = DraftGate(sps, cost, no_draft), RefGate(sps, cost, no_draft)
    for i, conf in enumerate(rounds):
        caps = caps_for(conf, seed + i)
        assert gate.predicted_rates(caps) == ref.predicted_rates(caps)
        gate.observe(conf)
        ref.observe(conf)
        np.testing.assert_array_equal(gate.curve, ref.curve)  # the queued round folded in, as the reference did
        np.testing.assert_array_equal(gate._cumulative, ref.cumulative)
        other = caps_for(conf[:1], seed + i + 1)  # the load changes: another R, the same curve
        assert gate.predicted_rates(other) == ref.predicted_rates(other)


@settings(max_examples=150, deadline=None)
@given(
    num_requests=st.sampled_from([1, 2, 5, 16, 40]),
    load_moves=st.booleans(),
    start=st.floats(0.3, 0.99),
    drift=st.floats(-0.02, 0.02),
    fixed_s=st.floats(0.2e-3, 6e-3),
    refits=st.sampled_from([0, 7, 40]),
    seed=st.integers(0, 2**16),
)
def test_gate_reusing_a_prediction_decides_as_predicting_every_round(
    num_requests: int, load_moves: bool, start: float, drift: float, fixed_s: float, refits: int, seed: int
) -> None:
    """Long runs at one load (or, ``load_moves``, at R, R - 1 and R + 1 in random order, as under a closed
    loop where requests finish and join), acceptance drifting across the point where skipping starts to win,
    costs now and then replaced by equal-valued new objects (a refit): the gate, which reuses its last
    prediction to draft for the round's R while it provably holds, decides every round as the frozen reference
    that predicts every round. Probes are pushed out of reach, so the reference's decision is its prediction
    alone."""
    rng = np.random.default_rng(seed)
    sps, no_draft = TABLES[2], DraftCost(fixed_s=6e-5)
    gate = DraftGate(sps, DraftCost(fixed_s=fixed_s), no_draft, probe_interval=10**6, max_probe_interval=10**6)
    ref = RefGate(sps, DraftCost(fixed_s=fixed_s), no_draft)
    level = start
    for i in range(300):
        if refits and i % refits == 0:
            gate.draft_cost = DraftCost(fixed_s=fixed_s)  # equal value, new object: nothing may be reused
        rows = max(1, num_requests + int(rng.integers(-1, 2))) if load_moves else num_requests
        caps = caps_for(np.zeros((rows, GAMMA_REUSE)), seed + i // 50)  # caps change now and then
        rates = ref.predicted_rates(caps)
        assert gate.should_draft(caps) == (rates is None or rates[0] >= rates[1]), f"round {i}"
        level = float(np.clip(level + drift, 0.05, 1.0))
        conf = np.clip(level + 0.05 * rng.standard_normal((rows, GAMMA_REUSE)), 0.0, 1.0)
        gate.observe(conf)
        ref.observe(conf)


GAMMA_REUSE = 7


@pytest.mark.parametrize("policy_cls", [DSparkScheduled, DSparkAsync])
@settings(max_examples=150, deadline=None)
@given(rounds=st.lists(confidences(max_requests=32), min_size=1, max_size=7), seed=st.integers(0, 2**16))
def test_policy_rounds_decide_exactly_as_before(policy_cls: type, rounds: list[np.ndarray], seed: int) -> None:
    """Whole rounds as the engine drives them (should_draft, then lengths with caps), gate included. At most
    7 rounds: the first always drafts (nothing observed), so no probe round (after 7 skips) can come."""
    sps, cost, no_draft = TABLES[2], DraftCost(fixed_s=2.2e-3), DraftCost(fixed_s=6e-5)
    policy = policy_cls(sps, draft_cost=cost, gate=DraftGate(sps, cost, no_draft))
    ref_gate, plans = RefGate(sps, cost, no_draft), deque()
    for i, conf in enumerate(rounds):
        caps = caps_for(conf, seed + i)
        rates = ref_gate.predicted_rates(caps)
        drafts = policy.should_draft(caps)
        assert drafts == (rates is None or rates[0] >= rates[1])
        if not drafts:
            plans.clear()  # the async variant drops its plans in a skipped round
            continue
        capped = ref_capped(conf, caps)
        if policy_cls is DSparkScheduled:
            expected = ref_schedule(capped, sps, cost)
        else:
            expected = ref_top_k(capped, plans.popleft()) if len(plans) == 2 else ref_schedule(capped, sps, cost)
            plans.append(ref_plan(capped, sps, cost))
        np.testing.assert_array_equal(policy.lengths(conf, caps), expected)
        ref_gate.observe(conf)


def test_fast_path_is_taken_on_flat_tables_and_refused_when_tau_cannot_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path really runs on the common small-R round, and a walk that stops is never shortcut."""
    monkeypatch.setattr(algorithm, "_SCALAR_MAX_ITEMS", 0)  # the vectorised path, even for these small rounds
    calls: list[bool] = []
    original = algorithm.every_step_improves

    def spy(*args: object) -> bool:
        calls.append(original(*args))  # type: ignore[arg-type]
        return calls[-1]

    high = np.full((4, 7), 0.9)
    algorithm.every_step_improves = spy  # type: ignore[assignment]
    try:
        for sps in TABLES[:2]:
            for cost in COSTS:
                np.testing.assert_array_equal(schedule_lengths(high, sps, draft_cost=cost), np.full(4, 7))
        assert all(calls)
        calls.clear()
        # tau = 2 + 1e-17 rounds to 2: Theta does not improve and the walk stops before the second draft.
        stuck = np.array([[1.0, 1e-17]])
        np.testing.assert_array_equal(schedule_lengths(stuck, TABLES[0]), [1])
        np.testing.assert_array_equal(ref_schedule(stuck, TABLES[0]), [1])
        assert calls == [False]
    finally:
        algorithm.every_step_improves = original  # type: ignore[assignment]


def test_price_curves_are_cached_per_table_cost_and_shape() -> None:
    sps = h200_like(1e-6)
    first = algorithm.walk_prices(sps, DraftCost(fixed_s=1e-3), 8, 7)
    assert algorithm.walk_prices(sps, DraftCost(fixed_s=1e-3), 8, 7) is first  # equal costs share the entry
    assert algorithm.walk_prices(sps, DraftCost(fixed_s=2e-3), 8, 7) is not first
    assert algorithm.walk_prices(sps, DraftCost(fixed_s=1e-3), 9, 7) is not first
    for r in range(200):  # bounded: entries go, the answers stay the same
        algorithm.walk_prices(sps, None, r + 1, 7)
    again = algorithm.walk_prices(sps, DraftCost(fixed_s=1e-3), 8, 7)
    np.testing.assert_array_equal(again.factor, first.factor)
    np.testing.assert_array_equal(again.growth, first.growth)
    assert len(pickle.loads(pickle.dumps(sps))._memo) == 0 < len(sps._memo)  # the memo does not travel


@settings(max_examples=1500, deadline=None)
@given(confidences(max_requests=6), st.sampled_from(TABLES), st.sampled_from(COSTS))
def test_scalar_walk_decides_exactly_as_the_vectorised_one(
    conf: np.ndarray, sps: SPSTable, cost: DraftCost | None
) -> None:
    """Small rounds take the Python-float walk; forced through the numpy walk they decide the same."""
    limit = algorithm._SCALAR_MAX_ITEMS
    small = conf[: min(conf.shape[0], limit), : max(1, min(conf.shape[1], limit // min(conf.shape[0], limit)))]
    assert small.size <= algorithm._SCALAR_MAX_ITEMS
    scalar = schedule_lengths(small, sps, draft_cost=cost)
    original = algorithm._SCALAR_MAX_ITEMS
    algorithm._SCALAR_MAX_ITEMS = 0
    try:
        vectorised = schedule_lengths(small, sps, draft_cost=cost)
    finally:
        algorithm._SCALAR_MAX_ITEMS = original
    assert scalar.dtype == vectorised.dtype == np.int64
    np.testing.assert_array_equal(scalar, vectorised)
    np.testing.assert_array_equal(
        schedule_lengths(small.astype(np.float32), sps, draft_cost=cost),
        ref_schedule(small.astype(np.float32), sps, cost),
    )


@settings(max_examples=1500, deadline=None)
@given(
    confidences(max_requests=6),
    st.sampled_from(TABLES),
    st.sampled_from(COSTS),
    st.one_of(st.none(), st.integers(0, 30)),
)
def test_scalar_async_round_plans_and_admits_exactly_as_the_vectorised_one(
    conf: np.ndarray, sps: SPSTable, cost: DraftCost | None, capacity: int | None
) -> None:
    """The asynchronous variant's small rounds (top-capacity admission or the early stop, plus the plan from the
    same walk) on Python floats decide and plan what the numpy walk does, and what the frozen reference does."""
    limit = algorithm._SCALAR_MAX_ITEMS
    small = conf[: min(conf.shape[0], limit), : max(1, min(conf.shape[1], limit // min(conf.shape[0], limit)))]
    lengths, plan = algorithm.scalar_round(small, sps, cost, *small.shape, capacity, plan=True)
    from scheduler.async_capacity import _lengths_and_plan

    vectorised, vectorised_plan = _lengths_and_plan(small, sps, cost, capacity)
    np.testing.assert_array_equal(lengths, vectorised)
    assert plan == vectorised_plan == ref_plan(small, sps, cost)
    expected = ref_schedule(small, sps, cost) if capacity is None else ref_top_k(small, capacity)
    np.testing.assert_array_equal(lengths, expected)
    lengths_only, _ = algorithm.scalar_round(small, sps, cost, *small.shape, capacity, plan=False)
    np.testing.assert_array_equal(lengths_only, expected)


@pytest.mark.parametrize("bad", [np.nan, -0.1, 1.5, np.inf])
def test_scalar_walk_rejects_bad_confidences_like_the_vectorised_one(bad: float) -> None:
    conf = np.full((2, 7), 0.9)
    conf[1, 3] = bad
    with pytest.raises(ValueError, match=r"confidences must be finite and in \[0, 1\].*request 1, position 4"):
        schedule_lengths(conf, TABLES[0])
    with pytest.raises(ValueError, match="sps must be an SPSTable"):
        schedule_lengths(np.full((2, 7), 0.9), "not a table")  # type: ignore[arg-type]
    scheduler = AsyncCapacityScheduler(TABLES[0], lag=1)
    scheduler.step(np.full((2, 7), 0.9))
    planned = scheduler.next_capacity
    with pytest.raises(ValueError, match=r"confidences must be finite and in \[0, 1\].*request 1, position 4"):
        scheduler.step(conf)
    assert scheduler.next_capacity == planned  # a rejected round uses up no plan
