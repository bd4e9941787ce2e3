"""Skinny weight GEMMs of the verify step, Triton (kernels/skinny_gemm_triton.py) vs torch linear (cuBLAS).

Issue 11: a verify step of <= 32 requests should take at most 1.5x its memory-bandwidth floor, and its weight
GEMMs at 8..64 token rows are most of it. For each Qwen3-4B projection (bf16, torch Linear layout) and M token
rows: QKV 2560 -> 6144, o_proj 4096 -> 2560, gate_up 2560 -> 19456, down_proj 9728 -> 2560, the fused
gate_up + silu * up (against linear + the fused path's silu_mul kernel) and the LM head 2560 -> 151936; reported:
median ms per call, GB/s of weight bytes and its share of the device copy bandwidth ((read + write) bytes / time
of a device copy, as bench_policies_gpu.py's floor uses), and the largest |difference| from torch's output.

Timing: CUDA events around a CUDA-graph replay (how the verify engine runs the step: no launch overhead) of one
call on each of several copies of the weight, together >= 4x the L2 cache, so that every call reads its weight
from HBM as in the 36-layer model (a single 21 MB o_proj weight would otherwise stay in the 50 MB L2).

``--sweep`` first searches launch configurations per projection and row bucket (coordinate descent: the K split,
then the tile shape, then warps x stages, then TMA or cp.async loads of W, from the default) and runs the table
with the fastest, recorded under "tuning" in the JSON and printed as ``TUNING`` entries for
kernels/skinny_gemm_triton.py.

GPU (about a minute; --sweep adds up to --sweep-time-s, mostly compilation):
    python bench/bench_skinny_gemm.py [--sweep] --out gemm.json
CPU smoke run (Triton through the interpreter, tiny shapes, wall clock):
    python bench/bench_skinny_gemm.py --small --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: use this checkout's kernels
    sys.path.insert(0, str(ROOT))

from bench.timing import copy_bandwidth, graph_timed, timed  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One projection: weight [rows, k] (gate/up stacked for ``gated``), output width ``n``."""

    name: str
    n: int
    k: int
    gated: bool = False

    @property
    def rows(self) -> int:
        return 2 * self.n if self.gated else self.n


FULL = [Case("qkv", 6144, 2560), Case("o_proj", 2560, 4096), Case("gate_up", 19456, 2560),
        Case("down_proj", 2560, 9728), Case("gate_up+silu", 9728, 2560, gated=True),
        Case("lm_head", 151936, 2560)]  # fmt: skip
SMALL = [Case("qkv", 96, 64), Case("o_proj", 64, 128), Case("gate_up+silu", 64, 64, gated=True)]
ROWS = [8, 16, 32, 64, 256]


def per_call_ms(fn: Callable[[int], object], copies: int, device: torch.device, repeats: int) -> float:
    """Milliseconds per call of ``fn(i)`` over the weight copies i = 0..copies-1, replayed from one CUDA graph
    (eager on CPU)."""
    def run_all() -> None:
        for i in range(copies):
            fn(i)

    if device.type != "cuda":
        return timed(run_all, device, repeats, warmup=1) / copies
    return graph_timed(run_all, device, repeats) / copies


