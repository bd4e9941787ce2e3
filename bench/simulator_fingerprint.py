"""A fingerprint of the cluster simulator's results, to show that a speed change leaves them bit for bit the same.

It simulates every policy on three deployments (colocated; disaggregated with one and with two request groups;
the scheduled policies with a fixed and a measured draft cost), a closed loop, autoscaled colocated and
disaggregated pools and 64 colocated replicas at 500 requests/s, and hashes every request's arrival, admission,
first-token and finish times, emitted tokens, rounds and rejection, and every run's totals, busy and held GPU
time, Little's-law areas and autoscaling timeline. Run it on two commits and compare the last line:

    PYTHONPATH=. python bench/simulator_fingerprint.py

Every case runs with ``--planned-rounds`` (default ``off``, Algorithm 1 in every drafted round: the fingerprint
measured since before planned rounds existed; ``auto``, the simulator's default, fingerprints the planned rounds)
and ``--decode-steps`` (default ``auto``: autoregressive decodes several tokens per disaggregated round, as served;
``1``: one token per plain round, the fingerprint measured before decode steps were modelled).
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np

from cluster.simulator.autoscaler import PoolScaling
from cluster.simulator.costs import load_costs
from cluster.simulator.simulation import PLANNED_ROUNDS, ClosedLoop, ClusterSpec, SimResult, simulate
from cluster.simulator.traces import load_traces
from cluster.simulator.workload import LengthSpec, Workload, generated
from scheduler.sts import STSCalibration

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("autoregressive", "fixed-1", "full", "dspark", "dspark-async")
DEPLOYMENTS = (("colocated", 1, 4, 1), ("disaggregated", 1, 3, 2), ("disaggregated", 2, 2, 1))


def _workload(rate: float, duration_s: float, cv: float = 1.0, output: str = "uniform:1:160") -> Workload:
    rng = np.random.default_rng(0)
    return generated(rate, duration_s, LengthSpec.parse("uniform:11:399"), LengthSpec.parse(output), rng, cv)


def fingerprint(result: SimResult) -> str:
    digest = hashlib.sha256()
    for values in (result.arrival_s, result.admit_s, result.first_token_s, result.finish_s):
        digest.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
    for counts in (result.emitted, result.rounds, result.rejected):
        digest.update(np.ascontiguousarray(counts, dtype=np.int64).tobytes())
    totals = (
        result.end_s,
        result.total_rounds,
        result.drafted_rounds,
        result.verifier_busy_s,
        result.drafter_busy_s,
        result.verifier_gpu_s,
        result.drafter_gpu_s,
        result.in_system_area,
        result.waiting_area,
        result.running_area,
        result.timeline,
    )
    digest.update(repr(totals).encode())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--planned-rounds", choices=PLANNED_ROUNDS, default="off",
                        help="ClusterSpec.planned_rounds of every case (default off: the fingerprint as before)")
    parser.add_argument("--decode-steps", default="auto",
                        help="ClusterSpec.decode_steps of every case: auto (default) or a count (1: as before)")
    args = parser.parse_args()
    planned = args.planned_rounds
    decode_steps = args.decode_steps if args.decode_steps == "auto" else int(args.decode_steps)
    costs = load_costs(ROOT / "docs" / "simulator" / "costs_h200.json")
    fast_start = replace(costs, verifier_start_s=1.0, drafter_start_s=1.0)
    trace = load_traces(
        ROOT / "tests" / "data" / "sim_traces_demo_mbpp.npz",
        STSCalibration.load(ROOT / "models" / "demo" / "draft_dspark" / "sts.json"),
    )
    cases = []
    for policy in POLICIES:
        for placement, groups, verifiers, drafters in DEPLOYMENTS:
            for draft_cost in ("none", "measured") if policy.startswith("dspark") else ("none",):
                spec = ClusterSpec(
                    placement=placement,
                    verifiers=verifiers,
                    drafters=drafters,
                    groups=groups,
                    policy=policy,
                    verifier_slots=32,
                    drafter_slots=48,
                    draft_cost=draft_cost,
                )
                name = f"{policy} {placement} groups={groups} draft-cost={draft_cost}"
                cases.append((name, _workload(120.0, 6.0, cv=2.0), costs, spec, None))
    loop = ClusterSpec(placement="colocated", verifiers=1, verifier_slots=8, policy="dspark")
    cases.append(("closed loop", _workload(40.0, 3.0), costs, loop, ClosedLoop(6, 0.004)))
    scaling = PoolScaling(
        min_replicas=1,
        max_replicas=6,
        target_ongoing_requests=4,
        look_back_period_s=2,
        upscale_delay_s=1,
        downscale_delay_s=2,
    )
    scaled = ClusterSpec(placement="colocated", policy="dspark", verifier_scaling=scaling, control_interval_s=0.5)
    long_requests = generated(60.0, 15.0, LengthSpec.parse("64"), LengthSpec.parse("400"), np.random.default_rng(0))
    cases.append(("autoscaled colocated", long_requests, fast_start, scaled, None))
    pools = ClusterSpec(
        placement="disaggregated",
        groups=2,
        policy="dspark",
        verifier_scaling=scaling,
        drafter_scaling=scaling,
        control_interval_s=0.5,
    )
    cases.append(("autoscaled pools", _workload(80.0, 8.0), fast_start, pools, None))
    large = ClusterSpec(placement="colocated", verifiers=64, policy="dspark")
    cases.append(("64 colocated at 500/s", _workload(500.0, 2.0, output="uniform:96:160"), costs, large, None))
    total = hashlib.sha256()
    for name, workload, case_costs, spec, closed_loop in cases:
        spec = replace(spec, planned_rounds=planned, decode_steps=decode_steps)
        result = simulate(workload, case_costs, trace, spec, seed=3, closed_loop=closed_loop)
        print(f"{fingerprint(result)}  {result.total_rounds:>7} rounds  {name}")
        total.update(fingerprint(result).encode())
    print(f"{total.hexdigest()[:16]}  all")


if __name__ == "__main__":
    main()
