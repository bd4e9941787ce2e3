"""Probe: does programmatic dependent launch (PDL) shrink the gaps between a verify step's chained kernels?

A Qwen3-4B verify step of 1 request is ~400 kernels in a CUDA graph, and on the H200 the step's device time
exceeds the sum of its kernels' times by ~0.7 us per kernel (docs/benchmarks/policies.md): the next kernel's
blocks only start once the previous kernel has drained. With PDL (Hopper), a kernel launched with
``launch_pdl=True`` may start while its predecessor's last blocks run; it calls ``gdc_wait()`` before it reads
what the predecessor wrote. A weight GEMM needs only its activations from the predecessor, so it can start
streaming its first weight tile before the wait ("prefetch").

This times 36 layers x 4 chained weight-streaming GEMMs of Qwen3-4B's shapes (8 token rows, bf16; each reads
the previous one's output), replayed as one CUDA graph, in four variants: torch linear (cuBLAS), the same
Triton kernel without PDL, with PDL (wait first), and with PDL plus the first weight tile loaded before the
wait. Every variant is checked against torch on the last output. Nothing in the engine uses PDL yet: this
measures whether it is worth doing.

GPU (well under a minute):
    python3 bench/probe_pdl.py --out $OUT/pdl.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.timing import copy_bandwidth, graph_timed  # noqa: E402

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without PDL intrinsics: the probe reports that and times the rest
    gdc_launch_dependents = gdc_wait = None

SHAPES = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)]  # (N, K): qkv, o_proj, gate_up, down
ROWS = 8


@triton.jit
def _stream_gemm_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_x, stride_y, M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """y[M, N] = x[M, K] @ w[N, K]^T for one BLOCK_N slice of w's rows (K a multiple of BLOCK_K; x and y rows
    ``stride_x`` / ``stride_y`` apart)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, BLOCK_K)
    ms = tl.arange(0, M)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    if PREFETCH:  # the first weight tile does not depend on the predecessor: load it before waiting
        w0 = tl.load(w_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, M], tl.float32)
    if PREFETCH:
        acc = tl.dot(w0, tl.trans(tl.load(x_ptr + ms[:, None] * stride_x + ks[None, :])), acc)
        start = BLOCK_K
    else:
        start = 0
    for k0 in range(start, K, BLOCK_K):
        w = tl.load(w_rows + k0 + ks[None, :], mask=row_ok[:, None], other=0.0)
        x = tl.load(x_ptr + ms[:, None] * stride_x + k0 + ks[None, :])
        acc = tl.dot(w, tl.trans(x), acc)
    tl.store(y_ptr + ms[None, :] * stride_y + rows[:, None], acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def chain(weights: list[torch.Tensor], buffers: list[torch.Tensor], variant: str) -> torch.Tensor:
    """Run the chained GEMMs: layer i reads buffer i (its K columns), writes buffer i + 1."""
    for i, w in enumerate(weights):
        n, k = w.shape
        x, y = buffers[i][:, :k], buffers[i + 1][:, :n]
        if variant == "cublas":
            torch.nn.functional.linear(x, w, out=y)
            continue
        pdl = variant != "triton"
        _stream_gemm_kernel[(triton.cdiv(n, 64),)](
            x, w, y, n, k, x.stride(0), y.stride(0), M=ROWS, BLOCK_N=64, BLOCK_K=128, PDL=pdl,
            PREFETCH=variant == "pdl+prefetch", num_warps=4, num_stages=4, launch_pdl=pdl,
        )  # fmt: skip
    return buffers[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [
        torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k**-0.5
        for _ in range(args.layers)
        for n, k in SHAPES
    ]
    width = max(max(n, k) for n, k in SHAPES)
    buffers = [torch.empty(ROWS, width, device=device, dtype=torch.bfloat16) for _ in range(len(weights) + 1)]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = copy_bandwidth(1 << 30, device, 20)
    variants = ["cublas", "triton"] + (["pdl", "pdl+prefetch"] if gdc_wait is not None else [])
    results = {"device": torch.cuda.get_device_name(device), "triton": triton.__version__, "torch": torch.__version__,
               "kernels": len(weights), "weight_GB": weight_bytes / 1e9, "copy_bandwidth_GBps": bandwidth,
               "pdl_available": gdc_wait is not None, "variants": {}}  # fmt: skip
    reference = None
    for variant in variants:
        buffers[0].normal_(generator=gen)
        if reference is None:
            start = buffers[0].clone()
        else:
            buffers[0].copy_(start)
        try:
            ms = graph_timed(lambda v=variant: chain(weights, buffers, v), device, args.repeats)
        except Exception as exc:  # a variant this Triton / driver cannot run is reported, not fatal
            results["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        buffers[0].copy_(start)
        out = chain(weights, buffers, variant).float()
        torch.cuda.synchronize()
        if reference is None:
            reference = out.clone()
        error = ((out - reference).norm() / reference.norm()).item()
        floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
        results["variants"][variant] = {
            "graph_ms": ms,
            "floor_ms": floor_ms,
            "ratio": ms / floor_ms,
            "us_per_kernel": 1e3 * ms / len(weights),
            "rel_error_vs_cublas": error,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{results['device']}, triton {results['triton']}: {len(weights)} chained GEMMs of 8 rows, "
          f"{results['weight_GB']:.2f} GB of weights, copy bandwidth {bandwidth:.0f} GB/s")  # fmt: skip
    for variant, row in results["variants"].items():
        if "error" in row:
            print(f"{variant:>14}: {row['error']}")
        else:
            print(
                f"{variant:>14}: {row['graph_ms']:.3f} ms = {row['ratio']:.2f}x floor, "
                f"{row['us_per_kernel']:.2f} us/kernel, rel err vs cuBLAS {row['rel_error_vs_cublas']:.1e}"
            )


if __name__ == "__main__":
    main()
