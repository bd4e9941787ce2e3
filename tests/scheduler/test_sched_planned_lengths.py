"""Lengths fixed before the drafts exist (``planned_lengths``): what lets a round chain its verify step behind
the drafter on the device. The fixed policies always know them; DSpark plans a uniform length from the last
drafted round of as many requests when it gives up little of Algorithm 1's objective there (on a flat SPS curve:
Algorithm 1's own decision); the asynchronous variant when the capacity it planned rounds earlier holds every
draft; counts and past rounds only."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from scheduler.algorithm import DraftCost, RecordedConfidences, schedule_lengths
from scheduler.chain_plan import CHAIN_TOLERANCE, RECHECK, ChainPlanners, uniform_choice
from scheduler.draft_gate import DraftGate
from scheduler.policy import DSparkAsync, DSparkScheduled, make_policy
from scheduler.sps import RequestSPS, SPSTable

GAMMA = 7


def _h200_by_requests() -> RequestSPS:
    """The graph-step tables measured per request count on the H200 (2026-12-02, docs/benchmarks/policies.md):
    at R = 1 the step of 8 tokens takes 3.5% longer than that of 1; at R = 8, 64 tokens take 23% longer."""
    one = SPSTable([1, 2, 4, 8], (1000.0 / np.array([2.89, 2.91, 2.93, 2.99])).tolist())
    eight = SPSTable([8, 16, 32, 64], (1000.0 / np.array([3.14, 3.55, 3.74, 3.86])).tolist())
    return RequestSPS({1: one, 8: eight})


def test_fixed_policies_plan_their_lengths_within_the_caps() -> None:
    caps = np.array([7, 3, 0, 9], dtype=np.int64)
    full = make_policy("full", None, GAMMA)
    assert full.planned_lengths(caps, GAMMA).tolist() == [7, 3, 0, 7]
    assert make_policy("fixed-2", None, GAMMA).planned_lengths(caps, GAMMA).tolist() == [2, 2, 0, 2]
    confidences = np.full((4, GAMMA), 0.5)
    assert full.planned_lengths(caps, GAMMA).tolist() == full.lengths(confidences, caps).tolist()


def test_dspark_plans_every_draft_when_it_costs_little_more_than_algorithm_1s_choice() -> None:
    policy = DSparkScheduled(_h200_by_requests())
    assert policy.planned_lengths(np.array([GAMMA]), GAMMA).tolist() == [GAMMA]  # R = 1: 3.5% over the anchors
    assert policy.planned_lengths(np.array([2]), GAMMA).tolist() == [2]  # a cap binds
    eight = np.full(8, GAMMA)
    assert policy.planned_lengths(eight, GAMMA) is None  # R = 8, no Algorithm 1 round yet: 23% over the anchors
    assert DSparkScheduled(_h200_by_requests(), chain_tolerance=0.02).planned_lengths(np.array([GAMMA]), GAMMA) is None
    assert policy.planned_lengths(np.zeros(0, dtype=np.int64), GAMMA) is None
    with pytest.raises(ValueError, match="chain_tolerance"):
        DSparkScheduled(_h200_by_requests(), chain_tolerance=-0.1)
    assert policy.chain_tolerance == CHAIN_TOLERANCE


def test_dspark_plans_from_its_last_round_of_as_many_requests() -> None:
    table = _h200_by_requests()
    eight = np.full(8, GAMMA)
    confident = DSparkScheduled(table)
    assert confident.planned_lengths(eight, GAMMA) is None  # the engine asks before every round
    chosen = confident.lengths(np.full((8, GAMMA), 0.9), eight)
    assert 8 + chosen.sum() >= 48  # most of the block: the whole block is the best uniform round, within 5%
    planned = [confident.planned_lengths(eight, GAMMA) for _ in range(40)]
    assert all(p is not None and p.tolist() == eight.tolist() for p in planned)  # until a round says otherwise
    assert confident.planned_lengths(np.array([GAMMA, 3, 0, 7, 7, 7, 7, 7]), GAMMA).tolist() == [7, 3, 0, 7, 7, 7, 7, 7]
    doubtful = DSparkScheduled(table)
    assert doubtful.planned_lengths(eight, GAMMA) is None
    doubtful.lengths(np.full((8, GAMMA), 0.02), eight)  # Algorithm 1 verifies (almost) only the anchors
    assert doubtful.planned_lengths(eight, GAMMA) is None
    # A planned round's confidences re-plan (Algorithm 1 runs on them): acceptance collapsed, so no plan.
    confident.observe_drafts(np.full((8, GAMMA), 0.02), eight)
    assert confident.planned_lengths(eight, GAMMA) is None
    confident.observe_drafts(np.full((8, GAMMA), 0.9), eight)
    assert confident.planned_lengths(eight, GAMMA).tolist() == eight.tolist()
    # Rounds Algorithm 1 schedules re-plan every RECHECK-th (the evaluation would delay their verify step).
    for _ in range(RECHECK - 1):
        doubtful.lengths(np.full((8, GAMMA), 0.9), eight)
        assert doubtful.planned_lengths(eight, GAMMA) is None
    doubtful.lengths(np.full((8, GAMMA), 0.9), eight)
    assert doubtful.planned_lengths(eight, GAMMA).tolist() == eight.tolist()


def test_a_round_driver_that_never_asks_for_a_plan_pays_nothing_for_it() -> None:
    """Without chaining (a remote drafter, eager steps) nobody asks for a plan: the rounds Algorithm 1 schedules
    are not evaluated for one, and the first plan asked for is the cold start's."""
    eight = np.full(8, GAMMA)
    policy = DSparkScheduled(_h200_by_requests())
    for _ in range(3):
        policy.lengths(np.full((8, GAMMA), 0.9), eight)
    assert policy.planned_lengths(eight, GAMMA) is None  # not planned from the unobserved rounds
    policy.lengths(np.full((8, GAMMA), 0.9), eight)
    assert policy.planned_lengths(eight, GAMMA).tolist() == eight.tolist()


