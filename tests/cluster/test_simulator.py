"""The cluster simulator: determinism, conservation, Little's law, placements, autoscaling, bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cluster.cli import main
from cluster.simulator.autoscaler import PoolAutoscaler, PoolScaling, ScalingConfigError
from cluster.simulator.costs import CostFileError, load_costs, parse_costs
from cluster.simulator.planner import candidates, plan, recommended_autoscaling, slice_of
from cluster.simulator.report import Slo, summarize
from cluster.simulator.simulation import ClosedLoop, ClusterSpec, SimResult, Simulation, SimulationError, simulate
from cluster.simulator.traces import TraceFileError, load_traces
from cluster.simulator.workload import LengthSpec, Workload, WorkloadError, generated, replayed
from scheduler.sts import STSCalibration

ROOT = Path(__file__).resolve().parents[2]
COSTS = ROOT / "docs" / "simulator" / "costs_h200.json"
TRACES = ROOT / "tests" / "data" / "sim_traces_demo_mbpp.npz"
STS = ROOT / "models" / "demo" / "draft_dspark" / "sts.json"
POLICIES = ["autoregressive", "fixed-1", "full", "dspark", "dspark-async"]
# An autoscaled pool that follows a load of a few requests per replica quickly (both autoscaling tests).
SCALING = PoolScaling(
    min_replicas=1,
    max_replicas=6,
    target_ongoing_requests=4,
    look_back_period_s=2,
    upscale_delay_s=1,
    downscale_delay_s=2,
)


@pytest.fixture(scope="module")
def costs():
    return load_costs(COSTS)


@pytest.fixture(scope="module")
def trace():
    return load_traces(TRACES, STSCalibration.load(STS))


def _workload(seed: int = 0, rate: float = 40.0, duration: float = 10.0, cv: float = 1.0) -> Workload:
    rng = np.random.default_rng(seed)
    return generated(rate, duration, LengthSpec.parse("uniform:11:399"), LengthSpec.parse("uniform:1:160"), rng, cv)


def _check_conservation(workload: Workload, result: SimResult) -> None:
    assert not result.rejected.any()
    assert np.isfinite(result.finish_s).all()  # every request finished (once: finish_s is written at its end)
    assert (result.emitted == workload.output_tokens).all()  # exactly the tokens it asked for
    assert (result.admit_s >= result.arrival_s).all()
    assert (result.first_token_s >= result.admit_s).all() and (result.finish_s >= result.first_token_s).all()


def _check_littles_law(result: SimResult) -> None:
    """L = lambda W on the whole run: the time integral of the number in the system (and of the queue)
    equals the sum of the requests' times in it (waiting for a slot), so mean L = arrival rate x mean W."""
    sojourn = result.finish_s - result.arrival_s
    queued = result.admit_s - result.arrival_s
    assert result.in_system_area == pytest.approx(sojourn.sum(), rel=1e-9)
    assert result.waiting_area == pytest.approx(queued.sum(), rel=1e-9, abs=1e-9)
    rate = result.arrival_s.size / result.end_s
    assert result.in_system_area / result.end_s == pytest.approx(rate * sojourn.mean(), rel=1e-9)


def test_a_run_is_a_function_of_its_seed(costs, trace) -> None:
    spec = ClusterSpec(placement="disaggregated", verifiers=3, drafters=2, groups=2, policy="dspark")
    first = simulate(_workload(), costs, trace, spec, seed=5)
    again = simulate(_workload(), costs, trace, spec, seed=5)
    other = simulate(_workload(), costs, trace, spec, seed=6)
    for name in ("finish_s", "first_token_s", "rounds"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert first.total_rounds == again.total_rounds
    assert not np.array_equal(first.finish_s, other.finish_s)  # another seed replays other trace rows


def test_a_single_prompt_draw_equals_a_batch_draw_of_one(trace) -> None:
    """The batched run draws one request's next recorded prompt with prompt_bound, the round-by-round run with
    prompt_bounds: the same draw from the same stream."""
    for seed in range(20):
        one, batch = np.random.default_rng(seed), np.random.default_rng(seed)
        for _ in range(5):
            assert trace.prompt_bound(one) == tuple(trace.prompt_bounds(1, batch)[0].tolist())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("placement", "groups"), [("colocated", 1), ("disaggregated", 1), ("disaggregated", 2)])
