"""Fused pieces of a Qwen3 decoder layer for the target's CUDA path: fewer, larger kernels per layer.

A verify step of a few tokens through 36 layers is a couple of thousand tiny kernels when every RMSNorm, rotary
embedding and activation runs as separate PyTorch ops (HF's RMSNorm alone is ~7 kernels); even replayed as a
CUDA graph each costs a few microseconds, which at 4B size is more than the weights take to stream. These
kernels fold each run of elementwise work into one pass over the rows:

* :func:`add_rms_norm`: ``x += delta`` (the residual add) and ``h = RMSNorm(x) * w`` in one kernel;
* :func:`qk_norm_rope_store`: from the fused QKV projection, per head: q/k RMSNorm, rotary embedding, q written
  out, k and v stored straight into the slot KV cache at (slot, position);
* :func:`silu_mul`: ``silu(gate) * up`` from the fused gate/up projection.

Numerics follow HF's modules op by op: every intermediate PyTorch rounds to the model dtype is rounded here too
(the sums of squares are float32 as in HF, only their order differs), so bf16 results match the unfused path up
to the last bit in almost every element. Float32 models compute in float32 throughout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.launch import pdl_options, tl_pdl_wait


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    h_ptr,
    stride_x,
    stride_d,
    stride_h,
    H,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x + d).to(dtype).to(tl.float32)  # rounded as PyTorch stores an op's result in the model dtype
        tl.store(x_ptr + row * stride_x + cols, x.to(dtype), mask=ok)
    var = tl.sum(x * x, axis=0) / H
    h = (x * tl.math.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * stride_h + cols, (w * h).to(h_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (when given), then return ``RMSNorm(x) * weight`` (HF Qwen3RMSNorm numerics).

    x, delta: [N, H] with unit stride on the last axis; weight [H]."""
    num, hidden = x.shape
    h = torch.empty_like(x)
    if num == 0:
        return h
    has_delta = delta is not None
    d = delta if delta is not None else x
    _add_rms_norm_kernel[(num,)](
        x,
        d,
        weight,
        h,
        x.stride(0),
        d.stride(0),
        h.stride(0),
        hidden,
        float(eps),
        HAS_DELTA=has_delta,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=4,
        **pdl_options(x.device, num),
    )
    return h


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    stride_qkv,
    w_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    q_ptr,
    stride_qn,
    stride_qh,
    kc_ptr,
    vc_ptr,
    stride_cs_slot,
    stride_ct,
    stride_ch,
    slots_ptr,
    pos_ptr,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HB: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)  # q head groups, then k head groups, then v head groups, HB heads each
    GQ: tl.constexpr = (HQ + HB - 1) // HB
    GKV: tl.constexpr = (HKV + HB - 1) // HB
    lanes = tl.arange(0, HB)
    half = tl.arange(0, D // 2)
    dtype = qkv_ptr.dtype.element_ty
    base = qkv_ptr + row * stride_qkv
    if group < GQ + GKV:  # q heads, or k heads (k heads follow the q heads in the fused projection)
        is_q = group < GQ
        head = tl.where(is_q, group, group - GQ) * HB + lanes  # the head's index among the q (or k) heads
        ok = (head < tl.where(is_q, HQ, HKV))[:, None]
        col = (tl.where(is_q, head, HQ + head) * D)[:, None]
        x1 = tl.load(base + col + half[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + col + D // 2 + half[None, :], mask=ok, other=0.0).to(tl.float32)
        w_off = tl.where(is_q, 0, D)  # q_norm weight, then k_norm weight, in one [2, D] buffer
        w1 = tl.load(w_ptr + w_off + half).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + w_off + D // 2 + half).to(tl.float32)[None, :]
        cos_a = tl.load(cos_ptr + row * stride_cs + half).to(tl.float32)[None, :]
        cos_b = tl.load(cos_ptr + row * stride_cs + D // 2 + half).to(tl.float32)[None, :]
        sin_a = tl.load(sin_ptr + row * stride_cs + half).to(tl.float32)[None, :]
        sin_b = tl.load(sin_ptr + row * stride_cs + D // 2 + half).to(tl.float32)[None, :]
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
        r = tl.math.rsqrt(var + eps)[:, None]
        # Every intermediate rounded to the model dtype as PyTorch stores it (a no-op for float32 models).
        n1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        n2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        # HF: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1); each product rounded, then the sum.
        o1 = (n1 * cos_a).to(dtype).to(tl.float32) + (-n2 * sin_a).to(dtype).to(tl.float32)
        o2 = (n2 * cos_b).to(dtype).to(tl.float32) + (n1 * sin_b).to(dtype).to(tl.float32)
        if is_q:
            q_out = q_ptr + row * stride_qn + head[:, None] * stride_qh + half[None, :]
            tl.store(q_out, o1.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(q_out + D // 2, o2.to(q_ptr.dtype.element_ty), mask=ok)
        else:
            slot = tl.load(slots_ptr + row).to(tl.int64)
            pos = tl.load(pos_ptr + row).to(tl.int64)
            k_out = kc_ptr + slot * stride_cs_slot + pos * stride_ct + head[:, None] * stride_ch + half[None, :]
            tl.store(k_out, o1.to(kc_ptr.dtype.element_ty), mask=ok)
            tl.store(k_out + D // 2, o2.to(kc_ptr.dtype.element_ty), mask=ok)
    else:  # v heads: stored as they are
        head = (group - GQ - GKV) * HB + lanes
        ok = (head < HKV)[:, None]
        full = tl.arange(0, D)[None, :]
        v = tl.load(base + (HQ + HKV + head)[:, None] * D + full, mask=ok, other=0.0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        out = vc_ptr + slot * stride_cs_slot + pos * stride_ct + head[:, None] * stride_ch
        tl.store(out + full, v.to(vc_ptr.dtype.element_ty), mask=ok)


QK_HEAD_GROUP = 8
"""Heads per program of :func:`qk_norm_rope_store`: a [8, D] tile per program keeps a verify step of many rows
at a few programs per row (one program per (row, head) is slower from 64 rows on: docs/benchmarks/kernels.md)."""


def qk_norm_rope_store(
    qkv: torch.Tensor,
    qk_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_slots: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_group: int | None = None,
) -> torch.Tensor:
    """q/k RMSNorm + rotary embedding of the fused projection qkv [N, (Hq + 2 Hkv) * D]; writes k and v into one
    layer's cache [S, T, Hkv, D] at (token_slots[i], positions[i]) and returns q [N, Hq, D]. cos, sin: [N, D];
    qk_norm_weight: [2, D] (q_norm's weight, then k_norm's). ``num_heads`` 0: qkv holds k and v only (a drafter's
    context append: keys normalised, rotated and stored, values stored). ``head_group``: heads per program (a power
    of two), None for :data:`QK_HEAD_GROUP` (bench/bench_qk_norm_rope.py times others)."""
    num = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    # At least one head's room, so that the kernel never gets an empty (null) pointer; returned as [N, Hq, D].
    q_room = torch.empty((num, max(num_heads, 1), head_dim), dtype=qkv.dtype, device=qkv.device)
    q = q_room[:, :num_heads]
    if num == 0:
        return q
    if head_dim & (head_dim - 1):
        raise ValueError(f"qk_norm_rope_store: head_dim must be a power of two, got {head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or qkv.stride(-1) != 1:
        raise ValueError("qk_norm_rope_store: caches must share strides, last axes must be contiguous")
    cos, sin = cos.contiguous(), sin.contiguous()
    if head_group is not None and (head_group < 1 or head_group & (head_group - 1)):
        raise ValueError(f"qk_norm_rope_store: head_group must be a power of two, got {head_group}")
    group = min(head_group or QK_HEAD_GROUP, triton.next_power_of_2(max(num_heads, num_kv_heads)))
    groups = triton.cdiv(num_heads, group) + 2 * triton.cdiv(num_kv_heads, group)
    _qk_norm_rope_store_kernel[(num, groups)](
        qkv,
        qkv.stride(0),
        qk_norm_weight.contiguous(),
        cos,
        sin,
        cos.stride(0),
        q_room,
        q_room.stride(0),
        q_room.stride(1),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        token_slots,
        positions,
        float(eps),
        HQ=num_heads,
        HKV=num_kv_heads,
        D=head_dim,
        HB=group,
        num_warps=2,
        **pdl_options(qkv.device, num),
    )
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (a * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused projection [N, 2 I] (gate first) -> [N, I] (HF: act_fn(gate) * up)."""
    num, width = gate_up.shape
    inter = width // 2
    out = torch.empty((num, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num == 0:
        return out
    block = 1024
    _silu_mul_kernel[(num, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
        **pdl_options(out.device, num),
    )
    return out


def stack_into_views(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """Stack the Linear weights along the output axis into one tensor (the fused projections' weight) and make
    each module's weight a view of it, so that nothing is held twice; ``requires_grad`` is kept."""
    stacked = torch.cat([lin.weight.detach() for lin in linears])
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(stacked[offset : offset + rows], requires_grad=lin.weight.requires_grad)
        offset += rows
    return stacked
