"""Decision time of the confidence scheduler: one call per verify step, as the scheduler actor makes it.

Measures `schedule_lengths` (Algorithm 1, with and without the draft-cost term) and the asynchronous variant
(`plan_capacity` + `admit_top_k`) for R requests x gamma draft positions, cycling over a pool of distinct
confidence arrays (Beta(5, 1.2), mean ~0.8, like a good confidence head) so caches do not flatter the numbers.
Each timing covers the whole call (input validation included). Goal for 256 x 16 on the 2-core dev CPU: median
<= 200 us.

    python -m bench.bench_scheduler                         # from the repo root; 256 x 16, 20k calls each
    python -m bench.bench_scheduler --requests 1024 --gamma 8 --json out.json

``--rounds R1,R2,...`` times instead what the round driver counts as schedule time for the scheduled policies
(``dspark`` and ``dspark-async`` with a fixed draft cost and the draft gate, as bench/bench_policies_gpu.py runs
them): ``should_draft(caps)`` then ``lengths(confidences, caps)``, at each R (issue 11: small R matters most).
``--sps`` reads the SPS table from a JSON file (an SPS table, or a results file with an ``sps`` key):

    python -m bench.bench_scheduler --rounds 1,8,32 --gamma 7 --sps docs/benchmarks/policies.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from scheduler.algorithm import DraftCost, schedule_lengths
from scheduler.async_capacity import admit_top_k, plan_capacity
from scheduler.draft_gate import DraftGate
from scheduler.policy import DSparkAsync, DSparkScheduled
from scheduler.sps import SPSTable


def synthetic_sps() -> SPSTable:
    """A verify-step curve shaped like a mid-size model on one GPU.

    Flat (memory-bound) up to 256 tokens, then ~20 us per extra token (compute-bound). Only its shape matters
    here: it decides where the early stop lands.
    """
    sizes = np.array([1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    step_s = 0.014 + 20e-6 * np.maximum(0, sizes - 256)
    return SPSTable(sizes, 1.0 / step_s, model="synthetic", device="any", dtype="n/a")


def time_calls(
    fn: Callable[[np.ndarray], object], pool: list[np.ndarray], repeats: int, warmup: int
) -> np.ndarray:
    """Per-call wall time in microseconds (garbage collection left on: its pauses belong in the tail)."""
    for i in range(warmup):
        fn(pool[i % len(pool)])
    times = np.empty(repeats)
    for i in range(repeats):
        conf = pool[i % len(pool)]
        start = time.perf_counter_ns()
        fn(conf)
        times[i] = (time.perf_counter_ns() - start) / 1e3
    return times


def load_sps(path: Path) -> SPSTable:
    """An SPS table from a JSON file: the table itself, or a benchmark's results with the table under ``sps``."""
    data = json.loads(path.read_text())
    return SPSTable.from_dict(data.get("sps", data))


def round_variants(sps: SPSTable) -> dict[str, Callable[[], DSparkScheduled | DSparkAsync]]:
    """Fresh scheduled policies as bench/bench_policies_gpu.py builds them (fixed costs of its c=1 H200 cell)."""
    draft_cost, no_draft_cost = DraftCost(fixed_s=2.2e-3), DraftCost(fixed_s=6e-5)
    return {
        "dspark round": lambda: DSparkScheduled(sps, draft_cost, DraftGate(sps, draft_cost, no_draft_cost)),
        "dspark-async round": lambda: DSparkAsync(
            sps, draft_cost=draft_cost, gate=DraftGate(sps, draft_cost, no_draft_cost)
        ),
    }


def time_rounds(args: argparse.Namespace, sps: SPSTable, rng: np.random.Generator) -> dict[str, object]:
    """Per-round schedule time (should_draft + lengths, every cap = gamma) of each scheduled policy at each R."""
    rows: dict[str, object] = {}
    print(f"{'R x gamma':<10} {'variant':<20} {'median us':>10} {'p10':>8} {'p90':>8}")
    for num_requests in args.rounds:
        pool = [rng.beta(5.0, 1.2, size=(num_requests, args.gamma)) for _ in range(args.pool)]
        caps = np.full(num_requests, args.gamma, dtype=np.int64)
        for name, build in round_variants(sps).items():
            policy = build()

            def one_round(
                conf: np.ndarray, policy: DSparkScheduled | DSparkAsync = policy, caps: np.ndarray = caps
            ) -> None:
                policy.should_draft(caps)
                policy.lengths(conf, caps)

            times = time_calls(one_round, pool, args.repeats, args.warmup)
            p10, median, p90 = np.percentile(times, [10, 50, 90])
            rows[f"{name} R={num_requests}"] = {"median_us": median, "p10_us": p10, "p90_us": p90}
            print(f"{num_requests:>3} x {args.gamma:<4} {name:<20} {median:>10.1f} {p10:>8.1f} {p90:>8.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--gamma", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--pool", type=int, default=64, help="distinct confidence arrays cycled through")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--rounds",
        type=lambda text: [int(r) for r in text.split(",")],
        help="comma-separated R: time whole scheduled-policy rounds (should_draft + lengths) instead",
    )
    parser.add_argument("--sps", type=Path, help="SPS table JSON (default: a synthetic curve)")
    args = parser.parse_args()
    if min(args.requests, args.gamma, args.repeats, args.pool, *(args.rounds or [1])) < 1 or args.warmup < 0:
        parser.error("sizes and counts must be positive")

    rng = np.random.default_rng(args.seed)
    sps = load_sps(args.sps) if args.sps else synthetic_sps()
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    if args.rounds:
        rounds = {"gamma": args.gamma, "repeats": args.repeats, "machine": machine}
        rounds["variants"] = time_rounds(args, sps, rng)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rounds, indent=2) + "\n")
        return
    pool = [rng.beta(5.0, 1.2, size=(args.requests, args.gamma)) for _ in range(args.pool)]
    draft_cost = DraftCost(fixed_s=0.004, per_request_s=2e-6, per_token_s=1e-6)
    variants: dict[str, Callable[[np.ndarray], object]] = {
        "algorithm1": lambda c: schedule_lengths(c, sps),
        "algorithm1+draft_cost": lambda c: schedule_lengths(c, sps, draft_cost=draft_cost),
        "async plan_capacity": lambda c: plan_capacity(c, sps),
        "async admit_top_k": lambda c: admit_top_k(c, 1500),
    }
    admitted = float(np.mean([schedule_lengths(c, sps).sum() for c in pool]))
    results = {
        "requests": args.requests,
        "gamma": args.gamma,
        "repeats": args.repeats,
        "mean_tokens_admitted_algorithm1": admitted,
        "machine": machine,
        "variants": {},
    }
    print(f"{args.requests} requests x {args.gamma}; Algorithm 1 admits {admitted:.0f} tokens on average")
    print(f"{'variant':<24} {'median us':>10} {'p10':>8} {'p90':>8} {'p99':>8}")
    for name, fn in tqdm(variants.items(), desc="variants", leave=False):
        times = time_calls(fn, pool, args.repeats, args.warmup)
        p10, median, p90, p99 = np.percentile(times, [10, 50, 90, 99])
        results["variants"][name] = {"median_us": median, "p10_us": p10, "p90_us": p90, "p99_us": p99}
        tqdm.write(f"{name:<24} {median:>10.1f} {p10:>8.1f} {p90:>8.1f} {p99:>8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
