"""Online draft cost: the robust fit of T_draft(R), its warm-up, and the policies it drives through the draft gate."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from cluster.config import AppConfig
from scheduler.algorithm import DraftCost, schedule_lengths
from scheduler.draft_cost_estimate import OnlineDraftCost
from scheduler.draft_gate import DraftGate
from scheduler.policy import DSparkAsync, DSparkScheduled, FixedLength, make_policy
from scheduler.sps import SPSTable

GAMMA = 7


def _sps() -> SPSTable:
    """The shape of the H200 graph-step table (docs/benchmarks/policies.md): flat to ~128 tokens, then rising."""
    sizes = [1, 32, 128, 256, 512, 1024]
    step_ms = np.array([3.95, 4.11, 4.84, 6.15, 9.93, 15.82])
    return SPSTable(sizes, (1000.0 / step_ms).tolist())


def _feed(estimator: OnlineDraftCost, rounds: int, fixed: float, per_request: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        r = int(rng.integers(1, 129))
        total = (fixed + per_request * r) * float(rng.normal(1.0, 0.02))
        estimator.observe(r, True, 0.8 * total, 0.2 * total)


def test_recovers_fixed_and_per_request_cost() -> None:
    estimator = OnlineDraftCost()
    _feed(estimator, 200, fixed=2.0e-3, per_request=0.052e-3)
    cost = estimator.draft_cost
    assert cost is not None
    assert cost.fixed_s == pytest.approx(2.0e-3, rel=0.1)
    assert cost.per_request_s == pytest.approx(0.052e-3, rel=0.1)
    assert cost.per_token_s == 0.0


def test_ignores_outliers() -> None:
    """One round in eight stalls for 20x its time (a GC pause, a retried RPC): the fit does not move."""
    estimator = OnlineDraftCost()
    rng = np.random.default_rng(1)
    for i in range(64):
        r = int(rng.integers(1, 129))
        total = 1.0e-3 + 0.03e-3 * r
        estimator.observe(r, True, total * (20.0 if i % 8 == 3 else 1.0), 0.0)
    cost = estimator.draft_cost
    assert cost is not None
    assert cost.fixed_s == pytest.approx(1.0e-3, rel=1e-6)
    assert cost.per_request_s == pytest.approx(0.03e-3, rel=1e-6)


def test_one_load_fit_ignores_outliers_like_the_general_fit() -> None:
    """Every round at the same R (steady load: the Python-float fit): stalled rounds are dropped and the cost is
    the inliers' mean, as the numpy fit of mixed loads computes it (checked on the same times at two loads,
    where the general fit's per-request term takes the difference)."""
    rng = np.random.default_rng(3)
    times = [1.0e-3 * float(rng.normal(1.0, 0.01)) * (25.0 if i % 9 == 4 else 1.0) for i in range(64)]
    inliers = [t for i, t in enumerate(times) if i % 9 != 4]
    steady = OnlineDraftCost()
    for t in times:
        steady.observe(32, True, t, 0.0)
    assert steady.draft_cost.fixed_s == pytest.approx(sum(inliers) / len(inliers), rel=1e-12)
    assert steady.draft_cost.per_request_s == 0.0
    mixed = OnlineDraftCost()
    for i, t in enumerate(times):  # the same times, every other round at R = 33 costing 1 us more
        r = 32 + i % 2
        mixed.observe(r, True, t + 1e-6 * (r - 32), 0.0)
    cost = mixed.draft_cost
    assert cost.seconds(32, 0) == pytest.approx(sum(inliers) / len(inliers), rel=0.02)


def test_warm_up_reports_nothing_and_plain_rounds_do_not_count() -> None:
    estimator = OnlineDraftCost(min_rounds=4)
    assert estimator.draft_cost is None
    assert estimator.no_draft_cost == DraftCost()  # 0 until a plain round is seen
    for _ in range(10):
        estimator.observe(16, False, 0.0, 0.5e-3)
    assert estimator.draft_cost is None
    assert estimator.no_draft_cost.fixed_s == pytest.approx(0.5e-3)
    for i in range(3):
        estimator.observe(16, True, 3e-3, 1e-3)
        assert estimator.draft_cost is None, i
    estimator.observe(16, True, 3e-3, 1e-3)
    # One load only: fixed and per-request cannot be told apart; the whole time is fixed (right at that load).
    cost = estimator.draft_cost
    assert cost.fixed_s == pytest.approx(4e-3) and cost.per_request_s == 0.0


