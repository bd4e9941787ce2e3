"""Triton varlen attention over slot caches: the contract of :mod:`kernels.slot_attention`, reading K/V in place.

One program per (request, kv head, block of query rows). The G query heads that share a kv head are stacked
with the request's queries into one tile of BLOCK_M rows (row m = query m // G, head kv_head * G + m % G), so
each key tile is loaded once for the whole group and multiplied with ``tl.dot``. Keys stream in BLOCK_N tiles
with an online softmax (flash-attention style), first from the slot's cache row, then (drafter mode) from the
request's own block rows. Loop bounds come from the device tensors (context and chunk lengths), so the grid is
fixed by (R, Hkv, max_query_len) alone: CUDA-graph capturable for a bucketed batch size.

Split keys (flash-decoding) for small grids: a verify step of one request (8 query rows, Qwen3-4B's 8 kv heads)
is 8 programs on an H200's 132 SMs, each streaming its ~264 keys serially, so the kernel is bound by one
program's latency, not by the ~1 MB it reads. With ``kv_splits`` S > 1 each (request, kv head, row block) gets S
programs, split s taking a contiguous run of the request's key tiles (counted in the kernel from the device
context length, so the grid still depends on host shapes only); each writes its unnormalised partial (running
max m_s, normaliser l_s, accumulator acc_s, in float32), then takes a ticket on the tile's arrival counter, and
the last of the S to arrive combines them exactly: ``M = max_s m_s``, ``out = sum_s exp(m_s - M) acc_s /
sum_s exp(m_s - M) l_s``, summed in split order whichever program came last (deterministic), and resets the
counter (a zeroed int32 buffer the kernel leaves zeroed, see :func:`new_counters`). One launch, as the skinny
GEMMs' split K (kernels/skinny_gemm_triton.py): that is the same softmax as the single pass, differing only in
the order of the float32 sums. S = 1 is the single-pass kernel alone. The default S (:func:`default_kv_splits`)
fills the SMs from the launch shape only, keeping CUDA-graph capture valid.

Rows of q that no request covers must come back as zeros. Callers whose requests' rows are in order
(``ordered_rows``: every production caller, see :func:`slot_attention_triton`) get an uninitialised output and
the kernel writes those zeros itself: each request's program of its last row block and last split zeroes the
rows from its queries' end to the next request's start. Other callers get a zero-filled output (one fill kernel
more).

Float32 inputs use IEEE fp32 dots (no TF32), so the result matches the torch reference to float rounding;
bf16 / fp16 inputs use native dots with float32 accumulation and probabilities rounded to the input dtype for
the second product, as flash-attention does. A single launch configuration (no autotuning) keeps it runnable
under ``TRITON_INTERPRET=1`` on CPU. On Hopper the launch is a programmatic dependent one
(:func:`kernels.launch.pdl_options`), as the fused layer kernels and skinny GEMMs around it are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import ArrivalCounters
from kernels.launch import num_sms, pdl_options, tl_pdl_wait
from kernels.slot_attention import validate_slot_attention_inputs


@triton.jit
def _online_update(q, k_tile, v_tile, visible, scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of the online softmax: returns the new (running max, normaliser, accumulator)."""
    s = tl.dot(q, tl.trans(k_tile), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k_tile))
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p, v_tile, input_precision="ieee") if IEEE else tl.dot(p.to(v_tile.dtype), v_tile)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _slot_attention_kernel(
    q_ptr,
    stride_qn,
    stride_qh,
    kc_ptr,
    vc_ptr,
    stride_cs,
    stride_ct,
    stride_ch,
    kb_ptr,
    vb_ptr,
    stride_bn,
    stride_bh,
    o_ptr,
    stride_on,
    stride_oh,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    count_ptr,
    slots_ptr,
    ctx_ptr,
    qstart_ptr,
    qlen_ptr,
    scale,
    D,
    N,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    CAUSAL_CACHE: tl.constexpr,
    CAUSAL_BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK_D: tl.constexpr,
    ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)  # launched while the norm/rotary/K-V store kernel before it drains
    r = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Axis 2 folds the row block and the key split (Triton grids have three axes).
    num_m_blocks = tl.num_programs(2) // SPLITS
    m_block = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q_len = tl.load(qlen_ptr + r).to(tl.int32)
    ctx = tl.load(ctx_ptr + r).to(tl.int32)
    q_start = tl.load(qstart_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = m // G
    head = kv_head * G + m % G
    row_ok = qi < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    q_rows = q_start + qi.to(tl.int64)
    o_rows = o_ptr + q_rows[:, None] * stride_on + head[:, None] * stride_oh
    o_tile = o_rows + dims[None, :]
    out_ok = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
        mask=out_ok,
        other=0.0,
    )
    q_pos = ctx + qi

    if ORDERED:  # by the last row block's last split: often a program without queries
        zeroes = (m_block == num_m_blocks - 1) & (split == SPLITS - 1)
        _zero_uncovered_rows(o_ptr, stride_on, stride_oh, qstart_ptr, r, kv_head, q_start, q_len, N, zeroes, dims,
                             dim_ok, G, BLOCK_M, BLOCK_D)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Programs whose rows are all padding skip the key loops and write nothing (no output rows of theirs).
    active = m_block * BLOCK_M < q_len * G
    num_cached = tl.where(active, ctx, 0) if HAS_BLOCK else tl.where(active, ctx + q_len, 0)
    if SPLITS == 1:
        lo = 0
        hi = num_cached
    else:  # this split's contiguous run of key tiles [split * per, (split + 1) * per), possibly empty
        per = tl.cdiv(tl.cdiv(num_cached, BLOCK_N), SPLITS) * BLOCK_N
        lo = tl.minimum(split * per, num_cached)
        hi = tl.minimum(lo + per, num_cached)

    kc_base = kc_ptr + slot * stride_cs + kv_head * stride_ch
    vc_base = vc_ptr + slot * stride_cs + kv_head * stride_ch
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        offs = t[:, None].to(tl.int64) * stride_ct + dims[None, :]
        tile_mask = t_ok[:, None] & dim_ok[None, :]
        k_tile = tl.load(kc_base + offs, mask=tile_mask, other=0.0)
        v_tile = tl.load(vc_base + offs, mask=tile_mask, other=0.0)
        visible = row_ok[:, None] & t_ok[None, :]
        if CAUSAL_CACHE:
            visible = visible & (t[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _online_update(q, k_tile, v_tile, visible, scale, m_i, l_i, acc, IEEE)

    if HAS_BLOCK:
        # The block's own keys go to the last split, whose run of cache tiles is the shortest.
        num_block = tl.where(active & (split == SPLITS - 1), q_len, 0)
        for start in range(0, num_block, BLOCK_N):
            i = start + tl.arange(0, BLOCK_N)
            i_ok = i < num_block
            offs = (q_start + i.to(tl.int64))[:, None] * stride_bn + kv_head * stride_bh + dims[None, :]
            tile_mask = i_ok[:, None] & dim_ok[None, :]
            k_tile = tl.load(kb_ptr + offs, mask=tile_mask, other=0.0)
            v_tile = tl.load(vb_ptr + offs, mask=tile_mask, other=0.0)
            visible = row_ok[:, None] & i_ok[None, :]
            if CAUSAL_BLOCK:
                visible = visible & (i[None, :] <= qi[:, None])
            m_i, l_i, acc = _online_update(q, k_tile, v_tile, visible, scale, m_i, l_i, acc, IEEE)

    if SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o_tile, out.to(o_ptr.dtype.element_ty), mask=out_ok)
    elif active:  # uniform over the tile's splits: all of them arrive, or none
        # Max and normaliser of every row, padding too (neutral: -inf, 0); the accumulator only of rows that saw
        # a key, the only ones the combine reads it for. Workspaces [R, Hkv, row blocks, SPLITS] x BLOCK_M [x BLOCK_D].
        tile = (r.to(tl.int64) * tl.num_programs(1) + kv_head) * num_m_blocks + m_block
        rows = tile * (SPLITS * BLOCK_M) + tl.arange(0, BLOCK_M)  # the tile's split-0 partial rows
        mine = rows + split * BLOCK_M
        tl.store(part_m_ptr + mine, m_i)
        tl.store(part_l_ptr + mine, l_i)
        seen = m_i > float("-inf")
        tl.store(part_acc_ptr + mine[:, None] * BLOCK_D + dims[None, :], acc, mask=seen[:, None])
        tl.debug_barrier()  # every thread's partial is written before the arrival (released by the atomic)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            _combine_splits(part_m_ptr, part_l_ptr, part_acc_ptr, rows, row_ok, o_rows, D, BLOCK_M, BLOCK_D, SPLITS,
                            CHUNK_D)  # fmt: skip
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _combine_splits(part_m_ptr, part_l_ptr, part_acc_ptr, rows, row_ok, o_rows, D, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, CHUNK_D: tl.constexpr):  # fmt: skip
    """Store out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s with M = max_s m_s over one tile's SPLITS
    partials (``rows``: split 0's partial rows; ``o_rows``: the output rows' pointers), summed in split order.
    CHUNK_D head dims at a time: all SPLITS partial chunks in flight at once, without spilling registers. Loads
    bypass L1 (``.cg``): the other programs' partials were written through L2 after this one may have cached
    the lines."""
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        m_s = tl.load(part_m_ptr + rows + s * BLOCK_M, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_s)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # a row with no key at all: every weight is 0
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    for s in tl.static_range(SPLITS):
        part = rows + s * BLOCK_M
        m_s = tl.load(part_m_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        seen = m_s > float("-inf")
        weight = tl.exp(tl.where(seen, m_s - m_safe, float("-inf")))
        l_sum += weight * tl.load(part_l_ptr + part, mask=seen, other=0.0, cache_modifier=".cg")
    norm = tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    for c in tl.static_range(BLOCK_D // CHUNK_D):
        dims = c * CHUNK_D + tl.arange(0, CHUNK_D)
        acc = tl.zeros([BLOCK_M, CHUNK_D], tl.float32)
        for s in tl.static_range(SPLITS):
            part = rows + s * BLOCK_M
            m_s = tl.load(part_m_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
            seen = m_s > float("-inf")
            weight = tl.exp(tl.where(seen, m_s - m_safe, float("-inf")))  # the same weight as l_sum's
            acc_s = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=seen[:, None], other=0.0,
                            cache_modifier=".cg")  # fmt: skip
            acc += weight[:, None] * acc_s
        out = acc / norm
        tl.store(o_rows + dims[None, :], out.to(o_rows.dtype.element_ty), mask=row_ok[:, None] & (dims < D)[None, :])


@triton.jit
def _zero_uncovered_rows(o_ptr, stride_on, stride_oh, qstart_ptr, r, kv_head, q_start, q_len, N, zeroes, dims,
                         dim_ok, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Where ``zeroes``: zeros for this kv head's G query heads of the rows from request r's queries' end to the
    next request's start (the last request: to row N), in tiles of BLOCK_M (row, head) pairs stacked as the
    queries are."""
    next_start = tl.load(qstart_ptr + r + 1, mask=zeroes & (r + 1 < tl.num_programs(0)), other=N).to(tl.int64)
    band = tl.where(zeroes, (next_start - q_start).to(tl.int32), q_len)  # rows request r answers for
    zeros = tl.zeros([BLOCK_M, BLOCK_D], o_ptr.dtype.element_ty)
    for first in range(q_len * G, band * G, BLOCK_M):
        m = first + tl.arange(0, BLOCK_M)
        rows = q_start + (m // G).to(tl.int64)
        heads = kv_head * G + m % G
        tl.store(o_ptr + rows[:, None] * stride_on + heads[:, None] * stride_oh + dims[None, :], zeros,
                 mask=(m < band * G)[:, None] & dim_ok[None, :])  # fmt: skip


MAX_KV_SPLITS = 8
"""Most key splits the default picks: beyond it the partials' traffic and the combine outgrow what the extra
programs save (a Qwen3-4B verify of 1 request over 264 keys is fastest at 8: bench/bench_slot_attention.py,
docs/benchmarks/kernels.md, "Slot attention")."""

COMBINE_ELEMENTS = 8192
"""Partial elements the last arriving program loads at once: it combines CHUNK_D head dims at a time, the most
(a power of 2) for which SPLITS x BLOCK_M x CHUNK_D stays within this, so the chunk's loads of every split are in
flight together without spilling registers. ptxas for sm_90 (bf16, head_dim 128): at Qwen3-4B's verify of 1
request (8 splits of 32-row tiles) chunks of 32 dims spill nothing, whole 128-dim tiles spilled 360 bytes per
thread; a fixed 64-dim chunk spilled 0.2-0.4 KB at 64-row tiles of 4 splits and 4 KB at 8. This budget leaves at
most 160 bytes, at 64-row tiles (the single-pass kernel's own registers are near the 255 limit)."""

COUNTER_SLOTS = 1 << 12
"""Arrival counters per buffer: one per (request, kv head, row block) tile of a split launch (int32, 16 KiB). The
default splits only grids of fewer programs than SMs; an explicit ``kv_splits`` over more tiles is refused."""

COUNTERS = ArrivalCounters("slot attention", COUNTER_SLOTS)
new_counters = COUNTERS.new  # a caller's own buffer


def _combine_chunk(splits: int, block_m: int, block_d: int) -> int:
    """CHUNK_D of a launch: see :data:`COMBINE_ELEMENTS` (at least 8 dims: one 16-byte vector of bf16)."""
    return max(8, min(block_d, triton.next_power_of_2(COMBINE_ELEMENTS // (splits * block_m) + 1) // 2))


def default_kv_splits(num_programs: int, max_key_tiles: int, num_sms: int) -> int:
    """Key splits that fill the SMs from host-known shapes only (the grid must not depend on context lengths,
    or a captured CUDA graph would be wrong on replay): none once the single-pass grid covers every SM, else
    enough to give each SM about one program, at most MAX_KV_SPLITS and at most the key tiles a slot holds."""
    if num_programs >= num_sms:
        return 1
    return max(1, min(num_sms // max(num_programs, 1), MAX_KV_SPLITS, max_key_tiles))


TUNING: dict[str, int | None] = {"block_n": None, "num_warps": 4, "num_stages": None}
"""Launch configuration (one, no autotuning: see the module docstring). ``block_n``: keys per step, None for 64
up to 64 head dims and 32 beyond (register room for the K and V tiles); ``num_stages``: None for Triton's
default software pipelining of the key loop. bench/bench_slot_attention.py --tuning times others."""


def _tile_shape(rows_per_request: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) of a launch: a request's stacked query rows, keys per step, head dims."""
    block_m = max(16, min(64, triton.next_power_of_2(rows_per_request)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = TUNING["block_n"] or (64 if block_d <= 64 else 32)
    return block_m, block_n, block_d


def launch_kv_splits(
    num_req: int, num_kv_heads: int, rows_per_request: int, head_dim: int, max_len: int, device: torch.device
) -> int:
    """The key splits ``kv_splits=None`` launches with: :func:`default_kv_splits` of the launch's grid on CUDA,
    1 elsewhere (the interpreter gains nothing from more programs; tests pass kv_splits explicitly).
    rows_per_request: max_query_len x query heads per kv head; max_len: the cache's positions per slot."""
    if device.type != "cuda":
        return 1
    block_m, block_n, _ = _tile_shape(rows_per_request, head_dim)
    programs = num_req * num_kv_heads * triton.cdiv(rows_per_request, block_m)
    return default_kv_splits(programs, triton.cdiv(max_len, block_n), num_sms(device))


def slot_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    k_block: torch.Tensor | None = None,
    v_block: torch.Tensor | None = None,
    causal: bool = True,
    validate: bool = True,
    ordered_rows: bool = False,
    kv_splits: int | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton slot attention; signature and semantics of :func:`kernels.slot_attention.slot_attention_reference`.

    ``ordered_rows`` (the caller's promise, checked with ``validate``): ``query_starts[0] == 0`` and each
    request's rows end at or before the next request's start, so request r answers for the rows from its start
    to the next request's (the last request's: to the end of q) and the kernel writes the zeros of those past
    its queries itself: no fill kernel before the launch. Every production caller lays its rows out so: the
    verify engine's eager batches (back to back, ``cu_seqlens``), its ragged graph step
    (verify_service/graphs.py: chunks back to back, a one-row padding chunk of query_len 0 after the real ones,
    the sink's rows after the last chunk, not a request of the attention) and the drafter's blocks (request r at
    row r * bs, bs rows). Without it the output starts as zeros (rows of no request may lie anywhere).

    ``kv_splits``: programs per (request, kv head, row block), each taking a contiguous run of the key tiles,
    the last to finish combining them; None: :func:`launch_kv_splits`. ``counters``: the split launches'
    arrival counters (:func:`new_counters`); None: this process's buffer for the device, made on first use,
    which must not be a CUDA-graph capture."""
    if validate:
        validate_slot_attention_inputs(
            q, k_cache, v_cache, slots, context_lens, query_starts, query_lens, max_query_len, k_block, v_block,
            ordered_rows,
        )  # fmt: skip
    if kv_splits is not None and kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_req = slots.shape[0]
    q = q.contiguous()
    if num_req == 0 or num_rows == 0:
        return torch.zeros_like(q)
    out = torch.empty_like(q) if ordered_rows else torch.zeros_like(q)
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share their strides")
    has_block = k_block is not None and v_block is not None
    if k_block is not None and v_block is not None:
        k_block, v_block = k_block.contiguous(), v_block.contiguous()
    else:
        k_block, v_block = k_cache, v_cache  # not read (HAS_BLOCK is off); any valid pointer will do
    rows_per_request = max_query_len * group
    block_m, block_n, block_d = _tile_shape(rows_per_request, head_dim)
    num_m_blocks = triton.cdiv(rows_per_request, block_m)
    if kv_splits is None:
        kv_splits = launch_kv_splits(num_req, num_kv_heads, rows_per_request, head_dim, k_cache.shape[1], q.device)
    if kv_splits > 1:
        tiles = num_req * num_kv_heads * num_m_blocks
        COUNTERS.check(tiles)
        counters = counters if counters is not None else COUNTERS.default(q.device)
        # fresh per call: inside a captured graph each launch gets its own pool memory
        num_partials = tiles * kv_splits * block_m
        workspace = torch.empty(num_partials * (2 + block_d), dtype=torch.float32, device=q.device)
        part_m, part_l, part_acc = workspace.split([num_partials, num_partials, num_partials * block_d])
    else:
        part_m = part_l = part_acc = counters = out  # not read (SPLITS is 1)
    _slot_attention_kernel[(num_req, num_kv_heads, num_m_blocks * kv_splits)](
        q,
        q.stride(0),
        q.stride(1),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_block,
        v_block,
        k_block.stride(0) if has_block else 0,
        k_block.stride(1) if has_block else 0,
        out,
        out.stride(0),
        out.stride(1),
        part_m,
        part_l,
        part_acc,
        counters,
        slots,
        context_lens,
        query_starts,
        query_lens,
        float(scale),
        head_dim,
        num_rows,
        G=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_BLOCK=has_block,
        CAUSAL_CACHE=causal and not has_block,
        CAUSAL_BLOCK=causal and has_block,
        IEEE=q.dtype == torch.float32,
        SPLITS=kv_splits,
        CHUNK_D=_combine_chunk(kv_splits, block_m, block_d),
        ORDERED=ordered_rows,
        num_warps=TUNING["num_warps"],
        **({} if TUNING["num_stages"] is None else {"num_stages": TUNING["num_stages"]}),
        **pdl_options(q.device, num_rows),
    )
    return out
