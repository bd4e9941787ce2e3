"""Service-level rules of the round driver (scheduler.service_levels): each keeps greedy output equal to the
target's own, and none lets a verification length depend on a token value.

Token independence is checked the way the early stop is argued (scheduler.algorithm): the confidence c[r, j+1]
is a function of the sampled token x[r, j], so whether l_r >= j may depend on c[r, <= j] but never on
c[r, j+1:]; rewriting those entries must leave {l_r >= j} unchanged, with lateness weights as without them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from kernels.sampling import SamplingError, SamplingParams
from scheduler.engine import SLO_RETRY_AFTER_S, SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.service_levels import (
    MIN_PACE,
    PACE_STEP,
    PaceTracker,
    RequestLevel,
    ServiceLevels,
    SLOUnattainableError,
    admission_order,
    behind_target,
    holds_joiners,
    join_slack_s,
    joiners_allowed,
    late_lengths,
    lateness_weights,
    merge_tiers,
    next_pause_count,
    pause_candidates,
    paused,
    predicted_tpot_s,
)
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
STEEP = SPSTable([1, 4, 8, 16, 32], [100.0, 80.0, 50.0, 25.0, 10.0])


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text())


def _engine(levels: ServiceLevels | None = None, policy: str = "dspark", max_requests: int = 8) -> SpeculativeEngine:
    draft_model = load_draft_model(FIXTURE / "draft", target_dir=FIXTURE / "target")
    target = TargetModel.from_pretrained(FIXTURE / "target", feature_layer_ids=draft_model.config.target_layer_ids)
    verify = VerifyEngine(target, max_requests=max_requests, max_seq_len=160)
    draft = DraftEngine(draft_model, max_requests=max_requests, max_seq_len=160)
    policy_ = make_policy(policy, STEEP, draft_model.block_size)
    return SpeculativeEngine(verify, draft, policy_, service_levels=levels)


def _greedy(reference: dict, **levels: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=reference["max_new_tokens"], **levels)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["dspark", "dspark-async", "full"])
@pytest.mark.parametrize(
    "levels",
    [
        {"speculative": "off"},
        {"speculative": "on"},
        {"priority": -3},
        {"tpot_slo_ms": 1e-6},  # always behind: weight 1 against the others' 0.1
        {"priority": -1, "tpot_slo_ms": 1e-6},  # always behind, and the others (a lower tier) sit rounds out
    ],
    ids=["off", "on", "priority", "target", "pause"],
)
def test_each_rule_keeps_greedy_output(reference: dict, policy: str, levels: dict) -> None:
    """Every other request carries the level (mixed rounds: off rows beside drafted ones, weighted beside
    unweighted); the output is the target's greedy output token for token."""
    engine = _engine(ServiceLevels(slo_admission="queue", pause_lower_tiers=True), policy)
    prompts = reference["prompts"]
    params = [_greedy(reference, **levels) if i % 2 else _greedy(reference) for i in range(len(prompts))]
    results = engine.generate(prompts, params)
    for i, res in enumerate(results):
        assert res.token_ids == reference["b"]["target_greedy_new_tokens"][i], (levels, i)
    if "speculative" in levels and levels["speculative"] == "off":
        for i, res in enumerate(results):
            if i % 2:
                assert sum(res.metrics.verified) == 0  # verified with no drafts, every round
        assert engine.draft is not None and engine.draft.num_free_slots == 8  # and released their slots


def test_off_requests_take_no_drafter_slot(reference: dict) -> None:
    engine = _engine(max_requests=2)
    prompt = reference["prompts"][0]
    engine.add_request(prompt, _greedy(reference, speculative="off"))
    engine.add_request(prompt, _greedy(reference, speculative="off"))
    engine.step()
    assert engine.num_running == 2
    assert engine.draft is not None and engine.draft.num_free_slots == 2
    assert engine.snapshot().rounds_without_draft == engine.snapshot().rounds


def test_all_off_round_does_not_call_the_drafter(reference: dict) -> None:
    engine = _engine()
    results = engine.generate(reference["prompts"][:2], _greedy(reference, speculative="off"))
    snap = engine.snapshot()
    assert snap.num_draft_tokens == 0 and snap.rounds_without_draft == snap.rounds > 0
    assert [r.token_ids for r in results] == reference["b"]["target_greedy_new_tokens"][:2]


