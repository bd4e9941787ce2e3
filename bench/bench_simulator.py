"""How fast the cluster simulator runs: simulated seconds of a large cluster per second of one CPU core.

The default case is the one the simulator is sized for: one simulated hour of 64 colocated replicas serving
500 requests/s (the serving benchmark's lengths) with the dspark policy. A shorter ``--duration-s`` gives the
same per-round cost; the output states the simulated-hour time it extrapolates to (rounds grow linearly with
simulated time at a steady load).

    PYTHONPATH=. python bench/bench_simulator.py --duration-s 3600 --out docs/simulator/speed.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from cluster.simulator.costs import load_costs
from cluster.simulator.simulation import PLANNED_ROUNDS, ClusterSpec, simulate
from cluster.simulator.traces import load_traces
from cluster.simulator.workload import LengthSpec, generated
from scheduler.sts import STSCalibration

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=3600.0, help="simulated arrival window")
    parser.add_argument("--rate", type=float, default=500.0, help="requests/s")
    parser.add_argument("--replicas", type=int, default=64, help="GPUs (colocated replicas, or split in two pools)")
    parser.add_argument("--placement", choices=("colocated", "disaggregated"), default="colocated")
    parser.add_argument("--policy", default="dspark")
    parser.add_argument("--costs", type=Path, default=ROOT / "docs" / "simulator" / "costs_h200.json")
    parser.add_argument("--traces", type=Path, default=ROOT / "tests" / "data" / "sim_traces_demo_mbpp.npz")
    parser.add_argument("--sts", type=Path, default=ROOT / "models" / "demo" / "draft_dspark" / "sts.json")
    parser.add_argument("--planned-rounds", choices=PLANNED_ROUNDS, default="off",
                        help="ClusterSpec.planned_rounds (off, the default: every round by Algorithm 1; auto: "
                        "colocated, chained rounds)")
    parser.add_argument("--out", type=Path, default=None, help="write the measurement as JSON")
    args = parser.parse_args()

    costs = load_costs(args.costs)
    trace = load_traces(args.traces, STSCalibration.load(args.sts))
    workload = generated(
        args.rate,
        args.duration_s,
        LengthSpec.parse("uniform:11:399"),
        LengthSpec.parse("uniform:96:160"),
        np.random.default_rng(0),
    )
    if args.placement == "colocated":
        spec = ClusterSpec(
            placement="colocated", verifiers=args.replicas, policy=args.policy, planned_rounds=args.planned_rounds
        )
    else:
        half = args.replicas // 2
        spec = ClusterSpec(
            placement="disaggregated",
            verifiers=half,
            drafters=args.replicas - half,
            groups=2,
            policy=args.policy,
            planned_rounds=args.planned_rounds,
        )
    load_before = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(workload, costs, trace, spec, seed=0, progress=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    record = {
        "command": f"PYTHONPATH=. python bench/bench_simulator.py --duration-s {args.duration_s:g} "
        f"--rate {args.rate:g} --replicas {args.replicas} --placement {args.placement} --policy {args.policy} "
        f"--planned-rounds {args.planned_rounds}",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.python_implementation()} {platform.python_version()}",
        # The machine's other jobs: the 1-minute load average before and after the run (wall_s grows with it).
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "requests": workload.size,
        "simulated_s": result.end_s,
        "rounds": result.total_rounds,
        "wall_s": wall,
        "cpu_s": cpu,
        "us_per_round": wall / result.total_rounds * 1e6,
        "wall_s_per_simulated_hour": wall * 3600.0 / result.end_s,
        "cpu_s_per_simulated_hour": cpu * 3600.0 / result.end_s,  # what a shared machine's other jobs disturb less
    }
    print(json.dumps(record, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
