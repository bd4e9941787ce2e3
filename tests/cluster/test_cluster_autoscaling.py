"""The pools' autoscaling policy on Serve's own context objects: replicas' engine load in, replica count out."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.autoscaling import CAPACITY, HELD_REQUESTS, POLICY_PATH, engine_load, engine_load_policy

DEPLOYMENT = DeploymentID(name="Verifier", app_name="dspark")


def _context(held: dict[str, float] | None, target: float = 4.0, current: int = 2) -> AutoscalingContext:
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target,
                               policy={"policy_function": POLICY_PATH})
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(current)]
    metrics: dict[str, Any] = {}
    if held is not None:
        metrics[HELD_REQUESTS] = {replicas[int(k[1:])]: v for k, v in held.items()}
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="Verifier", app_name="dspark", current_num_replicas=current,
        target_num_replicas=current, running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=config,
    )


def test_replicas_report_held_requests_and_capacity_as_numbers() -> None:
    assert engine_load(3, 64) == {HELD_REQUESTS: 3.0, CAPACITY: 64.0}


@pytest.mark.parametrize(
    ("held", "desired"),
    [
        ({"r0": 4.0, "r1": 4.0}, 2.0),  # at target: keep
        ({"r0": 8.0, "r1": 8.0}, 4.0),  # twice the target: double
        ({"r0": 1.0, "r1": 0.0}, 0.25),  # nearly idle: Serve rounds up and applies min_replicas
        ({"r0": 6.0}, 1.5),  # a replica that has not reported yet counts as idle
    ],
)
def test_desired_replicas_follow_held_requests_over_the_target(held: dict[str, float], desired: float) -> None:
    assert engine_load_policy(_context(held)) == (desired, {})


def test_no_reports_yet_keeps_the_current_target() -> None:
    assert engine_load_policy(_context(None, current=3)) == (3, {})
    assert engine_load_policy(_context({}, current=3)) == (3, {})


def test_serve_accepts_the_policy_by_import_path() -> None:
    config = AutoscalingConfig(policy={"policy_function": POLICY_PATH})
    assert config.policy.get_policy()(_context({"r0": 12.0, "r1": 4.0})) == (4.0, {})
