"""Serve autoscaling of the drafter and verifier pools on the load their engines report.

Why a custom policy: the per-round work reaches drafter and verifier replicas over gRPC from the scheduler, not
through Serve handles, so Serve's default signal (ongoing handle requests per replica) stays near zero however
busy a pool is, and the default policy would never scale up. Instead each pool replica reports the number of
requests its engine holds (KV slots on a verifier, context-cache slots on a drafter) through Serve's
``record_autoscaling_stats()`` hook, and :func:`engine_load_policy` sizes the deployment so that each replica
holds about ``target_ongoing_requests`` of them:

    desired replicas = (sum over replicas of held requests) / target_ongoing_requests

Serve averages each replica's reports over ``look_back_period_s`` (``aggregation_function``), then applies
``upscaling_factor`` / ``downscaling_factor``, ``upscale_delay_s`` / ``downscale_delay_s`` and
``min_replicas`` / ``max_replicas`` around this function as it does for its own policy, so a Serve config sets
both pools' ranges and speeds independently with the usual fields:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      target_ongoing_requests: 48      # requests held per replica; keep it below engine.max_requests
      policy: {policy_function: cluster.autoscaling:engine_load_policy}

``target_ongoing_requests`` must stay below ``engine.max_requests``: a full replica holds exactly
``max_requests`` (the rest wait at the scheduler), so with a target at or above it a saturated pool would never
ask for more replicas. Serve pickles this module by value into its controller; it imports nothing heavy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

#: Requests the replica's engine holds now (a KV slot on a verifier, a context-cache slot on a drafter).
HELD_REQUESTS = "dspark_held_requests"
#: How many requests the replica's engine can hold (``engine.max_requests``); reported for dashboards.
CAPACITY = "dspark_request_capacity"
POLICY_PATH = "cluster.autoscaling:engine_load_policy"


def engine_load(held_requests: int, capacity: int) -> dict[str, float]:
    """What a pool replica returns from ``record_autoscaling_stats()`` (Serve wants a flat name -> number map)."""
    return {HELD_REQUESTS: float(held_requests), CAPACITY: float(capacity)}


def engine_load_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Desired replica count from the engine load the replicas report; Serve applies bounds and delays after.

    Until a replica has reported (the first seconds after a deploy), the current target is kept: no data is not
    the same as no load. ``ctx.config`` must be set: Serve calls a policy only for a deployment that has an
    ``autoscaling_config``, and passes that config.
    """
    held = (ctx.aggregated_metrics or {}).get(HELD_REQUESTS)
    if not held:
        return ctx.target_num_replicas, {}
    assert ctx.config is not None, "Serve passes the deployment's autoscaling_config to its policy"
    target = ctx.config.get_target_ongoing_requests()
    return sum(held.values()) / target, {}