def test_every_request_finishes_once_with_its_tokens(costs, trace, policy: str, placement: str, groups: int) -> None:
    workload = _workload(rate=60.0, duration=5.0, cv=3.0)  # bursty: queues form, slots fill
    spec = ClusterSpec(
        placement=placement, verifiers=2, drafters=1, verifier_slots=16, drafter_slots=24, groups=groups, policy=policy
    )
    result = simulate(workload, costs, trace, spec, seed=1)
    _check_conservation(workload, result)
    _check_littles_law(result)
    assert (result.waiting_area > 0) == (result.admit_s > result.arrival_s).any()


@pytest.mark.parametrize("policy", ["autoregressive", "dspark"])
def test_a_closed_loop_sends_each_request_when_one_ends(costs, trace, policy: str) -> None:
    users, delay = 5, 0.004
    base = _workload(rate=40.0, duration=2.0)  # its arrival times are ignored: only lengths and order count
    spec = ClusterSpec(placement="colocated", verifiers=1, verifier_slots=8, policy=policy)
    result = simulate(base, costs, trace, spec, seed=1, closed_loop=ClosedLoop(users, delay))
    _check_conservation(base, result)
    # The first `users` requests arrive at once; request k > users-1 when the (k - users)-th end came, plus the delay.
    np.testing.assert_array_equal(result.arrival_s[:users], np.full(users, delay))
    ends = np.sort(result.finish_s)
    np.testing.assert_allclose(result.arrival_s[users:], ends[: base.size - users] + delay, rtol=0, atol=1e-12)
    assert result.in_system_area <= users * result.end_s * (1 + 1e-12)  # never more than `users` in the system
    again = simulate(base, costs, trace, spec, seed=1, closed_loop=ClosedLoop(users, delay))
    np.testing.assert_array_equal(result.finish_s, again.finish_s)
    with pytest.raises(SimulationError, match="closed loop"):
        ClosedLoop(0)


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_a_measured_draft_cost_learns_from_simulated_rounds(costs, trace, policy: str) -> None:
    """With ``draft_cost measured`` the policies get every round's simulated timings (observe_round) and their
    draft gate decides per round; requests still get exactly their tokens."""
    workload = _workload(rate=300.0, duration=3.0)
    spec = ClusterSpec(placement="colocated", verifiers=1, policy=policy, draft_cost="measured")
    simulation = Simulation(workload, costs, trace, spec, seed=0)
    result = simulation.run()
    _check_conservation(workload, result)
    assert 0 < result.drafted_rounds <= result.total_rounds
    learned = simulation.verifiers[0].drivers[0].policy
    if policy == "dspark":
        assert learned.draft_cost is not None  # the estimator has measured the simulated draft time


def test_colocated_steps_serialise_and_pipelined_groups_overlap(costs, trace) -> None:
    """One request alone: a colocated round is draft + verify on one GPU; disaggregated with two groups and
    enough load keeps the drafter busy while the verifier verifies, so it finishes the same work sooner."""
    one = Workload(np.zeros(1), np.array([50]), np.array([64]))
    colocated = simulate(one, costs, trace, ClusterSpec(placement="colocated", policy="full"), seed=0)
    assert colocated.drafter_busy_s == 0.0 and colocated.verifier_busy_s > 0
    heavy = Workload(np.zeros(64), np.full(64, 50), np.full(64, 128))
    spec = ClusterSpec(placement="disaggregated", verifiers=1, drafters=1, policy="full", verifier_slots=64)
    plain = simulate(heavy, costs, trace, spec, seed=0)
    pipelined = simulate(heavy, costs, trace, replace(spec, groups=2), seed=0)
    assert pipelined.end_s < plain.end_s


