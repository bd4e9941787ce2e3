"""The pool planner: for a GPU budget, workload and SLO, the deployment with the most goodput per GPU.

Candidates for G GPUs: every replica colocated (G replicas, each GPU holding both engines), and disaggregated
pools split by drafter:verifier ratios (V = round(G * v / (d + v)) verifiers, G - V drafters, both >= 1), each
with the request-group counts asked for. Each candidate serves the same workload (its rate scales with G) in
the simulator; the best is the one with the most SLO-meeting requests per second per GPU, all GPUs counted.

The recommended ``autoscaling_config`` of each pool keeps the best candidate's sizes as ``max_replicas`` and
sets ``target_ongoing_requests`` to the requests a replica of that pool held on average in the run that met
the SLO (below the replica's slot count, as :mod:`cluster.autoscaling` requires), so the engine-load policy
adds replicas when the load per replica rises past the one the plan was sized at.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from cluster.autoscaling import POLICY_PATH
from cluster.simulator.autoscaler import PoolScaling
from cluster.simulator.costs import Costs
from cluster.simulator.report import Slo, Summary, summarize
from cluster.simulator.simulation import ClusterSpec, simulate
from cluster.simulator.traces import AcceptanceTrace
from cluster.simulator.workload import Workload


@dataclass(frozen=True)
class PlanRow:
    """One candidate deployment and how it served the workload."""

    spec: ClusterSpec
    summary: Summary
    held_per_verifier: float
    held_per_drafter: float

    @property
    def label(self) -> str:
        if self.spec.placement == "colocated":
            return f"colocated x{self.spec.verifiers}"
        return f"{self.spec.drafters}D:{self.spec.verifiers}V groups {self.spec.groups}"


def candidates(
    base: ClusterSpec, gpus: int, ratios: Sequence[tuple[int, int]], groups: Sequence[int]
) -> list[ClusterSpec]:
    """The deployments of ``gpus`` GPUs to compare (module docstring); ``base`` gives every other setting."""
    specs = [replace(base, placement="colocated", verifiers=gpus, drafters=0, groups=1)]
    seen: set[tuple[int, int, int]] = set()
    for drafters, verifiers in ratios:
        v = round(gpus * verifiers / (drafters + verifiers))
        d = gpus - v
        for g in groups:
            if v >= 1 and d >= 1 and (v, d, g) not in seen:
                seen.add((v, d, g))
                specs.append(replace(base, placement="disaggregated", verifiers=v, drafters=d, groups=g))
    return specs


def plan(
    specs: Sequence[ClusterSpec],
    workload: Callable[[], Workload],
    costs: Costs,
    trace: AcceptanceTrace | None,
    slo: Slo,
    *,
    seed: int = 0,
    progress: bool = True,
) -> list[PlanRow]:
    """Simulate every candidate on the same workload; rows sorted best first (goodput per GPU)."""
    rows = []
    for spec in tqdm(specs, desc="plan", unit="deployment", disable=not progress):
        result = simulate(workload(), costs, trace, spec, seed=seed)
        mean_running = result.running_area / max(result.end_s, 1e-12)
        drafters = spec.drafters if spec.placement == "disaggregated" else spec.verifiers
        rows.append(
            PlanRow(spec, summarize(result, slo), mean_running / spec.verifiers, mean_running / max(drafters, 1))
        )
    rows.sort(key=lambda r: -(r.summary.goodput_per_gpu if math.isfinite(r.summary.goodput_per_gpu) else -1.0))
    return rows


def recommended_autoscaling(best: PlanRow) -> dict[str, dict[str, Any]]:
    """Serve ``autoscaling_config`` for the pools of the best deployment (module docstring)."""
    spec = best.spec
    defaults = PoolScaling()

    def pool(replicas: int, held: float, slots: int) -> dict[str, Any]:
        return {
            "min_replicas": 1,
            "max_replicas": replicas,
            "target_ongoing_requests": max(1, min(slots - 1, math.ceil(held))),
            "look_back_period_s": defaults.look_back_period_s,
            "upscale_delay_s": defaults.upscale_delay_s,
            "downscale_delay_s": defaults.downscale_delay_s,
            "policy": {"policy_function": POLICY_PATH},
        }

    config = {"verifier": pool(spec.verifiers, best.held_per_verifier, spec.verifier_slots)}
    if spec.placement == "disaggregated":
        config["drafter"] = pool(spec.drafters, best.held_per_drafter, spec.drafter_slots)
    return config
