"""Service levels under overload: two client populations, with and without tiers, through `dspark serve`.

The goal (issue 29): at 1.5x the saturating request rate, the high tier meets its TPOT target for >= 95% of its
requests when it is sent as a tier (``priority`` and ``tpot_slo_ms``), where the same traffic without tiers meets
it for < 50%, and the aggregate goodput is not lower than without tiers.

Steps, all over HTTP against one `dspark serve --no-ray` started here:

1. calibrate (unless given): the saturating rate, the requests per second the server completes with every
   slot busy (closed loop, as many users as slots), and the median TPOT there; the target is ``--tpot-factor``
   times that TPOT (below 1: a target that most requests of a full server miss, as the goal's "< 50% without
   tiers" asks); the TPOT of one user alone is measured too (a target below it is unattainable);
2. ``no tiers``: open loop at ``--overload`` x the saturating rate, split into a high population
   (``--high-share`` of the arrivals; its target measured, not sent) and a low one, neither sending any field;
3. ``tiers``: the same arrivals, the high population sending ``priority=-1`` and ``tpot_slo_ms``, the low one
   ``priority=1``;
4. with ``--also-join-hold-ms X``: the server restarted with that join hold, ``tiers`` again (the same
   calibration, rate and populations), an A/B of the hold on one machine.

It reports, for both runs, the high population's SLO attainment (a refused request is a miss), its TPOT and
TTFT, the low population's completions, and the aggregate goodput (requests/s that met their population's
objective: the high one's target; every completed low request), and the goal against the result. Writes
``service_levels.json`` and ``.md``. On the lent GPU, ``bench/gpu_service_levels.sh`` runs it in one device call.

    python3 bench/bench_service_levels.py --out-dir /tmp/slo --output-len 24 --duration 20   # demo pair, CPU
    python3 bench/bench_service_levels.py --inflate qwen3-4b --max-requests 32 --duration 15 --out-dir $OUT  # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve_matrix import DEMO, MODEL_NAME, inflate, start_server, stop, wait_port_free, wait_until_serving  # noqa: E402

from cluster.bench_serve.client import RequestOptions  # noqa: E402
from cluster.bench_serve.load import LoadLevel, Window  # noqa: E402
from cluster.bench_serve.populations import Population  # noqa: E402
from cluster.bench_serve.runner import BenchConfig, run  # noqa: E402
from cluster.bench_serve.workload import prompt_set_requests  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=DEMO / "target")
    p.add_argument("--draft", type=Path, default=DEMO / "draft_dspark")
    p.add_argument("--inflate", default=None, help="inflate the pair to this Qwen3 shape first (e.g. qwen3-4b)")
    p.add_argument("--scratch", type=Path, default=Path("/tmp/dspark-slo"), help="inflated models, server log")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-requests", type=int, default=8, help="server slots")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--slo-admission", choices=("refuse", "queue"), default="queue")
    p.add_argument("--slo-attainment", default="0.95", help="the server's pacing goal, a share or off")
    p.add_argument("--join-hold-ms", type=float, default=0.0,
                   help="the server's join hold: how long a prompt may wait to join with others while a target runs")
    p.add_argument("--also-join-hold-ms", type=float, default=None,
                   help="then restart the server with this join hold and run the tiers again (same calibration)")
    p.add_argument("--prompts-dir", type=Path, default=ROOT.parent / "shared" / "data" / "prompts")
    p.add_argument("--prompt-sets", nargs="+", default=["humaneval", "mbpp"])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds of arrivals per run")
    p.add_argument("--calibration-s", type=float, default=10.0, help="measured seconds of the saturation level")
    p.add_argument("--overload", type=float, default=1.5, help="offered rate / saturating rate")
    p.add_argument("--high-share", type=float, default=0.25, help="share of the arrivals in the high tier")
    p.add_argument("--tpot-factor", type=float, default=0.8, help="target = this x the saturated median TPOT")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="the target (skips its calibration)")
    p.add_argument("--saturating-rate", type=float, default=None, help="requests/s (skips its calibration)")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--out-dir", type=Path, required=True)
    return p.parse_args(argv)


def _config(url: str, requests: list[Any], levels: list[LoadLevel], window: Window, label: str,
            populations: tuple[Population, ...] = ()) -> BenchConfig:
    return BenchConfig(base_url=url, options=RequestOptions(model=MODEL_NAME, ignore_eos=True), requests=requests,
                       levels=levels, window=window, workload={"source": "prompts"}, label=label, progress=False,
                       populations=populations)


def calibrate(args: argparse.Namespace, url: str, requests: list[Any]) -> dict[str, float]:
    """The target (ms per token) and the saturating rate (requests/s), measured unless given."""
    alone = run(_config(url, requests, [LoadLevel("closed", 1)], Window(num_requests=4), "alone"))
    out = {"alone_tpot_ms": alone["levels"][0]["tpot_s"]["p50"] * 1e3}
    if args.saturating_rate is None or args.tpot_slo_ms is None:
        full = run(_config(url, requests, [LoadLevel("closed", args.max_requests)],
                           Window(duration_s=args.calibration_s), "saturated"))
        level = full["levels"][0]
        out["saturated_rate"] = level["request_throughput"]
        out["saturated_tpot_ms"] = level["tpot_s"]["p50"] * 1e3
    out["saturating_rate"] = args.saturating_rate or out["saturated_rate"]
    out["tpot_slo_ms"] = args.tpot_slo_ms or args.tpot_factor * out["saturated_tpot_ms"]
    return out


def populations(rate: float, share: float, target_ms: float, tiers: bool) -> tuple[Population, ...]:
    high_fields: dict[str, Any] = {"priority": -1, "tpot_slo_ms": target_ms} if tiers else {}
    return (Population("high", rate * share, high_fields, None if tiers else target_ms),
            Population("low", rate * (1 - share), {"priority": 1} if tiers else {}))


def row(name: str, level: dict[str, Any]) -> dict[str, Any]:
    high, low = level["populations"]
    return {
        "run": name,
        "high_attainment": high["slo_attainment"],
        "high_completed": high["completed"],
        "high_errors": high["errors"],
        "high_tpot_p50_ms": _ms(high["tpot_s"]["p50"]),
        "high_tpot_p99_ms": _ms(high["tpot_s"]["p99"]),
        "high_ttft_p50_s": high["ttft_s"]["p50"],
        "low_completed": low["completed"],
        "low_tpot_p50_ms": _ms(low["tpot_s"]["p50"]),
        "goodput_req_s": level["goodput_aggregate"]["requests_per_s"],
        "output_tok_s": level["output_throughput"],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | high SLO attainment | high done (errors) | high TPOT p50 / p99 ms | high TTFT p50 s "
            "| low done | low TPOT p50 ms | aggregate goodput req/s | output tok/s |")
    lines = [head, "| --- " * 9 + "|"]

    def f(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in rows:
        errors = ", ".join(f"{k}: {v}" for k, v in r["high_errors"].items()) or "0"
        attained = "-" if r["high_attainment"] is None else f"{100 * r['high_attainment']:.0f} %"
        lines.append(f"| {r['run']} | {attained} | {r['high_completed']} ({errors}) "
                     f"| {f(r['high_tpot_p50_ms'])} / {f(r['high_tpot_p99_ms'])} | {f(r['high_ttft_p50_s'], 2)} "
                     f"| {r['low_completed']} | {f(r['low_tpot_p50_ms'])} | {f(r['goodput_req_s'], 2)} "
                     f"| {f(r['output_tok_s'], 0)} |")
    return "\n".join(lines)


def goal(rows: list[dict[str, Any]]) -> str:
    """Issue 29's goal against the two runs: the high tier's attainment with tiers >= 95%, without < 50%, and
    aggregate goodput with tiers not lower than without."""
    by = {r["run"]: r for r in rows}
    flat, tiered = by["no tiers"], by["tiers"]

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    high, base = tiered["high_attainment"] or 0.0, flat["high_attainment"] or 0.0
    good = (tiered["goodput_req_s"] or 0.0) >= (flat["goodput_req_s"] or 0.0)
    return (f"goal: high tier {pct(tiered['high_attainment'])} with tiers (>= 95%: {met(high >= 0.95)}), "
            f"{pct(flat['high_attainment'])} without (< 50%: {met(base < 0.5)}); aggregate goodput "
            f"{tiered['goodput_req_s'] or 0:.2f} vs {flat['goodput_req_s'] or 0:.2f} req/s (not lower: {met(good)})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    target, draft = (args.target, args.draft) if args.inflate is None else inflate(args, device, dtype)
    requests = prompt_set_requests([args.prompts_dir / f"{n}.jsonl" for n in args.prompt_sets], args.output_len)
    def serve(join_hold_ms: float) -> list[str]:
        return [sys.executable, "-m", "cluster.cli", "serve", "--no-ray", "--target", str(target), "--draft",
                str(draft), "--device", device, "--dtype", dtype, "--max-requests", str(args.max_requests),
                "--max-seq-len", str(args.max_seq_len), "--slo-admission", args.slo_admission, "--slo-attainment",
                args.slo_attainment, "--join-hold-ms", str(join_hold_ms), "--served-model-name", MODEL_NAME,
                "--port", str(args.port), "--log-level", "warning"]

    servers: list[tuple[float, tuple[tuple[str, bool], ...]]] = [
        (args.join_hold_ms, (("no tiers", False), ("tiers", True)))]
    if args.also_join_hold_ms is not None:
        servers.append((args.also_join_hold_ms, ((f"tiers, join hold {args.also_join_hold_ms:g} ms", True),)))
    url = f"http://127.0.0.1:{args.port}"
    window = Window(duration_s=args.duration, warmup_requests=2)
    runs: dict[str, dict[str, Any]] = {}
    calibration: dict[str, float] = {}
    rate = 0.0
    for join_hold_ms, named in servers:
        cmd = serve(join_hold_ms)
        print("$ " + " ".join(cmd), flush=True)
        proc, started = start_server(cmd, args.scratch / "server.log", None)
        try:
            wait_until_serving(url, proc, started, args.startup_timeout_s)
            if not calibration:
                calibration = calibrate(args, url, requests)
                rate = args.overload * calibration["saturating_rate"]
                print(f"calibration {calibration}; offered {rate:.2f} requests/s", flush=True)
            for name, tiers in named:
                pops = populations(rate, args.high_share, calibration["tpot_slo_ms"], tiers)
                runs[name] = run(_config(url, requests, [LoadLevel("open", rate)], window, name, pops))
                print(table([row(name, runs[name]["levels"][0])]), flush=True)
        finally:
            stop(proc)
        wait_port_free(args.port)
    rows = [row(name, result["levels"][0]) for name, result in runs.items()]
    meta = {"command": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
            "dtype": dtype, "inflate": args.inflate, "slots": args.max_requests, "slo_admission": args.slo_admission,
            "slo_attainment": args.slo_attainment, "join_hold_ms": args.join_hold_ms,
            "also_join_hold_ms": args.also_join_hold_ms,
            "overload": args.overload, "high_share": args.high_share, "offered_rate": rate, **calibration}
    (args.out_dir / "service_levels.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    text = f"# Service levels, {meta['date']}\n\n{json.dumps(meta)}\n\n{goal(rows)}\n\n{table(rows)}\n"
    (args.out_dir / "service_levels.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
