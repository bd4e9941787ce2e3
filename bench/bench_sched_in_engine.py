"""Schedule time per round inside the real round driver, where it costs more than in a warm loop (issue 11).

``bench/bench_scheduler.py --rounds`` times the scheduled policies' decisions back to back, with every cache
warm. In the round driver the same calls run between model steps that evict the CPU's caches, and they cost
several times as much (on the GPU machine dspark's schedule time per round was 0.09-0.11 ms against 0.02-0.03 ms
for ``full``; at 1 request that is what separates the two policies). This script measures it on the CPU with
the trained demo pair: one request at a time decoded greedily through ``SpeculativeEngine``, the policies
interleaved repeat after repeat (so drifts of the machine hit all alike), schedule time per round from the
engine's own metrics, plus where the scheduled policy's time goes (its calls timed in place).

    python -m bench.bench_sched_in_engine                 # from the repo root, ~1 minute
    python -m bench.bench_sched_in_engine --repeats 8 --max-tokens 200 --json out.json
    python -m bench.bench_sched_in_engine --concurrency 8 --rounds 300   # a closed loop of 8 requests

With ``--concurrency`` c > 1 each repeat keeps c requests in flight for ``--rounds`` rounds (a finished request
is replaced at once, output lengths spread over max_tokens / 2 .. max_tokens), so the number of decoding
requests changes from round to round as it does under load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.engine_setup import DEMO_TARGET, demo_drafter, load_calibration, load_pair, synthetic_sps
from draft_service.engine import DraftEngine
from kernels.sampling import SamplingParams
from scheduler import draft_cost_estimate, draft_gate, policy
from scheduler.engine import SpeculativeEngine
from verify_service.engine import VerifyEngine

POLICIES = (("full", "none"), ("dspark", "none"), ("dspark", "measured"), ("dspark-async", "measured"))
# The scheduled policy's per-round calls, timed where they run: (owner, method name, label).
PARTS = (
    (policy._MeasuredCost, "current", "draft cost: current estimate"),
    (draft_cost_estimate.OnlineDraftCost, "_fit", "draft cost: refit"),
    (policy._MeasuredCost, "observe_round", "draft cost: observe round"),
    (draft_gate.DraftGate, "should_draft", "gate: should_draft"),
    (draft_gate.DraftGate, "observe", "gate: observe"),
    (policy, "schedule_lengths", "Algorithm 1: schedule_lengths"),
)


def _timed(fn: Callable[..., Any], totals: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[0] += time.perf_counter() - start
            totals[1] += 1

    return timed


def closed_loop(engine: SpeculativeEngine, concurrency: int, rounds: int, prompt: list[int], max_tokens: int) -> None:
    """``concurrency`` greedy requests in flight for ``rounds`` rounds, each replaced as soon as it finishes
    (lengths cycle through max_tokens / 2 .. max_tokens, so requests finish at different rounds), then aborted."""
    lengths = itertools.cycle([max_tokens // 2 + (i * 37) % (max_tokens // 2 + 1) for i in range(64)])
    live: set[str] = set()

    def submit() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=next(lengths), ignore_eos=True)
        live.add(engine.add_request(prompt, params))

    for _ in range(concurrency):
        submit()
    for _ in range(rounds):
        for out in engine.step():
            if out.finished:
                live.discard(out.req_id)
                submit()
    for req_id in live:
        engine.abort(req_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6, help="interleaved repeats of every policy")
    parser.add_argument("--requests-per-repeat", type=int, default=3, help="requests decoded per repeat")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop when > 1)")
    parser.add_argument("--rounds", type=int, default=300, help="rounds per repeat with --concurrency > 1")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    drafter_dir = demo_drafter()
    if drafter_dir is None:
        raise SystemExit("needs the trained demo drafter (models/demo/draft_dspark)")
    target, drafter = load_pair(DEMO_TARGET, drafter_dir, "cpu", torch.float32)
    slots = max(4, args.concurrency)
    verify = VerifyEngine(target, slots, 512, max_drafts=drafter.block_size)
    draft = DraftEngine(drafter, slots, 512, calibration=load_calibration(drafter_dir))
    sps = synthetic_sps()
    prompt = [list(range(10, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(spec: str, draft_cost: str) -> tuple[float, int, int]:
        """(schedule seconds per round, rounds, full predictions of the draft gate) of one repeat."""
        engine = SpeculativeEngine(
            verify, draft, policy.make_policy(spec, sps, drafter.block_size, draft_cost), max_running=slots
        )
        if args.concurrency == 1:
            for _ in range(args.requests_per_repeat):
                engine.generate(prompt, params)
        else:
            closed_loop(engine, args.concurrency, args.rounds, prompt[0], args.max_tokens)
        snapshot = engine.snapshot()
        gate = getattr(engine.policy, "gate", None)
        return snapshot.schedule_time_s / snapshot.rounds, snapshot.rounds, gate.predictions if gate else 0

    run("full", "none")  # warm-up: kernels, allocator, imports
    per_round: dict[str, list[float]] = defaultdict(list)
    for _ in tqdm(range(args.repeats), desc="repeats", unit="repeat"):
        for spec, draft_cost in POLICIES:
            seconds, _, _ = run(spec, draft_cost)
            per_round[f"{spec} (draft cost {draft_cost})"].append(seconds)

    # Where the measured-cost policy's time goes: its calls wrapped with timers, one more set of runs.
    totals: dict[str, list[float]] = {label: [0.0, 0] for _, _, label in PARTS}
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]
    for owner, name, label in PARTS:
        setattr(owner, name, _timed(getattr(owner, name), totals[label]))
    try:
        measured = [run("dspark", "measured") for _ in range(args.repeats)]
        rounds = sum(m[1] for m in measured)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)

    results = {
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, torch {torch.__version__}",
        "command": " ".join(["python -m bench.bench_sched_in_engine", *(sys.argv[1:] if argv is None else argv)]),
        "schedule_us_per_round": {k: [1e6 * s for s in v] for k, v in per_round.items()},
        "parts_us_per_round": {label: 1e6 * t / rounds for label, (t, _) in totals.items()},
        "parts_calls_per_round": {label: n / rounds for label, (_, n) in totals.items()},
        "gate_predictions_per_round": sum(m[2] for m in measured) / rounds,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    load = "1 request" if args.concurrency == 1 else f"{args.concurrency} requests in flight"
    print(f"\n{results['machine']}; {load}, demo pair, greedy, {args.repeats} interleaved repeats")
    print(f"{'policy':<36} {'schedule us / round (median)':>28}  per repeat")
    for name, values in results["schedule_us_per_round"].items():
        print(f"{name:<36} {statistics.median(values):>28.1f}  {' '.join(f'{v:.0f}' for v in values)}")
    print(f"\n{'dspark (draft cost measured): part':<40} {'us / round':>10} {'calls / round':>14}")
    for label, value in results["parts_us_per_round"].items():
        print(f"{label:<40} {value:>10.1f} {results['parts_calls_per_round'][label]:>14.2f}")
    print(f"draft gate: full predictions per round {results['gate_predictions_per_round']:.3f} (the others reuse one)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
