"""Client populations: several open-loop arrival processes in one level, each with its own request fields.

``--population "name=gold,rate=2,priority=-1,tpot_slo_ms=40"`` (repeated) runs every population's own gamma
arrivals at its own rate, all at once, each sending its fields in the request body (``priority``,
``tpot_slo_ms``, ``speculative``: dspark-serve's service levels, docs/HTTP_API.md; any other server ignores or
rejects them, as it would in ``extra_body``). Each population is summarised on its own, with its SLO attainment:
the fraction of its measured requests whose TPOT met its ``tpot_slo_ms`` (a refused or failed request misses);
``goal_tpot_ms`` is the same objective without sending it (the same traffic without tiers); without either, the
run's ``--slo``. The aggregate goodput is the sum over populations of requests per
second that met their population's objectives (a population with neither a target nor ``--slo`` counts every
completed request), so "with tiers" and "without tiers" runs of the same traffic compare on one number.

Population k takes the workload's requests k, k + n, k + 2n, ... (n populations), so they do not send the same
prompts at the same moments, and seeds its arrivals with the window's seed + k.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cluster.bench_serve.client import RequestOptions
from cluster.bench_serve.load import Hook, LevelRun, LoadLevel, Window, run_open
from cluster.bench_serve.stats import SLO, RequestRecord, summarize
from cluster.bench_serve.workload import BenchRequest

#: Sends one request with the given options (a population's): ``send(request, index, options)``.
SendWith = Callable[[BenchRequest, int, RequestOptions], Awaitable[RequestRecord]]
#: The request fields a population may set, with the type each takes.
FIELDS: dict[str, type] = {"priority": int, "tpot_slo_ms": float, "speculative": str}


@dataclass(frozen=True)
class Population:
    """One client population: its name, arrival rate (requests/s) and the fields its requests carry."""

    name: str
    rate: float
    fields: dict[str, Any]
    goal_tpot_ms: float | None = None  # a TPOT objective measured, not sent

    @property
    def tpot_slo_s(self) -> float | None:
        target = self.fields.get("tpot_slo_ms", self.goal_tpot_ms)
        return None if target is None else float(target) / 1000.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rate": self.rate, "fields": dict(self.fields), "goal_tpot_ms": self.goal_tpot_ms}


def parse_population(text: str, index: int) -> Population:
    """Parse ``rate=R[,name=N][,priority=P][,tpot_slo_ms=T][,speculative=S][,goal_tpot_ms=G]``; raises
    ValueError naming the part that does not parse. The name defaults to ``p<index>``."""
    values: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"population item {part.strip()!r} does not parse: expected KEY=VALUE")
        if key in values:
            raise ValueError(f"population key {key!r} is given twice")
        values[key] = value
    if "rate" not in values:
        raise ValueError(f"population {text!r} needs rate=REQUESTS_PER_S")
    try:
        rate = float(values.pop("rate"))
    except ValueError:
        raise ValueError(f"population {text!r}: rate must be a number") from None
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"population {text!r}: rate must be a positive finite number")
    name = values.pop("name", f"p{index}")
    goal = values.pop("goal_tpot_ms", None)
    try:
        goal_ms = None if goal is None else float(goal)
    except ValueError:
        raise ValueError(f"population {name}: goal_tpot_ms must be a number, got {goal!r}") from None
    fields: dict[str, Any] = {}
    for key, value in values.items():
        kind = FIELDS.get(key)
        if kind is None:
            raise ValueError(f"population key {key!r} is not one of rate, name, goal_tpot_ms, {', '.join(FIELDS)}")
        try:
            fields[key] = kind(value)
        except ValueError:
            raise ValueError(f"population {name}: {key} must be {kind.__name__}, got {value!r}") from None
    return Population(name, rate, fields, goal_ms)


async def run_populations(
    send: SendWith,
    options: RequestOptions,
    requests: Sequence[BenchRequest],
    populations: Sequence[Population],
    window: Window,
    *,
    on_measure_start: Hook,
    progress: bool = True,
) -> list[LevelRun]:
    """Every population's open loop at once, each sending with ``options`` plus its fields;
    ``on_measure_start`` runs once, when the first population opens its measured window."""
    started = False

    async def once() -> None:
        nonlocal started
        if not started:
            started = True
            await on_measure_start()

    count = len(populations)

    async def one(k: int, population: Population) -> LevelRun:
        extra = {**options.extra_body, **population.fields}
        mine = replace(options, extra_body=extra)
        share = list(requests[k::count]) or list(requests)

        async def send_one(request: BenchRequest, index: int) -> RequestRecord:
            return await send(request, index, mine)

        return await run_open(
            send_one, share, LoadLevel("open", population.rate), replace(window, seed=window.seed + k),
            on_measure_start=once, label=population.name, progress=progress,
        )

    return list(await asyncio.gather(*(one(k, p) for k, p in enumerate(populations))))


def population_results(
    populations: Sequence[Population], runs: Sequence[LevelRun], slo: SLO | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per population: its summary with ``slo_attainment`` (fraction of measured requests that met its
    objectives, None without any); and the aggregate: goodput (requests/s meeting their population's
    objectives, over the longest window) and the fraction of all measured requests that did."""
    results = []
    good_total = 0
    measured_total = 0
    window_s = max((run.window_s for run in runs), default=1e-9)
    for population, run in zip(populations, runs, strict=True):
        target = population.tpot_slo_s
        objective = SLO(ttft_s=slo.ttft_s if slo else None, tpot_s=target, e2e_s=slo.e2e_s if slo else None) if (
            target is not None
        ) else slo
        summary = summarize(run.records, run.window_s, objective)
        good = summary["goodput"]["met"] if objective is not None else summary["completed"]
        good_total += good
        measured_total += len(run.records)
        results.append({
            **population.as_dict(),
            "slo_attainment": None if objective is None else summary["goodput"]["fraction"],
            **summary,
        })
    aggregate = {
        "requests_per_s": good_total / window_s,
        "fraction": good_total / measured_total if measured_total else None,
        "met": good_total,
        "measured": measured_total,
    }
    return results, aggregate


def merged_run(runs: Sequence[LevelRun]) -> LevelRun:
    """All populations' measured requests as one level run over the union of their windows."""
    records = [r for run in runs for r in run.records]
    return LevelRun(records, min(run.t0 for run in runs), max(run.t1 for run in runs))