def test_sliding_window_follows_a_changed_cost() -> None:
    estimator = OnlineDraftCost(window=32, refit_interval=1)
    _feed(estimator, 32, fixed=1e-3, per_request=0.0)
    _feed(estimator, 32, fixed=5e-3, per_request=0.0, seed=2)  # the drafter moved behind a slower link
    assert estimator.draft_cost.fixed_s == pytest.approx(5e-3, rel=0.05)


def test_coefficients_stay_nonnegative() -> None:
    falling = OnlineDraftCost(min_rounds=2)
    for r in range(1, 20):
        falling.observe(r, True, 2e-3 - 1e-5 * r, 0.0)
    assert falling.draft_cost.per_request_s == 0.0 and falling.draft_cost.fixed_s > 0
    steep = OnlineDraftCost(min_rounds=2)
    for r in range(10, 30):
        steep.observe(r, True, 1e-4 * r - 5e-4, 0.0)  # would fit a negative intercept
    assert steep.draft_cost.fixed_s == 0.0 and steep.draft_cost.per_request_s > 0


def test_ignores_empty_and_non_finite_rounds() -> None:
    estimator = OnlineDraftCost(min_rounds=1)
    estimator.observe(0, True, 1.0, 1.0)
    estimator.observe(4, True, float("nan"), 0.0)
    assert estimator.draft_cost is None


def test_a_refit_within_keep_within_keeps_the_estimate_object() -> None:
    """Round-to-round noise does not renew the estimate (the scheduler's caches are keyed by it); a real change
    does, and the plain rounds' overhead follows the same rule."""
    estimator = OnlineDraftCost(min_rounds=4, refit_interval=1, window=8)
    for t in (1.000e-3, 1.002e-3, 0.998e-3, 1.001e-3):
        estimator.observe(8, True, t, 0.0)
    first = estimator.draft_cost
    assert first is not None and first.fixed_s == pytest.approx(1.00025e-3)
    estimator.observe(8, True, 1.004e-3, 0.0)  # moves the fit by ~0.1%
    assert estimator.draft_cost is first
    for _ in range(8):
        estimator.observe(8, True, 1.5e-3, 0.0)  # the drafter got slower
    assert estimator.draft_cost is not first and estimator.draft_cost.fixed_s == pytest.approx(1.5e-3)
    estimator.observe(8, False, 0.0, 2.0e-4)
    plain = estimator.no_draft_cost
    estimator.observe(8, False, 0.0, 2.01e-4)
    assert estimator.no_draft_cost is plain
    for _ in range(3):
        estimator.observe(8, False, 0.0, 3.0e-4)
    assert estimator.no_draft_cost.fixed_s == pytest.approx(3.0e-4)
    exact = OnlineDraftCost(window=1, min_rounds=1, refit_interval=1, max_refit_interval=1, keep_within=0.0)
    # (a window of one round: the fit is the last round; no backoff: every read after a round refits)
    exact.observe(8, True, 1.0e-3, 0.0)
    kept = exact.draft_cost
    exact.observe(8, True, 1.0e-3, 0.0)
    assert exact.draft_cost is kept  # an identical fit keeps it even at 0
    exact.observe(8, True, 1.1e-3, 0.0)
    assert exact.draft_cost is not kept


def test_refits_back_off_while_the_estimate_holds_and_return_when_it_moves_or_the_load_changes() -> None:
    estimator = OnlineDraftCost(min_rounds=4, refit_interval=4, max_refit_interval=32)
    fits: list[int] = []
    fit = estimator._fit
    estimator._fit = lambda: fits.append(len(estimator._drafted)) or fit()  # type: ignore[method-assign]
    rng = np.random.default_rng(0)

    def rounds(n: int, r: int, seconds: float) -> None:
        for _ in range(n):
            estimator.observe(r, True, seconds * float(rng.normal(1.0, 0.001)), 0.0)
            assert estimator.draft_cost is None or estimator.draft_cost.fixed_s > 0  # read every round, as policies do

    rounds(200, 1, 1e-3)  # steady: intervals 4, 8, 16, 32, 32, ...
    assert 6 <= len(fits) <= 10
    assert estimator._interval == 32
    fits.clear()
    rounds(1, 2, 1e-3)  # another R: back to the base cadence, a refit within its 4 rounds
    rounds(3, 1, 1e-3)
    assert len(fits) >= 1
    rounds(40, 1, 3e-3)  # the drafter got 3x slower at the old load: renewed within a few refits
    assert estimator.draft_cost.fixed_s == pytest.approx(3e-3, rel=0.05)  # (the R = 2 round is in the window)
    assert len(fits) >= 3


