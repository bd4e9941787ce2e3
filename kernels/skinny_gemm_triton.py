"""Skinny weight GEMMs for the target's verify step: ``y = x @ W^T`` with few rows, streamed at memory bandwidth.

A verify step multiplies 8..64 token rows by each weight matrix once. At that height the GEMM does ~M/4 flops
per weight byte, so its time is the time to read W: the kernel's job is to keep every SM streaming W. cuBLAS
picks tile shapes for square problems and falls short of the copy bandwidth on these shapes
(docs/benchmarks/kernels.md); here:

* the weight tile is the MMA's tall operand (``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T``: "swap AB"), so a
  16-row x costs no padding of W's reads, and W is loaded in wide contiguous rows of BLOCK_K elements (16-byte
  cp.async vectors with an evict-first hint, W being read once while x and the split partials stay in L2; or,
  ``tma=True``, one TMA copy per tile from a host tensor descriptor), software pipelined over ``num_stages``
  shared-memory buffers;
* narrow outputs (o_proj and down_proj: N = 2560 at K = 4096 / 9728) are split along K into SPLIT programs per
  output tile, so that enough programs fill the SMs; each writes its fp32 partial tile, and the last program
  of a tile to finish (an arrival counter, reset by that program) sums the partials in split order (the result
  does not depend on which program came last) and writes the output: one launch, deterministic;
* epilogues fold the ops that follow: ``residual += y`` in place (down_proj / o_proj with the residual add of
  the next norm), and for the stacked gate/up weight ``silu(gate) * up`` (the [M, I] activation is written
  directly, the [M, 2I] projection never is).

Numerics follow the modules op by op: the fp32 accumulator is rounded to the model dtype as torch's linear
returns it, then the epilogue ops round as torch rounds each op's result (``silu`` then the product; the
residual sum). Only the order of the fp32 dot-product sums differs from cuBLAS. Float32 models compute in
float32 (IEEE dot, no TF32). Every kernel has a torch reference of the same signature (``*_reference``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors: launches with tma=True are refused
    TensorDescriptor = None

from kernels.arrival_counters import ArrivalCounters
from kernels.launch import interpreting, launch_options, num_sms, pdl_options, tl_pdl_wait

MAX_ROWS = 64
"""The tallest row tile (BLOCK_M): a pass of more rows runs several M tiles. The target uses the kernels for
passes of at most FASTER_ROWS rows."""

_SHARED_MEMORY = 220 * 1024  # per SM on sm_90, as the launch heuristic budgets it

COUNTER_SLOTS = 1 << 16
"""Arrival counters per workspace: one per output tile of a split launch (int32, 256 KiB)."""


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration: output rows of W per program, K elements per step, K splits, warps, stages,
    and whether W is read by TMA (a host tensor descriptor) instead of cp.async vector loads."""

    block_n: int = 64
    block_k: int = 128
    split: int = 1
    warps: int = 4
    stages: int = 4
    tma: bool = False


FASTER_ROWS = 16
"""Passes of at most this many token rows use the skinny GEMMs when :class:`~verify_service.target.TargetModel`
has ``skinny_gemm`` on: the H200 sweep (docs/benchmarks/kernels.md, "Skinny weight GEMMs") measured them faster
than cuBLAS at 8 and 16 rows with the launches below, about even at 64 and slower at 32 (an unswept row bucket),
so larger passes stay on cuBLAS."""

