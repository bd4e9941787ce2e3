"""Engine metrics: counters, tau with bonus, conditional acceptance per position."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler.metrics import EngineMetrics, RequestMetrics, merge_snapshots, snapshot_from_dict, snapshot_to_dict


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
    assert s.rounds_without_draft == 0
    m.record_round(np.array([0, 0]), np.array([0, 0]), 0.0, 0.0, 0.02, output_tokens=2, drafted=False)
    assert m.snapshot().rounds_without_draft == 1 and m.snapshot().rounds == 2


def test_request_tau_includes_bonus() -> None:
    r = RequestMetrics(verified=[3, 3], accepted=[3, 1])
    assert r.tau == 3.0 and r.mean_verify_budget == 3.0


def test_counts_folded_across_many_rounds_equal_direct_counts() -> None:
    """Rounds are kept and folded into the counts in batches: the counts equal a direct per-round count
    whenever read (before, at and after a fold), whether rounds come as arrays or lists."""
    rng = np.random.default_rng(3)
    m = EngineMetrics(block_size=5)
    verified_all, accepted_all = [], []
    for i in range(2 * EngineMetrics.FOLD_ROUNDS + 7):
        verified = rng.integers(0, 6, size=int(rng.integers(1, 9)))
        accepted = np.minimum(verified, rng.integers(0, 6, size=verified.size))
        verified_all += verified.tolist()
        accepted_all += accepted.tolist()
        if i % 2:
            m.record_round(verified.tolist(), accepted.tolist(), 0.0, 0.0, 0.0, output_tokens=1)
        else:
            m.record_round(verified, accepted, 0.0, 0.0, 0.0, output_tokens=1)
        if i in (3, EngineMetrics.FOLD_ROUNDS - 1, EngineMetrics.FOLD_ROUNDS + 1) or i % 97 == 0:
            v, a = np.array(verified_all)[:, None], np.array(accepted_all)[:, None]
            k = np.arange(5)[None, :]
            s = m.snapshot()
            assert s.num_draft_tokens == sum(verified_all) and s.num_accepted_tokens == sum(accepted_all)
            assert s.verified_per_position == tuple((v > k).sum(axis=0).tolist())
            assert s.accepted_per_position == tuple((a > k).sum(axis=0).tolist())
            assert s.reached_per_position == tuple(((v > k) & (a >= k)).sum(axis=0).tolist())
            assert s.verify_tokens_per_round == (sum(verified_all) + len(verified_all)) / (i + 1)


def test_verifier_groups_snapshots_merge_and_cross_the_wire_as_dicts() -> None:
    """The hub sums its verifier groups' counters, and snapshots travel as plain dicts (msgpack, no pickle)."""
    a, b = EngineMetrics(block_size=3), EngineMetrics(block_size=3)
    a.record_round([3], [1], 0.01, 0.001, 0.02, output_tokens=2)
    b.record_round([0, 0], [0, 0], 0.0, 0.001, 0.02, output_tokens=2, drafted=False)
    b.record_round([2, 1], [2, 0], 0.01, 0.001, 0.02, output_tokens=5)
    a.record_joins(2, verified=False)
    a.record_first_token(0.5, 0.25)
    a.record_first_token(0.25, 0.25)
    b.record_joins(1, verified=True)
    b.record_first_token(1.0, 0.5)
    a.record_round([2], [2], 0.001, 0.0, 0.002, output_tokens=3, host_s=0.001, planned=True)
    b.record_round([1], [0], 0.002, 0.001, 0.004, output_tokens=1, host_s=0.001, joined=True)
    merged = merge_snapshots([a.snapshot(running=1), b.snapshot(running=2)])
    assert (merged.rounds, merged.rounds_without_draft, merged.num_drafts, merged.running) == (5, 1, 7, 3)
    # a round's wall time is its five parts' sum: draft, schedule, verify (transfer inside them) and host
    assert (merged.planned_rounds, merged.joined_rounds) == (1, 1)
    assert merged.planned_round_time_s == pytest.approx(0.004)
    assert merged.joined_round_time_s == pytest.approx(0.008)
    assert (merged.first_tokens, merged.queue_time_s, merged.admission_to_first_token_s) == (3, 1.75, 1.0)
    assert (merged.joined_prompts, merged.prefill_only_rounds) == (3, 1)
    assert merged.accepted_per_position == (3, 2, 0) and merged.num_output_tokens == 13
    assert snapshot_from_dict(snapshot_to_dict(merged)) == merged
    older = snapshot_to_dict(merged)
    for name in ("rounds_without_draft", "first_tokens", "queue_time_s", "joined_prompts", "prefill_only_rounds",
                 "planned_round_time_s", "joined_rounds", "joined_round_time_s"):
        del older[name]  # a peer from before the counter existed
    assert snapshot_from_dict(older).joined_rounds == 0 and snapshot_from_dict(older).planned_round_time_s == 0
    assert snapshot_from_dict(older).rounds_without_draft == 0
    assert snapshot_from_dict(older).first_tokens == 0 and snapshot_from_dict(older).prefill_only_rounds == 0
    assert merge_snapshots([]).rounds_without_draft == 0