def test_on_request_verifies_a_draft_every_round(reference: dict) -> None:
    engine = _engine(policy="dspark")
    # A steep curve and many requests: Algorithm 1 alone would verify no draft in some rounds.
    prompts = reference["prompts"] * 2
    params = [_greedy(reference, speculative="on")] + [_greedy(reference)] * (len(prompts) - 1)
    results = engine.generate(prompts, params)
    verified = results[0].metrics.verified
    caps_left = reference["max_new_tokens"] - 1  # the last round may be capped to 0 drafts
    assert all(v >= 1 for v in verified[:-1]) and sum(verified) <= caps_left + len(verified) * 8


def test_lower_tiers_than_a_late_request_sit_out_its_rounds(reference: dict) -> None:
    """A late high-tier request (always late: its target is 1 ns) beside one lower-tier request runs alone: the
    pause count reaches the one candidate in the first round, so the lower tier keeps its slot and the token of
    its prefill, gets no round until the late request finishes, then resumes and still gives the target's greedy
    output."""
    engine = _engine(ServiceLevels(pause_lower_tiers=True))
    prompts = reference["prompts"][:2]
    engine.add_request(prompts[0], _greedy(reference, priority=-1, tpot_slo_ms=1e-6), req_id="high")
    engine.add_request(prompts[1], _greedy(reference, priority=1), req_id="low")
    outputs: dict[str, list[int]] = {"high": [], "low": []}
    high_done = False
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
            high_done = high_done or (out.req_id == "high" and out.finished)
        if not high_done:
            assert len(outputs["low"]) <= 1 and engine.num_running == 2
    assert engine.snapshot().paused_request_rounds > 0
    assert outputs["high"] == reference["b"]["target_greedy_new_tokens"][0]
    assert outputs["low"] == reference["b"]["target_greedy_new_tokens"][1]


def test_pause_candidates_are_every_lower_tier_than_some_late_request() -> None:
    priorities = np.array([-1, 0, 0, 2, -1])
    assert not pause_candidates(priorities, np.zeros(5, dtype=bool)).any()
    assert pause_candidates(priorities, np.array([False, True, False, False, False])).tolist() == [0, 0, 0, 1, 0]
    # A late request of the top tier makes every lower one a candidate; nobody of its own tier.
    assert pause_candidates(priorities, np.array([False, True, False, False, True])).tolist() == [0, 1, 1, 1, 0]
    assert not pause_candidates(priorities, np.array([False, False, False, True, False])).any()


def test_pause_count_grows_by_steps_and_pauses_the_lowest_latest_first() -> None:
    assert [next_pause_count(c, 16) for c in (0, 2, 15, 16)] == [2, 4, 16, 16]
    assert next_pause_count(0, 3) == 1 and next_pause_count(5, 3) == 3  # at most every candidate
    priorities = np.array([-1, 1, 2, 1, 2, 1])
    candidates = priorities > -1
    assert paused(priorities, candidates, 0).tolist() == [0, 0, 0, 0, 0, 0]
    assert paused(priorities, candidates, 1).tolist() == [0, 0, 0, 0, 1, 0]  # tier 2, the later one
    assert paused(priorities, candidates, 3).tolist() == [0, 0, 1, 0, 1, 1]  # then tier 1, latest first
    assert paused(priorities, candidates, 9).tolist() == [0, 1, 1, 1, 1, 1]


def test_priority_admission_order_is_tier_then_fifo() -> None:
    assert admission_order([0, 5, -1, 0, -1]) == [2, 4, 0, 3, 1]


def test_join_slack_is_the_budget_left_after_the_remaining_rounds() -> None:
    # 20 ms per token over 24 tokens: 0.46 s from the first token; 0.1 s spent; 0.8 x 0.36 s left to plan with;
    # 20 tokens to go at 4 a round: 5 rounds of 0.04 s.
    assert join_slack_s(0.02, 0.1, 4, 24, 4.0, 0.04) == pytest.approx(0.8 * 0.36 - 0.2)
    assert join_slack_s(0.02, 0.1, 4, 24, 4.0, 0.08) == pytest.approx(0.8 * 0.36 - 0.4)  # < 0: misses at pace
    assert join_slack_s(0.02, 0.5, 4, 24, 4.0, 0.04) is None  # the budget is spent: it holds nothing back
    assert joiners_allowed([], 0.05) == -1
    assert joiners_allowed([0.26, 0.11], 0.05) == 2 and joiners_allowed([0.26, -0.01], 0.05) == 0
    assert joiners_allowed([0.01], 0.0) == -1  # no join cost learned yet


