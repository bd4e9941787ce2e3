"""The in-process speculative engine on a GPU: CUDA graphs on vs off, and the host time per round.

1. Exactness: the same 32 greedy requests (mixed prompt lengths and max_tokens, joining over several rounds,
   policy dspark so the verify lengths vary) through the engine with graphs off and with graphs captured; both
   must equal the target's own greedy decoding token for token.
2. Round cost: for R in --requests (default 1 8 32 128) running requests (policy full: every request verifies
   its whole block, so each round does the same work), median draft / schedule / verify / total ms per round
   with graphs off and on, after warm-up rounds. With graphs on, the host time per round outside the graphs =
   wall time of the round - device time of the graph replays (CUDA events); goal at 32 requests <= 0.5 ms.
   Timed rounds (events around every replay) alternate with plain ones: the host time is the plain rounds'
   median wall - the timed rounds' median device time, so the benchmark's own event calls do not count in it
   (the host time within the timed rounds, events included, is reported too).

The demo target (models/demo/target) and a drafter folder (--drafter; default models/demo/dspark if present,
else a random drafter written to a temporary folder: round costs only, its acceptance means nothing).
Prints a short table last and writes JSON (--out).

GPU (H200):  PYTHONPATH=. python -m bench.bench_engine_gpu --out /tmp/engine_gpu.json
CPU smoke:   PYTHONPATH=. python -m bench.bench_engine_gpu --device cpu --small
On CPU "graphs on" is the bucketed step run eagerly (mode static): it checks the code path, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.engine_setup import (
    DEMO_TARGET,
    build_engine,
    code_prompts,
    demo_drafter,
    load_calibration,
    load_pair,
    synthetic_sps,
    tokenizer_for,
    write_random_drafter,
)
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine

HOST_GOAL_MS = 0.5


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def exactness(engines: dict[str, SpeculativeEngine], target, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    """Greedy outputs of every engine (requests join a few per round) against the target's greedy decoding."""
    reference = target.generate(prompts, max_new_tokens=max(max_tokens))
    expected = [ref[:m] for ref, m in zip(reference, max_tokens, strict=True)]
    outputs: dict[str, list[list[int]]] = {}
    for name, engine in engines.items():
        got: dict[str, list[int]] = {}
        order: list[str] = []
        pending = list(range(len(prompts)))
        while pending or engine.has_unfinished():
            for _ in range(min(4, len(pending))):
                i = pending.pop(0)
                rid = engine.add_request(
                    prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
                )
                order.append(rid)
                got[rid] = []
            for out in engine.step():
                got[out.req_id].extend(out.new_token_ids)
        outputs[name] = [got[rid] for rid in order]
    result = {name: sum(o == e for o, e in zip(out, expected, strict=True)) for name, out in outputs.items()}
    names = list(outputs)
    same = all(outputs[n] == outputs[names[0]] for n in names)
    return {
        "requests": len(prompts),
        "equal_to_target_greedy": result,
        "graphs_on_equals_graphs_off": same,
        "ok": same and all(v == len(prompts) for v in result.values()),
    }


