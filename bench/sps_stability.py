"""How stable is SPS profiling: profile the same verifier N times in one process and report the spread.

Each profile is exactly what a verifier replica runs at start when the SPS cache is empty
(``cluster.loading._profile_sps``: the eager token table on CPU, tables by request count with graphs) on the engine
``dspark serve`` builds for the same flags. Reported per batch size B: the median steps/s over the profiles and the
spread ``(max - min) / median``, raw and of the table's shape (each profile divided by its own geometric mean over
B: Algorithm 1's choices with ``draft_cost: none`` depend only on the ratios between Bs, so a table measured on a
uniformly slower machine schedules the same); and the time each profile took and the 1-minute load average after
it. The goal (issue 31): every B within 10 %. ``--threads`` is the torch intra-op threads of the profiling
process: 1 is what a Ray verifier replica of one CPU gets (Ray sets ``OMP_NUM_THREADS`` to a replica's whole
CPUs), and with 1 a CPU profile times steps by the thread's CPU time (:func:`scheduler.profiling.host_step_timer`).

    python bench/sps_stability.py --profiles 8 --out docs/benchmarks/sps_stability_cpu.json
    python bench/sps_stability.py --device cuda --dtype bfloat16 --target T --draft D --profiles 5 --out X.json

``--target`` / ``--draft`` profile another pair (e.g. the demo pair inflated to a real shape by ``dspark inflate``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import cpu_name  # noqa: E402

from cluster.config import AppConfig  # noqa: E402
from cluster.loading import _profile_sps, build_verify_engine, drafter_block_size  # noqa: E402
from scheduler.profiling import PROFILER_VERSION, host_step_timer  # noqa: E402
from scheduler.sps import SPSMonotonicityWarning, SPSTable, cuda_event_timer  # noqa: E402


def _spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def machine_speed(device: torch.device, seconds: float = 1.0) -> float:
    """How fast the machine runs a fixed memory-bound workload now, in calls/s: 20 products of a fixed matrix with
    8 columns, like a verify step's weight reads (on a CPU an fp32 2048 x 4096 one, 32 MiB, the demo target's
    size; on a GPU a bf16 8192 x 8192 one), timed by the profiler's own clock (CUDA events on a GPU,
    :func:`scheduler.profiling.host_step_timer` on a CPU); the lower quartile of the calls made in ``seconds``.
    How much it moves between profiles is how much the machine's own speed moved: what no statistic within one
    profile can remove."""
    if device.type == "cuda":
        weight = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        columns = torch.randn(8192, 8, device=device, dtype=torch.bfloat16)
        timer = cuda_event_timer(device)
    else:
        weight, columns = torch.randn(2048, 4096), torch.randn(4096, 8)
        timer = host_step_timer(device)

    def call() -> None:
        for _ in range(20):
            weight @ columns

    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 8:
        samples.append(timer(call))
    return 1.0 / float(np.quantile(samples, 0.25))


def _tables(sps: Any) -> dict[str, SPSTable]:
    """A token table as ``{"tokens": table}``; tables by request count as ``{"R=<r>": table}``."""
    if isinstance(sps, SPSTable):
        return {"tokens": sps}
    return {f"R={r}": table for r, table in sorted(sps.tables.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=5, help="profiles to take (default: 5)")
    parser.add_argument("--max-requests", type=int, default=64, help="engine slots, as dspark serve (default: 64)")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="engine context (default: 1024)")
    parser.add_argument("--device", default="cpu", help="device (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the models' dtype (default: float32)")
    parser.add_argument("--target", default=None, help="target model folder (default: the demo target)")
    parser.add_argument("--draft", default=None, help="drafter folder (default: the demo drafter)")
    parser.add_argument("--graphs", default="auto", help="engine step mode, as dspark serve (default: auto)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, as a Ray verifier replica of one CPU has (default: 1)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (default: none)")
    args = parser.parse_args(argv)
    models: dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    models.update({key: value for key, value in (("target", args.target), ("draft", args.draft)) if value})
    config = AppConfig.from_args({
        "models": models,
        "engine": {"max_requests": args.max_requests, "max_seq_len": args.max_seq_len, "graphs": args.graphs},
    })
    torch.set_num_threads(args.threads)
    verify = build_verify_engine(config)
    block_size = drafter_block_size(config)
    profiles: list[dict[str, SPSTable]] = []
    seconds: list[float] = []
    loads: list[float] = []
    warned: list[int] = []
    speeds: list[float] = []  # the machine's speed around each profile: the mean of before and after
    device = verify.target.device
    for i in range(args.profiles):
        before = machine_speed(device)
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SPSMonotonicityWarning)
            profiles.append(_tables(_profile_sps(config, verify, block_size)))
        seconds.append(time.perf_counter() - started)
        speeds.append((before + machine_speed(device)) / 2)
        loads.append(os.getloadavg()[0])
        warned.append(sum(issubclass(w.category, SPSMonotonicityWarning) for w in caught))
        print(f"profile {i + 1}/{args.profiles}: {seconds[-1]:.1f} s, {warned[-1]} monotonicity warnings, "
              f"machine speed {speeds[-1]:.1f}/s, load average {loads[-1]:.2f}", flush=True)
    rows = []
    for name in profiles[0]:
        first = profiles[0][name]
        means = [float(np.exp(np.log(p[name].steps_per_s).mean())) for p in profiles]
        for k, b in enumerate(first.batch_sizes.tolist()):
            rates = [float(p[name].steps_per_s[k]) for p in profiles]
            shape = [rate / mean for rate, mean in zip(rates, means, strict=True)]
            rows.append({"table": name, "B": b, "median_sps": statistics.median(rates), "spread": _spread(rates),
                         "shape_spread": _spread(shape), "sps": rates})
    spreads = [r["spread"] for r in rows]
    shapes = [r["shape_spread"] for r in rows]
    print("\n| table | B | median steps/s | spread | shape spread |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['table']} | {r['B']} | {r['median_sps']:.1f} | {100 * r['spread']:.1f} % "
              f"| {100 * r['shape_spread']:.1f} % |")
    print(f"\nspread over B: max {100 * max(spreads):.1f} %, median {100 * statistics.median(spreads):.1f} %; "
          f"shape: max {100 * max(shapes):.1f} %, median {100 * statistics.median(shapes):.1f} %; "
          f"the machine's speed {100 * _spread(speeds):.1f} %; "
          f"profile time {min(seconds):.1f}-{max(seconds):.1f} s; load average {min(loads):.2f}-{max(loads):.2f}")
    if args.out is not None:
        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                        "python": platform.python_version(),
                        "torch": torch.__version__},
            "load_average": os.getloadavg(),
            "load_average_per_profile": loads,
            "profiler_version": PROFILER_VERSION,
            "config": {"max_requests": args.max_requests, "max_seq_len": args.max_seq_len, "device": args.device,
                       "dtype": args.dtype, "target": config.models.target, "graphs": args.graphs,
                       "block_size": block_size},
            "profile_seconds": seconds,
            "monotonicity_warnings": warned,
            "max_spread": max(spreads),
            "median_spread": statistics.median(spreads),
            "max_shape_spread": max(shapes),
            "median_shape_spread": statistics.median(shapes),
            "machine_speed": speeds,
            "machine_speed_spread": _spread(speeds),
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
