"""Lengths fixed before the drafts exist (``planned_lengths``): what lets a round chain its verify step behind
the drafter on the device. The fixed policies always know them; DSpark when verifying every draft costs little
more than what Algorithm 1 chose last (on a flat SPS curve: its own decision); counts and past rounds only."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.algorithm import DraftCost, schedule_lengths
from scheduler.draft_gate import DraftGate
from scheduler.policy import CHAIN_REFRESH, CHAIN_TOLERANCE, DSparkAsync, DSparkScheduled, make_policy
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
    assert not hasattr(DSparkAsync(_h200_by_requests()), "planned_lengths")  # its plan is made rounds earlier


def test_dspark_measures_the_plan_against_its_last_choice_and_lets_algorithm_1_decide_again() -> None:
    table = _h200_by_requests()
    eight = np.full(8, GAMMA)
    confident = DSparkScheduled(table)
    chosen = confident.lengths(np.full((8, GAMMA), 0.9), eight)
    assert 8 + chosen.sum() >= 48  # most of the block: the whole block's step is within 5% of it
    planned = [confident.planned_lengths(eight, GAMMA) for _ in range(2 * CHAIN_REFRESH + 2)]
    assert [p is None for p in planned] == [False] * CHAIN_REFRESH + [True] + [False] * CHAIN_REFRESH + [True]
    assert all(p.tolist() == eight.tolist() for p in planned if p is not None)
    doubtful = DSparkScheduled(table)
    doubtful.lengths(np.full((8, GAMMA), 0.02), eight)  # Algorithm 1 verifies (almost) only the anchors
    assert doubtful.planned_lengths(eight, GAMMA) is None


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
