"""bench/bench_moving_load.py on a few hundred synthetic rounds: the gate's kept predictions are reused under a
moving R, and the estimate backs off its refits when R stays inside the fitted range."""

from __future__ import annotations

from bench.bench_moving_load import ROOT, estimate_refits, gate_rounds


def test_a_moving_load_still_reuses_predictions_and_backs_off_refits() -> None:
    predictions, us = gate_rounds(ROOT / "docs/benchmarks/policies.json", 8, 400, seed=0)
    assert 0.0 < predictions < 0.5 and us > 0  # R moves between 6 and 8 every round: reuse per R
    assert estimate_refits(8, 400, noise=0.01, seed=0) < 0.2  # the base cadence would be 0.25