class Problem:
    """Weight copies and inputs of one case at M rows, with the torch and Triton calls on copy i."""

    def __init__(self, case: Case, m: int, device: torch.device, min_bytes: int, seed: int = 0) -> None:
        from kernels.fused_layer_triton import silu_mul
        from kernels.skinny_gemm_triton import skinny_gate_up_silu, skinny_linear

        gen = torch.Generator(device=device).manual_seed(seed)
        self.case, self.m = case, m
        self.weight_bytes = case.rows * case.k * 2
        self.copies = max(1, -(-min_bytes // self.weight_bytes))
        self.weights = [torch.randn(case.rows, case.k, generator=gen, device=device).div_(case.k**0.5)
                        .to(torch.bfloat16) for _ in range(self.copies)]  # fmt: skip
        self.x = torch.randn(m, case.k, generator=gen, device=device).to(torch.bfloat16)
        if case.gated:
            self.torch_call = lambda i: silu_mul(torch.nn.functional.linear(self.x, self.weights[i]))
            self.triton_call = lambda i, config=None: skinny_gate_up_silu(self.x, self.weights[i], config=config)
        else:
            self.torch_call = lambda i: torch.nn.functional.linear(self.x, self.weights[i])
            self.triton_call = lambda i, config=None: skinny_linear(self.x, self.weights[i], config=config)

    def max_diff(self, config: Any = None) -> float:
        return float((self.triton_call(0, config).float() - self.torch_call(0).float()).abs().max())


def sweep_configs(problem: Problem, device: torch.device, repeats: int, deadline: float) -> tuple[Any, float, list]:
    """Coordinate descent from the default launch: K split, then tile shape, then warps x stages. Configs that
    fail to compile (shared memory) or disagree with torch are skipped. Returns (best, its ms, every timing)."""
    from dataclasses import replace

    from kernels.launch import num_sms
    from kernels.skinny_gemm_triton import _block_m, default_config

    case, m = problem.case, problem.m
    best = default_config(m, case.n, case.k, case.gated, num_sms(device))
    tried: dict[Any, float | None] = {}
    tolerance = float(problem.torch_call(0).float().abs().max()) * 2**-6  # 4 bf16 ulps of the largest output

    def measure(config: Any) -> float | None:
        if config in tried or time.monotonic() > deadline:
            return tried.get(config)
        try:
            ok = problem.max_diff(config) <= tolerance
            tried[config] = per_call_ms(lambda i: problem.triton_call(i, config), problem.copies, device,
                                        repeats) if ok else None  # fmt: skip
        except Exception as error:  # out of shared memory / registers: not a candidate
            tried[config] = None
            print(f"  skip {config}: {type(error).__name__}", file=sys.stderr)
        return tried[config]

    k_steps = lambda cfg: -(-case.k // cfg.block_k)  # noqa: E731
    axes = [  # about a dozen launches per cell: each costs a compilation (~1 s)
        lambda cfg: [replace(cfg, split=s) for s in (1, 2, 4, 8, 16) if s <= k_steps(cfg)],
        lambda cfg: [replace(cfg, block_n=bn, block_k=bk, split=min(cfg.split, -(-case.k // bk)))
                     for bn, bk in ((32, 128), (64, 64), (64, 256), (128, 128))],
        lambda cfg: [replace(cfg, warps=w, stages=s) for w, s in ((4, 3), (4, 5), (8, 4))],
        lambda cfg: [replace(cfg, tma=not cfg.tma)],  # W by TMA copies instead of cp.async vectors
    ]  # fmt: skip
    best_ms = measure(best)
    for axis in axes:
        for config in axis(best):
            ms = measure(config)
            if ms is not None and (best_ms is None or ms < best_ms):
                best, best_ms = config, ms
    timings = [{"config": asdict(c), "ms": t, "block_m": _block_m(m)} for c, t in tried.items()]
    return best, best_ms, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help=f"token rows M (default {ROWS})")
    parser.add_argument("--cases", nargs="+", default=None, help="projection names (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed graph replays (default 20 GPU, 1 CPU)")
    parser.add_argument("--min-mib", type=int, default=256, help="weight bytes per graph, >= 4x L2 (MiB)")
    parser.add_argument("--sweep", action="store_true", help="search launch configurations first, use the best")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[8, 64],
                        help="rows swept (R = 1 and 8 verify steps; M in one row bucket of 16 / 32 / 64 rows share "
                        "its winner, the others keep the default launch)")
    parser.add_argument("--sweep-time-s", type=float, default=150.0, help="stop sweeping after this long")
    parser.add_argument("--out", default=None, help="JSON output")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import triton

    from kernels import skinny_gemm_triton as skinny
    from kernels.launch import num_sms

    cases = SMALL if args.small else FULL
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    rows = args.rows or ([4, 16] if args.small else ROWS)
    repeats = args.repeats or (20 if device.type == "cuda" else 1)
    min_bytes = 0 if args.small else args.min_mib * 2**20
    copy_gbps = copy_bandwidth(64 * 2**20 if args.small else 1024 * 2**20, device, repeats)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "repeats": repeats, "min_weight_bytes": min_bytes,
        "copy_bandwidth_gbps": copy_gbps, "tuning": [], "sweep": [], "results": [],
    }  # fmt: skip

    if args.sweep:
        deadline = time.monotonic() + args.sweep_time_s
        cells = [(c, m) for c in cases if c.name != "lm_head" for m in args.sweep_rows]
        for case, m in tqdm(cells, desc="sweep", unit="shape"):
            problem = Problem(case, m, device, min_bytes)
            best, best_ms, timings = sweep_configs(problem, device, repeats, deadline)
            key = (case.n, case.k, case.gated, skinny._block_m(m))
            results["sweep"].append({"case": case.name, "m": m, "timings": timings})
            if best_ms is not None:
                skinny.TUNING[key] = best
                results["tuning"].append({"case": case.name, "m": m, "key": list(key), "config": asdict(best),
                                          "ms": best_ms})  # fmt: skip
            del problem

    for case, m in tqdm([(c, m) for c in cases for m in rows], desc="benchmark", unit="cell"):
        problem = Problem(case, m, device, min_bytes)
        torch_ms = per_call_ms(problem.torch_call, problem.copies, device, repeats)
        triton_ms = per_call_ms(problem.triton_call, problem.copies, device, repeats)
        block_m = skinny._block_m(m)
        config = skinny.TUNING.get((case.n, case.k, case.gated, block_m)) or skinny.default_config(
            m, case.n, case.k, case.gated, num_sms(device))
        torch_gbps, triton_gbps = (problem.weight_bytes / (ms * 1e-3) / 1e9 for ms in (torch_ms, triton_ms))
        results["results"].append({
            "case": case.name, "n": case.n, "k": case.k, "gated": case.gated, "m": m,
            "weight_bytes": problem.weight_bytes, "copies": problem.copies, "config": asdict(config),
            "torch_ms": torch_ms, "triton_ms": triton_ms, "speedup": torch_ms / triton_ms,
            "torch_gbps": torch_gbps, "triton_gbps": triton_gbps, "torch_fraction_of_copy": torch_gbps / copy_gbps,
            "triton_fraction_of_copy": triton_gbps / copy_gbps,
            "max_abs_diff": problem.max_diff(),
        })  # fmt: skip
        del problem

    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if results["tuning"]:
        print("\nTUNING entries for kernels/skinny_gemm_triton.py (fastest swept launch per shape and row bucket):")
        for t in results["tuning"]:
            c = t["config"]
            print(f"    {tuple(t['key'])}: SkinnyConfig(block_n={c['block_n']}, block_k={c['block_k']}, "
                  f"split={c['split']}, warps={c['warps']}, stages={c['stages']}, tma={c['tma']}),  "
                  f"# {t['case']} M={t['m']}: "
                  f"{t['ms'] * 1e3:.1f} us")  # fmt: skip
    print(f"\ndevice: {results['device']}  copy bandwidth: {copy_gbps:.0f} GB/s (read+write)  "
          f"torch {torch.__version__}  triton {triton.__version__}")  # fmt: skip
    print(f"{'case':<13} {'M':>4} {'torch us':>9} {'triton us':>9} {'speedup':>7} {'torch %copy':>11} "
          f"{'triton %copy':>12} {'max|diff|':>9}  config (block_n, block_k, split, warps, stages, tma)")  # fmt: skip
    for r in results["results"]:
        c = r["config"]
        print(f"{r['case']:<13} {r['m']:>4} {r['torch_ms'] * 1e3:>9.1f} {r['triton_ms'] * 1e3:>9.1f} "
              f"{r['speedup']:>6.2f}x {100 * r['torch_fraction_of_copy']:>10.0f}% "
              f"{100 * r['triton_fraction_of_copy']:>11.0f}% {r['max_abs_diff']:>9.2g}  "
              f"({c['block_n']}, {c['block_k']}, {c['split']}, {c['warps']}, {c['stages']}, {c['tma']})")  # fmt: skip


if __name__ == "__main__":
    main()
