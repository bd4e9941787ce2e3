"""Engine metrics: counters, tau with bonus, conditional acceptance per position."""

from __future__ import annotations

import math

import numpy as np

from scheduler.metrics import EngineMetrics, RequestMetrics


def test_round_counters_and_conditional_acceptance() -> None:
    m = EngineMetrics(block_size=4)
    # Two requests: one verifies 4 and accepts 2; one verifies 1 and accepts 1.
    m.record_round(np.array([4, 1]), np.array([2, 1]), 0.01, 0.001, 0.02, output_tokens=5)
    s = m.snapshot(running=2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_output_tokens) == (2, 5, 3, 5)
    assert s.accepted_per_position == (2, 1, 0, 0)
    assert s.verified_per_position == (2, 1, 1, 1)
    assert s.tau == (3 + 2) / 2
    assert s.reached_per_position == (2, 1, 1, 0)
    cond = s.conditional_acceptance
    assert cond[:3] == (1.0, 1.0, 0.0) and math.isnan(cond[3])
    assert s.verify_tokens_per_round == 7


def test_request_tau_includes_bonus() -> None:
    r = RequestMetrics(verified=[3, 3], accepted=[3, 1])
    assert r.tau == 3.0 and r.mean_verify_budget == 3.0
