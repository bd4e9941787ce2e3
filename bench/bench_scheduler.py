"""Decision time of the confidence scheduler: one call per verify step, as the scheduler actor makes it.

Measures `schedule_lengths` (Algorithm 1, with and without the draft-cost term) and the asynchronous variant
(`plan_capacity` + `admit_top_k`) for R requests x gamma draft positions, cycling over a pool of distinct
confidence arrays (Beta(5, 1.2), mean ~0.8, like a good confidence head) so caches do not flatter the numbers.
Each timing covers the whole call (input validation included). Goal for 256 x 16 on the 2-core dev CPU: median
<= 200 us.

    python -m bench.bench_scheduler                         # from the repo root; 256 x 16, 20k calls each
    python -m bench.bench_scheduler --requests 1024 --gamma 8 --json out.json
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
    args = parser.parse_args()
    if min(args.requests, args.gamma, args.repeats, args.pool) < 1 or args.warmup < 0:
        parser.error("sizes and counts must be positive")

    rng = np.random.default_rng(args.seed)
    pool = [rng.beta(5.0, 1.2, size=(args.requests, args.gamma)) for _ in range(args.pool)]
    sps = synthetic_sps()
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
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
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
