"""Triton varlen attention over slot caches: the contract of :mod:`kernels.slot_attention`, reading K/V in place.

One program per (request, kv head, block of query rows). The G query heads that share a kv head are stacked
with the request's queries into one tile of BLOCK_M rows (row m = query m // G, head kv_head * G + m % G), so
each key tile is loaded once for the whole group and multiplied with ``tl.dot``. Keys stream in BLOCK_N tiles
with an online softmax (flash-attention style), first from the slot's cache row, then (drafter mode) from the
request's own block rows. Loop bounds come from the device tensors (context and chunk lengths), so the grid is
fixed by (R, Hkv, max_query_len) alone: CUDA-graph capturable for a bucketed batch size.

Float32 inputs use IEEE fp32 dots (no TF32), so the result matches the torch reference to float rounding;
bf16 / fp16 inputs use native dots with float32 accumulation and probabilities rounded to the input dtype for
the second product, as flash-attention does. A single launch configuration (no autotuning) keeps it runnable
under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    slots_ptr,
    ctx_ptr,
    qstart_ptr,
    qlen_ptr,
    scale,
    D,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    CAUSAL_CACHE: tl.constexpr,
    CAUSAL_BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
):
    r = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)
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
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_pos = ctx + qi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Programs whose rows are all padding skip the key loops (their output rows stay zero).
    active = m_block * BLOCK_M < q_len * G
    num_cached = tl.where(active, ctx, 0) if HAS_BLOCK else tl.where(active, ctx + q_len, 0)

    kc_base = kc_ptr + slot * stride_cs + kv_head * stride_ch
    vc_base = vc_ptr + slot * stride_cs + kv_head * stride_ch
    for start in range(0, num_cached, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < num_cached
        offs = t[:, None].to(tl.int64) * stride_ct + dims[None, :]
        tile_mask = t_ok[:, None] & dim_ok[None, :]
        k_tile = tl.load(kc_base + offs, mask=tile_mask, other=0.0)
        v_tile = tl.load(vc_base + offs, mask=tile_mask, other=0.0)
        visible = row_ok[:, None] & t_ok[None, :]
        if CAUSAL_CACHE:
            visible = visible & (t[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _online_update(q, k_tile, v_tile, visible, scale, m_i, l_i, acc, IEEE)

    if HAS_BLOCK:
        num_block = tl.where(active, q_len, 0)
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

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_on + head[:, None] * stride_oh + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


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
) -> torch.Tensor:
    """Triton slot attention; signature and semantics of :func:`kernels.slot_attention.slot_attention_reference`."""
    if validate:
        validate_slot_attention_inputs(
            q, k_cache, v_cache, slots, context_lens, query_starts, query_lens, max_query_len, k_block, v_block
        )
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_req = slots.shape[0]
    q = q.contiguous()
    out = torch.zeros_like(q)
    if num_req == 0 or num_rows == 0:
        return out
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share their strides")
    has_block = k_block is not None and v_block is not None
    if k_block is not None and v_block is not None:
        k_block, v_block = k_block.contiguous(), v_block.contiguous()
    else:
        k_block, v_block = k_cache, v_cache  # not read (HAS_BLOCK is off); any valid pointer will do
    rows_per_request = max_query_len * group
    block_m = max(16, min(64, triton.next_power_of_2(rows_per_request)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 64 else 32
    grid = (num_req, num_kv_heads, triton.cdiv(rows_per_request, block_m))
    _slot_attention_kernel[grid](
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
        slots,
        context_lens,
        query_starts,
        query_lens,
        float(scale),
        head_dim,
        G=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_BLOCK=has_block,
        CAUSAL_CACHE=causal and not has_block,
        CAUSAL_BLOCK=causal and has_block,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    return out
