"""Triton rejection sampler: the contract of :mod:`kernels.rejection`, reading the target logits ~once.

Four launches, so that the big logits tensor is read once in full plus one row per sampled request:
1. ``_row_stats_kernel``, one program per target row: greedy rows get their argmax; sampled rows get
   max z, the normaliser of the kept set and the keep threshold tau (top-k / top-p) in one streaming pass
   over the vocabulary (plus search passes only for rows that use top-k or top-p, see below).
2. ``_accept_chain_kernel``, one program per request: the short accept chain from scalars (p_t and p_d at the
   draft tokens, one uniform each) up to the first rejection; writes the accepted drafts, the count, and for
   greedy requests the final argmax token.
3. ``_race_kernel``, programs (sampled request, vocabulary split): the exponential race on its split of the
   residual (or bonus) row, as norm * max(0, p_t - p_d) * (1 / E_v): the same argmax as the normalised
   residual with one division per token; sparse draft entries are scattered into the chunk they fall in.
4. ``_finalize_kernel``, one program per request: combines the per-split race winners.

Top-k / top-p thresholds are found exactly without sorting: the keep threshold is the largest order key t
(see :mod:`kernels.float_keys`) with count(z >= t) >= k, respectively mass(z >= t) >= p * mass(top-k set).
Both functions are monotone in t, so a 16-ary search over the int32 key range (<= 8 passes over the row,
16 candidate thresholds counted per pass; 256-ary under the interpreter) lands on the exact data value, ties
included. Rows without top-k / top-p skip this entirely.

Kernels load in the storage dtype and upcast to float32 before any arithmetic, mask every load, and use a
single launch configuration (no autotuning), so that they also run under ``TRITON_INTERPRET=1`` on CPU. The
float canonicalisation and order keys of :mod:`kernels.float_keys` are written out inside the vocabulary
loops: under the interpreter every device-function call costs about a millisecond.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.float_keys import tl_key_to_float, tl_ordered_key
from kernels.launch import interpreting, launch_options
from kernels.rejection import RejectionOutput, _row_layout, validate_rejection_inputs
from kernels.rng import STREAM_ACCEPT, STREAM_TARGET_SAMPLE, tl_row_key, tl_uniform

_ACCEPT = tl.constexpr(STREAM_ACCEPT)
_TARGET = tl.constexpr(STREAM_TARGET_SAMPLE)
_NCAND_GPU = 16  # candidate thresholds per search pass: a [BLOCK_S, 16] tile stays in registers
_NCAND_INTERPRETER = 256  # numpy does not care about tile size, but every pass costs interpreter overhead
TUNING = {"row_block_v": 4096, "row_warps": 8, "race_block_v": 2048, "race_warps": 8, "split_size": 16384}
"""Launch sizes (one fixed configuration, no autotuning); bench/bench_kernels.py --sweep measures others."""

PROBS_NONE, PROBS_DENSE, PROBS_SPARSE = 0, 1, 2  # how the draft distribution arrives (kernel constexpr)
_DENSE = tl.constexpr(PROBS_DENSE)
_SPARSE = tl.constexpr(PROBS_SPARSE)


@triton.jit
def _mass_at_least(row_ptr, V, temp, z_max, lo, BLOCK_S: tl.constexpr):
    """sum of exp(z - z_max) over tokens whose order key is >= lo."""
    acc = tl.zeros([BLOCK_S], tl.float32)
    for start in range(0, V, BLOCK_S):
        idx = start + tl.arange(0, BLOCK_S)
        mask = idx < V
        z = tl.math.div_rn(tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32), temp)
        z = tl.where(z == 0.0, 0.0, z)
        bits = z.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        acc += tl.where(mask & (key >= lo), tl.exp(z - z_max), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _search_threshold(
    row_ptr,
    V,
    temp,
    z_max,
    lo,
    hi,
    target,
    USE_MASS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NCAND: tl.constexpr,
):
    """Largest int32 key t in [lo, hi] with f(t) >= target, f(t) = count or mass of {key(z) >= t}.

    Requires f(lo) >= target (not re-checked) and f non-increasing; NCAND candidates per pass over the row.
    """
    j = tl.arange(0, NCAND).to(tl.int64)
    while lo < hi:
        step = (hi.to(tl.int64) - lo.to(tl.int64) + NCAND - 1) // NCAND
        cand = tl.minimum(lo.to(tl.int64) + 1 + j * step, hi.to(tl.int64) + 1).to(tl.int32)
        acc = tl.zeros([NCAND], tl.float32)
        for start in range(0, V, BLOCK_S):
            idx = start + tl.arange(0, BLOCK_S)
            mask = idx < V
            z = tl.math.div_rn(tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32), temp)
            z = tl.where(z == 0.0, 0.0, z)
            bits = z.to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            w = tl.where(mask, tl.exp(z - z_max) if USE_MASS else 1.0, 0.0)
            hit = key[:, None] >= cand[None, :]
            acc += tl.sum(tl.where(hit, w[:, None], 0.0), axis=0)
        ok = acc >= target
        new_lo = tl.max(tl.where(ok, cand, lo), 0)
        hi = tl.min(tl.where(ok, hi + 1, cand), 0) - 1
        lo = new_lo
    return lo


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    stride_row,
    row_req_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    argmax_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    V,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NCAND: tl.constexpr,
):
    row = tl.program_id(0)
    req = tl.load(row_req_ptr + row)
    temp = tl.load(temperature_ptr + req)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK_V)
    if temp == 0.0:
        # argmax as one max-reduction over (value key, 2**31 - 1 - index) packed in int64: ties -> lower index
        best = tl.full((), -9223372036854775808, tl.int64)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            best = tl.maximum(best, tl.max((key.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64), 0))
        tl.store(argmax_ptr + row, 0x7FFFFFFF - (best & 0x7FFFFFFF).to(tl.int32))
    else:
        z_max = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            mask = idx < V
            z = tl.math.div_rn(tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32), temp)
            z = tl.where(z == 0.0, 0.0, z)
            new_max = tl.maximum(z_max, tl.max(z, 0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            total = total * tl.exp(z_max - safe_max) + tl.sum(tl.exp(z - safe_max), 0)
            z_max = new_max
        top_k = tl.load(top_k_ptr + req)
        top_p = tl.load(top_p_ptr + req)
        use_k = (top_k > 0) & (top_k < V)
        use_p = top_p < 1.0
        lo = tl_ordered_key(tl.full((), float("-inf"), tl.float32))  # f(lo) = every token
        hi = tl_ordered_key(z_max)
        if use_k:
            lo = _search_threshold(
                row_ptr, V, temp, z_max, lo, hi, top_k.to(tl.float32), False, BLOCK_S, NCAND
            )
        if use_p:
            kept_mass = _mass_at_least(row_ptr, V, temp, z_max, lo, BLOCK_S)
            lo = _search_threshold(row_ptr, V, temp, z_max, lo, hi, top_p * kept_mass, True, BLOCK_S, NCAND)
        tau = tl.full((), float("-inf"), tl.float32)
        if use_k | use_p:
            tau = tl_key_to_float(lo)
            total = _mass_at_least(row_ptr, V, temp, z_max, lo, BLOCK_S)
        tl.store(zmax_ptr + row, z_max)
        tl.store(norm_ptr + row, total)
        tl.store(tau_ptr + row, tau)


@triton.jit
def _accept_chain_kernel(
    logits_ptr,
    stride_row,
    draft_ids_ptr,
    probs_ptr,
    stride_probs,
    prob_ids_ptr,
    cu_ptr,
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    argmax_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    out_ptr,
    num_acc_ptr,
    K,
    PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per request: accept drafts left to right until the first rejection; greedy requests finish here."""
    r = tl.program_id(0)
    temp = tl.load(temperature_ptr + r)
    d0 = tl.load(cu_ptr + r)
    num_draft = (tl.load(cu_ptr + r + 1) - d0).to(tl.int32)
    row0 = d0 + r
    seed = tl.load(seeds_ptr + r)
    position = tl.load(positions_ptr + r)
    greedy = temp == 0.0
    offs_k = tl.arange(0, BLOCK_K)
    zero = tl.full((), 0, tl.int32)
    n_acc = tl.full((), 0, tl.int32)
    alive = tl.full((), 1, tl.int32)
    for k in range(0, num_draft):
        row = row0 + k
        j = d0 + k
        x = tl.load(draft_ids_ptr + j)
        if greedy:
            accepted = x == tl.load(argmax_ptr + row)
        else:
            z = tl.math.div_rn(tl.load(logits_ptr + row * stride_row + x).to(tl.float32), temp)
            z = tl.where(z == 0.0, 0.0, z)
            p_t = tl.where(
                z >= tl.load(tau_ptr + row),
                tl.math.div_rn(tl.exp(z - tl.load(zmax_ptr + row)), tl.load(norm_ptr + row)),
                0.0,
            )
            if PROBS == _DENSE:
                p_d = tl.load(probs_ptr + j * stride_probs + x)
            elif PROBS == _SPARSE:
                ids = tl.load(prob_ids_ptr + j * stride_probs + offs_k, mask=offs_k < K, other=-1)
                probs = tl.load(probs_ptr + j * stride_probs + offs_k, mask=offs_k < K, other=0.0)
                p_d = tl.sum(tl.where(ids == x, probs, 0.0), 0)
            else:
                p_d = tl.full((), 0.0, tl.float32)
            u = tl_uniform(tl_row_key(seed, position + 1 + k, _ACCEPT), zero)
            accepted = u * p_d < p_t
        alive = alive & accepted.to(tl.int32)
        n_acc += alive
        if alive == 1:
            tl.store(out_ptr + row, x)
    tl.store(num_acc_ptr + r, n_acc.to(tl.int64))
    if greedy:
        tl.store(out_ptr + row0 + n_acc, tl.load(argmax_ptr + row0 + n_acc).to(tl.int64))