def _brute_force(conf: np.ndarray, caps: np.ndarray, lengths: np.ndarray, table: SPSTable, cost: DraftCost) -> tuple:
    """Theta of every uniform length and of ``lengths``, request by request in plain Python."""
    num, gamma = conf.shape

    def theta(ls: list[int]) -> float:
        tau = num + sum(float(np.prod(conf[r, : j + 1])) for r in range(num) for j in range(ls[r]))
        batch = num + sum(ls)
        return tau / (1.0 / float(table(batch)) + cost.fixed_s + cost.per_request_s * num + cost.per_token_s * batch)

    uniform = [theta([min(L, int(c), gamma) for c in caps]) for L in range(1, gamma + 1)]
    return uniform, theta([int(x) for x in lengths])


def test_under_load_the_plan_is_the_best_uniform_length_near_algorithm_1() -> None:
    """A steep curve (the 4B step at 32 requests: 128 tokens cost far less than 256): Algorithm 1 verifies a few
    drafts per request; the plan is the uniform length with the best objective, kept when it is within the
    tolerance of Algorithm 1's, and the caps still bind."""
    table = SPSTable([32, 64, 128, 256], (1000.0 / np.array([4.0, 4.3, 4.8, 6.2])).tolist())
    cost = DraftCost(fixed_s=1.5e-3, per_token_s=1e-6)
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.55, 0.95, size=(32, GAMMA))
    caps = np.full(32, GAMMA)
    caps[:3] = [0, 2, 5]
    conf[0, :] = 0.0
    conf[1, 2:] = 0.0
    conf[2, 5:] = 0.0
    policy = DSparkScheduled(table, draft_cost=cost)
    assert policy.planned_lengths(caps, GAMMA) is None  # the cold start: a step of every draft is far from flat
    chosen = policy.lengths(conf, caps)
    assert 0 < chosen.sum() < 32 * GAMMA - 9  # Algorithm 1 stops early
    best, theta_best, theta_a = uniform_choice(conf, caps, chosen, table, cost)
    uniform, theta_chosen = _brute_force(conf, caps, chosen, table, cost)
    assert theta_a == pytest.approx(theta_chosen, rel=1e-9)
    assert theta_best == pytest.approx(max(uniform), rel=1e-9) and best == 1 + int(np.argmax(uniform))
    assert 1 < best < GAMMA and theta_best * (1 + CHAIN_TOLERANCE) >= theta_a
    assert policy.planned_lengths(caps, GAMMA).tolist() == np.minimum(caps, best).tolist()
    strict = DSparkScheduled(table, draft_cost=cost, chain_tolerance=0.0)
    strict.planned_lengths(caps, GAMMA)
    strict.lengths(conf, caps)
    assert (strict.planned_lengths(caps, GAMMA) is None) == (theta_best < theta_a)