def test_a_load_moving_inside_the_fitted_range_keeps_backing_off() -> None:
    """A closed loop: R moves between 6, 7 and 8 as requests finish and join. Those loads are all in the window
    the fit saw, so the refits back off as at a steady load; a load outside that range resets the cadence."""
    estimator = OnlineDraftCost(min_rounds=4, refit_interval=4, max_refit_interval=32)
    fits: list[int] = []
    fit = estimator._fit
    estimator._fit = lambda: fits.append(len(estimator._drafted)) or fit()  # type: ignore[method-assign]
    rng = np.random.default_rng(1)
    for i in range(200):
        r = 6 + i % 3
        estimator.observe(r, True, (0.5e-3 + 0.03e-3 * r) * float(rng.normal(1.0, 0.001)), 0.0)
        assert estimator.draft_cost is not None or i < 3
    assert len(fits) <= 12 and estimator._interval == 32
    assert estimator.draft_cost.seconds(7, 7) == pytest.approx(0.71e-3, rel=0.01)
    estimator.observe(20, True, 1.1e-3, 0.0)  # a new load, outside the fitted range
    assert estimator._interval == 4


def test_policies_read_the_estimate_once_a_round() -> None:
    """should_draft and lengths in one round see the same cost object; the next round's report can move it."""
    estimator = OnlineDraftCost(min_rounds=1, refit_interval=1)
    policy = DSparkScheduled(_sps(), gate=DraftGate(_sps(), DraftCost()), estimator=estimator)
    policy.observe_round(4, True, 1e-3, 1e-4)
    assert policy.draft_cost is policy.draft_cost is policy.gate.draft_cost
    assert policy.draft_cost.fixed_s == pytest.approx(1.1e-3)
    policy.observe_round(4, True, 3e-3, 1e-4)
    assert policy.draft_cost.fixed_s == pytest.approx(2.1e-3) and policy.gate.draft_cost is policy.draft_cost


def test_bad_arguments() -> None:
    for kwargs in ({"window": 0}, {"min_rounds": 0}, {"refit_interval": 0}, {"window": 4, "min_rounds": 5},
                   {"keep_within": 1.0}, {"keep_within": -0.1}, {"keep_within": float("nan")},
                   {"max_refit_interval": 0}, {"refit_interval": 8, "max_refit_interval": 4}):  # fmt: skip
        with pytest.raises(ValueError):
            OnlineDraftCost(**kwargs)
    with pytest.raises(ValueError, match="outlier_mads"):
        OnlineDraftCost(outlier_mads=float("inf"))
    with pytest.raises(ValueError, match="not both"):
        DSparkScheduled(_sps(), draft_cost=DraftCost(), estimator=OnlineDraftCost())


def _caps(num_requests: int) -> np.ndarray:
    return np.full(num_requests, GAMMA, dtype=np.int64)


def _drafted_round(policy: DSparkScheduled | DSparkAsync, num_requests: int, draft_s: float) -> None:
    """One drafted round at flat confidence 0.5, as the round driver runs it, with a measured draft time."""
    assert policy.should_draft(_caps(num_requests))
    policy.lengths(np.full((num_requests, GAMMA), 0.5), _caps(num_requests))
    policy.observe_round(num_requests, True, draft_s, 0.2e-3)


@pytest.mark.parametrize("spec", ["dspark", "dspark-async"])
def test_measured_expensive_draft_skips_and_cheap_draft_drafts(spec: str) -> None:
    """With the real DraftGate: 8.6 ms of drafting at 128 requests against a ~4.8 ms verify step makes a plain
    round faster (skip); 0.1 ms of drafting does not (draft). Before the warm-up nothing is skipped."""
    expensive = make_policy(spec, _sps(), GAMMA, draft_cost="measured")
    for _ in range(7):
        _drafted_round(expensive, 128, 8.6e-3)  # 7 drafted rounds: still warming up, so still drafting
    assert expensive.should_draft(_caps(128))  # the 8th round drafts: the estimator has 7 observations
    expensive.lengths(np.full((128, GAMMA), 0.5), _caps(128))
    expensive.observe_round(128, True, 8.6e-3, 0.2e-3)
    assert not expensive.should_draft(_caps(128))
    expensive.observe_round(128, False, 0.0, 0.2e-3)  # the skipped round teaches the no-draft overhead
    assert not expensive.should_draft(_caps(128))
    assert expensive.gate.no_draft_cost.fixed_s == pytest.approx(0.2e-3)

    cheap = make_policy(spec, _sps(), GAMMA, draft_cost="measured")
    for _ in range(20):
        _drafted_round(cheap, 128, 0.1e-3)
    assert cheap.should_draft(_caps(128)) and cheap.gate.skipped == 0