@triton.jit
def _race_kernel(
    logits_ptr,
    stride_row,
    probs_ptr,
    stride_probs,
    prob_ids_ptr,
    cu_ptr,
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    num_acc_ptr,
    part_ptr,
    V,
    K,
    split_size,
    num_splits,
    PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Exponential race on one vocabulary split of a sampled request's residual (or bonus) row."""
    r = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temperature_ptr + r)
    if temp != 0.0:
        d0 = tl.load(cu_ptr + r)
        num_draft = (tl.load(cu_ptr + r + 1) - d0).to(tl.int32)
        n_acc = tl.load(num_acc_ptr + r).to(tl.int32)
        sample_row = d0 + r + n_acc
        draft_row = d0 + n_acc
        bonus = n_acc == num_draft
        z_max = tl.load(zmax_ptr + sample_row)
        norm = tl.load(norm_ptr + sample_row)
        tau = tl.load(tau_ptr + sample_row)
        key = tl_row_key(tl.load(seeds_ptr + r), tl.load(positions_ptr + r) + 1 + n_acc, _TARGET)
        row_ptr = logits_ptr + sample_row * stride_row
        if PROBS == _SPARSE:
            # the bonus row has no draft distribution: load no sparse entries for it
            k_live = tl.where(bonus, 0, K)
            offs_k = tl.arange(0, BLOCK_K)
            ids = tl.load(prob_ids_ptr + draft_row * stride_probs + offs_k, mask=offs_k < k_live, other=-1)
            probs = tl.load(probs_ptr + draft_row * stride_probs + offs_k, mask=offs_k < k_live, other=0.0)
        # winners packed as (order key of the race key, 2**31 - 1 - index): one max-reduction, ties: lower id
        best_res = tl.full((), -9223372036854775808, tl.int64)
        best_fb = tl.full((), -9223372036854775808, tl.int64)
        lo_v = split * split_size
        hi_v = tl.minimum(lo_v + split_size, V)
        for start in range(lo_v, hi_v, BLOCK_V):
            idx = start + tl.arange(0, BLOCK_V)
            mask = idx < hi_v
            z = tl.math.div_rn(tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32), temp)
            z = tl.where(z == 0.0, 0.0, z)
            weight = tl.where(z >= tau, tl.exp(z - z_max), 0.0)  # = norm * p_t
            if PROBS == _DENSE:
                limit = tl.where(bonus, 0, hi_v)
                p_d = tl.load(probs_ptr + draft_row * stride_probs + idx, mask=idx < limit, other=0.0)
            elif PROBS == _SPARSE:
                # scatter the few sparse entries that fall into this chunk (usually none)
                here = (ids >= start) & (ids < start + BLOCK_V)
                p_d = tl.zeros([BLOCK_V], tl.float32)
                previous = tl.zeros((), tl.int64) + (start - 1)
                for _ in range(0, tl.sum(here.to(tl.int32), 0)):
                    current = tl.min(tl.where(here & (ids > previous), ids, 2147483647), 0)
                    p_d = tl.where(idx == current, tl.sum(tl.where(ids == current, probs, 0.0), 0), p_d)
                    previous = current
            else:
                p_d = tl.zeros([BLOCK_V], tl.float32)
            residual = tl.where(bonus, weight, tl.maximum(weight - norm * p_d, 0.0))
            inv_race = tl.math.div_rn(1.0, -tl.log(tl_uniform(key, idx)))
            low = (0x7FFFFFFF - idx).to(tl.int64)
            # keys are >= +0.0, whose float bits already order like the floats
            key_res = (residual * inv_race).to(tl.int32, bitcast=True).to(tl.int64)
            key_fb = (weight * inv_race).to(tl.int32, bitcast=True).to(tl.int64)
            best_res = tl.maximum(best_res, tl.max(tl.where(mask, (key_res << 32) | low, best_res), 0))
            best_fb = tl.maximum(best_fb, tl.max(tl.where(mask, (key_fb << 32) | low, best_fb), 0))
        tl.store(part_ptr + (r * num_splits + split) * 2, best_res)
        tl.store(part_ptr + (r * num_splits + split) * 2 + 1, best_fb)


