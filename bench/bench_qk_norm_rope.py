"""The fused q/k norm + rotary + K/V store kernel (kernels/fused_layer_triton.py) by rows and heads per program.

A verify step runs it once per layer on every row of the step: 8 rows for one request, 64 for 8, 256 for 32, up
to the prefill room. Until 2026-12-02 it launched one 1-warp program per (row, head), which the H200 profile
showed at 1.7 / 4.6 / 15.8 us per layer at 8 / 64 / 256 rows; now each program takes a group of heads. This
times one call at Qwen3-4B's shape (bf16, 32 q heads, 8 kv heads, head_dim 128) for each head group, as a
CUDA-graph replay over several layers' caches (the per-layer cost the step sees, programmatic dependent launch
off), and the largest difference of each group's q, k and v from the shipped group's: the sum of squares of a
head is reduced in another order in another tile shape, which can move a bf16 output by its last bit.

GPU (seconds):  PYTHONPATH=. python3 bench/bench_qk_norm_rope.py --out qk_norm_rope.json
CPU smoke run:  PYTHONPATH=. python bench/bench_qk_norm_rope.py --small --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FULL = dict(num_heads=32, num_kv_heads=8, head_dim=128, rows=[8, 64, 256, 1024], groups=[1, 2, 4, 8, 16],
            layers=36, dtype=torch.bfloat16)  # fmt: skip
SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16, rows=[4, 16], groups=[1, 2, 4], layers=2,
             dtype=torch.float32)  # fmt: skip


def _problem(fused: Any, shape: dict[str, Any], num: int, device: torch.device, gen: torch.Generator) -> tuple[
    Callable[[int, int], torch.Tensor], list[torch.Tensor]
]:
    """``call(group, layer)`` of one layer's inputs of ``num`` rows (a cache per layer, as the step has), and the
    caches [2, 1, num, Hkv, D] (k, v) it writes."""
    hq, hkv, dim, layers, dtype = (shape[k] for k in ("num_heads", "num_kv_heads", "head_dim", "layers", "dtype"))
    qkv = [torch.randn((num, (hq + 2 * hkv) * dim), generator=gen, device=device).to(dtype) for _ in range(layers)]
    weight = torch.ones((2, dim), dtype=dtype, device=device)
    angles = torch.rand((num, dim), generator=gen, device=device)
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    positions = torch.arange(num, device=device)
    slots = torch.zeros(num, dtype=torch.int64, device=device)
    caches = [torch.zeros((2, 1, num, hkv, dim), dtype=dtype, device=device) for _ in range(layers)]

    def call(group: int, layer: int) -> torch.Tensor:
        k, v = caches[layer]
        return fused.qk_norm_rope_store(qkv[layer], weight, cos, sin, 1e-6, k, v, slots, positions, hq, hkv,
                                        head_group=group)  # fmt: skip

    return call, caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed replays (default 50 GPU, 1 CPU)")
    parser.add_argument("--out", default=None, help="JSON output")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    os.environ["DSPARK_PDL"] = "0"  # each call's own time, not overlapped with the last (kernels.launch)
    from bench.timing import graph_timed, timed
    from kernels import fused_layer_triton as fused

    shape = SMALL if args.small else FULL
    layers = shape["layers"]
    repeats = args.repeats or (50 if device.type == "cuda" else 1)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shipped_group": fused.QK_HEAD_GROUP, "shape": {k: str(v) for k, v in shape.items()}, "rows": [],
    }  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    for num in shape["rows"]:
        call, caches = _problem(fused, shape, num, device, gen)
        shipped = call(fused.QK_HEAD_GROUP, 0).clone(), caches[0].clone()
        row: dict[str, Any] = {"rows": num, "us": {}, "max_diff_from_shipped": {}}
        for group in shape["groups"]:
            q = call(group, 0)
            diffs = [(new.float() - old.float()).abs().max() for new, old in zip((q, caches[0]), shipped, strict=True)]
            row["max_diff_from_shipped"][group] = float(max(diffs))

            def all_layers(group: int = group, call: Callable[[int, int], torch.Tensor] = call) -> None:
                for layer in range(layers):
                    call(group, layer)

            ms = graph_timed(all_layers, device, repeats) if device.type == "cuda" else timed(all_layers, device, 1)
            row["us"][group] = 1000 * ms / layers
        results["rows"].append(row)
        print(f"rows {num:>5}: " + "  ".join(f"group {g}: {us:6.2f} us" for g, us in row["us"].items())
              + f"  (max |difference| from group {fused.QK_HEAD_GROUP}: "
              + ", ".join(f"{g}: {d:.2g}" for g, d in row["max_diff_from_shipped"].items()) + ")")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
