"""The simulator replays a real engine run round for round: one replica, the demo pair, the same policy.

The real :class:`SpeculativeEngine` runs a few greedy requests on CPU with the shipped demo pair; a recording
proxy of its draft engine keeps every proposal's confidences per request. Fed those confidences and the
accepted counts the engine's metrics recorded, the one-replica simulation (same slots, same context limit,
same policy and SPS tables) makes the same admission and length decisions, so its round count, and every
request's, equal the engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.simulator.costs import load_costs
from cluster.simulator.simulation import ClusterSpec, simulate
from cluster.simulator.traces import AcceptanceTrace
from cluster.simulator.workload import Workload
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.sts import STSCalibration
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"
COSTS = ROOT / "docs" / "simulator" / "costs_h200.json"
SLOTS, MAX_SEQ_LEN = 4, 256


class RecordingDrafter:
    """A draft engine that remembers, per request, the confidences of every block it proposed."""

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.rows: dict[str, list[np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def propose(self, batch: Any) -> Any:
        proposal = self.engine.propose(batch)
        confidences = np.asarray(proposal.confidences, dtype=np.float64)
        for req_id, row in zip(batch.req_ids, confidences, strict=True):
            self.rows.setdefault(req_id, []).append(row.copy())
        return proposal


@pytest.mark.parametrize("policy", ["dspark", "dspark-async", "full"])
def test_one_replica_simulation_matches_the_engine_round_count(policy: str) -> None:
    costs = load_costs(COSTS)
    draft_model = load_draft_model(DEMO / "draft_dspark", target_dir=DEMO / "target")
    target = TargetModel.from_pretrained(DEMO / "target", feature_layer_ids=draft_model.config.target_layer_ids)
    verify = VerifyEngine(target, max_requests=SLOTS, max_seq_len=MAX_SEQ_LEN)
    calibration = STSCalibration.load(DEMO / "draft_dspark" / "sts.json")
    drafter = RecordingDrafter(DraftEngine(draft_model, SLOTS, MAX_SEQ_LEN, calibration=calibration))
    engine = SpeculativeEngine(verify, drafter, make_policy(policy, costs.sps, draft_model.block_size))  # type: ignore[arg-type]

    rng = np.random.default_rng(1)
    prompt_lengths = [12, 30, 7, 21, 16, 9]
    output_lengths = [40, 24, 56, 33, 17, 45]  # more requests than slots: some wait for a free slot
    ids = [
        engine.add_request(rng.integers(1, 4000, size=n).tolist(), SamplingParams(0.0, max_tokens=m, ignore_eos=True))
        for n, m in zip(prompt_lengths, output_lengths, strict=True)
    ]
    steps = 0
    finished: dict[str, Any] = {}
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.req_id] = out.metrics
    assert set(finished) == set(ids)

    confidences, accepted, request = [], [], []
    for k, req_id in enumerate(ids):
        rows = drafter.rows[req_id]
        recorded = finished[req_id].accepted
        assert len(rows) == len(recorded)  # every verify round drafted (no draft gate without a draft cost)
        confidences += rows
        accepted += recorded
        request += [k] * len(rows)
    trace = AcceptanceTrace.from_arrays(np.array(confidences), np.array(accepted), np.array(request))
    workload = Workload(
        np.zeros(len(ids)), np.array(prompt_lengths, dtype=np.int64), np.array(output_lengths, dtype=np.int64)
    )
    spec = ClusterSpec(
        placement="colocated",
        verifiers=1,
        verifier_slots=SLOTS,
        drafter_slots=SLOTS,
        max_seq_len=MAX_SEQ_LEN,
        policy=policy,
        planned_rounds="off",  # the engine above runs without chained rounds (chain_verify off)
    )
    result = simulate(workload, costs, trace, spec, replay_in_order=True)

    assert result.total_rounds == steps
    assert result.rounds.tolist() == [len(finished[i].accepted) for i in ids]
    assert (result.emitted == workload.output_tokens).all()