@triton.jit
def _finalize_kernel(
    part_ptr, cu_ptr, temperature_ptr, num_acc_ptr, out_ptr, num_splits, BLOCK_SPLITS: tl.constexpr
):
    """Per sampled request: the race winner over all splits (an all-zero residual falls back to p_t)."""
    r = tl.program_id(0)
    if tl.load(temperature_ptr + r) != 0.0:
        offs = tl.arange(0, BLOCK_SPLITS)
        part = (r * num_splits + offs) * 2
        best_res = tl.max(tl.load(part_ptr + part, mask=offs < num_splits, other=-9223372036854775808), 0)
        best_fb = tl.max(tl.load(part_ptr + part + 1, mask=offs < num_splits, other=-9223372036854775808), 0)
        best = tl.where((best_res >> 32) > 0, best_res, best_fb)  # key bits > 0 <=> residual key > +0.0
        sample_row = tl.load(cu_ptr + r) + r + tl.load(num_acc_ptr + r)
        tl.store(out_ptr + sample_row, 0x7FFFFFFF - (best & 0x7FFFFFFF))


def _block(limit: int, size: int) -> int:
    """Power-of-two block no larger than ``limit`` and no larger than needed for ``size`` elements."""
    return max(16, min(limit, triton.next_power_of_2(max(size, 1))))


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_draft_lens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_prob_ids: torch.Tensor | None = None,
    validate: bool = True,
) -> RejectionOutput:
    """Triton rejection sampler; same signature, semantics and random numbers as the torch reference."""
    if validate:
        validate_rejection_inputs(
            target_logits,
            draft_token_ids,
            draft_probs,
            cu_draft_lens,
            temperature,
            top_k,
            top_p,
            seeds,
            positions,
            draft_prob_ids,
        )
    device = target_logits.device
    num_req = temperature.shape[0]
    num_draft = draft_token_ids.shape[0]
    rows, vocab = target_logits.shape
    num_acc = torch.zeros(num_req, dtype=torch.int64, device=device)
    out = torch.full((rows,), -1, dtype=torch.int64, device=device)
    if num_req == 0:
        return RejectionOutput(num_accepted=num_acc, output_tokens=out)

    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    cu = cu_draft_lens.to(torch.int64).contiguous()
    temps = temperature.to(torch.float32).contiguous()
    row_req, _ = _row_layout(cu, num_req, num_draft)
    row_req = row_req.to(torch.int32)
    ids = draft_token_ids.to(torch.int64).contiguous()
    if draft_probs is None or num_draft == 0:
        mode, probs, prob_ids, width = PROBS_NONE, temps, ids, 1
    elif draft_prob_ids is None:
        mode, probs, prob_ids, width = PROBS_DENSE, draft_probs.contiguous(), ids, vocab
    else:
        mode, probs, prob_ids, width = (
            PROBS_SPARSE,
            draft_probs.contiguous(),
            draft_prob_ids.to(torch.int64).contiguous(),
            draft_probs.shape[1],
        )

    seeds64 = seeds.to(torch.int64).contiguous()
    positions64 = positions.to(torch.int64).contiguous()
    argmax = torch.empty(rows, dtype=torch.int32, device=device)
    z_max = torch.empty(rows, dtype=torch.float32, device=device)
    norm = torch.empty(rows, dtype=torch.float32, device=device)
    tau = torch.empty(rows, dtype=torch.float32, device=device)
    options = launch_options()
    _row_stats_kernel[(rows,)](
        logits, logits.stride(0), row_req, temps, top_k.to(torch.int64).contiguous(),
        top_p.to(torch.float32).contiguous(), argmax, z_max, norm, tau, vocab,
        BLOCK_V=_block(TUNING["row_block_v"], vocab), BLOCK_S=_block(512, vocab),
        NCAND=_NCAND_INTERPRETER if interpreting() else _NCAND_GPU, num_warps=TUNING["row_warps"], **options,
    )  # fmt: skip
    block_k = _block(1024, width) if mode == PROBS_SPARSE else 16
    _accept_chain_kernel[(num_req,)](
        logits, logits.stride(0), ids, probs, width, prob_ids, cu, temps, seeds64, positions64,
        argmax, z_max, norm, tau, out, num_acc, width, PROBS=mode, BLOCK_K=block_k, num_warps=1, **options,
    )  # fmt: skip
    block_v = _block(TUNING["race_block_v"], vocab)
    split_size = triton.cdiv(min(TUNING["split_size"], vocab), block_v) * block_v
    num_splits = triton.cdiv(vocab, split_size)
    partials = torch.empty((num_req, num_splits, 2), dtype=torch.int64, device=device)
    _race_kernel[(num_req, num_splits)](
        logits, logits.stride(0), probs, width, prob_ids, cu, temps, seeds64, positions64, z_max, norm, tau,
        num_acc, partials, vocab, width, split_size, num_splits,
        PROBS=mode, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=TUNING["race_warps"], **options,
    )  # fmt: skip
    _finalize_kernel[(num_req,)](
        partials, cu, temps, num_acc, out, num_splits,
        BLOCK_SPLITS=_block(1 << 20, num_splits), num_warps=1, **options,
    )  # fmt: skip
    return RejectionOutput(num_accepted=num_acc, output_tokens=out)