def test_autoscaling_follows_the_engine_load_policy(costs, trace) -> None:
    """A load that needs several replicas at a target of 4 held requests each scales the pool up, and the
    pool drains back to min_replicas once the arrivals stop."""
    scaling = SCALING
    spec = ClusterSpec(
        placement="colocated", verifiers=1, policy="dspark", verifier_scaling=scaling, control_interval_s=0.5
    )
    fast = replace(costs, verifier_start_s=1.0)
    workload = generated(60.0, 20.0, LengthSpec.parse("64"), LengthSpec.parse("400"), np.random.default_rng(0))
    result = simulate(workload, fast, trace, spec, seed=0)
    _check_conservation(workload, result)
    replicas = [v for _, v, _, _ in result.timeline]
    assert max(replicas) > 2
    assert replicas[-1] <= replicas[replicas.index(max(replicas))]
    assert result.timeline[-1][3] <= 1  # the last tick saw the system (nearly) empty


def test_a_drafter_pool_scaled_to_zero_starts_again_for_waiting_requests(costs, trace) -> None:
    idle = PoolScaling(
        min_replicas=0,
        max_replicas=2,
        target_ongoing_requests=4,
        look_back_period_s=1,
        upscale_delay_s=0,
        downscale_delay_s=0,
    )
    spec = ClusterSpec(placement="disaggregated", verifiers=1, drafters=1, drafter_scaling=idle, control_interval_s=0.5)
    two_bursts = Workload(np.array([0.0, 0.1, 30.0, 30.1]), np.full(4, 20), np.full(4, 32))
    result = simulate(two_bursts, replace(costs, drafter_start_s=2.0), trace, spec, seed=0)
    _check_conservation(two_bursts, result)
    drafters = [d for _, _, d, _ in result.timeline]
    assert 0 in drafters  # idle between the bursts
    assert result.first_token_s[2] - result.arrival_s[2] >= 2.0  # waited for a drafter to start


def test_serve_rules_around_the_policy() -> None:
    scaler = PoolAutoscaler(
        PoolScaling(
            min_replicas=1,
            max_replicas=10,
            target_ongoing_requests=2,
            look_back_period_s=2,
            upscale_delay_s=3,
            downscale_delay_s=5,
        ),
        initial=2,
    )
    assert scaler.tick(0.0, {"a": 8.0, "b": 8.0}, 2) == 2  # wants 8, waits for the upscale delay
    assert scaler.tick(3.0, {"a": 8.0, "b": 8.0}, 2) == 8
    assert scaler.tick(4.0, {"a": 0.0}, 8) == 8  # wants fewer: waits for the downscale delay
    assert scaler.tick(20.0, {"a": 0.0}, 8) == 1  # look-back average is 0 now; never below one replica


def test_planner_ranks_candidates_and_recommends_pool_configs(costs, trace) -> None:
    base = ClusterSpec(policy="dspark", verifier_slots=64, drafter_slots=64)
    specs = candidates(base, 4, [(1, 1), (1, 3)], [1, 2])
    assert [(s.placement, s.verifiers, s.drafters, s.groups) for s in specs] == [
        ("colocated", 4, 0, 1),
        ("disaggregated", 2, 2, 1),
        ("disaggregated", 2, 2, 2),
        ("disaggregated", 3, 1, 1),
        ("disaggregated", 3, 1, 2),
    ]
    slo = Slo(0.5, 0.02)
    rows = plan(specs[:2], lambda rate: _workload(rate=rate, duration=3.0), costs, trace, slo, progress=False)
    per_gpu = [r.goodput_per_gpu for r in rows]
    assert per_gpu == sorted(per_gpu, reverse=True) and per_gpu[-1] > 0
    for row in rows:  # the goodput rate meets the attainment; twice the rate (past the search's bracket) misses
        assert row.summary.slo_met >= 0.9
        double = simulate(_workload(rate=2.2 * row.goodput_rps, duration=3.0), costs, trace, row.simulated, seed=0)
        assert summarize(double, slo).slo_met < 0.9
    config = recommended_autoscaling(rows[0])
    assert 1 <= config["verifier"]["target_ongoing_requests"] < 64
    assert config["verifier"]["max_replicas"] == rows[0].deployment.verifiers
    for pool in config.values():
        PoolScaling.from_config(pool, "recommended")  # a valid autoscaling_config


