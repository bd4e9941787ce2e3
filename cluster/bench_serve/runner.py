"""A whole benchmark run: check the server, then measure every load level and summarise it.

Before any level, the server must answer ``/v1/models`` and one real request of the workload: an unreachable
URL, a wrong model name or a server that answers 4xx / 5xx stops the run with the server's own message
(:class:`BenchError`), instead of a sweep of failures. During the levels, failures are measured and counted by kind.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import math
import os
import platform
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx

from cluster.bench_serve import server_metrics
from cluster.bench_serve.client import RequestOptions, api_base, make_client, send
from cluster.bench_serve.fanout import run_closed_fanout
from cluster.bench_serve.load import LevelRun, LoadLevel, LoopLag, Window, run_closed, run_open
from cluster.bench_serve.populations import Population, merged_run, population_results, run_populations
from cluster.bench_serve.stats import SLO, RequestRecord, first_wave_summary, summarize
from cluster.bench_serve.workload import BenchRequest


class BenchError(RuntimeError):
    """The run cannot go on (server unreachable, refusing the workload); the message says why."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs. ``options.model`` may be empty: the server's first model is used."""

    base_url: str
    options: RequestOptions
    requests: Sequence[BenchRequest]
    levels: Sequence[LoadLevel]
    window: Window
    workload: dict[str, Any]
    slo: SLO | None = None
    api_key: str | None = None
    request_timeout_s: float = 600.0
    label: str = ""
    progress: bool = True
    client_processes: int | None = None
    #: Client populations (:mod:`cluster.bench_serve.populations`): when given, ``levels`` is their one open
    #: loop level (the total rate) and each is sent and summarised on its own.
    populations: Sequence[Population] = ()


def client_processes(concurrency: int, asked: int | None) -> int:
    """Client processes of a closed-loop level: as asked, else one per 16 users up to half the CPUs (one
    process keeps up with a few thousand chunks per second; a 2-core machine keeps one)."""
    if asked is not None:
        return max(1, min(asked, concurrency))
    return max(1, min((os.cpu_count() or 1) // 2, math.ceil(concurrency / 16)))


async def _server_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> dict[str, Any]:
    """The server's ``/v1/models`` listing; raises :class:`BenchError` when it cannot be had."""
    url = api_base(base_url) + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.get(url, headers=headers, timeout=30.0)
    except httpx.HTTPError as error:
        raise BenchError(f"cannot reach {url}: {error.__class__.__name__}: {error}") from None
    if response.status_code != 200:
        raise BenchError(f"{url} answered HTTP {response.status_code}: {response.text[:300]}")
    try:
        listing = response.json()
        models = listing["data"]
        valid = isinstance(models, list) and bool(models) and all(isinstance(m.get("id"), str) for m in models)
    except (ValueError, KeyError, TypeError, AttributeError):
        valid = False
    if not valid:
        raise BenchError(f"{url} did not answer an OpenAI model list: {response.text[:300]}")
    return listing


def _level_result(level: LoadLevel, run: LevelRun, slo: SLO | None, spec: dict[str, Any] | None) -> dict[str, Any]:
    summary = summarize(run.records, run.window_s, slo)
    return {"load": {"kind": level.kind, "value": _json_number(level.value), "label": level.label},
            **summary, "unfinished": run.unfinished,
            "first_wave": first_wave_summary(run.first_wave, summary, [r.e2e_s for r in run.records if r.ok]),
            "speculative": spec}


def _probe_result(probe: RequestRecord) -> dict[str, Any]:
    """The run's very first request (sent alone before any level): on a freshly started server, what the first
    user meets."""
    return {"e2e_s": probe.e2e_s, "ttft_s": probe.ttft_s, "output_tokens": probe.output_tokens}


def _json_number(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run every level of ``config`` in order; returns the results document (see :mod:`cluster.bench_serve.report`)."""
    if not config.requests:
        raise BenchError("the workload holds no requests")
    async with httpx.AsyncClient() as plain:
        listing = await _server_model(plain, config.base_url, config.api_key)
        models = [m["id"] for m in listing["data"]]
        options = config.options
        if not options.model:
            options = replace(options, model=models[0])
        client = make_client(config.base_url, config.api_key, config.request_timeout_s)
        try:
            probe = await send(client, config.requests[0], options, 0)
            if not probe.ok:
                raise BenchError(
                    f"the server refused the first request of the workload (model {options.model!r}): "
                    f"{probe.error}: {probe.error_message}"
                )

            async def one(request: BenchRequest, index: int) -> Any:
                return await send(client, request, options, index)

            async def one_with(request: BenchRequest, index: int, with_options: RequestOptions) -> Any:
                return await send(client, request, with_options, index)

            levels = []
            for level in config.levels:
                before: dict[str, server_metrics.Snapshot | None] = {}

                async def snapshot(before: dict[str, Any] = before) -> None:
                    before["snap"] = await server_metrics.scrape(plain, config.base_url)

                label = f"{config.label} {level.label}".strip()
                processes = client_processes(int(level.value), config.client_processes) if level.kind == "closed" else 1
                child_lags = None
                groups = None
                with LoopLag() as lag:
                    if config.populations:
                        runs = await run_populations(one_with, options, config.requests, config.populations,
                                                     config.window, on_measure_start=snapshot,
                                                     progress=config.progress)
                        run = merged_run(runs)
                        groups = population_results(config.populations, runs, config.slo)
                    elif processes > 1:
                        try:
                            run, child_lags = await run_closed_fanout(
                                config.base_url, config.api_key, config.request_timeout_s, options, config.requests,
                                int(level.value), processes, config.window, on_measure_start=snapshot,
                            )
                        except RuntimeError as error:
                            raise BenchError(f"{level.label}: {error}") from None
                    elif level.kind == "closed":
                        run = await run_closed(one, config.requests, int(level.value), config.window,
                                               on_measure_start=snapshot, label=label, progress=config.progress)
                    else:
                        run = await run_open(one, config.requests, level, config.window,
                                             on_measure_start=snapshot, label=label, progress=config.progress)
                after = await server_metrics.scrape(plain, config.base_url)
                spec = server_metrics.speculative_delta(before.get("snap"), after)
                lags = lag.summary() if child_lags is None else LoopLag.summarize(child_lags)
                result = {**_level_result(level, run, config.slo, spec), "client_processes": processes,
                          "client_loop_lag_ms": lags}
                if groups is not None:
                    result["populations"], result["goodput_aggregate"] = groups
                levels.append(result)
        finally:
            await client.close()
    return {
        "tool": "dspark bench serve",
        "label": config.label,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "client_host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                        "python": platform.python_version()},
        # The model cards as served: dspark-serve's hold what it serves with (its SPS table and where it came
        # from), which a simulator calibration prices rounds with.
        "server": {"base_url": config.base_url, "model": options.model, "models": models, "cards": listing["data"]},
        "request": {k: v for k, v in asdict(options).items() if k != "model"},
        "workload": config.workload,
        "window": asdict(config.window),
        "slo": None if config.slo is None else config.slo.as_dict(),
        "probe": _probe_result(probe),
        "levels": levels,
    }


def run(config: BenchConfig) -> dict[str, Any]:
    """:func:`run_benchmark` from synchronous code."""
    return asyncio.run(run_benchmark(config))
