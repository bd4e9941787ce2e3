"""Probe: what does launching a CUDA graph cost the host, by node count, and does PDL change it? (issue 11)

A round of the inflated qwen3-4b pair at 1 request launches two graphs (draft ~90 kernels, verify ~340), and the
round's device idle time (bench/profile_round_gpu.py) is far above what the host does in Python. This times, for
straight chains of N tiny kernels captured as one graph (N = 1 ... 1000; each kernel adds 1 to a 4 KiB buffer,
so the device time is launch-bound), with and without programmatic dependent launch on the Triton kernel:

* ``launch_us``: host time of ``CUDAGraph.replay()`` (the call returns once the launch is submitted);
* ``wall_us``: replay + stream synchronize, from the host;
* ``device_us``: CUDA events around the replay;
* ``gap_us`` = wall - device: time the device did not spend in the graph (launch latency + sync wake-up).

Each variant is checked (the buffer counts the kernels that ran). With ``--engines`` it then builds the
inflated qwen3-4b pair's engines with captured graphs (debug mode on, so each graph's nodes can be listed) and
replays every captured graph alone, the device idle before each replay: its launch's host time and its node
types (kernel, memcpy, memset, event, ...) and edge count from ``cudaGraphDebugDotPrint``. Prints tables last.

GPU (well under a minute; ~2 minutes with --engines):
    python3 bench/probe_graph_launch.py --engines --out $OUT/graph_launch.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels.launch import tl_pdl_wait  # noqa: E402

SIZE = 1024


@triton.jit
def _add_one_kernel(x_ptr, SIZE: tl.constexpr, PDL: tl.constexpr):
    tl_pdl_wait(PDL)
    offs = tl.arange(0, SIZE)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def chain(kind: str, x: torch.Tensor, nodes: int) -> None:
    for _ in range(nodes):
        if kind == "torch":
            x.add_(1.0)
        else:
            pdl = kind == "triton-pdl"
            _add_one_kernel[(1,)](x, SIZE=SIZE, PDL=pdl, **({"launch_pdl": True} if pdl else {}))


def replay_once(
    graph: torch.cuda.CUDAGraph,
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None,
    after: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """One replay: (host us of the call, us until the stream is idle again); with ``events`` the replay is
    bracketed by them (its device time is then read from them; the events' own cost is in this replay's
    times, so callers take host times from replays without events). ``after``: work queued after it (a copy)."""
    if events is not None:
        events[0].record()
    t0 = time.perf_counter()
    graph.replay()
    t1 = time.perf_counter()
    if events is not None:
        events[1].record()
    if after is not None:
        after()
    torch.cuda.current_stream().synchronize()
    return (t1 - t0) * 1e6, (time.perf_counter() - t0) * 1e6


def measure(kind: str, nodes: int, repeats: int) -> dict[str, float]:
    x = torch.zeros(SIZE, device="cuda")
    chain(kind, x, 2)  # compile outside the capture
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            chain(kind, x, nodes)
    torch.cuda.synchronize()
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ok = float(x[0]) == nodes
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launch, wall, device = [], [], []
    for i in range(repeats):
        timed = i % 2 == 1  # events only in every other replay: they are not part of the plain ones' wall
        host, until_idle = replay_once(graph, (start, end) if timed else None)
        if timed:
            device.append(start.elapsed_time(end) * 1000)
        else:
            launch.append(host)
            wall.append(until_idle)
    row = {
        "kind": kind,
        "nodes": nodes,
        "launch_us": statistics.median(launch),
        "wall_us": statistics.median(wall),
        "device_us": statistics.median(device),
        "correct": ok,
    }
    row["gap_us"] = row["wall_us"] - row["device_us"]
    return row


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDA graph captured in debug mode (its cudaGraph_t kept, so that it can be dumped); every one made is
    listed in ``made``."""

    made: ClassVar[list[_DebugGraph]] = []

    def __new__(cls, *args: object, **kwargs: object) -> _DebugGraph:
        return super().__new__(cls, keep_graph=True)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(keep_graph=True)
        self.enable_debug_mode()
        _DebugGraph.made.append(self)