@functools.cache
def tuned_for(device: torch.device) -> bool:
    """Whether the target uses these kernels on ``device`` (with ``skinny_gemm`` on): Hopper GPUs (compute
    capability 9.x: where FASTER_ROWS and TUNING were measured, and the only ones with the TMA copies some
    TUNING launches use) and the CPU interpreter (tests). Other GPUs keep cuBLAS until a sweep there says
    otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] == 9
    return interpreting()


# (N out, K, gated, BLOCK_M) -> config of bf16 launches: the fastest of `bench/bench_skinny_gemm.py --sweep` on an
# H200 (the Qwen3-4B projections the fused layers launch, swept at M = 8: the 16-row bucket that FASTER_ROWS
# admits; the sweep's timings are in docs/benchmarks/gemm.json). Shapes not listed (and float32 models) use
# default_config.
TUNING: dict[tuple[int, int, bool, int], SkinnyConfig] = {
    (6144, 2560, False, 16): SkinnyConfig(block_n=64, block_k=256, split=1, warps=4, stages=4),  # qkv
    (2560, 4096, False, 16): SkinnyConfig(block_n=64, block_k=128, split=4, warps=4, stages=4, tma=True),  # o_proj
    (2560, 9728, False, 16): SkinnyConfig(block_n=128, block_k=128, split=4, warps=4, stages=5),  # down_proj
    (9728, 2560, True, 16): SkinnyConfig(block_n=64, block_k=64, split=1, warps=4, stages=4),  # gate_up+silu
}


def load_tuning(path: str | Path) -> int:
    """Add the swept launches of a ``bench/bench_skinny_gemm.py --sweep --out FILE`` result to :data:`TUNING`
    (its ``tuning`` list), so that a run measures the GPU's own best launches before they are pasted into the
    table; returns how many entries were loaded. Plain JSON: nothing executable is read."""
    entries = json.loads(Path(path).read_text()).get("tuning", [])
    for entry in entries:
        n, k, gated, block_m = entry["key"]
        TUNING[(int(n), int(k), bool(gated), int(block_m))] = SkinnyConfig(**entry["config"])
    return len(entries)


@triton.jit
def _w_tile(w_ptr, row0, rows, ok_rows, k0, ks, ok_k, stride_wn, TMA: tl.constexpr, EVEN: tl.constexpr):
    """W[row0 : row0 + BLOCK_N, k0 : k0 + BLOCK_K]: one TMA copy of a tensor descriptor, or 16-byte vector
    loads (unmasked when the shape tiles evenly) with an evict-first hint (W is read once)."""
    if TMA:
        w = w_ptr.load([row0, k0])  # out-of-range rows / columns read as zero
    else:
        ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        if EVEN:
            w = tl.load(ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(ptrs, mask=ok_rows[:, None] & ok_k[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    up_offset,
    blocks_per_split,
    num_m_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    EVEN: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    # w_ptr: a pointer, or with TMA a tensor descriptor of W [rows, K] with blocks [BLOCK_N, BLOCK_K].
    # Program 0 axis: output tiles, M tiles of one N tile adjacent (they read the same W tile, from L2 when
    # several run at once); axis 1: the K split.
    tile = tl.program_id(0)
    pid_m = tile % num_m_tiles
    pid_n = tile // num_m_tiles
    pid_k = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_m = rows_m < M
    ok_n = rows_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = pid_k * blocks_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + blocks_per_split * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        ok_k = ks < K
        x = tl.load(x_rows + ks[None, :], mask=ok_m[:, None] & ok_k[None, :], other=0.0)
        w = _w_tile(w_ptr, pid_n * BLOCK_N, rows_n, ok_n, k0, ks, ok_k, stride_wn, TMA, EVEN)
        if NATIVE_DOT:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        if GATED:
            u = _w_tile(w_ptr, up_offset + pid_n * BLOCK_N, up_offset + rows_n, ok_n, k0, ks, ok_k, stride_wn, TMA,
                        EVEN)  # fmt: skip
            if NATIVE_DOT:
                acc_up = tl.dot(u, tl.trans(x), acc_up)
            else:
                acc_up = tl.dot(u.to(tl.float32), tl.trans(x.to(tl.float32)), acc_up, input_precision="ieee")

    # [BLOCK_N, BLOCK_M] tile of y^T: element (n, m) is y[m, n]
    y_tile = y_ptr + rows_m.to(tl.int64)[None, :] * stride_ym + rows_n[:, None]
    ok = ok_n[:, None] & ok_m[None, :]
    finish = True
    if SPLIT > 1:
        # Write this split's partial(s); the tile's last arrival sums them in split order.
        parts_per_split: tl.constexpr = 2 if GATED else 1
        tile_elems: tl.constexpr = BLOCK_N * BLOCK_M
        cell = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        base = part_ptr + tile.to(tl.int64) * (SPLIT * parts_per_split * tile_elems)
        mine = base + pid_k * (parts_per_split * tile_elems)
        tl.store(mine + cell, acc)
        if GATED:
            tl.store(mine + tile_elems + cell, acc_up)
        tl.debug_barrier()  # every thread's partial is written before the arrival (released by the atomic)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        finish = arrived == SPLIT - 1
        if finish:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT):
                part = base + s * (parts_per_split * tile_elems)
                acc += tl.load(part + cell, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part + tile_elems + cell, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    if finish:
        dtype = y_ptr.dtype.element_ty
        y = acc.to(dtype).to(tl.float32)  # the projection as torch's linear returns it
        if GATED:
            up = acc_up.to(dtype).to(tl.float32)
            y = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32) * up  # act_fn(gate) * up, as HF's MLP
        if RESIDUAL:
            y = tl.load(y_tile, mask=ok, other=0.0).to(tl.float32) + y
        tl.store(y_tile, y.to(dtype), mask=ok)


@functools.cache  # called per launch: eager steps must not pay the search every time
def default_config(m: int, n: int, k: int, gated: bool, num_sms: int, elem_bytes: int = 2) -> SkinnyConfig:
    """A launch for shapes the sweep has not covered: 64-row W tiles of 128 K elements (64 for float32), up to 4
    stages as shared memory allows, split along K just enough that every SM gets a program and the programs come
    close to whole waves over the SMs (as many resident per SM as shared memory holds), without programs of under
    4 K steps (pipeline warm-up) or much partial-sum traffic."""
    block_m = _block_m(m)
    block_n, block_k = 64, 128 if elem_bytes <= 2 else 64
    stage_bytes = ((2 if gated else 1) * block_n + block_m) * block_k * elem_bytes
    stages = max(1, min(4, _SHARED_MEMORY // stage_bytes))
    cfg = SkinnyConfig(block_n=block_n, block_k=block_k, warps=4, stages=stages)
    slots = num_sms * max(1, min(4, _SHARED_MEMORY // (cfg.stages * stage_bytes)))
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, block_m)
    k_blocks = triton.cdiv(k, cfg.block_k)
    best, best_score = 1, -1.0
    for blocks in range(k_blocks, 0, -1):  # fewest splits first
        split = triton.cdiv(k_blocks, blocks)
        programs = tiles * split
        if programs < num_sms and blocks > 1:  # an SM without a program streams nothing
            continue
        fill = programs / (triton.cdiv(programs, slots) * slots)
        partial_traffic = 4 * block_m * split / (2 * k)  # fp32 partial bytes per weight byte
        score = fill * min(1.0, blocks / 4) / (1 + 0.25 * partial_traffic)
        if score > best_score + 0.02:
            best, best_score = split, score
    return SkinnyConfig(block_n=cfg.block_n, block_k=cfg.block_k, split=best, warps=cfg.warps, stages=cfg.stages)


def _block_m(m: int) -> int:
    return max(16, min(MAX_ROWS, triton.next_power_of_2(max(m, 1))))


COUNTERS = ArrivalCounters("skinny GEMM", COUNTER_SLOTS)
new_counters = COUNTERS.new  # a caller's own buffer (the target's, the drafter's)


def takes_pass(rows: int, device: torch.device) -> bool:
    """Whether a model pass of ``rows`` token rows on ``device`` runs these GEMMs (with the model's switch on):
    at most FASTER_ROWS rows (read at call time) on a GPU :func:`tuned_for` accepts."""
    return rows <= FASTER_ROWS and tuned_for(device)


def model_counters(owner: str, device: torch.device, projections: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """A model's own arrival counters (zeroed once; the kernels leave them zeroed; a model of its own so that two
    models may run on different streams), after checking that the projections whose residual epilogues the GEMMs
    take over are bias-free. Made on an eager pass (graph steps warm up before they capture): zeroed inside a
    capture they would hold garbage until the first replay."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{owner}: run a skinny-GEMM pass eagerly before capturing it in a graph")
    if any(p.bias is not None for p in projections):
        raise ValueError(f"{owner}: skinny GEMMs need bias-free projections (set skinny_gemm = False)")
    return new_counters(device)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    n: int,
    gated: bool,
    residual: bool,
    counters: torch.Tensor | None,
    config: SkinnyConfig | None,
) -> None:
    m, k = x.shape
    if m == 0 or n == 0:
        return
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("skinny GEMM: x, weight and the output need a contiguous last axis")
    if weight.shape[-1] != k or x.dtype != weight.dtype or out.dtype != x.dtype:
        raise ValueError(f"skinny GEMM: x {tuple(x.shape)} {x.dtype} does not fit weight "
                         f"{tuple(weight.shape)} {weight.dtype} / output {out.dtype}")  # fmt: skip
    block_m = _block_m(m)
    elem = x.element_size()
    tuned = TUNING.get((n, k, gated, block_m)) if elem == 2 else None  # swept in bf16
    cfg = config or tuned or default_config(m, n, k, gated, num_sms(x.device), elem)
    num_m_tiles = triton.cdiv(m, block_m)
    tiles = triton.cdiv(n, cfg.block_n) * num_m_tiles
    k_blocks = triton.cdiv(k, cfg.block_k)
    blocks_per_split = triton.cdiv(k_blocks, cfg.split)
    split = triton.cdiv(k_blocks, blocks_per_split)  # no empty splits
    if split > 1:
        COUNTERS.check(tiles)
        counters = counters if counters is not None else COUNTERS.default(x.device)
        parts = torch.empty(tiles * split * (2 if gated else 1) * cfg.block_n * block_m,
                            dtype=torch.float32, device=x.device)  # fmt: skip
    else:
        counters = parts = out  # unused (never dereferenced without a split)
    even = k % cfg.block_k == 0 and n % cfg.block_n == 0
    native = x.dtype != torch.float32 and not interpreting()
    w_arg = weight
    if cfg.tma:
        if TensorDescriptor is None:
            raise RuntimeError(f"skinny GEMM: this Triton ({triton.__version__}) has no host tensor descriptors")
        w_arg = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [cfg.block_n, cfg.block_k])
    _skinny_gemm_kernel[(tiles, split)](
        x, w_arg, out, parts, counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), n if gated else 0, blocks_per_split, num_m_tiles,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split, GATED=gated, RESIDUAL=residual,
        EVEN=even, NATIVE_DOT=native, TMA=cfg.tma, num_warps=cfg.warps, num_stages=cfg.stages, **launch_options(),
        **pdl_options(x.device, m),
    )  # fmt: skip


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    counters: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``x @ weight^T`` (torch.nn.functional.linear without bias) for x [M, K], weight [N, K] -> [M, N].

    With ``residual`` [M, N]: ``residual += x @ weight^T`` in place (the product rounded to the dtype first, as
    ``residual + linear(x, weight)`` rounds), and residual is returned. ``counters``: see :func:`new_counters`."""
    n = weight.shape[0]
    out = residual if residual is not None else torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if residual is not None and residual.shape != (x.shape[0], n):
        raise ValueError(f"skinny_linear: residual {tuple(residual.shape)} is not [{x.shape[0]}, {n}]")
    _launch(x, weight, out, n, False, residual is not None, counters, config)
    return out


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    counters: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """:func:`skinny_linear` in torch (``counters`` and ``config`` are ignored)."""
    y = torch.nn.functional.linear(x, weight)
    return y if residual is None else residual.add_(y)


def skinny_gate_up_silu(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    *,
    counters: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``silu(x @ gate^T) * (x @ up^T)`` for the stacked weight [2I, K] (gate rows first) -> [M, I]: HF's
    ``act_fn(gate_proj(x)) * up_proj(x)`` in one kernel, without writing the [M, 2I] projection."""
    two_i = gate_up_weight.shape[0]
    if two_i % 2:
        raise ValueError(f"skinny_gate_up_silu: the stacked weight needs an even row count, got {two_i}")
    out = torch.empty((x.shape[0], two_i // 2), dtype=x.dtype, device=x.device)
    _launch(x, gate_up_weight, out, two_i // 2, True, False, counters, config)
    return out


def skinny_gate_up_silu_reference(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    *,
    counters: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """:func:`skinny_gate_up_silu` in torch (``counters`` and ``config`` are ignored)."""
    gate, up = torch.nn.functional.linear(x, gate_up_weight).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
