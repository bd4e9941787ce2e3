"""Where a round's wall time goes on the GPU: device busy vs idle, split by the host phase it falls in (issue 11).

At 1 request a speculative round of the inflated qwen3-4b pair is ~3.9 ms, of which the draft and verify graph
replays are ~3.5 ms of device time: the rest is time the GPU waits for the host. This script says where. For
each policy (autoregressive, full, dspark) and concurrency it serves closed-loop requests of the code prompt
mix through the in-process engine with captured graphs, then records rounds under ``torch.profiler`` with every
host phase of the round annotated (the draft engine's propose and context append, the policy's lengths and
draft decision, the verify engine's step, the commit). From the trace, per round (medians):

* wall time, device busy time (union of kernels and copies), device idle time;
* per phase: its host duration and the device idle time inside it (a phase that waits on the device, e.g. a
  step's result copy, shows little idle; one that prepares work while the device has none shows its whole
  length);
* CUDA runtime calls by name (count and host microseconds per round).

The profiler slows the host's CUDA calls, so the same rounds are also run without it: ``wall_ms_unprofiled``
is the real round time, the profiled split says where it goes. The profiler also keeps slowing them after it
stops: with CUDA graphs in the process Kineto leaves CUPTI attached (it sets ``TEARDOWN_CUPTI=0``; pytorch
issue 144455), and every graph launch afterwards costs ~90-200 us of host time instead of ~10-60. So every
cell's unprofiled rounds run first, before any profiler starts, and the profiled pass comes after them all.
The bench's own methods wrap the engines' (instance attributes, removed after); nothing in the engine knows
about it.

GPU:  PYTHONPATH=. python3 bench/profile_round_gpu.py --prompts-dir .data/prompts --out $OUT/round_profile.json
CPU smoke (tiny shape, eager): PYTHONPATH=. python bench/profile_round_gpu.py --prompts-dir .data/prompts \
      --device cpu --shape small --rounds 4 --warmup 2 --graphs off --out /tmp/round_profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.bench_policies_gpu import (
    SMALL_SHAPE,
    SharedEngines,
    load_prompt_mix,
    machine_description,
    scheduled_policy,
    sps_grid,
)
from bench.engine_setup import DEMO_TARGET, load_calibration, tokenizer_for
from draft_service.inflate import inflate_pair
from kernels.sampling import SamplingParams
from scheduler.algorithm import DraftCost
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.profiling import profile_graph_sps, profile_target_sps
from verify_service.inflate import SHAPES

DEMO_DRAFTER = DEMO_TARGET.parent / "draft_dspark"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
PHASES = {
    # (object attribute on the engine, method): phase name
    ("draft", "propose"): "draft.propose",
    ("draft", "propose_start"): "draft.propose_start",
    ("draft", "append_context"): "draft.append_context",
    ("draft", "propose_behind"): "draft.propose_behind",  # the next round's draft step queued behind the verify step
    ("verify", "step"): "verify.step",
    ("verify", "start_chained"): "verify.start_chained",  # a chained round's launch (its wait is not wrapped)
    ("policy", "lengths"): "policy.lengths",
    ("policy", "should_draft"): "policy.should_draft",
    (None, "_commit_results"): "commit",
    (None, "_admit"): "admit",
}
NESTED = {"draft.append_context", "draft.propose_start"}
"""Phases that run inside another one (the context append is part of the commit; a propose starts inside the
propose, or, drafting ahead, inside the commit)."""


def annotate(engine: SpeculativeEngine) -> Callable[[], None]:
    """Wrap the round's phases in profiler ranges; returns the function that removes the wrappers."""
    undo: list[tuple[object, str]] = []
    for (owner_name, method), label in PHASES.items():
        owner = engine if owner_name is None else getattr(engine, owner_name, None)
        if owner is None or not hasattr(owner, method):
            continue
        inner = getattr(owner, method)

        def wrapped(*args: Any, _inner: Callable[..., Any] = inner, _label: str = label, **kwargs: Any) -> Any:
            with torch.profiler.record_function(_label):
                return _inner(*args, **kwargs)

        setattr(owner, method, functools.wraps(inner)(wrapped))
        undo.append((owner, method))

    def remove() -> None:
        for owner, method in undo:
            delattr(owner, method)

    return remove


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _busy_within(busy: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in busy)