def graph_nodes(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """Node counts by type (the first word of each node's label in the DOT dump) and the edge count."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        graph.debug_dump(str(path))
        text = path.read_text()
    counts = collections.Counter(re.findall(r'label="\{?\s*([A-Za-z_]+)', text))
    counts["edges"] = text.count("->")
    return dict(counts)


def engine_graphs(repeats: int) -> list[dict[str, object]]:
    """Every graph the policy sweep's engines capture (qwen3-4b, 8 requests max), replayed alone."""
    from bench.bench_policies_gpu import SharedEngines
    from bench.engine_setup import DEMO_TARGET
    from draft_service.inflate import inflate_pair
    from verify_service.inflate import SHAPES

    pair = inflate_pair(DEMO_TARGET, DEMO_TARGET.parent / "draft_dspark", SHAPES["qwen3-4b"], device="cuda", seed=0)
    target, drafter = pair.target_model(), pair.draft
    original = torch.cuda.CUDAGraph
    torch.cuda.CUDAGraph = _DebugGraph  # type: ignore[misc]
    try:
        engines = SharedEngines(target, drafter, 8, 700, None, graphs="capture")
    finally:
        torch.cuda.CUDAGraph = original  # type: ignore[misc]
    rows = []
    for index, graph in enumerate(_DebugGraph.made):
        launch = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            launch.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        try:
            nodes = graph_nodes(graph)
        except (OSError, RuntimeError) as error:  # a torch whose graphs cannot be dumped: the times stand
            nodes = {"dump failed": 1}
            print(f"graph {index}: dump failed: {error}", file=sys.stderr)
        rows.append({"index": index, "launch_us": statistics.median(launch), "nodes": nodes})
    del engines
    return rows, _DebugGraph.made


def launch_patterns(graphs: list[torch.cuda.CUDAGraph], repeats: int) -> list[dict[str, object]]:
    """Launch host time and device start gap of a verify-sized and a draft-sized graph: each replayed again and
    again, the two alternating (as in a round), and each after the host touched 16 MiB of memory (as a round's
    Python work may evict the launch's host-side data from the CPU caches)."""
    sizes = [(graph_nodes(g).get("KERNEL", 0), i) for i, g in enumerate(graphs)]
    big = graphs[max(sizes)[1]]
    small = graphs[max(i for n, i in sizes if 50 <= n <= 150)]
    junk = np.ones(2**21)  # 16 MiB
    # A round's copies around each replay: a small upload from page-locked memory before, a blocking result
    # download into page-locked memory after.
    upload_host = torch.ones(4096, dtype=torch.int64).pin_memory()
    upload_dev = torch.empty(4096, dtype=torch.int64, device="cuda")
    result_host = torch.empty(64, dtype=torch.int64).pin_memory()
    result_dev = torch.zeros(64, dtype=torch.int64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for name, order, pollute, copies in [
        ("verify again", [big], False, False),
        ("draft again", [small], False, False),
        ("alternating", [small, big], False, False),
        ("verify after 16 MiB touched", [big], True, False),
        ("draft after 16 MiB touched", [small], True, False),
        ("verify again, with copies", [big], False, True),
        ("alternating, with copies", [small, big], False, True),
    ]:
        per_graph: dict[int, dict[str, list[float]]] = {}
        for i in range(repeats * len(order)):
            graph = order[i % len(order)]
            if pollute:
                junk += 1.0
            torch.cuda.synchronize()
            if copies:
                upload_dev.copy_(upload_host, non_blocking=True)
            timed = (i // len(order)) % 2 == 1
            download = partial(result_host.copy_, result_dev) if copies else None
            host, until_idle = replay_once(graph, (start, end) if timed else None, download)
            entry = per_graph.setdefault(i % len(order), {"launch": [], "wall": [], "device": []})
            if timed:
                entry["device"].append(start.elapsed_time(end) * 1000)
            else:
                entry["launch"].append(host)
                entry["wall"].append(until_idle)
        for k, entry in per_graph.items():
            launch, wall, device = (statistics.median(entry[x]) for x in ("launch", "wall", "device"))
            label = name if len(order) == 1 else f"{name} ({'draft' if order[k] is small else 'verify'})"
            rows.append(
                {"pattern": label, "launch_us": launch, "wall_us": wall, "device_us": device, "gap_us": wall - device}
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 10, 100, 340, 1000])
    parser.add_argument("--kinds", nargs="+", default=["torch", "triton", "triton-pdl"])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--engines", action="store_true", help="also replay the engines' captured graphs alone")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [measure(k, n, args.repeats) for k in args.kinds for n in args.nodes]
    result: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    if args.engines:
        result["engine_graphs"], graphs = engine_graphs(30)
        result["launch_patterns"] = launch_patterns(graphs, 40)
        args.out.write_text(json.dumps(result, indent=1))
        print("| pattern | launch us | wall us | device us | gap us |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for r in result["launch_patterns"]:  # type: ignore[union-attr]
            print(
                f"| {r['pattern']} | {r['launch_us']:.1f} | {r['wall_us']:.1f} | {r['device_us']:.1f} | "
                f"{r['gap_us']:.1f} |"
            )
        print("| graph | launch us | nodes |")
        print("| ---: | ---: | --- |")
        for g in result["engine_graphs"]:  # type: ignore[union-attr]
            nodes = ", ".join(f"{k} {v}" for k, v in sorted(g["nodes"].items()))
            print(f"| {g['index']} | {g['launch_us']:.1f} | {nodes} |")
    print("| kind | nodes | launch us | wall us | device us | gap us | correct |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['kind']} | {r['nodes']} | {r['launch_us']:.1f} | {r['wall_us']:.1f} | {r['device_us']:.1f} | "
            f"{r['gap_us']:.1f} | {r['correct']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
