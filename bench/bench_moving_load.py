"""How often the scheduled policies' host-side work runs under a moving load (issue 11): no model, no GPU.

In a closed loop of c requests the number of decoding requests R moves between c - 2 and c as requests finish
and join. Two caches of the scheduled policies depend on it: the draft gate's reuse of its last prediction to
draft (scheduler/draft_gate.py) and the draft-cost estimate's refit backoff (scheduler/draft_cost_estimate.py).
This runs both on synthetic rounds, with an SPS table from a results file (the H200 sweep's by default) and draft
costs of the size measured there, and prints the gate's full predictions per round and the estimate's refits
per round, plus the gate's warm time per round (a loop with hot caches: the engine pays several times as much).

    python -m bench.bench_moving_load                    # ~10 s
    python -m bench.bench_moving_load --rounds 3000 --sps docs/benchmarks/policies.json
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np

from bench.bench_scheduler import load_sps
from scheduler.algorithm import DraftCost
from scheduler.draft_cost_estimate import OnlineDraftCost
from scheduler.draft_gate import DraftGate

ROOT = Path(__file__).resolve().parents[1]
DRAFT_S = {1: 0.75e-3, 8: 0.95e-3, 32: 1.4e-3}  # draft + other host ms per round in the H200 sweep (full)
GAMMA = 7


def gate_rounds(sps_path: Path, concurrency: int, rounds: int, seed: int) -> tuple[float, float]:
    """(full predictions per round, warm us per round of should_draft + observe)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a measured table's small non-monotone steps are smoothed, as served
        sps = load_sps(sps_path)
    rng = np.random.default_rng(seed)
    gate = DraftGate(sps, DraftCost(fixed_s=DRAFT_S[concurrency]), DraftCost(fixed_s=0.1e-3))
    start = time.perf_counter()
    for _ in range(rounds):
        r = max(1, concurrency - int(rng.integers(0, 3)))  # 0-2 requests prefilling instead of decoding
        caps = np.full(r, GAMMA, dtype=np.int64)
        if rng.random() < 0.05:
            caps[0] = int(rng.integers(0, GAMMA))  # a request's last rounds
        gate.should_draft(caps)
        gate.observe(np.clip(0.85 + 0.1 * rng.standard_normal((r, GAMMA)), 0.0, 1.0))
    return gate.predictions / gate.decisions, 1e6 * (time.perf_counter() - start) / rounds


def estimate_refits(concurrency: int, rounds: int, noise: float, seed: int) -> float:
    """Refits per round of the draft-cost estimate, read every round as the policies do."""
    rng = np.random.default_rng(seed)
    estimator = OnlineDraftCost()
    fits = 0
    fit = estimator._fit

    def counted() -> DraftCost:
        nonlocal fits
        fits += 1
        return fit()

    estimator._fit = counted  # type: ignore[method-assign]
    for _ in range(rounds):
        r = max(1, concurrency - int(rng.integers(0, 3)))
        seconds = (0.6e-3 + 0.02e-3 * r) * float(rng.normal(1.0, noise))
        estimator.observe(r, True, seconds, 0.05e-3)
        _ = estimator.draft_cost
    return fits / rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sps", type=Path, default=ROOT / "docs/benchmarks/policies.json")
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"{'c':>4} {'gate predictions / round':>25} {'gate us / round (warm)':>23} "
          f"{'refits / round at 1% / 5% / 10% noise':>40}")  # fmt: skip
    for concurrency in (1, 8, 32):
        predictions, us = gate_rounds(args.sps, concurrency, args.rounds, args.seed)
        refits = [estimate_refits(concurrency, args.rounds, noise, args.seed) for noise in (0.01, 0.05, 0.10)]
        print(f"{concurrency:>4} {predictions:>25.3f} {us:>23.1f} {' / '.join(f'{x:.3f}' for x in refits):>40}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