@pytest.mark.parametrize("confidence", [0.05, 0.5, 0.95])
def test_on_an_exactly_flat_curve_the_plan_is_algorithm_1s_decision(confidence: float) -> None:
    """Every draft of positive survival adds to tau and nothing to the step: Algorithm 1 admits them all, with
    the plain objective and with a draft cost."""
    flat = SPSTable([1, 64], [300.0, 300.0])
    caps = np.array([7, 7, 4], dtype=np.int64)
    conf = np.full((3, GAMMA), confidence)
    conf[2, 4:] = 0.0  # past the cap: what the policy's capping does
    planned = DSparkScheduled(flat).planned_lengths(caps, GAMMA)
    for cost in (None, DraftCost(fixed_s=1e-3)):
        assert schedule_lengths(conf, flat, draft_cost=cost).tolist() == planned.tolist() == [7, 7, 4]


def test_a_planned_round_still_teaches_the_draft_gate() -> None:
    gate = DraftGate(_h200_by_requests(), DraftCost(fixed_s=0.6e-3), DraftCost(fixed_s=0.1e-3))
    policy = DSparkScheduled(_h200_by_requests(), gate=gate)
    assert gate.curve is None
    policy.observe_drafts(np.full((1, GAMMA), 0.7), np.array([GAMMA]))
    assert gate.curve is not None and gate.curve.max() == pytest.approx(0.7)  # the round's survival curve


def test_the_async_variant_plans_the_caps_when_its_capacity_holds_every_draft() -> None:
    """DSparkAsync admits the top-K drafts with K planned ``lag`` rounds earlier: when K holds every draft the
    caps allow, the lengths are the caps before the drafts exist. A planned round (planned_lengths, then
    observe_drafts with its confidences) leaves the scheduler exactly where the same round admitted by
    ``lengths`` does: the same capacities and lengths from then on."""
    table = _h200_by_requests()
    one, eight = np.array([GAMMA]), np.full(8, GAMMA)
    planned, scheduled = DSparkAsync(table, lag=2), DSparkAsync(table, lag=2)
    assert planned.planned_lengths(one, GAMMA) is None  # warming up: no capacity planned yet
    rng = np.random.default_rng(0)
    rounds = [np.clip(rng.uniform(0.5, 1.0, (1, GAMMA)), 0.01, 0.99) for _ in range(2)]
    for confidences in rounds:  # the warm-up rounds: Algorithm 1 on their own confidences, plan K for later
        assert planned.lengths(confidences, one).tolist() == scheduled.lengths(confidences, one).tolist()
    # R = 1, a flat curve: K = the whole block, so the round's lengths are the caps (a binding cap too).
    assert planned.planned_lengths(one, GAMMA).tolist() == [GAMMA]
    assert planned.planned_lengths(np.array([3]), GAMMA).tolist() == [3]
    for _ in range(6):
        confidences = np.clip(rng.uniform(0.3, 1.0, (1, GAMMA)), 0.01, 0.99)
        lengths = planned.planned_lengths(one, GAMMA)
        assert lengths is not None
        assert scheduled.lengths(confidences, one).tolist() == lengths.tolist()  # top-K admits all of them
        planned.observe_drafts(confidences, one)
    assert planned._scheduler._plans == scheduled._scheduler._plans
    # R = 8 on its steep curve: a capacity below 8 * 7 drafts means top-K chooses on the confidences.
    doubtful = DSparkAsync(table, lag=1)
    doubtful.lengths(np.full((8, GAMMA), 0.3), eight)
    assert doubtful._scheduler.next_capacity < 8 * GAMMA
    assert doubtful.planned_lengths(eight, GAMMA) is None


