"""Skip-the-draft gate: when a plain target round beats the best speculative one, and that it follows the load."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.algorithm import DraftCost
from scheduler.draft_gate import DraftGate
from scheduler.policy import DSparkAsync, DSparkScheduled
from scheduler.sps import SPSTable

GAMMA = 7


def _sps() -> SPSTable:
    """The shape of the H200 graph-step table (docs/benchmarks/policies.md): flat to ~128 tokens, then rising."""
    sizes = [1, 32, 128, 256, 512, 1024]
    step_ms = np.array([3.95, 4.11, 4.84, 6.15, 9.93, 15.82])
    return SPSTable(sizes, (1000.0 / step_ms).tolist())


def _caps(num_requests: int) -> np.ndarray:
    return np.full(num_requests, GAMMA, dtype=np.int64)


def _flat(num_requests: int, c: float) -> np.ndarray:
    return np.full((num_requests, GAMMA), c)


# Draft time growing with the batch as measured: ~2 ms fixed, 8.6 ms at 128 requests.
LOAD_COST = DraftCost(fixed_s=2.0e-3, per_request_s=0.052e-3)
NO_DRAFT = DraftCost(fixed_s=0.4e-3)


def test_expensive_draft_and_flat_acceptance_skips() -> None:
    gate = DraftGate(_sps(), DraftCost(fixed_s=8.6e-3), NO_DRAFT)
    gate.observe(_flat(128, 0.5))
    spec, ar = gate.predicted_rates(_caps(128))
    assert spec < ar
    assert not gate.should_draft(_caps(128))
    assert gate.skipped == 1 and gate.decisions == 1


def test_cheap_draft_drafts() -> None:
    gate = DraftGate(_sps(), DraftCost(fixed_s=0.2e-3), NO_DRAFT)
    gate.observe(_flat(128, 0.8))
    spec, ar = gate.predicted_rates(_caps(128))
    assert spec > ar
    assert gate.should_draft(_caps(128))


def test_nothing_observed_drafts_and_zero_cost_never_skips() -> None:
    gate = DraftGate(_sps(), DraftCost(fixed_s=50e-3))
    assert gate.predicted_rates(_caps(8)) is None and gate.should_draft(_caps(8))
    free = DraftGate(_sps(), DraftCost())
    free.observe(_flat(128, 0.0))  # even useless drafts: with no draft cost a round with drafts is never slower
    assert all(free.should_draft(_caps(r)) for r in (1, 8, 128))


def test_flips_back_when_load_drops() -> None:
    """The same pool of confidences: skip at 128 requests, draft at 4 (the draft costs less per verified step)."""
    gate = DraftGate(_sps(), LOAD_COST, NO_DRAFT)
    gate.observe(_flat(128, 0.6))
    assert not gate.should_draft(_caps(128))
    assert gate.should_draft(_caps(4))
    assert not gate.should_draft(_caps(128))  # and back again when the load returns


def test_probe_after_interval_refreshes_the_prediction() -> None:
    gate = DraftGate(_sps(), DraftCost(fixed_s=8.6e-3), NO_DRAFT, probe_interval=4, max_probe_interval=4)
    gate.observe(_flat(128, 0.3))
    decisions = [gate.should_draft(_caps(128)) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    gate.observe(_flat(128, 0.99))  # the probe round found confident drafts: speculation wins again
    # A long confident block is worth 8.6 ms of drafting at 128 requests in this table.
    assert gate.should_draft(_caps(128))


def test_probes_back_off_while_skipping_wins_and_reset_when_drafting_does() -> None:
    gate = DraftGate(_sps(), LOAD_COST, NO_DRAFT, probe_interval=4, max_probe_interval=16)
    gate.observe(_flat(128, 0.6))
    probes = []
    for round_ in range(60):
        if gate.should_draft(_caps(128)):
            probes.append(round_)
            gate.observe(_flat(128, 0.6))  # each probe confirms: drafting does not pay at this load
    # Probes at intervals 4, 8, 16, 16, ...: the gaps double up to the cap.
    assert np.diff(probes).tolist() == [8, 16, 16, 16]
    assert probes[0] == 3 and gate.interval == 16
    assert gate.should_draft(_caps(4))  # load dropped: the prediction drafts at once, no probe needed ...
    assert gate.interval == 4  # ... and the probe interval is back at its base


def test_caps_count_zero_cap_requests_skip() -> None:
    """Requests at their last token cannot verify drafts; if none can, a draft is pure cost."""
    gate = DraftGate(_sps(), DraftCost(fixed_s=1e-3), NO_DRAFT)
    gate.observe(_flat(8, 0.95))
    assert gate.should_draft(_caps(8))
    assert not gate.should_draft(np.zeros(8, dtype=np.int64))


def test_curve_is_a_row_weighted_average_of_recent_rounds() -> None:
    gate = DraftGate(_sps(), LOAD_COST, NO_DRAFT, history_rows=10)
    gate.observe(_flat(4, 0.1))
    gate.observe(_flat(10, 0.9))  # a round of >= history_rows requests replaces the curve
    assert gate.curve == pytest.approx(DraftGate(_sps(), LOAD_COST, NO_DRAFT)._curve_of(_flat(10, 0.9)))
    gate.observe(_flat(5, 0.5))  # half the weight
    expected = 0.5 * gate._curve_of(_flat(10, 0.9)) + 0.5 * gate._curve_of(_flat(5, 0.5))
    assert gate.curve == pytest.approx(expected)


def test_a_steady_load_reuses_the_prediction_to_draft_until_it_may_no_longer_hold() -> None:
    """One request, drafting clearly wins (m ~ 2): the gate predicts about once per ln(m) / -ln(1 - 1/64)
    rounds instead of every round; a new cost object or another cap forces a prediction at once.
    (tests/scheduler/test_sched_fast_path.py checks that the decisions equal predicting every round.)"""
    gate = DraftGate(_sps(), DraftCost(fixed_s=1e-3), NO_DRAFT)
    predictions = []
    predict = gate.predicted_rates
    gate.predicted_rates = lambda caps: predictions.append(caps.copy()) or predict(caps)  # type: ignore[method-assign]
    gate.observe(_flat(1, 0.8))
    for _ in range(200):
        assert gate.should_draft(_caps(1))
        gate.observe(_flat(1, 0.8))
    spec, ar = predict(_caps(1))
    assert spec / ar > 1.5
    assert 1 <= len(predictions) <= 200 * np.log(1 - 1 / 64) / -np.log(spec / ar) + 2
    assert gate.predictions == len(predictions) and gate.decisions == 200
    before = len(predictions)
    gate.should_draft(np.array([3]))  # another cap: fewer steps of the walk
    gate.draft_cost = DraftCost(fixed_s=1e-3)  # a refit's new object, even of the same value
    gate.should_draft(np.array([3]))
    assert len(predictions) == before + 2


def test_a_moving_load_reuses_each_request_counts_prediction() -> None:
    """Requests finish and join: R cycles through 3, 4 and 5 while drafting clearly wins. Each R keeps its own
    prediction to draft, so the gate predicts a few times per R and then reuses them, where a single kept
    prediction would be replaced every round (R changes every round here)."""
    gate = DraftGate(_sps(), DraftCost(fixed_s=1e-3), NO_DRAFT)
    gate.observe(_flat(4, 0.8))
    for i in range(60):
        assert gate.should_draft(_caps(3 + i % 3))
        gate.observe(_flat(3 + i % 3, 0.8))
    assert 3 <= gate.predictions <= 20 and gate.decisions == 60


def test_prediction_from_one_row_pool_scales_to_many_requests() -> None:
    """The curve describes an average request: one observed row predicts the same per-request gain at any R."""
    one = DraftGate(_sps(), LOAD_COST, NO_DRAFT)
    one.observe(_flat(1, 0.7))
    many = DraftGate(_sps(), LOAD_COST, NO_DRAFT)
    many.observe(_flat(64, 0.7))
    assert one.predicted_rates(_caps(64)) == pytest.approx(many.predicted_rates(_caps(64)), rel=1e-12)


@pytest.mark.parametrize("policy_cls", [DSparkScheduled, DSparkAsync])
def test_policies_consult_the_gate_and_observe_drafted_rounds(policy_cls: type) -> None:
    gate = DraftGate(_sps(), DraftCost(fixed_s=8.6e-3), NO_DRAFT)
    policy = policy_cls(_sps(), draft_cost=DraftCost(fixed_s=8.6e-3), gate=gate)
    assert policy.should_draft(_caps(128))  # nothing observed: draft
    lengths = policy.lengths(_flat(128, 0.4), _caps(128))
    assert lengths.shape == (128,)
    assert not policy.should_draft(_caps(128))
    if isinstance(policy, DSparkAsync):
        assert policy._scheduler.next_capacity is None  # plans dropped: the next drafted round warms up


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        DraftGate(_sps(), DraftCost(), probe_interval=0)
    with pytest.raises(ValueError):
        DraftGate(_sps(), DraftCost(), history_rows=0)
    with pytest.raises(ValueError, match="max_probe_interval"):
        DraftGate(_sps(), DraftCost(), probe_interval=8, max_probe_interval=4)
    with pytest.raises(ValueError):
        DraftGate(_sps(), DraftCost()).observe(np.full((2, 3), 1.5))
