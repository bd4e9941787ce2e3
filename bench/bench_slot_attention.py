"""Slot attention of a verify step (kernels/slot_attention_triton.py): one pass vs keys split across programs.

One launch per call either way: the split programs combine their partials themselves (the last to arrive), and
the requests' rows are passed as ordered (``ordered_rows``, as the verify and draft engines pass them), so the
output needs no zero fill first.

The verify step of a few requests launches R x 8 kv heads programs of the single-pass kernel on 132 SMs, each
streaming its request's keys serially: latency-bound. This times the kernel at Qwen3-4B's shapes (bf16, 32 query
heads over 8 kv heads, head_dim 128), R requests of 8 query rows (gamma = 7 drafts + the anchor) after 256
cached positions (264 keys per request with the chunk's own) in slots of --max-len positions (the engine's
max_seq_len, which caps the default), for the default split count (``kv_splits=None``:
:func:`kernels.slot_attention_triton.launch_kv_splits`, printed as "default S"), one pass (S = 1) and fixed S.

Timing: CUDA events around a CUDA-graph replay (how the verify engine runs the step) of one call on each of
several layers' worth of distinct caches, together >= --min-mib of keys and values read (4x the H200's L2 by
default), so that every call reads its keys from HBM as in the 36-layer model; reported in us per call (per
layer) with the read bandwidth, and the largest |difference| of each split count from the one-pass output and
from the float32 torch reference.

GPU (under a minute):
    python bench/bench_slot_attention.py --out slot_attention.json
CPU smoke run (Triton through the interpreter, tiny shapes, wall clock):
    python bench/bench_slot_attention.py --small --device cpu
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: use this checkout's kernels
    sys.path.insert(0, str(ROOT))

from bench.timing import graph_timed, timed  # noqa: E402

FULL = dict(num_heads=32, num_kv_heads=8, head_dim=128, context=256, rows=8, requests=[1, 8, 32],
            splits=[1, 2, 4, 8, 16], dtype=torch.bfloat16, max_len=2048)  # fmt: skip
SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16, context=40, rows=4, requests=[1, 2], splits=[1, 3],
             dtype=torch.float32, max_len=64)  # fmt: skip


class Problem:
    """``copies`` layers of caches for R requests (slot r = request r), one query batch, the control tensors."""

    def __init__(self, shape: dict[str, Any], num_req: int, device: torch.device, min_bytes: int) -> None:
        gen = torch.Generator(device=device).manual_seed(num_req)
        hq, hkv, dim, rows, dtype = (shape[k] for k in ("num_heads", "num_kv_heads", "head_dim", "rows", "dtype"))
        self.keys = shape["context"] + rows  # the chunk's own K/V are in the cache before attention runs
        self.read_bytes = 2 * num_req * self.keys * hkv * dim * torch.finfo(dtype).bits // 8
        self.copies = max(1, -(-min_bytes // self.read_bytes))
        self.max_len = shape["max_len"]
        self.caches = []
        for _ in range(self.copies):  # positions past the keys: finite, for the torch reference's masked product
            layer = torch.zeros(2, num_req, self.max_len, hkv, dim, dtype=dtype, device=device)
            layer[:, :, : self.keys] = torch.randn(2, num_req, self.keys, hkv, dim, generator=gen, device=device)
            self.caches.append((layer[0], layer[1]))
        self.q = torch.randn(num_req * rows, hq, dim, generator=gen, device=device).to(dtype)
        as_long = dict(dtype=torch.int64, device=device)
        self.slots = torch.arange(num_req, **as_long)
        self.context_lens = torch.full((num_req,), shape["context"], **as_long)
        self.query_starts = torch.arange(num_req, **as_long) * rows
        self.query_lens = torch.full((num_req,), rows, **as_long)
        self.rows, self.scale = rows, dim**-0.5

    def call(self, impl, i: int, **kwargs) -> torch.Tensor:
        k_cache, v_cache = self.caches[i]
        return impl(self.q, k_cache, v_cache, self.slots, self.context_lens, self.query_starts, self.query_lens,
                    self.scale, max_query_len=self.rows, validate=False, ordered_rows=True, **kwargs)  # fmt: skip


def per_call_us(fn, copies: int, device: torch.device, repeats: int) -> float:
    """Microseconds per call of ``fn(i)`` over the cache copies, replayed from one CUDA graph (eager on CPU)."""

    def run_all() -> None:
        for i in range(copies):
            fn(i)

    if device.type != "cuda":
        return timed(run_all, device, repeats, warmup=1) / copies * 1e3
    return graph_timed(run_all, device, repeats) / copies * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, nargs="+", default=None, help="R values (default 1 8 32)")
    parser.add_argument("--splits", type=int, nargs="+", default=None, help="fixed S values (default 1 2 4 8 16)")
    parser.add_argument("--repeats", type=int, default=None, help="timed graph replays (default 20 GPU, 1 CPU)")
    parser.add_argument("--min-mib", type=int, default=200, help="K/V bytes read per graph, >= 4x L2 (MiB)")
    parser.add_argument("--max-len", type=int, default=None, help="cache positions per slot (default 2048)")
    parser.add_argument("--tuning", nargs="+", default=None, metavar="JSON",
                        help='launch configurations to time, each a JSON object of '
                        'kernels.slot_attention_triton.TUNING keys, e.g. \'{"block_n": 64, "num_warps": 8}\' '
                        '(default: the shipped one)')  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON output")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import triton

    from kernels.slot_attention import slot_attention_reference
    from kernels.slot_attention_triton import launch_kv_splits, slot_attention_triton

    module = importlib.import_module("kernels.slot_attention_triton")  # the package exports the function
    shipped = dict(module.TUNING)
    tunings = [json.loads(t) for t in args.tuning] if args.tuning else [{}]
    for tuning in tunings:
        unknown = set(tuning) - set(shipped)
        if unknown:
            parser.error(f"unknown TUNING keys {sorted(unknown)} (known: {sorted(shipped)})")

    shape = dict(SMALL if args.small else FULL)
    shape["max_len"] = args.max_len or shape["max_len"]
    requests = args.requests or shape["requests"]
    fixed = args.splits or shape["splits"]
    repeats = args.repeats or (20 if device.type == "cuda" else 1)
    min_bytes = 0 if args.small else args.min_mib * 2**20
    group = shape["num_heads"] // shape["num_kv_heads"]
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "repeats": repeats, "min_read_bytes": min_bytes,
        "shape": {k: str(v) if k == "dtype" else v for k, v in shape.items()}, "results": [],
    }  # fmt: skip
    for tuning, num_req in ((t, r) for t in tunings for r in requests):
        module.TUNING.clear()
        module.TUNING.update(shipped, **tuning)
        problem = Problem(shape, num_req, device, min_bytes)
        default = launch_kv_splits(num_req, shape["num_kv_heads"], shape["rows"] * group, shape["head_dim"],
                                   problem.max_len, device)  # fmt: skip
        one_pass = problem.call(slot_attention_triton, 0, kv_splits=1).float()
        reference = problem.call(slot_attention_reference, 0).float()
        row: dict[str, Any] = {"tuning": dict(module.TUNING), "requests": num_req, "keys": problem.keys,
                               "read_bytes": problem.read_bytes,
                               "copies": problem.copies, "default_splits": default, "us": {}, "max_diff_one_pass": {},
                               "max_diff_reference": {}}  # fmt: skip
        for splits in [None, *fixed]:
            key = "default" if splits is None else str(splits)
            out = problem.call(slot_attention_triton, 0, kv_splits=splits).float()
            row["max_diff_one_pass"][key] = float((out - one_pass).abs().max())
            row["max_diff_reference"][key] = float((out - reference).abs().max())
            call = functools.partial(problem.call, slot_attention_triton, kv_splits=splits)
            row["us"][key] = per_call_us(call, problem.copies, device, repeats)
        row["speedup_default"] = row["us"]["1"] / row["us"]["default"] if "1" in row["us"] else None
        results["results"].append(row)
        del problem

    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"\ndevice: {results['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"shape {results['shape']}")  # fmt: skip
    columns = ["default", *map(str, fixed)]
    print(f"{'tuning':<42} {'R':>3} {'keys':>5} {'default S':>9} "
          + " ".join(f"{'S=' + c + ' us':>12}" for c in columns)
          + f" {'speedup':>7} {'GB/s':>6} {'|d| 1-pass':>10} {'|d| ref':>8}")  # fmt: skip
    for r in results["results"]:
        gbps = r["read_bytes"] / (r["us"]["default"] * 1e-6) / 1e9
        speedup = f"{r['speedup_default']:>6.2f}x" if r["speedup_default"] else f"{'-':>7}"
        worst_one_pass = max(r["max_diff_one_pass"].values())
        worst_reference = max(r["max_diff_reference"].values())
        tuning = json.dumps({k: v for k, v in r["tuning"].items() if v is not None})
        print(f"{tuning:<42} {r['requests']:>3} {r['keys']:>5} {r['default_splits']:>9} "
              + " ".join(f"{r['us'][c]:>12.1f}" for c in columns)
              + f" {speedup} {gbps:>6.0f} {worst_one_pass:>10.2g} {worst_reference:>8.2g}")  # fmt: skip


if __name__ == "__main__":
    main()