def _stack_cases() -> list[tuple[object, DraftCost | None, float]]:
    flat = SPSTable([1, 1024], [1000.0, 1000.0])  # exactly flat: exact ties between uniform lengths
    return [
        (_h200_by_requests(), None, CHAIN_TOLERANCE),
        (_h200_by_requests(), DraftCost(fixed_s=4e-4, per_request_s=2e-5, per_token_s=1e-6), CHAIN_TOLERANCE),
        (_h200_by_requests(), None, 0.0),
        (flat, None, 0.0),
    ]


@pytest.mark.parametrize("case", range(4))
def test_stacks_of_rounds_plan_as_each_drivers_own_policy_round_by_round(case: int) -> None:
    """``plan_recorded_rounds`` (ChainPlanners: every driver's planner as arrays, one walk per stack) decides
    and learns exactly what each round driver's own DSparkScheduled does round by round: planned_lengths where
    the driver asks, observe_drafts after a planned round, lengths (Algorithm 1, every RECHECK-th re-planning)
    for the others; random request counts, caps, ties, zeros, tiny survivals and padding."""
    sps, cost, tolerance = _stack_cases()[case]
    rng = np.random.default_rng(case)
    table = rng.choice([0.0, 1e-9, 0.3, 0.5, 0.9, 1.0], size=(60, GAMMA), p=[0.05, 0.05, 0.2, 0.2, 0.3, 0.2])
    table[:30] = rng.random((30, GAMMA))
    recorded = RecordedConfidences(table)
    drivers, width = 6, 9
    prototype = DSparkScheduled(sps, draft_cost=cost, chain_tolerance=tolerance)  # type: ignore[arg-type]
    assert prototype.plans_in_stacks
    own = [copy.deepcopy(prototype) for _ in range(drivers)]
    planners = ChainPlanners(drivers, width, tolerance)
    planned_total = 0
    for _ in range(400):
        take = np.flatnonzero(rng.random(drivers) < 0.7)
        if not take.size:
            continue
        counts = rng.choice([1, 2, 3, 8, width], size=take.size)
        rows = rng.integers(0, table.shape[0], size=(take.size, width))
        caps = rng.choice([0, 1, 3, GAMMA, GAMMA + 2], size=(take.size, width), p=[0.05, 0.05, 0.1, 0.6, 0.2])
        asking = rng.random(take.size) < 0.8
        lengths, planned = prototype.plan_recorded_rounds(planners, take, recorded, rows, caps, counts, asking)
        for k, d in enumerate(take.tolist()):
            count = int(counts[k])
            policy, row_caps, confidences = own[d], caps[k, :count], table[rows[k, :count]]
            plan = policy.planned_lengths(row_caps, GAMMA) if asking[k] else None
            if plan is None:
                expected = policy.lengths(confidences, row_caps)
            else:
                policy.observe_drafts(confidences, row_caps)
                expected = plan
            assert bool(planned[k]) == (plan is not None)
            assert lengths[k, :count].tolist() == expected.tolist()
            assert not lengths[k, count:].any()
            planned_total += plan is not None
    for d, policy in enumerate(own):  # the same state: plans and re-plan counters by request count
        chain = policy.chain
        assert bool(planners.asked[d]) == chain.asked
        assert {r: int(planners.plans[d, r]) for r in range(width + 1) if planners.plans[d, r] >= 0} == chain._plans
        assert {r: int(planners.scheduled[d, r]) for r in range(width + 1) if planners.scheduled[d, r]} == {
            r: n for r, n in chain._scheduled.items() if n
        }
    assert planned_total > 100