def round_costs(
    engine: SpeculativeEngine,
    prompts: list[list[int]],
    *,
    warmup: int,
    rounds: int,
    device: str,
    max_tokens: int,
) -> dict:
    """Median per-round times with len(prompts) running requests (all admitted and prefilled first)."""
    runners = [r for r in (engine.verify.graphs, engine.draft.graphs if engine.draft else None) if r is not None]
    ids = [
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)) for p in prompts
    ]
    engine.step()  # admission + prefill of everyone (eager)
    if engine.num_running != len(prompts):
        raise RuntimeError(f"only {engine.num_running} of {len(prompts)} requests are running")
    for _ in range(warmup):
        engine.step()
    # Rounds alternate: the timed ones record CUDA events around every replay (device time inside the graphs),
    # the plain ones do not: their wall time is a round's cost without the benchmark's own event calls.
    walls, plain_walls, drafts, schedules, verifies, in_graphs = [], [], [], [], [], []
    for i in range(2 * rounds if runners else rounds):
        timed = i % 2 == 0
        for runner in runners:
            runner.timed = timed
        before = engine.snapshot()
        graph_before = sum(r.step_time_s for r in runners)
        _sync(device)
        start = time.perf_counter()
        engine.step()
        _sync(device)
        wall = time.perf_counter() - start
        if engine.num_running != len(prompts):
            raise RuntimeError("a request finished during the measured rounds: raise max_tokens / max_seq_len")
        if not timed:
            plain_walls.append(wall)
            continue
        walls.append(wall)
        after = engine.snapshot()
        drafts.append(after.draft_time_s - before.draft_time_s)
        schedules.append(after.schedule_time_s - before.schedule_time_s)
        verifies.append(after.verify_time_s - before.verify_time_s)
        in_graphs.append(sum(r.step_time_s for r in runners) - graph_before)
    for runner in runners:
        runner.timed = False
    snapshot = engine.snapshot()
    for rid in ids:
        engine.abort(rid)

    def ms(values: list[float]) -> float:
        return 1000.0 * statistics.median(values)

    row = {
        "requests": len(prompts),
        "draft_ms": ms(drafts),
        "schedule_ms": ms(schedules),
        "verify_ms": ms(verifies),
        "total_ms": ms(walls),
        "tau": snapshot.tau,
    }
    if runners:
        row["in_graphs_ms"] = ms(in_graphs)
        # Host time outside the graphs: the plain rounds' wall - the timed rounds' device time in the graphs
        # (every round does the same work: policy full, same R); and the same within the timed rounds, whose
        # event records and reads count in it.
        row["plain_total_ms"] = ms(plain_walls)
        row["host_outside_graphs_ms"] = ms(plain_walls) - ms(in_graphs)
        row["host_outside_graphs_timed_ms"] = ms([w - g for w, g in zip(walls, in_graphs, strict=True)])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--drafter", type=Path, default=None, help="DSpark drafter folder (default: demo or random)")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--small", action="store_true", help="a quick smoke run (CPU): 1 and 4 requests, few rounds")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.small:
        args.requests, args.prompt_tokens, args.warmup, args.rounds = [1, 4], 24, 1, 3
    device = args.device
    on_cuda = device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --small for a smoke test", file=sys.stderr)
        return 2
    if not on_cuda:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    dtype = getattr(torch, args.dtype)
    graphs_on = "capture" if on_cuda else "static"
    started = time.perf_counter()

    drafter_dir = args.drafter
    random_drafter = False
    tmp = tempfile.TemporaryDirectory()
    if drafter_dir is None:
        drafter_dir = demo_drafter()
        if drafter_dir is None:
            drafter_dir = write_random_drafter(args.target, Path(tmp.name) / "drafter")
            random_drafter = True
    print(f"drafter: {drafter_dir}{' (random weights: round costs only)' if random_drafter else ''}")
    target, drafter = load_pair(args.target, drafter_dir, device, dtype)
    tokenizer = tokenizer_for(args.target)
    max_requests = max(args.requests)
    buckets = tuple(sorted({1, 2, 4, 8, 16, 32, 64, 128} | set(args.requests)))
    max_seq_len = min(
        target.max_context_len, args.prompt_tokens + (args.warmup + 2 * args.rounds + 4) * (drafter.block_size + 1) + 64
    )
    print(f"target {args.target} on {device} ({args.dtype}), block {drafter.block_size}, max_seq_len {max_seq_len}")

    engines: dict[str, SpeculativeEngine] = {}
    build_s = {}
    for mode in ("off", graphs_on):
        t0 = time.perf_counter()
        engines[mode] = build_engine(
            target,
            drafter,
            policy="full",
            sps=None,
            max_requests=max_requests,
            max_seq_len=max_seq_len,
            graphs=mode,
            buckets=buckets,
        )
        _sync(device)
        build_s[mode] = time.perf_counter() - t0
    print(f"engines built (graphs {graphs_on}: {build_s[graphs_on]:.1f} s incl. capture)")

    # 1. exactness (policy dspark: varied verify lengths inside the graphs)
    num_exact = 8 if args.small else 32
    rng = np.random.default_rng(0)
    exact_prompts = [
        p[: int(rng.integers(4, args.prompt_tokens))]
        for p in code_prompts(tokenizer, num_exact, args.prompt_tokens, seed=1)
    ]
    exact_max = [int(rng.integers(4, 12 if args.small else 48)) for _ in exact_prompts]
    exact_engines = {}
    for mode in ("off", graphs_on):
        engine = build_engine(
            target,
            drafter,
            policy="dspark",
            sps=synthetic_sps(),
            calibration=load_calibration(drafter_dir),
            max_requests=min(max_requests, 16 if not args.small else 4),
            max_seq_len=max_seq_len,
            graphs=mode,
            buckets=buckets,
        )
        exact_engines[f"graphs_{mode}"] = engine
    check = exactness(exact_engines, target, exact_prompts, exact_max)
    del exact_engines
    print(f"exactness: {check}")

    # 2. round costs
    rows = []
    plan = [(mode, r) for r in args.requests for mode in ("off", graphs_on)]
    for mode, num in tqdm(plan, desc="round costs", unit="config"):
        prompts = code_prompts(tokenizer, num, args.prompt_tokens, seed=num)
        row = round_costs(
            engines[mode],
            prompts,
            warmup=args.warmup,
            rounds=args.rounds,
            device=device,
            max_tokens=max_seq_len,
        )
        row["graphs"] = mode
        rows.append(row)

    machine = (
        f"{torch.cuda.get_device_name() if on_cuda else platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    result = {
        "machine": machine,
        "device": device,
        "dtype": args.dtype,
        "drafter": str(drafter_dir),
        "random_drafter": random_drafter,
        "block_size": drafter.block_size,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "graph_build_s": build_s[graphs_on],
        "exactness": check,
        "rows": rows,
        "host_goal_ms": HOST_GOAL_MS,
        "elapsed_s": time.perf_counter() - started,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    tmp.cleanup()

    print(
        f"\nmachine: {machine}; {args.dtype}; block {drafter.block_size}; policy full; median of {args.rounds} rounds"
    )
    print(
        f"exactness (greedy, {check['requests']} requests): graphs on == off: {check['graphs_on_equals_graphs_off']}, "
        f"== target greedy: {check['equal_to_target_greedy']}"
    )
    header = (
        f"{'R':>4} {'graphs':>8} {'draft ms':>9} {'sched ms':>9} {'verify ms':>10} {'total ms':>9} "
        f"{'in graphs':>10} {'host ms':>8} {'(timed)':>8}"
    )
    print(header)
    for row in rows:
        graph_ms = f"{row['in_graphs_ms']:10.3f}" if "in_graphs_ms" in row else f"{'-':>10}"
        host_ms = (
            f"{row['host_outside_graphs_ms']:8.3f} {row['host_outside_graphs_timed_ms']:8.3f}"
            if "host_outside_graphs_ms" in row
            else f"{'-':>8} {'-':>8}"
        )
        print(
            f"{row['requests']:>4} {row['graphs']:>8} {row['draft_ms']:9.3f} {row['schedule_ms']:9.3f} "
            f"{row['verify_ms']:10.3f} {row['total_ms']:9.3f} {graph_ms} {host_ms}"
        )
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