def test_large_deployments_are_simulated_as_slices_with_the_same_ratio() -> None:
    spec = ClusterSpec(placement="disaggregated", verifiers=384, drafters=128, groups=2)
    assert (slice_of(spec, 64).verifiers, slice_of(spec, 64).drafters, slice_of(spec, 64).groups) == (48, 16, 2)
    assert slice_of(replace(spec, placement="colocated", verifiers=512, drafters=0), 64).verifiers == 64
    assert slice_of(replace(spec, verifiers=6, drafters=2), 64) == replace(spec, verifiers=6, drafters=2)
    near = slice_of(replace(spec, verifiers=341, drafters=171), 64)  # 341:171 does not reduce: the closest split
    assert (near.verifiers, near.drafters) == (43, 21)


def test_summary_goodput_counts_slo_meeting_requests(costs, trace) -> None:
    workload = _workload(rate=20.0, duration=5.0)
    result = simulate(workload, costs, trace, ClusterSpec(placement="colocated", verifiers=2), seed=0)
    loose, tight = summarize(result, Slo(10.0, 1.0)), summarize(result, Slo(1e-4, 1e-4))
    assert loose.slo_met == 1.0 and tight.slo_met == 0.0
    assert loose.goodput_rps == pytest.approx(workload.size / result.end_s)
    assert loose.goodput_per_gpu == pytest.approx(loose.goodput_rps / 2)


def test_cost_file_errors_name_the_field() -> None:
    data = json.loads(COSTS.read_text())
    parse_costs(data)
    broken = dict(data, draft={**data["draft"], "seconds": data["draft"]["seconds"][:-1]})
    with pytest.raises(CostFileError, match="draft"):
        parse_costs(broken)
    with pytest.raises(CostFileError, match=r"hops\.colocated_s"):
        parse_costs(dict(data, hops={**data["hops"], "colocated_s": -1}))
    with pytest.raises(CostFileError, match="source"):
        parse_costs(dict(data, host={k: v for k, v in data["host"].items() if k != "source"}))
    with pytest.raises(CostFileError, match="format"):
        parse_costs({"format": "other"})


def test_bad_traces_workloads_and_scaling_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceFileError, match="readable"):
        load_traces(COSTS)
    np.savez(
        tmp_path / "t.npz",
        logits=np.zeros((2, 7)),
        accepted=np.array([1, 9]),
        request=np.array([0, 0]),
        has_confidence=np.array(True),
    )
    with pytest.raises(TraceFileError, match="accepted"):
        load_traces(tmp_path / "t.npz")
    log = tmp_path / "log.txt"
    log.write_text("# arrival input output\n0.5 10 20\n0.1, 5, 7\n")
    replay = replayed(log)
    assert replay.arrival_s.tolist() == [0.1, 0.5] and replay.output_tokens.tolist() == [7, 20]
    log.write_text("0.5 10\n")
    with pytest.raises(WorkloadError, match=":1:"):
        replayed(log)
    with pytest.raises(WorkloadError, match="bad length"):
        LengthSpec.parse("uniform:5:2")
    with pytest.raises(ScalingConfigError, match="unknown field"):
        PoolScaling.from_config({"min_replica": 1}, "verifier")


