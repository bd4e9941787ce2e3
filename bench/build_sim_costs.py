"""Build the simulator's H200 cost file from measurements already in docs/benchmarks (uncalibrated).

Every number is read from a measurement file or quoted from a results page of docs/benchmarks, and the file
records where each came from (each section's ``source``). The calibration against the served product (HTTP runs of
``dspark serve``) replaces these with fitted values and sets ``calibrated``.

    PYTHONPATH=. python bench/build_sim_costs.py --out docs/simulator/costs_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from cluster.simulator.costs import FORMAT, parse_costs

POLICIES = "docs/benchmarks/policies.json"
# docs/benchmarks/data_plane.md, "Per-message cost", measured on the lent H200 host (2026-12-03): one message on an
# open grpc.aio bidirectional stream, loopback, 1 KiB payload, p50.
STREAM_MESSAGE_S = 210e-6
# Measured through HTTP on one H200 at 1 request (2026-12-03): the Ray deployment's round
# 8.1 ms against 3.4 ms for the same pipeline in one process.
SERVED_ROUND_S, IN_PROCESS_ROUND_S = 8.1e-3, 3.4e-3
HOPS_PER_ROUND = 4  # to the drafters and back, to the verifier and back


def _mean_by_concurrency(cells: list[dict[str, Any]], policy: str, key: str) -> tuple[list[int], list[float]]:
    values: dict[int, list[float]] = {}
    for cell in cells:
        if cell["policy"] == policy:
            values.setdefault(int(cell["concurrency"]), []).append(float(cell[key]) / 1e3)
    counts = sorted(values)
    return counts, [statistics.fmean(values[c]) for c in counts]


def build(root: Path) -> dict[str, Any]:
    """The cost file object (validated by the simulator's own loader before it is returned)."""
    policies = json.loads((root / POLICIES).read_text())
    cells = policies["cells"]
    draft_r, draft_s = _mean_by_concurrency(cells, "full", "draft_ms")
    host_r, drafted_s = _mean_by_concurrency(cells, "dspark", "host_ms")
    plain_r, plain_s = _mean_by_concurrency(cells, "autoregressive", "host_ms")
    if plain_r != host_r:
        raise ValueError(f"{POLICIES}: autoregressive and dspark cells cover other concurrencies")
    overhead = SERVED_ROUND_S - IN_PROCESS_ROUND_S - HOPS_PER_ROUND * STREAM_MESSAGE_S
    data = {
        "format": FORMAT,
        "gpu": "NVIDIA H200",
        "model": f"demo pair inflated to the {policies['shape']} shape, {policies['dtype']}, greedy",
        "calibrated": False,
        "block_size": int(policies["block_size"]),
        "verify": {
            "sps": policies["sps_by_requests"],
            "scale": 1.0,
            "source": f"{POLICIES}: sps_by_requests (graph step profiled per request count, "
            f"context {policies['profile_context']}); scale 1 until calibrated",
        },
        "prefill": {
            "sps": policies["sps"],
            "source": f"{POLICIES}: sps (token table, graph step, few requests)",
        },
        "draft": {
            "requests": draft_r,
            "seconds": draft_s,
            "source": f"{POLICIES}: cells of policy full, draft_ms (in-process engine), mean of the repeats",
        },
        "host": {
            "requests": host_r,
            "drafted_s": drafted_s,
            "plain_s": plain_s,
            "source": f"{POLICIES}: host_ms (schedule + other host time) of the dspark cells (drafted) and the "
            "autoregressive cells (plain), mean of the repeats",
        },
        "hops": {
            "colocated_s": STREAM_MESSAGE_S,
            "disaggregated_s": STREAM_MESSAGE_S,
            "round_overhead_s": overhead,
            "source": "docs/benchmarks/data_plane.md, measured on the H200 host: a message on an open grpc.aio "
            "stream, 1 KiB, p50 210 us (both placements: the per-round messages are a few KiB, features move "
            "device to device); "
            "round_overhead_s = served round at 1 request (8.1 ms, HTTP, one H200) - in-process round (3.4 ms) "
            "- 4 hops",
        },
        "replica_start_s": {
            "verifier": float(policies["graphs"]["build_s"]),
            "drafter": float(policies["graphs"]["build_s"]),
            "source": f"{POLICIES}: graphs.build_s (CUDA graph capture of the engine pair); weight loading and "
            "Ray actor start are not measured yet",
        },
    }
    parse_costs(data, "built cost file")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(build(args.root), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
