"""``dspark simulate run`` and ``dspark simulate plan``: the cluster simulator and the pool planner.

Both read a cost file (``--costs``, :mod:`cluster.simulator.costs`) and, for drafting policies, decoding traces
(``--traces``, what ``dspark eval --save-traces`` writes) with the drafter's STS calibration (``--sts``).
Bad input files or flags end with exit code 2 and one line saying what is wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cluster.config import GPU_DECODE_STEPS
from cluster.simulator.autoscaler import PoolScaling, ScalingConfigError
from cluster.simulator.costs import PLACEMENTS, CostFileError, Costs, load_costs
from cluster.simulator.planner import candidates, plan, recommended_autoscaling
from cluster.simulator.report import Slo, Summary, summarize
from cluster.simulator.simulation import MAX_DECODE_STEPS, PLANNED_ROUNDS, ClusterSpec, SimulationError, simulate
from cluster.simulator.traces import AcceptanceTrace, TraceFileError, load_traces
from cluster.simulator.workload import LengthSpec, Workload, WorkloadError, generated, replayed
from scheduler.policy import DRAFT_COSTS
from scheduler.sts import STSCalibration

_INPUT_ERRORS = (CostFileError, TraceFileError, WorkloadError, ScalingConfigError, SimulationError)


def _inputs(args: argparse.Namespace) -> tuple[Costs, AcceptanceTrace | None]:
    costs = load_costs(args.costs)
    trace = None
    if args.traces is not None:
        calibration = None
        if args.sts is not None:
            try:
                calibration = STSCalibration.load(args.sts)
            except (OSError, ValueError, KeyError) as error:
                raise TraceFileError(f"{args.sts}: not an STS calibration ({error})") from None
        trace = load_traces(args.traces, calibration)
    return costs, trace


def _scaling(path: Path | None) -> tuple[PoolScaling | None, PoolScaling | None]:
    if path is None:
        return None, None
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ScalingConfigError(f"{path}: cannot read ({error.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ScalingConfigError(f"{path}: not valid YAML/JSON ({error})") from None
    if not isinstance(data, dict) or not set(data) <= {"verifier", "drafter"} or not data:
        raise ScalingConfigError(f"{path}: expected a mapping with 'verifier' and/or 'drafter' autoscaling_config")
    pools = [PoolScaling.from_config(data[k], f"{path}: {k}") if k in data else None for k in ("verifier", "drafter")]
    return pools[0], pools[1]


def _spec(args: argparse.Namespace, **overrides: Any) -> ClusterSpec:
    verifier_scaling, drafter_scaling = _scaling(getattr(args, "autoscaling", None))
    settings: dict[str, Any] = {
        "placement": args.placement,
        "verifiers": args.verifiers,
        "drafters": args.drafters,
        "verifier_slots": args.verifier_slots,
        "drafter_slots": args.drafter_slots,
        "groups": args.groups,
        "max_seq_len": args.max_seq_len,
        "policy": args.policy,
        "draft_cost": args.draft_cost,
        "verifier_scaling": verifier_scaling,
        "drafter_scaling": drafter_scaling,
        "control_interval_s": args.control_interval_s,
        "planned_rounds": args.planned_rounds,
        "decode_steps": args.decode_steps,
    }
    settings.update(overrides)
    return ClusterSpec(**settings)


def _workload(args: argparse.Namespace, rate: float) -> Workload:
    if getattr(args, "requests_log", None) is not None:
        return replayed(args.requests_log)
    rng = np.random.default_rng(args.seed)
    return generated(
        rate, args.duration_s, LengthSpec.parse(args.input_len), LengthSpec.parse(args.output_len), rng, cv=args.cv
    )


def _slo(args: argparse.Namespace) -> Slo | None:
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    return Slo(
        (args.slo_ttft_ms if args.slo_ttft_ms is not None else math.inf) / 1e3,
        (args.slo_tpot_ms if args.slo_tpot_ms is not None else math.inf) / 1e3,
    )


def _format(summary: Summary) -> str:
    ms = 1e3
    lines = [
        f"requests {summary.requests} (finished {summary.finished}, rejected {summary.rejected}) over "
        f"{summary.duration_s:.1f} s simulated, {summary.rounds} rounds ({summary.drafted_rounds} drafted)",
        f"output tokens/s {summary.output_tokens_per_s:.0f}; mean GPUs {summary.mean_gpus:.2f}; busy: verifier pool "
        f"{summary.verifier_busy:.0%}, drafter pool "
        + ("-" if not math.isfinite(summary.drafter_busy) else f"{summary.drafter_busy:.0%}"),
        f"TTFT ms p50 {summary.ttft_p50_s * ms:.1f} p90 {summary.ttft_p90_s * ms:.1f} "
        f"p99 {summary.ttft_p99_s * ms:.1f}",
        f"TPOT ms p50 {summary.tpot_p50_s * ms:.2f} p90 {summary.tpot_p90_s * ms:.2f} "
        f"p99 {summary.tpot_p99_s * ms:.2f}",
    ]
    if math.isfinite(summary.slo_met):
        lines.append(
            f"SLO met by {summary.slo_met:.1%}; goodput {summary.goodput_rps:.2f} req/s, "
            f"{summary.goodput_per_gpu:.3f} req/s per GPU"
        )
    return "\n".join(lines)


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        costs, trace = _inputs(args)
        spec = _spec(args)
        workload = _workload(args, args.rate)
        result = simulate(workload, costs, trace, spec, seed=args.seed, progress=not args.no_progress)
        summary = summarize(result, _slo(args))
    except _INPUT_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not costs.calibrated:
        print(f"note: {args.costs} is uncalibrated (not yet fitted to served measurements)", file=sys.stderr)
    print(_format(summary))
    if args.json is not None:
        record = {"spec": _spec_dict(spec), "summary": summary.to_dict(), "timeline": result.timeline}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def _spec_dict(spec: ClusterSpec) -> dict[str, Any]:
    out = dict(spec.__dict__)
    for key in ("verifier_scaling", "drafter_scaling"):
        if out[key] is not None:
            out[key] = dict(out[key].__dict__)
    return out


def _ratio(text: str) -> tuple[int, int]:
    drafters, sep, verifiers = text.partition(":")
    try:
        pair = (int(drafters), int(verifiers))
    except ValueError:
        pair = (0, 0)
    if not sep or min(pair) < 1:
        raise argparse.ArgumentTypeError(f"ratio must be DRAFTERS:VERIFIERS with both >= 1, got {text!r}")
    return pair


def _cmd_plan(args: argparse.Namespace) -> int:
    slo = _slo(args)
    if slo is None:
        print("error: plan needs an SLO (--slo-ttft-ms and/or --slo-tpot-ms)", file=sys.stderr)
        return 2
    if not 0 < args.attainment <= 1:
        print(f"error: --attainment must be in (0, 1], got {args.attainment}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "attainment": args.attainment,
        "plans": [],
    }
    try:
        costs, trace = _inputs(args)
        base = _spec(args, verifier_scaling=None, drafter_scaling=None)
        for gpus in args.gpus:
            rows = plan(
                candidates(base, gpus, args.ratios, args.groups_list),
                lambda rate: _workload(args, rate),
                costs,
                trace,
                slo,
                attainment=args.attainment,
                start_rate_per_gpu=args.start_rate_per_gpu,
                max_sim_gpus=args.max_sim_gpus,
                seed=args.seed,
                progress=not args.no_progress,
            )
            print(
                f"\n{gpus} GPUs, policy {args.policy}: goodput = highest rate with >= {args.attainment:.0%} "
                "of requests within the SLO"
            )
            print(
                "| deployment | goodput/GPU (req/s) | TTFT p90 ms | TPOT p90 ms | verifier busy | drafter busy | "
                "simulated as |"
            )
            print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
            for row in rows:
                s = row.summary
                drafter_busy = "-" if not math.isfinite(s.drafter_busy) else f"{s.drafter_busy:.0%}"
                simulated = f"slice {row.simulated.drafters}D:{row.simulated.verifiers}V" if row.sliced else "whole"
                if row.sliced and row.simulated.placement == "colocated":
                    simulated = f"slice x{row.simulated.verifiers}"
                print(
                    f"| {row.label} | {row.goodput_per_gpu:.2f} | {s.ttft_p90_s * 1e3:.1f} | "
                    f"{s.tpot_p90_s * 1e3:.2f} | {s.verifier_busy:.0%} | {drafter_busy} | {simulated} |"
                )
            best = rows[0]
            scaling = recommended_autoscaling(best)
            print(f"best: {best.label}; recommended autoscaling_config:")
            print(yaml.safe_dump(scaling, sort_keys=False).rstrip())
            report["plans"].append(
                {
                    "gpus": gpus,
                    "rows": [
                        {
                            "deployment": r.label,
                            "goodput_per_gpu": r.goodput_per_gpu,
                            "simulated": _spec_dict(r.simulated),
                            "summary": r.summary.to_dict(),
                        }
                        for r in rows
                    ],
                    "best": best.label,
                    "autoscaling_config": scaling,
                }
            )
    except _INPUT_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not costs.calibrated:
        print(f"\nnote: {args.costs} is uncalibrated (not yet fitted to served measurements)", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _decode_steps(text: str) -> int | str:
    """``--decode-steps``: ``auto`` or a count of 1 to :data:`MAX_DECODE_STEPS`."""
    if text == "auto":
        return text
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if not 1 <= steps <= MAX_DECODE_STEPS:
        raise argparse.ArgumentTypeError(f"expected auto or 1-{MAX_DECODE_STEPS}, got {text!r}")
    return steps


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", type=Path, required=True, help="cost file of the GPU type (dspark-sim-costs/1 JSON)")
    p.add_argument("--traces", type=Path, default=None, help="decoding traces (.npz of `dspark eval --save-traces`)")
    p.add_argument("--sts", type=Path, default=None, help="the drafter's sts.json (confidences as it serves them)")
    p.add_argument("--policy", default="dspark", help="autoregressive, fixed-N, full, dspark or dspark-async")
    p.add_argument("--draft-cost", choices=DRAFT_COSTS, default="none", help="the policies' draft-cost setting")
    p.add_argument("--placement", choices=PLACEMENTS, default="disaggregated",
                   help="drafter and verifier on one GPU (colocated) or in separate pools")
    p.add_argument("--planned-rounds", choices=PLANNED_ROUNDS, default="off",
                   help="rounds whose lengths the policy plans before the drafts, as the served engine runs them "
                        "(chained in process, relayed by a verifier; auto: the served defaults per placement, "
                        "1.3-1.5x slower; off: Algorithm 1 every round)")
    p.add_argument("--decode-steps", type=_decode_steps, default="auto",
                   help="autoregressive: tokens per plain round, one verifier Step (scheduler.decode_steps; auto: "
                        f"{GPU_DECODE_STEPS} disaggregated, 1 colocated, as served on GPUs)")
    p.add_argument("--verifier-slots", type=int, default=128, help="requests a verifier replica holds")
    p.add_argument("--drafter-slots", type=int, default=128, help="requests a drafter replica holds")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context positions per request")
    p.add_argument("--control-interval-s", type=float, default=1.0, help="autoscaler decision interval")
    p.add_argument("--rate", type=float, default=10.0, help="requests/s (Poisson, or gamma with --cv)")
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of the gaps (> 1: bursty)")
    p.add_argument("--duration-s", type=float, default=60.0, help="arrival window in simulated seconds (per run)")
    p.add_argument("--input-len", default="uniform:11:399", help="N, uniform:A:B or lognormal:MEDIAN:SIGMA:MAX")
    p.add_argument("--output-len", default="uniform:96:160", help="N, uniform:A:B or lognormal:MEDIAN:SIGMA:MAX")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="time-to-first-token bound of the SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="time-per-output-token bound of the SLO")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and traces")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``simulate`` (``run`` and ``plan``) to the ``dspark`` parser."""
    p = sub.add_parser("simulate", help="trace-driven cluster simulator and pool planner")
    modes = p.add_subparsers(dest="mode", metavar="MODE", required=True)
    run = modes.add_parser("run", help="simulate one deployment serving a workload")
    _common(run)
    run.add_argument("--verifiers", type=int, default=1, help="verifier replicas (initial, when autoscaled)")
    run.add_argument("--drafters", type=int, default=1, help="drafter replicas of a disaggregated deployment")
    run.add_argument("--groups", type=int, default=1, help="request groups pipelined per verifier")
    run.add_argument(
        "--requests-log",
        type=Path,
        default=None,
        help="replay 'arrival_s input_tokens output_tokens' lines instead of generating requests",
    )
    run.add_argument(
        "--autoscaling",
        type=Path,
        default=None,
        help="YAML/JSON {verifier: autoscaling_config, drafter: ...} (default: fixed pools)",
    )
    run.set_defaults(handler=_cmd_run)
    planner = modes.add_parser("plan", help="best drafter:verifier ratio and placement per GPU count")
    _common(planner)
    planner.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512], help="GPU counts to plan for")
    planner.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    planner.add_argument(
        "--start-rate-per-gpu",
        type=float,
        default=10.0,
        help="first rate the goodput search tries (requests/s per GPU)",
    )
    planner.add_argument(
        "--max-sim-gpus", type=int, default=64, help="larger deployments are simulated as a slice with the same ratio"
    )
    planner.add_argument(
        "--ratios",
        type=_ratio,
        nargs="+",
        default=[(1, 1), (1, 2), (1, 3), (1, 7)],
        help="drafter:verifier ratios of the disaggregated candidates",
    )
    planner.add_argument(
        "--groups",
        dest="groups_list",
        type=int,
        nargs="+",
        default=[1, 2],
        help="request groups per verifier to try (disaggregated)",
    )
    planner.set_defaults(handler=_cmd_plan, verifiers=1, drafters=1, groups=1)
