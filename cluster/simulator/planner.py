"""The pool planner: for a GPU budget, workload and SLO, the deployment with the most goodput per GPU.

Candidates for G GPUs: every replica colocated (G replicas, each GPU holding both engines), and disaggregated
pools split by drafter:verifier ratios (V = round(G * v / (d + v)) verifiers, G - V drafters, both >= 1), each
with the request-group counts asked for. A candidate's goodput is the highest request rate at which at least
``attainment`` of the requests meet the SLO (found by doubling, then bisection on the rate, each probe one
simulated run of the workload at that rate); per GPU it is divided by all the candidate's GPUs.

Deployments larger than ``max_sim_gpus`` are simulated as their largest slice of at most that many GPUs with
the same drafter:verifier ratio (or the closest one), at the same rate per GPU: the router spreads requests
over the replicas (fewest held requests first), so a slice of a large pool sees the load per replica the whole
pool does. What a slice does not show is the smoothing of a larger pool (its burst per replica is smaller); the
tables say which deployments were simulated as slices.

The recommended ``autoscaling_config`` of each pool keeps the best candidate's sizes as ``max_replicas`` and
sets ``target_ongoing_requests`` to the requests a replica of that pool held on average at the goodput rate (below
the replica's slot count, as :mod:`cluster.autoscaling` requires), so the engine-load policy adds replicas
when the load per replica rises past the one at which the SLO still held.
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

MAX_PROBES = 24  # simulated runs per candidate at most (doubling plus bisection)


@dataclass(frozen=True)
class PlanRow:
    """One candidate ``deployment``, simulated as ``simulated`` (itself or a slice), at its goodput."""

    deployment: ClusterSpec
    simulated: ClusterSpec
    goodput_rps: float  # highest rate meeting the attainment, for the whole deployment
    summary: Summary  # the run at that rate (of ``simulated``)
    held_per_verifier: float
    held_per_drafter: float

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.deployment.gpus

    @property
    def sliced(self) -> bool:
        return self.simulated != self.deployment

    @property
    def label(self) -> str:
        spec = self.deployment
        if spec.placement == "colocated":
            return f"colocated x{spec.verifiers}"
        return f"{spec.drafters}D:{spec.verifiers}V groups {spec.groups}"


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


def slice_of(spec: ClusterSpec, max_gpus: int) -> ClusterSpec:
    """The largest deployment of at most ``max_gpus`` GPUs with ``spec``'s drafter:verifier ratio: ``spec``
    itself when it fits, a multiple of the ratio's smallest integer form when that fits, else the split of
    ``max_gpus`` closest to the ratio."""
    if spec.gpus <= max_gpus:
        return spec
    if spec.placement == "colocated":
        return replace(spec, verifiers=max_gpus)
    divisor = math.gcd(spec.verifiers, spec.drafters)
    v, d = spec.verifiers // divisor, spec.drafters // divisor
    if v + d <= max_gpus:
        k = max_gpus // (v + d)
        return replace(spec, verifiers=v * k, drafters=d * k)
    verifiers = min(max(1, round(max_gpus * spec.verifiers / spec.gpus)), max_gpus - 1)
    return replace(spec, verifiers=verifiers, drafters=max_gpus - verifiers)


def _probe(
    spec: ClusterSpec,
    rate: float,
    workload: Callable[[float], Workload],
    costs: Costs,
    trace: AcceptanceTrace | None,
    slo: Slo,
    seed: int,
) -> tuple[Summary, float]:
    result = simulate(workload(rate), costs, trace, spec, seed=seed)
    return summarize(result, slo), result.running_area / max(result.end_s, 1e-12)


def goodput(
    spec: ClusterSpec,
    workload: Callable[[float], Workload],
    costs: Costs,
    trace: AcceptanceTrace | None,
    slo: Slo,
    *,
    attainment: float,
    start_rate: float,
    tolerance: float = 0.1,
    seed: int = 0,
) -> tuple[float, Summary, float]:
    """The highest rate (requests/s for ``spec``) at which at least ``attainment`` of the requests meet the SLO,
    to within ``tolerance`` (relative), with the run at that rate and its mean number of running requests.
    Rate 0 (and the run at the smallest rate tried) when even that rate misses."""
    probes = 0

    def attains(rate: float) -> tuple[bool, Summary, float]:
        nonlocal probes
        probes += 1
        summary, running = _probe(spec, rate, workload, costs, trace, slo, seed)
        return summary.slo_met >= attainment, summary, running

    ok, summary, running = attains(start_rate)
    if ok:
        low, best, high = start_rate, (summary, running), math.inf
        while math.isinf(high) and probes < MAX_PROBES:
            ok, summary, running = attains(2 * low)
            if ok:
                low, best = 2 * low, (summary, running)
            else:
                high = 2 * low
    else:
        low, best, high = 0.0, (summary, running), start_rate
        while low == 0.0 and probes < MAX_PROBES:
            ok, summary, running = attains(high / 2)
            if ok:
                low, best = high / 2, (summary, running)
            else:
                high /= 2
        if low == 0.0:
            return 0.0, summary, running
    while high / low > 1 + tolerance and probes < MAX_PROBES:
        mid = math.sqrt(low * high)
        ok, summary, running = attains(mid)
        if ok:
            low, best = mid, (summary, running)
        else:
            high = mid
    return low, best[0], best[1]


def plan(
    specs: Sequence[ClusterSpec],
    workload: Callable[[float], Workload],
    costs: Costs,
    trace: AcceptanceTrace | None,
    slo: Slo,
    *,
    attainment: float = 0.9,
    start_rate_per_gpu: float = 10.0,
    max_sim_gpus: int = 64,
    seed: int = 0,
    progress: bool = True,
) -> list[PlanRow]:
    """Every candidate's goodput (``workload(rate)`` makes the requests at a rate); rows best first."""
    rows = []
    for spec in tqdm(specs, desc="plan", unit="deployment", disable=not progress):
        simulated = slice_of(spec, max_sim_gpus)
        rate, summary, running = goodput(
            simulated,
            workload,
            costs,
            trace,
            slo,
            attainment=attainment,
            start_rate=start_rate_per_gpu * simulated.gpus,
            seed=seed,
        )
        drafters = simulated.drafters if simulated.placement == "disaggregated" else simulated.verifiers
        rows.append(
            PlanRow(
                spec,
                simulated,
                rate * spec.gpus / simulated.gpus,
                summary,
                running / simulated.verifiers,
                running / max(drafters, 1),
            )
        )
    rows.sort(key=lambda r: -r.goodput_per_gpu)
    return rows


def recommended_autoscaling(best: PlanRow) -> dict[str, dict[str, Any]]:
    """Serve ``autoscaling_config`` for the pools of the best deployment at its full size (module docstring)."""
    spec = best.deployment
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