def analyse_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Per-round medians (ms) of wall, device busy / idle, per-phase host time and idle, CUDA runtime calls."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    busy = _merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATEGORIES])
    rounds = sorted((e for e in events if e.get("name") == "round"), key=lambda e: e["ts"])
    phases = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in PHASES.values()]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    per_round: list[dict[str, Any]] = []
    for r in rounds:
        start, end = r["ts"], r["ts"] + r["dur"]
        on_device = _busy_within(busy, start, end)
        row: dict[str, Any] = {"wall": r["dur"], "device_busy": on_device, "device_idle": r["dur"] - on_device}
        phase_host: dict[str, float] = defaultdict(float)
        phase_idle: dict[str, float] = defaultdict(float)
        for p in phases:
            if start <= p["ts"] < end:
                p_end = p["ts"] + p["dur"]
                phase_host[p["name"]] += p["dur"]
                phase_idle[p["name"]] += p["dur"] - _busy_within(busy, p["ts"], p_end)
        row["phase_host"], row["phase_idle"] = dict(phase_host), dict(phase_idle)
        nested = NESTED & phase_idle.keys()
        row["phase_idle"]["(between phases)"] = row["device_idle"] - sum(
            v for k, v in phase_idle.items() if k not in nested
        )
        calls: dict[str, list[float]] = defaultdict(list)
        for c in runtime:
            if start <= c["ts"] < end:
                calls[c["name"]].append(c["dur"])
        row["runtime"] = {name: (len(d), sum(d)) for name, d in calls.items()}
        per_round.append(row)
    if not per_round:
        return {"rounds": 0}

    def med(values: Sequence[float]) -> float:
        return statistics.median(values) / 1000 if values else 0.0

    names = sorted({n for r in per_round for n in r["phase_host"]})
    idle_names = sorted({n for r in per_round for n in r["phase_idle"]})
    calls = sorted({n for r in per_round for n in r["runtime"]})
    return {
        "rounds": len(per_round),
        "wall_ms": med([r["wall"] for r in per_round]),
        "device_busy_ms": med([r["device_busy"] for r in per_round]),
        "device_idle_ms": med([r["device_idle"] for r in per_round]),
        "phase_host_ms": {n: med([r["phase_host"].get(n, 0.0) for r in per_round]) for n in names},
        "phase_idle_ms": {n: med([r["phase_idle"].get(n, 0.0) for r in per_round]) for n in idle_names},
        "runtime_calls": {
            n: {
                "per_round": statistics.median([r["runtime"].get(n, (0, 0.0))[0] for r in per_round]),
                "host_us_per_round": statistics.median([r["runtime"].get(n, (0, 0.0))[1] for r in per_round]),
            }
            for n in calls
        },
    }


@contextlib.contextmanager
def replay_timer(sync_before: bool = False) -> Iterator[list[list[tuple[float, float]]]]:
    """Times every ``CUDAGraph.replay`` call into the last list of the yielded list of rounds, as (host
    seconds of the call, seconds the host waited for the stream first): with ``sync_before`` the stream is
    synchronized before each replay, which tells a launch that is slow by itself from one that waits behind
    device work still queued (a copy, say)."""
    rounds: list[list[tuple[float, float]]] = []
    original = torch.cuda.CUDAGraph.replay

    def timed(graph: torch.cuda.CUDAGraph) -> None:
        t0 = time.perf_counter()
        if sync_before:
            torch.cuda.current_stream().synchronize()
        t1 = time.perf_counter()
        original(graph)
        if rounds:
            rounds[-1].append((time.perf_counter() - t1, t1 - t0))

    torch.cuda.CUDAGraph.replay = timed  # type: ignore[method-assign]
    try:
        yield rounds
    finally:
        torch.cuda.CUDAGraph.replay = original  # type: ignore[method-assign]


def timed_rounds(loop: ClosedLoop, rounds: int, sync_before: bool) -> tuple[list[float], dict[str, list[float]]]:
    """Round walls (s) and, per graph replay of a round (k-th call), the median host us of the launch and of
    the wait before it."""
    with replay_timer(sync_before) as replays:
        walls = []
        for _ in range(rounds):
            replays.append([])
            walls.append(loop.step())
    slots = max(map(len, replays), default=0)
    per_call = {
        "launch_us": [1e6 * statistics.median([r[k][0] for r in replays if len(r) > k]) for k in range(slots)],
        "wait_us": [1e6 * statistics.median([r[k][1] for r in replays if len(r) > k]) for k in range(slots)],
    }
    return walls, per_call