def test_a_queued_target_holds_lower_tiers_back(reference: dict) -> None:
    """Queue mode: a waiting request whose target is predicted to be missed waits while others run, and a
    lower tier waiting behind it does not overtake it; both join once nothing runs."""
    engine = _engine(ServiceLevels(slo_admission="queue"))
    prompt = reference["prompts"][0]
    engine.generate([prompt], _greedy(reference))  # timed rounds to predict from
    running = engine.add_request(prompt, _greedy(reference))
    engine.step()
    high = engine.add_request(prompt, _greedy(reference, priority=-1, tpot_slo_ms=1e-6))
    low = engine.add_request(prompt, _greedy(reference, priority=3))
    finished: list[str] = []
    while running not in finished:
        assert engine.num_waiting == 2
        finished += [out.req_id for out in engine.step() if out.finished]
    while engine.has_unfinished():
        finished += [out.req_id for out in engine.step() if out.finished]
    assert set(finished) == {running, high, low}


def test_unattainable_target_is_refused_once_rounds_are_timed(reference: dict) -> None:
    engine = _engine()
    engine.generate(reference["prompts"][:1], _greedy(reference))
    with pytest.raises(SLOUnattainableError) as refused:
        engine.add_request(reference["prompts"][0], _greedy(reference, tpot_slo_ms=1e-6, priority=2))
    assert refused.value.retry_after_s == SLO_RETRY_AFTER_S
    tier = {t.priority: t for t in engine.snapshot().tiers}[2]
    assert tier.refused == 1 and tier.requests == 0
    engine.add_request(reference["prompts"][0], _greedy(reference, tpot_slo_ms=1e6))  # attainable: queued


def test_server_defaults_apply_to_requests_that_set_nothing(reference: dict) -> None:
    engine = _engine(ServiceLevels(default_speculative="off", default_priority=7))
    results = engine.generate(reference["prompts"][:1], _greedy(reference))
    assert sum(results[0].metrics.verified) == 0
    assert [t.priority for t in engine.snapshot().tiers] == [7]


def test_weighted_lengths_never_depend_on_later_confidences() -> None:
    """{l_r >= j} may read c[r, <= j] only: rewriting c[r, j+1:] (functions of the token x[r, j]) must not
    change it, for every request, position and random weights."""
    rng = np.random.default_rng(0)
    policy = make_policy("dspark", STEEP, 6)
    for _ in range(60):
        num = int(rng.integers(1, 9))
        confidences = rng.uniform(0.05, 1.0, size=(num, 6))
        caps = rng.integers(0, 7, size=num)
        weights = np.where(rng.random(num) < 0.5, 1.0, rng.uniform(0.05, 1.0))
        lengths = policy.lengths(confidences, caps, weights=weights)
        for r in range(num):
            for j in range(1, 7):
                changed = confidences.copy()
                changed[r, j:] = rng.uniform(0.05, 1.0, size=6 - j)
                again = policy.lengths(changed, caps, weights=weights)
                assert (again[r] >= j) == (lengths[r] >= j), (r, j)


def test_weights_are_functions_of_timings_counts_and_settings() -> None:
    # Behind: 3 tokens, the first 0.25 s ago, a 0.1 s round: (0.25 + 0.1) / 3 > 0.1 s per token.
    assert behind_target(0.1, 0.25, 3, 0.1)
    assert not behind_target(0.2, 0.25, 3, 0.1)
    weights = lateness_weights(np.array([True, False, False]), 0.5)
    assert weights is not None and weights.tolist() == [1.0, 0.5, 0.5]
    assert lateness_weights(np.array([True, False]), 1.0) is None
    assert lateness_weights(np.array([False, False]), 0.5) is None
    assert predicted_tpot_s(0.03, 3.0, "auto") == pytest.approx(0.01)
    assert predicted_tpot_s(0.03, 3.0, "off") == pytest.approx(0.03)
    assert predicted_tpot_s(0.0, 3.0, "auto") == 0.0


def test_levels_resolve_and_validate() -> None:
    defaults = ServiceLevels(default_priority=2, default_tpot_slo_ms=50.0)
    assert RequestLevel.resolve(None, None, None, defaults) == RequestLevel("auto", 2, 0.05)
    assert RequestLevel.resolve("off", -1, 10.0, defaults) == RequestLevel("off", -1, 0.01)
    for bad in ({"speculative": "maybe"}, {"priority": 101}, {"priority": True}, {"tpot_slo_ms": 0.0}):
        with pytest.raises(SamplingError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]
    params = SamplingParams(speculative="on", priority=3, tpot_slo_ms=20.0)
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(ValueError):
        ServiceLevels(on_target_weight=0.0)
    for attainment in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="slo_attainment"):
            ServiceLevels(slo_attainment=attainment)