def test_make_policy_draft_cost_setting() -> None:
    plain = make_policy("dspark", _sps(), GAMMA)
    assert plain.gate is None and plain.draft_cost is None
    measured = make_policy("dspark", _sps(), GAMMA, draft_cost="measured")
    assert measured.gate is not None and measured.draft_cost is None  # warming up
    assert isinstance(make_policy("fixed-3", _sps(), GAMMA, draft_cost="measured"), FixedLength)
    with pytest.raises(ValueError, match="unknown draft_cost 'fast'"):
        make_policy("dspark", _sps(), GAMMA, draft_cost="fast")


def test_config_setting_defaults_to_none_and_rejects_unknown_values() -> None:
    assert AppConfig.from_args({}).scheduler.draft_cost == "none"
    assert AppConfig.from_args({"scheduler": {"draft_cost": "measured"}}).scheduler.draft_cost == "measured"
    with pytest.raises(ValidationError, match=r"scheduler\.draft_cost\n  Input should be 'none' or 'measured'"):
        AppConfig.from_args({"scheduler": {"draft_cost": "fast"}})


def test_verify_scale_is_the_robust_measured_over_predicted_ratio() -> None:
    estimator = OnlineDraftCost(min_rounds=8)
    for _ in range(7):
        estimator.observe(128, True, 2e-3, 1e-3, verify_s=16e-3, predicted_verify_s=10e-3)
    assert estimator.verify_scale == 1.0 and estimator.verify_rounds == 7  # warming up
    estimator.observe(128, False, 0.0, 1e-3, verify_s=16e-3, predicted_verify_s=10e-3)  # plain rounds count too
    assert estimator.verify_scale == pytest.approx(1.6, rel=0.012)  # 1/32-octave steps: within 1.1%
    for _ in range(3):  # a few prefill-heavy or paused rounds do not move the median
        estimator.observe(128, True, 2e-3, 1e-3, verify_s=200e-3, predicted_verify_s=10e-3)
    assert estimator.verify_scale == pytest.approx(1.6, rel=0.012)
    for bad in ((None, 10e-3), (16e-3, None), (16e-3, 0.0), (float("nan"), 10e-3), (-1.0, 10e-3)):
        estimator.observe(128, True, 2e-3, 1e-3, verify_s=bad[0], predicted_verify_s=bad[1])
    assert estimator.verify_rounds == 11


@pytest.mark.parametrize("spec", ["dspark", "dspark-async"])
def test_policies_price_verify_steps_at_their_measured_scale(spec: str) -> None:
    """Verify steps measured 1.6x the table: both round costs the policy and its gate use are divided by the
    scale, which prices the verify step 1.6x as long (Theta changes by a constant factor only)."""
    sps = _sps()
    policy = make_policy(spec, sps, GAMMA, draft_cost="measured")
    predicted = float(sps.dense_step_time(128 * 3)[128 * 3])
    for drafted in [True] * 12 + [False]:
        policy.observe_round(128, drafted, 2e-3 if drafted else 0.0, 1e-3, 1.6 * predicted, 128 * 3)
    estimator = policy._cost.estimator
    scale = estimator.verify_scale
    assert scale == pytest.approx(1.6, rel=0.012)
    assert policy._cost.current() == estimator.draft_cost.scaled(1 / scale)
    assert policy.gate.draft_cost == estimator.draft_cost.scaled(1 / scale)
    assert policy.gate.no_draft_cost == estimator.no_draft_cost.scaled(1 / scale)


def test_scaled_draft_cost_decides_as_a_scaled_table() -> None:
    """Algorithm 1 with both costs divided by k on the profiled table decides as with the table's steps k times
    as long and the costs as measured (the constant factor of Theta), on many random rounds."""
    rng = np.random.default_rng(7)
    sps, cost = _sps(), DraftCost(fixed_s=2.3e-3, per_request_s=4e-6)
    for k in (0.8, 1.25, 1.6, 2.5):
        slow = sps.scaled(k)
        for _ in range(300):
            r = int(rng.integers(1, 160))
            conf = rng.beta(5.0, 1.2, size=(r, GAMMA))
            np.testing.assert_array_equal(
                schedule_lengths(conf, sps, draft_cost=cost.scaled(1 / k)),
                schedule_lengths(conf, slow, draft_cost=cost),
            )


def test_draft_cost_scaled_rejects_bad_factors() -> None:
    assert DraftCost(1e-3, 2e-6, 3e-7).scaled(2.0) == DraftCost(2e-3, 4e-6, 6e-7)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale factor"):
            DraftCost(1e-3).scaled(bad)