class ClosedLoop:
    """``concurrency`` requests of the prompt mix kept running: a finished one is replaced at once."""

    def __init__(self, engine: SpeculativeEngine, mix: Any, concurrency: int, temperature: float) -> None:
        self.engine, self.mix, self.temperature = engine, mix, temperature
        self.next_prompt = 0
        self.live: set[str] = set()
        for _ in range(concurrency):
            self.submit()

    def submit(self) -> None:
        index = self.next_prompt % len(self.mix)
        self.next_prompt += 1
        params = SamplingParams(
            temperature=self.temperature, max_tokens=self.mix.max_tokens[index], ignore_eos=True, seed=index
        )
        self.live.add(self.engine.add_request(self.mix.token_ids[index], params))

    def step(self) -> float:
        t0 = time.perf_counter()
        with torch.profiler.record_function("round"):
            deltas = self.engine.step()
        wall = time.perf_counter() - t0
        for out in deltas:
            if out.finished:
                self.live.discard(out.req_id)
                self.submit()
        return wall

    def close(self) -> None:
        for req_id in list(self.live):
            self.engine.abort(req_id)
        self.live.clear()


def timed_cell(
    engine: SpeculativeEngine, mix: Any, concurrency: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """The cell's rounds without the profiler: wall time, each graph replay's host time (also after a stream
    sync), and the engine's own split of the round."""
    loop = ClosedLoop(engine, mix, concurrency, args.temperature)
    try:
        for _ in range(args.warmup):
            loop.step()
        walls, replays = timed_rounds(loop, args.rounds, sync_before=False)
        synced_walls, synced = timed_rounds(loop, args.rounds, sync_before=True) if device.type == "cuda" else ([], {})
        snapshot = engine.snapshot()
    finally:
        loop.close()
    result: dict[str, Any] = {
        "wall_ms_unprofiled": 1000 * statistics.median(walls),
        "replay_host_us": replays["launch_us"],  # the k-th graph replay of a round: median host us
    }
    if synced:
        result["replay_after_sync"] = synced | {"wall_ms": 1000 * statistics.median(synced_walls)}
    rounds = max(snapshot.rounds, 1)
    result["engine_split_ms"] = {  # the engine's own clocks over warm-up and unprofiled rounds
        "draft": 1000 * snapshot.draft_time_s / rounds,
        "schedule": 1000 * snapshot.schedule_time_s / rounds,
        "verify": 1000 * snapshot.verify_time_s / rounds,
    }
    return result


def profiled_cell(
    engine: SpeculativeEngine, mix: Any, concurrency: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """The cell's rounds under ``torch.profiler``, phases annotated: device busy / idle per host phase."""
    loop = ClosedLoop(engine, mix, concurrency, args.temperature)
    try:
        for _ in range(args.warmup):
            loop.step()
        remove = annotate(engine)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with tempfile.TemporaryDirectory() as tmp:
            trace_path = Path(tmp) / "trace.json"
            try:
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(args.rounds):
                        loop.step()
                prof.export_chrome_trace(str(trace_path))
            finally:
                remove()
            trace = json.loads(trace_path.read_text())
    finally:
        loop.close()
    return analyse_trace(trace)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts-dir", type=Path, required=True)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mbpp"])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--shape", default="qwen3-4b", choices=sorted([*SHAPES, "small"]))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--drafter", type=Path, default=DEMO_DRAFTER)
    parser.add_argument("--graphs", default="capture", choices=["off", "static", "capture"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--policies", nargs="+", default=["autoregressive", "full", "dspark"])
    parser.add_argument(
        "--draft-ahead", nargs="+", default=["on"], choices=["on", "off"], help="SpeculativeEngine draft_ahead"
    )
    parser.add_argument(
        "--chain-verify", default="on", choices=["on", "off"], help="SpeculativeEngine chain_verify (chained rounds)"
    )
    parser.add_argument(
        "--chain-draft", default="on", choices=["on", "off"], help="SpeculativeEngine chain_draft (drafting behind)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=40, help="rounds before the timed ones")
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds (unprofiled, then profiled)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    shape = SMALL_SHAPE if args.shape == "small" else SHAPES[args.shape]
    pair = inflate_pair(args.target, args.drafter, shape, dtype=dtype, device=device, seed=0)
    target, drafter = pair.target_model(), pair.draft
    assert drafter is not None
    block = drafter.block_size
    mix = load_prompt_mix(
        args.prompts_dir,
        args.datasets,
        tokenizer_for(args.target),
        per_dataset=40,
        max_prompt_tokens=512,
        max_tokens=args.max_tokens,
        jitter=32,
    )
    max_seq_len = min(target.max_context_len, max(len(p) for p in mix.token_ids) + max(mix.max_tokens) + block + 2)
    engines = SharedEngines(
        target, drafter, max(args.concurrency), max_seq_len, load_calibration(args.drafter), graphs=args.graphs
    )
    grid = sps_grid(block + 1, args.concurrency)
    context = int(statistics.median(len(p) for p in mix.token_ids)) + args.max_tokens // 2
    if engines.verify.graphs is not None:
        sps, _ = profile_graph_sps(engines.verify, chunk=block + 1, batch_sizes=grid, context=context)
    else:
        sps = profile_target_sps(target, chunk=block + 1, max_batch_tokens=max(grid), batch_sizes=grid, context=context)
    results: dict[str, Any] = {
        "machine": machine_description(device),
        "shape": args.shape,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cells": [],
    }
    cells = [(c, p, a) for c in args.concurrency for p in args.policies for a in args.draft_ahead]
    overheads: dict[int, DraftCost] = {}
    no_draft: dict[int, DraftCost] = {}

    def engine_for(concurrency: int, policy: str, ahead: str) -> SpeculativeEngine:
        if policy in ("dspark", "dspark-async") and concurrency in overheads:
            chosen = scheduled_policy(policy, sps, overheads[concurrency], no_draft.get(concurrency))
        else:
            chosen = make_policy(policy, sps, block)
        return SpeculativeEngine(
            engines.verify,
            engines.draft,
            chosen,
            eos_token_ids=target.eos_token_ids,
            max_running=concurrency,
            draft_ahead=ahead == "on",
            chain_verify=args.chain_verify == "on",
            chain_draft=args.chain_draft == "on",
        )

    show = sys.stderr.isatty()
    # Pass 1, no profiler anywhere in the process yet: the real round and launch times.
    for concurrency, policy, ahead in tqdm(cells, desc="timed cells", unit="cell", disable=not show):
        cell = timed_cell(engine_for(concurrency, policy, ahead), mix, concurrency, args, device)
        split = cell["engine_split_ms"]
        outside_verify = (cell["wall_ms_unprofiled"] - split["verify"]) / 1000
        # What the scheduled policies' whole-round objective prices a drafted round with (first draft-ahead mode).
        if policy == "full" and ahead == args.draft_ahead[0]:
            overheads[concurrency] = DraftCost(fixed_s=max(outside_verify, 0.0))
        if policy == "autoregressive" and ahead == args.draft_ahead[0]:
            no_draft[concurrency] = DraftCost(fixed_s=max(outside_verify, 0.0))
        cell.update(concurrency=concurrency, policy=policy, draft_ahead=ahead)
        results["cells"].append(cell)
        args.out.write_text(json.dumps(results, indent=1))
    # Pass 2: where the time goes, under the profiler (which slows every later CUDA call of the process).
    for cell in tqdm(results["cells"], desc="profiled cells", unit="cell", disable=not show):
        engine = engine_for(cell["concurrency"], cell["policy"], cell["draft_ahead"])
        cell.update(profiled_cell(engine, mix, cell["concurrency"], args, device))
        args.out.write_text(json.dumps(results, indent=1))
    lines = [
        "| c | policy (draft ahead) | round ms (unprofiled) | profiled | device busy | device idle | idle by phase |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for cell in results["cells"]:
        if not cell.get("rounds"):
            continue
        idle = ", ".join(f"{k} {v:.3f}" for k, v in sorted(cell["phase_idle_ms"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {cell['concurrency']} | {cell['policy']} ({cell['draft_ahead']}) | {cell['wall_ms_unprofiled']:.3f} | "
            f"{cell['wall_ms']:.3f} | "
            f"{cell['device_busy_ms']:.3f} | {cell['device_idle_ms']:.3f} | {idle} |"
        )
    for cell in results["cells"]:
        launches = " / ".join(f"{us:.0f}" for us in cell.get("replay_host_us", []))
        after = cell.get("replay_after_sync", {})
        synced = " / ".join(
            f"{a:.0f} (+{w:.0f} wait)"
            for a, w in zip(after.get("launch_us", []), after.get("wait_us", []), strict=True)
        )
        lines.append(
            f"c={cell['concurrency']} {cell['policy']}: graph replay host us per call {launches}; "
            f"after a stream sync {synced} (round {after.get('wall_ms', float('nan')):.3f} ms)"
        )
        top = sorted(cell.get("runtime_calls", {}).items(), key=lambda kv: -kv[1]["host_us_per_round"])[:6]
        lines.append(
            f"c={cell['concurrency']} {cell['policy']}: runtime "
            + ", ".join(f"{n} x{v['per_round']:.0f} {v['host_us_per_round']:.0f}us" for n, v in top)
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main())