def test_cli_runs_and_refuses_bad_input_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--costs", str(COSTS), "--traces", str(TRACES), "--sts", str(STS), "--no-progress"]
    out = tmp_path / "run.json"
    argv = ["simulate", "run", *common, "--rate", "10", "--duration-s", "3", "--slo-ttft-ms", "500", "--json", str(out)]
    assert main(argv) == 0
    assert "SLO met by" in capsys.readouterr().out
    assert json.loads(out.read_text())["summary"]["finished"] > 0
    assert main(["simulate", "run", "--costs", str(TRACES), "--no-progress"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["simulate", "run", "--costs", str(COSTS), "--policy", "dspark", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    assert main(["simulate", "run", *common, "--policy", "fixed-x"]) == 2
    assert main(["simulate", "plan", *common, "--gpus", "2"]) == 2  # no SLO
    assert "needs an SLO" in capsys.readouterr().err


def _same_result(a: SimResult, b: SimResult) -> None:
    for name in ("arrival_s", "admit_s", "first_token_s", "finish_s", "emitted", "rounds", "rejected"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for name in (
        "end_s",
        "total_rounds",
        "drafted_rounds",
        "planned_rounds",
        "verifier_busy_s",
        "drafter_busy_s",
        "verifier_gpu_s",
        "drafter_gpu_s",
        "in_system_area",
        "waiting_area",
        "running_area",
        "timeline",
    ):
        assert getattr(a, name) == getattr(b, name), name
    # The rounds logged (when asked): one a round, its verified requests and joins as the per-request counts have
    # them; the batched run logs them a batch at a time (another order), the same rounds.
    if not a.round_end_s.size and not b.round_end_s.size:
        return
    for result in (a, b):
        assert result.round_end_s.size == result.round_requests.size == result.round_joins.size == result.total_rounds
        assert result.round_requests.sum() == result.rounds.sum()
        assert result.round_joins.sum() == np.isfinite(result.admit_s).sum()
    rounds = [(r.round_end_s, r.round_requests, r.round_joins) for r in (a, b)]
    order = [np.lexsort((joins, requests, ends)) for ends, requests, joins in rounds]
    for x, y in zip(*rounds, strict=True):
        np.testing.assert_array_equal(x[order[0]], y[order[1]])


@pytest.mark.parametrize(
    ("policy", "case"),
    [
        ("dspark", "open"),
        ("full", "open"),
        ("fixed-1", "open"),
        ("autoregressive", "open"),
        ("dspark", "closed loop"),
        ("dspark", "autoscaled"),
        ("dspark", "many replicas"),
        ("dspark", "chained"),
        ("dspark", "relayed"),
        ("dspark", "chained closed loop"),
        ("dspark", "chained autoscaled"),
        ("dspark", "chained many replicas"),
        ("dspark", "relayed many replicas"),
        ("full", "relayed"),
        ("fixed-1", "chained"),
        ("autoregressive", "decode steps"),
        ("autoregressive", "decode steps closed loop"),
        ("autoregressive", "decode steps many replicas"),
    ],
)
def test_batched_rounds_run_exactly_as_round_by_round(costs, trace, policy: str, case: str) -> None:
    """Replicas on their own GPU with a policy that decides each round alone, or plans rounds from its planner's
    state alone (dspark with planned rounds, chained or relayed: every replica's planner a row of one
    ChainPlanners), are decided in batches (one vectorised walk for the rounds pending across the cluster, no
    event for a round whose end changes nothing outside its replica): the same run, bit for bit, as the
    round-by-round loop, planned rounds included."""
    closed_loop = ClosedLoop(6, 0.004) if "closed loop" in case else None
    planned = case.split()[0] if case.split()[0] in ("chained", "relayed") else "off"
    spec = ClusterSpec(placement="colocated", verifiers=3, verifier_slots=8, policy=policy, planned_rounds=planned)
    if case.startswith("decode steps"):  # plain rounds of several decode steps, requests finishing mid-round
        spec = replace(spec, decode_steps=8)
    workload = _workload(seed=4, rate=60.0, duration=6.0, cv=2.0)
    run_costs = costs
    if case.endswith("autoscaled"):
        scaling = SCALING
        spec = replace(spec, verifiers=1, verifier_slots=128, verifier_scaling=scaling, control_interval_s=0.5)
        run_costs = replace(costs, verifier_start_s=1.0, drafter_start_s=1.0)
    if case.endswith("many replicas"):
        spec = replace(spec, verifiers=16, verifier_slots=128)
        lengths = LengthSpec.parse("uniform:11:399"), LengthSpec.parse("uniform:1:160")
        workload = generated(300.0, 2.0, *lengths, np.random.default_rng(1))
    batched = Simulation(workload, run_costs, trace, spec, 5, closed_loop=closed_loop, log_rounds=True)
    assert batched.batched
    by_round = Simulation(workload, run_costs, trace, spec, 5, closed_loop=closed_loop, log_rounds=True)
    by_round.batched = False
    result = batched.run()
    _same_result(result, by_round.run())
    assert (result.planned_rounds > 0) == (planned != "off")


def test_planned_rounds_run_where_the_served_engine_plans_them(costs, trace) -> None:
    """The served engine's planned rounds (lengths from the policy's ``planned_lengths`` before the drafts, their
    confidences back through ``observe_drafts``): in process (chained) only rounds no prompt joins and whose
    drafts launched ahead hold no finished request, relayed every drafted round; ``auto`` is the placement's
    served default (colocated: chained); a planning dspark with a fixed draft cost is decided in batches, every
    replica's planner a row of one ChainPlanners (asked, and learning from the drafts, where rounds are planned)."""
    workload = _workload(seed=2, rate=30.0, duration=4.0)
    results = {}
    for planned in ("off", "chained", "relayed", "auto"):
        spec = ClusterSpec(
            placement="colocated", verifiers=1, verifier_slots=8, policy="dspark", planned_rounds=planned
        )
        sim = Simulation(workload, costs, trace, spec, 3)
        assert sim.batched
        result = results[planned] = sim.run()
        _check_conservation(workload, result)
        planners = sim._planners
        assert (planners is not None) == (planned != "off")
        if planners is not None:  # the policy was asked for plans, and learned them from drafts
            assert planners.asked[0] and (planners.plans[0] >= 0).any()
    assert results["off"].planned_rounds == 0
    assert 0 < results["chained"].planned_rounds < results["chained"].drafted_rounds  # joiners: Algorithm 1
    assert 0 < results["relayed"].planned_rounds <= results["relayed"].drafted_rounds
    _same_result(results["auto"], results["chained"])
    assert results["auto"].planned_rounds == results["chained"].planned_rounds
    with pytest.raises(SimulationError, match="planned_rounds"):
        simulate(workload, costs, trace, ClusterSpec(policy="dspark", planned_rounds="sometimes"))


@pytest.mark.parametrize("policy", ["fixed-3", "full"])
def test_planned_rounds_of_fixed_lengths_verify_the_planned_lengths(costs, trace, policy: str) -> None:
    """A fixed-length policy plans the lengths it decides: relayed, every drafted round is planned, and the run
    is the one that decides every round on its drafts (the same lengths, verified and accepted)."""
    workload = _workload(seed=5, rate=30.0, duration=3.0)
    runs = {}
    for planned in ("relayed", "off"):
        spec = ClusterSpec(placement="disaggregated", verifiers=1, drafters=1, policy=policy, planned_rounds=planned)
        runs[planned] = simulate(workload, costs, trace, spec, seed=1)
    assert runs["relayed"].planned_rounds == runs["relayed"].drafted_rounds > 0
    assert runs["off"].planned_rounds == 0
    _same_result(runs["relayed"], replace(runs["off"], planned_rounds=runs["relayed"].planned_rounds))


def test_one_new_recorded_prompt_is_the_same_draw_as_an_array_of_one(trace) -> None:
    for seed in range(20):
        one, array = np.random.default_rng(seed), np.random.default_rng(seed)
        for _ in range(30):
            starts, ends = trace.row_ranges(1, one)
            prompts = array.integers(0, trace.num_prompts, size=1)
            assert starts.tolist() == trace.starts[prompts].tolist()
            assert ends.tolist() == trace.starts[prompts + 1].tolist()
        assert one.bit_generator.state == array.bit_generator.state


def _plain_round_s(costs, spec: ClusterSpec, requests: int, steps: list[float]) -> float:
    """A plain round of ``requests`` requests as the simulator times it: a hop to the verifier, its steps, a hop
    back, host time and the per-round overhead."""
    hop = costs.hop_s(spec.placement)
    return hop + sum(steps) + hop + costs.host_plain(requests) + costs.round_overhead_s


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_decode_steps_emit_that_many_tokens_per_round(costs, placement: str) -> None:
    """A plain round of N decode steps is N verify steps behind one hop each way and one host time: a request
    emits N tokens a round, its tokens and the verifier's work are those of N one-step rounds, and only the
    per-round times are paid once instead of N times."""
    one = Workload(np.zeros(1), np.array([50]), np.array([17]))  # the prefill's token, then 16 decoded
    spec = ClusterSpec(placement=placement, policy="autoregressive", decode_steps=8)
    steps8 = simulate(one, costs, None, spec)
    steps1 = simulate(one, costs, None, replace(spec, decode_steps=1))
    for result in (steps8, steps1):
        _check_conservation(one, result)
    assert steps8.rounds.tolist() == [2] and steps1.rounds.tolist() == [16]  # verify rounds (the prefill's not)
    assert steps8.total_rounds == 3 and steps1.total_rounds == 17
    assert steps8.verifier_busy_s == pytest.approx(steps1.verifier_busy_s, rel=1e-12)  # the same target passes
    first = steps8.first_token_s[0]
    assert first == steps1.first_token_s[0]
    verify = costs.verify_s(1, 1)
    assert steps8.finish_s[0] - first == pytest.approx(2 * _plain_round_s(costs, spec, 1, [verify] * 8), rel=1e-12)
    assert steps1.finish_s[0] - first == pytest.approx(16 * _plain_round_s(costs, spec, 1, [verify]), rel=1e-12)


def test_a_request_finishing_mid_round_stops_there_and_joiners_wait_for_the_next_round(costs) -> None:
    """Two requests decode together, 8 steps a round: the one that needs 4 more tokens takes part in the
    round's first 4 steps (its slot frees at the round's end, when the verifier answers), the others run with
    one request; a request that arrives during the round is prefilled in the next one."""
    spec = ClusterSpec(placement="disaggregated", policy="autoregressive", decode_steps=8)
    workload = Workload(np.array([0.0, 0.0, 0.02]), np.array([50, 60, 40]), np.array([5, 17, 3]))
    result = simulate(workload, costs, None, spec)
    _check_conservation(workload, result)
    prefilled = result.first_token_s[0]
    assert result.first_token_s[1] == prefilled  # both prefilled in the first round
    two, one = costs.verify_s(2, 2), costs.verify_s(1, 1)
    mixed = _plain_round_s(costs, spec, 2, [two] * 4 + [one] * 4)
    assert result.finish_s[0] - prefilled == pytest.approx(mixed, rel=1e-12)  # 4 tokens, at the round's end
    assert prefilled < workload.arrival_s[2] < result.finish_s[0]  # arrives during that round ...
    assert result.admit_s[2] == result.finish_s[0]  # ... and joins the next one
    assert result.rounds.tolist() == [1, 2, 1]  # 4 tokens; 8 + 8; 2 (after its prefill's)
    assert result.total_rounds == 4  # the prefills, the mixed round, B's last 8 with C's prefill, C's last 2


def test_decode_steps_default_as_served_on_a_gpu(costs, trace) -> None:
    """``auto``: the served default on a CUDA verifier, several steps disaggregated, one colocated (in-process);
    a drafting policy decodes one token per plain round whatever the setting; counts outside 1-64 are refused."""
    from cluster.config import GPU_DECODE_STEPS, SchedulerConfig

    served = SchedulerConfig(policy="autoregressive").decode_steps_on("cuda")
    assert ClusterSpec(placement="disaggregated").plain_decode_steps(False) == served == GPU_DECODE_STEPS
    assert ClusterSpec(placement="colocated").plain_decode_steps(False) == 1
    assert ClusterSpec(placement="colocated", decode_steps=4).plain_decode_steps(False) == 4
    assert ClusterSpec(placement="disaggregated", decode_steps=4).plain_decode_steps(True) == 1
    workload = _workload(rate=30.0, duration=2.0)
    spec = ClusterSpec(placement="disaggregated", policy="dspark")
    eight = replace(spec, decode_steps=8)
    _same_result(simulate(workload, costs, trace, spec), simulate(workload, costs, trace, eight))
    for bad in (0, 65, "many"):
        with pytest.raises(SimulationError, match="decode_steps"):
            simulate(workload, costs, None, ClusterSpec(policy="autoregressive", decode_steps=bad))


def test_cli_takes_decode_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    common = ["simulate", "run", "--costs", str(COSTS), "--policy", "autoregressive", "--no-progress"]
    rounds = {}
    for steps in ("1", "8", "auto"):  # auto: the default placement is disaggregated, as served 8
        assert main([*common, "--rate", "20", "--duration-s", "2", "--decode-steps", steps, "--json", str(out)]) == 0
        rounds[steps] = json.loads(out.read_text())["summary"]["rounds"]
    assert rounds["8"] == rounds["auto"] < rounds["1"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*common, "--decode-steps", "0"])
    assert "expected auto or 1-64" in capsys.readouterr().err