def test_pace_factor_settles_where_the_attainment_goal_is_met() -> None:
    """A tier whose TPOT scales with the pace it is held to (log-normal spread around it): quantile tracking
    moves the factor below 1 until the share meeting the target is the goal's, and back up once the load eases;
    without a goal the factor stays 1."""
    rng = np.random.default_rng(0)
    pace = PaceTracker(0.95)
    met = []
    for _ in range(20000):
        tpot = pace.factor(0) * float(rng.lognormal(0.0, 0.25))  # the target is 1
        met.append(tpot <= 1.0)
        pace.finished(0, met[-1])
    assert 0.93 <= np.mean(met[5000:]) <= 0.97
    assert MIN_PACE < pace.factor(0) < 0.8  # a 0.25 log-spread needs ~0.66 for 95 % under the target
    for _ in range(400):  # the load eases: every request meets its target
        pace.finished(0, True)
    assert pace.factor(0) == 1.0 and pace.factor(7) == 1.0  # and a tier never heard of is at 1
    for _ in range(100):
        pace.finished(0, False)
    assert pace.factor(0) == MIN_PACE  # clipped
    off = PaceTracker(None)
    off.finished(0, False)
    assert off.factor(0) == 1.0


def test_missed_targets_tighten_their_tier_only(reference: dict) -> None:
    """Requests with an unattainable target (1 ns per token) lower their tier's pace factor; a tier with a
    target it meets, and a tier without targets, keep 1. The output stays the target's greedy output."""
    engine = _engine(ServiceLevels(slo_admission="queue"))
    prompts = reference["prompts"][:3]
    params = [_greedy(reference, priority=-1, tpot_slo_ms=1e-6), _greedy(reference, priority=1, tpot_slo_ms=1e6),
              _greedy(reference, priority=2)]
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == reference["b"]["target_greedy_new_tokens"][:3]
    assert engine.pace.factor(-1) == 1.0 - PACE_STEP * 0.95
    assert engine.pace.factor(1) == 1.0 and engine.pace.factor(2) == 1.0


def test_tier_snapshots_merge() -> None:
    engine_tiers = _engine_free_tiers()
    merged = merge_tiers([engine_tiers, engine_tiers])
    assert merged[0].requests == 2 * engine_tiers[0].requests
    assert merged[0].tpot_buckets == tuple(2 * b for b in engine_tiers[0].tpot_buckets)


def _engine_free_tiers():
    from scheduler.service_levels import TierMetrics

    tiers = TierMetrics()
    tiers.finished(RequestLevel("auto", 0, 0.02), 10, 0.015, [3, 2, 4])
    tiers.finished(RequestLevel("auto", 0, 0.02), 10, 0.05, [1])
    snap = tiers.snapshot()
    assert snap[0].slo_attained == 1 and snap[0].slo_missed == 1 and snap[0].draft_tokens == 10
    return snap


def test_tier_snapshots_survive_the_hubs_wire() -> None:
    """The scheduler hub ships snapshots as msgpack maps and merges its verifier groups' tiers."""
    from dataclasses import replace

    import msgpack

    from scheduler.metrics import EngineMetrics, merge_snapshots, snapshot_from_dict, snapshot_to_dict

    snap = replace(EngineMetrics(4).snapshot(), tiers=_engine_free_tiers())
    back = snapshot_from_dict(msgpack.unpackb(msgpack.packb(snapshot_to_dict(snap))))
    assert back == snap
    assert merge_snapshots([snap, back]).tiers[0].requests == 4


def test_late_lengths_give_late_requests_their_whole_blocks() -> None:
    """In a planned round a late request verifies every draft its cap allows (at most the block); the others
    keep their planned lengths; no late request changes nothing."""
    planned = np.array([2, 2, 2, 0])
    caps = np.array([7, 3, 7, 5])
    late = np.array([True, True, False, False])
    assert late_lengths(planned, caps, late, 5).tolist() == [5, 3, 2, 0]
    assert late_lengths(planned, caps, None, 5) is planned


def test_prompts_are_held_only_while_a_target_runs_and_never_past_the_hold() -> None:
    assert holds_joiners(0.02, 0.0, True) and holds_joiners(0.02, 0.019, True)
    assert not holds_joiners(0.02, 0.02, True)  # the oldest prompt waited the whole hold: everyone joins
    assert not holds_joiners(0.02, 0.0, False)  # no running target: nothing to protect
    assert not holds_joiners(0.0, 0.0, True)  # off by default
    with pytest.raises(ValueError, match="join_hold_ms"):
        ServiceLevels(join_hold_ms=-1.0)
    with pytest.raises(ValueError, match="join_hold_ms"):
        ServiceLevels(join_hold_ms=float("nan"))
