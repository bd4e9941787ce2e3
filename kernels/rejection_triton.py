"""Triton rejection sampler: the contract of :mod:`kernels.rejection`, reading the target logits ~once.

The big tensor is the target logits [N + R, V]; everything else is small. It is read once in full by the
statistics kernel, plus one row per sampled request by the inverse-CDF masses (about 1/(gamma + 1) more, with a
dense draft also its draft row; for a row filtered by top-k / top-p only the blocks holding kept tokens) and
one block of it by the draw, plus, for the rows that use top-k / top-p, the lane groups that can hold a token
above the candidate bound (a tenth of the row with top-k 50). Launches:

1. ``_row_stats_kernel``, programs (row, vocabulary split): every row of every request at once. Greedy rows
   keep a per-lane running argmax; sampled rows a per-lane online (max, sum exp) of z = logits * (1 / T),
   updated with one exp per token (``exp(min - max)`` serves both the rescale and the new term). Lanes are
   only reduced at the end of the split, so the loop is pure streaming. Rows with top-k / top-p also write a
   *sketch*: the maxima of NG disjoint groups of lanes, i.e. NG distinct entries of the split.
2. ``_row_combine_kernel``, one program per row: combines the splits into argmax, or max z and the
   normaliser. A filtered row then (same program: it needs nothing from other rows) turns the sketch into a
   lower bound L on the keep threshold (below), writes every token with z >= L (as packed (order key, id),
   see :mod:`kernels.float_keys`) to a per-row candidate buffer of CAP slots, reading only the sketch groups
   whose maximum is >= L (``_compact_candidates``), sorts the candidates and finds tau exactly (top-k: the
   k-th value; top-p: the crossing of the cumulative mass in descending order) and the normaliser of the
   kept set, plus a bitmap of the inverse-CDF blocks that hold kept tokens. Rows whose candidates do not
   certify the answer take the exact fallback search (below).
3. ``_accept_chain_kernel``, one program per request: the short accept chain from scalars (p_t and p_d at the
   draft tokens, one uniform each) up to the first rejection; writes the accepted drafts, the count, and for
   greedy requests the final argmax token.
4. ``_cdf_mass_kernel``, programs (sampled request, group of ``cdf_group`` blocks of CDF_BLOCK ids, read as
   one tile): over the one row the request draws from (the residual row after a rejection, else the bonus
   row), the mass of each block: sum of w = max(0, e - Z * p_d) with e = exp(z - max z) on kept tokens
   (z >= tau), and with drafts also the sum of e (for an all-zero residual). One exp per token, no random
   number and no log; a sparse draft's few ids in a block are applied in id order, a dense draft row is read
   alongside; blocks that the row's bitmap does not list have no kept token and are not read (mass 0).
5. ``_cdf_draw_kernel``, one program per sampled request: scans the block masses with uniform 0 (first block
   whose running mass exceeds u_0 * total), recomputes that block's weights (the same function as kernel 4,
   so they are bit for bit those summed) and scans them with uniform 1 against u_1 * the block's mass.

Why the draw is exact: P(block b) = M_b / sum M and P(v | b) = w_v / M_b, so the token follows norm(w) =
norm(max(0, p_t - p_d)) (p_t on the bonus row, p_d = 0) for any block size; the reference
(:func:`kernels.rejection.inverse_cdf_draw`) cuts the same blocks (``kernels.rejection.CDF_BLOCK``, read at
call time) and uses the same two uniforms, so the two differ only when a target lies within float rounding of
a running-sum boundary (the sums run in another order). Every scan takes the first entry of positive weight
past its target, or the last positive one when rounding lets the target pass the end, so no token of weight 0
(-inf logit, filtered out, zero residual) is drawn. If the residual is all zero (float rounding only), the
same draw runs on the kept masses and weights e, i.e. on p_t. Compared with an exponential race (one
counter-based uniform and two logs per token, which made the draw compute bound), the two passes over the
chosen row are memory bound, and the statistics loop is left exactly as it was (block bookkeeping inside it
slowed the big read: docs/CHANGELOG.md).

Why the top-k / top-p bound is exact. The sketch values of a row are distinct entries of it (disjoint lane
groups). If s_1 >= s_2 >= ... are the sorted sketch values, at least j entries are >= s_j, so the k-th
largest z (the top-k threshold tau_k) is >= s_k: L = s_k keeps every token of the top-k set, and top-p is
applied inside that set, so tau >= tau_k >= L. Without top-k, L = s_j for the first j whose sketch prefix
mass sum_{i<=j} exp(s_i - max z) reaches p * Z: the mass of {z >= s_j} is at least that prefix, hence the
top-p threshold tau_p (the largest t with mass(z >= t) >= p * Z) is >= L. So {z >= L} contains every kept
token; sorting it gives tau_k as its k-th value and tau_p at the crossing of the running mass, exactly the
reference's definitions. A row falls back to the exact search over the whole row (as slow as it sounds: a
16-ary search on the int32 order keys, <= 8 passes per threshold) when the bound does not exist (k larger
than the sketch, a top-p nucleus wider than the sketch can certify) or when more than CAP tokens are >= L.

Kernels load in the storage dtype and upcast to float32 before any arithmetic, mask every load, and use a
single launch configuration (no autotuning), so that they also run under ``TRITON_INTERPRET=1`` on CPU.
Every launch has a static grid and no host reads a device value, so the sampler can be captured in a CUDA
graph; the work for filtered rows is in the per-row combine kernel, skipped by rows without filters.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels import rejection as reference
from kernels.float_keys_triton import tl_key_to_float, tl_ordered_key, tl_pack_value_id
from kernels.launch import interpreting, launch_options
from kernels.rejection import RejectionOutput, validate_rejection_inputs
from kernels.rng import STREAM_ACCEPT, STREAM_TARGET_SAMPLE
from kernels.rng_triton import tl_row_key, tl_uniform

_ACCEPT = tl.constexpr(STREAM_ACCEPT)
_TARGET = tl.constexpr(STREAM_TARGET_SAMPLE)
_NCAND_GPU = 16  # fallback search: candidate thresholds per pass, a [BLOCK_S, 16] tile stays in registers
_NCAND_INTERPRETER = 256  # numpy does not care about tile size, but every pass costs interpreter overhead
_BIG = tl.constexpr(2147483647)
_INT64_MIN = tl.constexpr(-(2**63))
TUNING = {
    "row_block_v": 2048, "row_warps": 4, "row_splits": 4, "cdf_group": 1, "cdf_warps": 4, "select_tile": 8192,
    "select_warps": 4,
}  # fmt: skip
"""Launch sizes (one fixed configuration, no autotuning): for the statistics kernel the vocabulary block per loop
step, warps and the number of programs a row is split over; for the inverse-CDF masses the blocks per program
and warps (the block itself is ``kernels.rejection.CDF_BLOCK``, shared with the reference); for the combine
kernel (which also compacts and thresholds filtered rows) the ids per compaction tile, read at once (whole
chunks of one sketch group in one block), and warps. The statistics sizes were set from
``bench/bench_kernels.py --sweep --tune`` on an H200, the inverse-CDF and compaction ones from ``--sweep cdf
select --tune`` there (the sweep's results: docs/benchmarks/kernels.md)."""
SKETCH_GROUPS = 128
"""Sketch entries per (row, split) of a filtered row (fewer when a split has fewer lanes)."""
CANDIDATES = 2048
"""Candidate slots per filtered row: rows with more tokens above the bound take the fallback search."""

PROBS_NONE, PROBS_DENSE, PROBS_SPARSE = 0, 1, 2  # how the draft distribution arrives (kernel constexpr)
_DENSE = tl.constexpr(PROBS_DENSE)
_SPARSE = tl.constexpr(PROBS_SPARSE)
# per-row threshold state: no filter; tau from the fallback search; tau from the candidates, whose inverse-CDF
# blocks are listed in a bitmap (the mass kernel reads only those blocks of the row)
_DONE, _SEARCH, _LISTED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _filters(top_k_ptr, top_p_ptr, req, V):
    """(top_k, top_p, use_k, use_p) of request ``req``."""
    top_k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    return top_k, top_p, (top_k > 0) & (top_k < V), top_p < 1.0


@triton.jit
def _request_of_row(cu_ptr, row, num_req):
    """The request owning target row ``row``: the largest r with cu[r] + r <= row (rows of r start there)."""
    lo = tl.zeros((), tl.int32)
    hi = num_req - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_ptr + mid) + mid <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    stride_row,
    cu_ptr,
    num_req,
    out_ptr,
    row_req_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_arg_ptr,
    sketch_ptr,
    V,
    split_size,
    num_splits,
    BLOCK_V: tl.constexpr,
    NG: tl.constexpr,
):
    """Per (row, split): argmax (greedy) or online (max z, sum exp(z - max)) and the sketch (filtered rows).

    Split 0 also records the row's request for the later kernels and initialises the row's output to -1."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    req = _request_of_row(cu_ptr, row, num_req)
    if split == 0:
        tl.store(row_req_ptr + row, req)
        tl.store(out_ptr + row, tl.full((), -1, tl.int64))
    temp = tl.load(temperature_ptr + req)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK_V)
    lo_v = split * split_size
    hi_v = tl.minimum(lo_v + split_size, V)  # splits are whole blocks: only the row's end needs a mask
    part = row * num_splits + split
    if temp == 0.0:
        # per lane: the first maximum (tokens arrive in increasing id order), reduced once at the end
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        arg = tl.full([BLOCK_V], _BIG, tl.int32)
        for start in range(lo_v, hi_v, BLOCK_V):
            idx = start + offs
            x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            arg = tl.where(better, idx, arg)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, arg, _BIG), 0)
        tl.store(part_max_ptr + part, top)
        tl.store(part_arg_ptr + part, tl.where(first == _BIG, lo_v, first))  # an all -inf split: its first id
    else:
        inv_t = tl.math.div_rn(1.0, temp)
        # lanes start at -FLT_MAX, not -inf: exp(min - max) is then never exp(-inf + inf), with no extra test
        m = tl.full([BLOCK_V], -3.4028234663852886e38, tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        for start in range(lo_v, hi_v, BLOCK_V):
            idx = start + offs
            z = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
            big = tl.maximum(m, z)
            e = tl.exp(tl.minimum(m, z) - big)
            s = tl.where(z > m, s * e + 1.0, s + e)
            m = big
        top = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - top), 0)
        tl.store(part_max_ptr + part, tl.where(total > 0.0, top, float("-inf")))  # an all -inf split
        tl.store(part_sum_ptr + part, total)
        _, _, use_k, use_p = _filters(top_k_ptr, top_p_ptr, req, V)
        if use_k | use_p:
            groups = tl.max(tl.reshape(m, [NG, BLOCK_V // NG]), 1)
            tl.store(sketch_ptr + part.to(tl.int64) * NG + tl.arange(0, NG), groups)


@triton.jit
def _row_combine_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_arg_ptr,
    sketch_ptr,
    row_req_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    argmax_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    state_ptr,
    logits_ptr,
    stride_row,
    hits_ptr,
    cand_ptr,
    listed_ptr,
    V,
    split_size,
    num_splits,
    num_words,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_SKETCH: tl.constexpr,
    NG: tl.constexpr,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    TINY: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NCAND: tl.constexpr,
    BLOCK_V: tl.constexpr,
    W: tl.constexpr,
    CHUNKS: tl.constexpr,
    HIT_CHUNKS: tl.constexpr,
    CDF_BLOCK: tl.constexpr,
    NW: tl.constexpr,
):
    """Per row: combine the splits into argmax, or max z and the normaliser; for a filtered row also derive the
    candidate bound L from the sketch and find the exact tau and the kept set's normaliser (one launch for
    both: they need nothing from other rows)."""
    row = tl.program_id(0)
    req = tl.load(row_req_ptr + row)
    temp = tl.load(temperature_ptr + req)
    offs = tl.arange(0, BLOCK_SPLITS)
    live = offs < num_splits
    part = row * num_splits + offs
    tops = tl.load(part_max_ptr + part, mask=live, other=float("-inf"))
    top = tl.max(tops, 0)
    state = tl.full((), _DONE, tl.int32)
    if temp == 0.0:
        args = tl.load(part_arg_ptr + part, mask=live, other=_BIG)
        tl.store(argmax_ptr + row, tl.min(tl.where(live & (tops == top), args, _BIG), 0))
    else:
        safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(tl.load(part_sum_ptr + part, mask=live, other=0.0) * tl.exp(tops - safe), 0)
        tl.store(zmax_ptr + row, top)
        tau = tl.full((), float("-inf"), tl.float32)
        norm = total
        top_k, top_p, use_k, use_p = _filters(top_k_ptr, top_p_ptr, req, V)
        if use_k | use_p:
            n_sketch = num_splits * NG
            pos = tl.arange(0, BLOCK_SKETCH)
            sketch = tl.load(sketch_ptr + row.to(tl.int64) * n_sketch + pos, mask=pos < n_sketch,
                             other=float("-inf"))  # fmt: skip
            ordered = tl.sort(sketch, descending=True)
            if use_k:
                # the k-th sketch value: k distinct entries are >= it, so it is <= the k-th largest z
                j = tl.where(top_k <= n_sketch, top_k.to(tl.int32) - 1, _BIG)
            else:
                mass = tl.cumsum(tl.where(pos < n_sketch, tl.exp(ordered - safe), 0.0), 0)
                j = tl.min(tl.where(mass >= top_p * total, pos, _BIG), 0)
            tau, norm, state = _keep_threshold(
                logits_ptr + row.to(tl.int64) * stride_row, sketch, hits_ptr, cand_ptr, listed_ptr, row, j < _BIG,
                tl.sum(tl.where(pos == j, ordered, 0.0), 0), tl.math.div_rn(1.0, temp), top, total, top_k, top_p,
                use_k, use_p, V, split_size, num_words, CAP, SMALL, TINY, BLOCK_S, NCAND, BLOCK_V, NG,
                W, CHUNKS, HIT_CHUNKS, BLOCK_SKETCH, CDF_BLOCK, NW,
            )  # fmt: skip
        tl.store(tau_ptr + row, tau)
        tl.store(norm_ptr + row, norm)
    tl.store(state_ptr + row, state)


@triton.jit
def _bit_or(a, b):
    """Combine function of a bitwise-or reduction."""
    return a | b


@triton.jit
def _compact_candidates(
    row_ptr,
    sketch,
    hits_ptr,
    cand_ptr,
    row,
    bound,
    inv_t,
    V,
    split_size,
    BLOCK_V: tl.constexpr,
    NG: tl.constexpr,
    W: tl.constexpr,
    CHUNKS: tl.constexpr,
    HIT_CHUNKS: tl.constexpr,
    BLOCK_SKETCH: tl.constexpr,
    CAP: tl.constexpr,
):
    """Write every token of a filtered row with z >= L to its candidates (packed, any order); returns how many.

    Sketch group g of split s holds the W lanes g * W .. g * W + W - 1 of every block of the split, and its sketch
    value is the largest z among them, so a token with z >= L lies in a group whose sketch value is >= L: only
    those groups are read (with top-k 50 about 50 of 512, a tenth of the row). The hit groups are listed first
    (``hits_ptr``, BLOCK_SKETCH entries); their chunks (one group in one block: W contiguous ids) are read CHUNKS
    at a time as one [CHUNKS, W] tile, all its loads in flight at once, and only tested against L there (few
    registers per id, so many ids in flight). The chunks holding a candidate (a few per tile) are listed
    (``hits_ptr + BLOCK_SKETCH``) and re-read, HIT_CHUNKS at a time (cache hits), to write their candidates
    with slots from a prefix sum, no atomics. The set written is exactly {z >= L}, whatever the order."""
    pos = tl.arange(0, BLOCK_SKETCH)
    hit = sketch >= bound  # the sketch padding is -inf, below any bound
    tl.store(hits_ptr + tl.cumsum(hit.to(tl.int32), 0) - 1, pos, mask=hit)
    tl.debug_barrier()  # the list is read back by other threads of this program
    blocks = split_size // BLOCK_V  # chunks per group (the last split's ends past V are masked)
    n_chunks = tl.sum(hit.to(tl.int32), 0) * blocks
    lanes = tl.arange(0, W)[None, :]
    chunk_list = hits_ptr + BLOCK_SKETCH
    base = cand_ptr + row.to(tl.int64) * CAP
    count = tl.zeros((), tl.int32)
    for first in range(0, n_chunks, CHUNKS):
        chunk = first + tl.arange(0, CHUNKS)
        group = tl.load(hits_ptr + chunk // blocks, mask=chunk < n_chunks, other=0)
        start = (group // NG) * split_size + (chunk % blocks) * BLOCK_V + (group % NG) * W
        idx = start[:, None] + lanes
        live = (chunk < n_chunks)[:, None] & (idx < V)
        z = tl.load(row_ptr + idx, mask=live, other=float("-inf")).to(tl.float32) * inv_t
        held = tl.max((live & (z >= bound)).to(tl.int32), 1)  # chunks holding a candidate
        n_held = tl.sum(held, 0)
        if n_held > 0:
            tl.store(chunk_list + tl.cumsum(held, 0) - 1, start, mask=held != 0)
            tl.debug_barrier()  # the chunk list is read back by other threads
            for again in range(0, n_held, HIT_CHUNKS):
                slot_c = again + tl.arange(0, HIT_CHUNKS)
                start_c = tl.load(chunk_list + slot_c, mask=slot_c < n_held, other=0)
                idx_c = start_c[:, None] + lanes
                live_c = (slot_c < n_held)[:, None] & (idx_c < V)
                z_c = tl.load(row_ptr + idx_c, mask=live_c, other=float("-inf")).to(tl.float32) * inv_t
                take = tl.reshape(live_c & (z_c >= bound), [HIT_CHUNKS * W]).to(tl.int32)
                slot = count + tl.cumsum(take, 0) - 1
                packed = tl_pack_value_id(tl.reshape(tl.where(z_c == 0.0, 0.0, z_c), [HIT_CHUNKS * W]),
                                          tl.reshape(idx_c, [HIT_CHUNKS * W]))  # fmt: skip
                tl.store(base + slot, packed, mask=(take != 0) & (slot < CAP))
                count += tl.sum(take, 0)
            tl.debug_barrier()  # the chunk list is rewritten by the next tile
    return count


@triton.jit
def _mass_at_least(row_ptr, V, inv_t, z_max, lo, BLOCK_S: tl.constexpr):
    """sum of exp(z - z_max) over tokens whose order key is >= lo."""
    acc = tl.zeros([BLOCK_S], tl.float32)
    for start in range(0, V, BLOCK_S):
        idx = start + tl.arange(0, BLOCK_S)
        mask = idx < V
        z = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        z = tl.where(z == 0.0, 0.0, z)
        bits = z.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        acc += tl.where(mask & (key >= lo), tl.exp(z - z_max), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _search_threshold(
    row_ptr,
    V,
    inv_t,
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
            z = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
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
def _candidate_threshold(
    cand_ptr,
    listed_ptr,
    row,
    count,
    z_max,
    total_all,
    top_k,
    top_p,
    use_k,
    use_p,
    num_words,
    CAP: tl.constexpr,
    SIZE: tl.constexpr,
    CDF_BLOCK: tl.constexpr,
    NW: tl.constexpr,
):
    """(found, tau, norm of the kept set) from a row's count <= SIZE candidates, sorted descending.

    Top-k: tau_k is the k-th candidate (fewer than k candidates only happens when fewer than k tokens are
    finite, and then the k-th largest z is -inf). Top-p: the crossing of the running mass within the
    candidates; not found when the mass of all candidates stays below p * total (float rounding).
    When found, also writes the row's inverse-CDF blocks holding a kept candidate as a bitmap of num_words
    int32 words: every token of positive weight (z >= tau, z finite) is a candidate, since tau >= L, so the
    other blocks have mass 0 and the mass kernel need not read them."""
    pos = tl.arange(0, SIZE)
    valid = pos < count
    cands = tl.load(cand_ptr + row.to(tl.int64) * CAP + pos, mask=valid, other=_INT64_MIN)
    cands = tl.sort(cands, descending=True)  # value descending, then id ascending; invalid last
    key = (cands >> 32).to(tl.int32)
    z = tl.where(valid, tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True), float("-inf"))
    kth = tl.sum(tl.where(pos == top_k.to(tl.int32) - 1, z, 0.0), 0)
    tau_k = tl.where(use_k & (top_k <= count), kth, float("-inf"))
    weight = tl.where(z >= tau_k, tl.exp(z - z_max), 0.0)
    total = tl.where(use_k, tl.sum(weight, 0), total_all)
    mass = tl.cumsum(weight, 0)
    first = tl.min(tl.where(valid & (mass >= top_p * total), pos, _BIG), 0)
    tau_p = tl.where(use_p & (first < _BIG), tl.sum(tl.where(pos == first, z, 0.0), 0), float("-inf"))
    tau = tl.maximum(tau_k, tau_p)
    found = (first < _BIG) | (use_p == 0)
    block = (0x7FFFFFFF - (cands & 0xFFFFFFFF).to(tl.int32)) // CDF_BLOCK
    word = tl.arange(0, NW)
    bits = tl.where((valid & (z >= tau))[:, None] & ((block // 32)[:, None] == word[None, :]),
                    1 << (block % 32)[:, None], 0)  # fmt: skip
    tl.store(listed_ptr + row.to(tl.int64) * num_words + word, tl.reduce(bits, 0, _bit_or),
             mask=word < tl.where(found, num_words, 0))  # fmt: skip
    return found, tau, tl.sum(tl.where(z >= tau, tl.exp(z - z_max), 0.0), 0)


@triton.jit
def _keep_threshold(
    row_ptr,
    sketch,
    hits_ptr,
    cand_ptr,
    listed_ptr,
    row,
    certified,
    bound,
    inv_t,
    z_max,
    total_all,
    top_k,
    top_p,
    use_k,
    use_p,
    V,
    split_size,
    num_words,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    TINY: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NCAND: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NG: tl.constexpr,
    W: tl.constexpr,
    CHUNKS: tl.constexpr,
    HIT_CHUNKS: tl.constexpr,
    BLOCK_SKETCH: tl.constexpr,
    CDF_BLOCK: tl.constexpr,
    NW: tl.constexpr,
):
    """(tau, normaliser of the kept set, state) of a filtered row: the candidates {z >= L} sorted when the sketch
    certified L, else (or when they do not settle it) the fallback search. State _LISTED: tau came from the
    candidates and the row's bitmap of inverse-CDF blocks holding kept tokens is written."""
    state = tl.full((), _SEARCH, tl.int32)
    tau = tl.full((), float("-inf"), tl.float32)
    norm = total_all
    count = tl.zeros((), tl.int32)
    if certified:
        count = _compact_candidates(
            row_ptr, sketch, hits_ptr + row.to(tl.int64) * (BLOCK_SKETCH + CHUNKS), cand_ptr, row, bound, inv_t, V,
            split_size, BLOCK_V, NG, W, CHUNKS, HIT_CHUNKS, BLOCK_SKETCH, CAP,
        )  # fmt: skip
        tl.debug_barrier()  # the candidates were written by other threads of this program
    if certified & (count <= CAP):
        if count <= TINY:  # the usual case (top-k 50: about 55 candidates): sort a short buffer
            found, tau, norm = _candidate_threshold(
                cand_ptr, listed_ptr, row, count, z_max, total_all, top_k, top_p, use_k, use_p, num_words,
                CAP, TINY, CDF_BLOCK, NW,
            )  # fmt: skip
        elif count <= SMALL:
            found, tau, norm = _candidate_threshold(
                cand_ptr, listed_ptr, row, count, z_max, total_all, top_k, top_p, use_k, use_p, num_words,
                CAP, SMALL, CDF_BLOCK, NW,
            )  # fmt: skip
        else:
            found, tau, norm = _candidate_threshold(
                cand_ptr, listed_ptr, row, count, z_max, total_all, top_k, top_p, use_k, use_p, num_words,
                CAP, CAP, CDF_BLOCK, NW,
            )  # fmt: skip
        # not found: the top-p crossing lies below the candidates (float rounding): search
        state = tl.where(found, _LISTED, _SEARCH)
    if state == _SEARCH:
        lo = tl_ordered_key(tl.full((), float("-inf"), tl.float32))  # f(lo) = every token
        hi = tl_ordered_key(z_max)
        if use_k:
            lo = _search_threshold(row_ptr, V, inv_t, z_max, lo, hi, top_k.to(tl.float32), False, BLOCK_S, NCAND)
        if use_p:
            kept_mass = _mass_at_least(row_ptr, V, inv_t, z_max, lo, BLOCK_S)
            lo = _search_threshold(row_ptr, V, inv_t, z_max, lo, hi, top_p * kept_mass, True, BLOCK_S, NCAND)
        tau = tl_key_to_float(lo)
        norm = _mass_at_least(row_ptr, V, inv_t, z_max, lo, BLOCK_S)
    return tau, norm, state


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
    inv_t = tl.math.div_rn(1.0, tl.where(greedy, 1.0, temp))
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
            z = tl.load(logits_ptr + row * stride_row + x).to(tl.float32) * inv_t
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
def _draw_row(cu_ptr, num_acc_ptr, r):
    """(sample row, draft row, bonus) of request ``r``'s residual or bonus draw, once its chain is known."""
    d0 = tl.load(cu_ptr + r)
    n_acc = tl.load(num_acc_ptr + r)
    return d0 + r + n_acc, d0 + n_acc, n_acc == tl.load(cu_ptr + r + 1) - d0


@triton.jit
def _block_weights(
    row_ptr,
    probs_row_ptr,
    ids,
    probs,
    idx,
    live,
    lo,
    hi,
    V,
    inv_t,
    z_max,
    norm,
    tau,
    bonus,
    PROBS: tl.constexpr,
):
    """(e, w) on the ids ``idx`` (a tile of any shape, inside lo .. hi - 1) of a draw row: the kept weights
    e = exp(z - max z) (0 off the kept set, where not ``live`` and past the end) and the residual weights
    w = max(0, e - Z * p_d) (w = e on the bonus row). Only ``live`` ids are read.

    Both draw kernels evaluate the weights with this one function, so the chosen block's recomputed weights
    are bit for bit those whose sum made it chosen (a block of positive mass has a positive entry)."""
    live = live & (idx < V)
    z = tl.load(row_ptr + idx, mask=live, other=float("-inf")).to(tl.float32) * inv_t
    e = tl.where(live & (z >= tau), tl.exp(z - z_max), 0.0)
    if PROBS == _DENSE:
        p_d = tl.load(probs_row_ptr + idx, mask=live & (idx < tl.where(bonus, 0, V)), other=0.0)
        w = tl.maximum(e - norm * p_d, 0.0)
    elif PROBS == _SPARSE:
        # scatter the few sparse entries that fall into this tile (usually none or one); duplicates add up
        # (off them p_d = 0 and w = max(e - Z * 0, 0) = e exactly: only their entries are computed)
        here = (ids >= lo) & (ids < hi)
        w = e
        previous = tl.zeros((), tl.int32) + (lo - 1)
        for _ in range(0, tl.sum(here.to(tl.int32), 0)):
            current = tl.min(tl.where(here & (ids > previous), ids, 2147483647), 0)
            p_d = tl.sum(tl.where(ids == current, probs, 0.0), 0)
            w = tl.where(idx == current, tl.maximum(w - norm * p_d, 0.0), w)  # w == e there: ids increase
            previous = current
    else:
        w = e
    return e, w


@triton.jit
def _first_positive_crossing(weight, cum, target, index):
    """The first index with running mass ``cum`` > target and positive weight; if rounding lets the target
    pass every entry, the last index of positive weight (0 when none has positive weight)."""
    first = tl.min(tl.where((cum > target) & (weight > 0.0), index, _BIG), 0)
    return tl.where(first < _BIG, first, tl.max(tl.where(weight > 0.0, index, 0), 0))


@triton.jit
def _cdf_mass_kernel(
    logits_ptr,
    stride_row,
    probs_ptr,
    stride_probs,
    prob_ids_ptr,
    cu_ptr,
    temperature_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    num_acc_ptr,
    state_ptr,
    listed_ptr,
    mass_ptr,
    emass_ptr,
    V,
    K,
    num_blocks,
    group,
    num_words,
    PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Per (sampled request, group of blocks): the residual mass sum w and (with drafts) the kept mass sum e
    of each block of BLOCK_V ids of its draw row. One exp per token, no random number, no log. A draw row whose
    kept set is listed (top-k / top-p from the candidates) reads only its listed blocks: the others hold no
    token of positive weight, so both their sums are 0 without a read."""
    r = tl.program_id(0)
    temp = tl.load(temperature_ptr + r)
    if temp != 0.0:
        inv_t = tl.math.div_rn(1.0, temp)
        sample_row, draft_row, bonus = _draw_row(cu_ptr, num_acc_ptr, r)
        z_max = tl.load(zmax_ptr + sample_row)
        norm = tl.load(norm_ptr + sample_row)
        tau = tl.load(tau_ptr + sample_row)
        row_ptr = logits_ptr + sample_row * stride_row
        ids = tl.zeros((), tl.int32)
        probs = tl.zeros((), tl.float32)
        if PROBS == _SPARSE:
            # the bonus row has no draft distribution: load no sparse entries for it
            offs_k = tl.arange(0, BLOCK_K)
            live = offs_k < tl.where(bonus, 0, K)
            ids = tl.load(prob_ids_ptr + draft_row * stride_probs + offs_k, mask=live, other=-1).to(tl.int32)
            probs = tl.load(probs_ptr + draft_row * stride_probs + offs_k, mask=live, other=0.0)
        listed = tl.load(state_ptr + sample_row) == _LISTED
        # the program's blocks, all read at once as one [GROUP, BLOCK_V] tile (no serial round trips)
        b = tl.program_id(1) * group + tl.arange(0, GROUP)
        end = tl.minimum(tl.program_id(1) * group + group, num_blocks)
        mine = b < end
        # an unlisted row reads every block: its "words" are all ones
        word = tl.load(listed_ptr + sample_row * num_words + b // 32, mask=b < tl.where(listed, end, 0), other=-1)
        read = mine & (((word >> (b % 32)) & 1) != 0)
        lo = tl.program_id(1) * group * BLOCK_V
        idx = b[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
        e, w = _block_weights(row_ptr, probs_ptr + draft_row * stride_probs, ids, probs, idx, read[:, None], lo,
                              lo + GROUP * BLOCK_V, V, inv_t, z_max, norm, tau, bonus, PROBS)  # fmt: skip
        tl.store(mass_ptr + r * num_blocks + b, tl.sum(w, 1), mask=mine)
        if PROBS != 0:
            tl.store(emass_ptr + r * num_blocks + b, tl.sum(e, 1), mask=mine)


@triton.jit
def _cdf_draw_kernel(
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
    mass_ptr,
    emass_ptr,
    out_ptr,
    V,
    K,
    num_blocks,
    PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per sampled request: the block by its running mass (uniform 0), then the token inside it by its running
    weight (uniform 1); p_t (the kept masses and weights) when the residual is all zero."""
    r = tl.program_id(0)
    temp = tl.load(temperature_ptr + r)
    if temp != 0.0:
        inv_t = tl.math.div_rn(1.0, temp)
        sample_row, draft_row, bonus = _draw_row(cu_ptr, num_acc_ptr, r)
        position = tl.load(positions_ptr + r) + 1 + tl.load(num_acc_ptr + r)
        key = tl_row_key(tl.load(seeds_ptr + r), position, _TARGET)
        zero = tl.full((), 0, tl.int32)
        offs = tl.arange(0, BLOCK_NB)
        mass = tl.load(mass_ptr + r * num_blocks + offs, mask=offs < num_blocks, other=0.0)
        fallback = tl.sum(mass, 0) <= 0.0
        if PROBS != 0:
            kept = tl.load(emass_ptr + r * num_blocks + offs, mask=offs < num_blocks, other=0.0)
            mass = tl.where(fallback, kept, mass)
        ids = tl.zeros((), tl.int32)
        probs = tl.zeros((), tl.float32)
        if PROBS == _SPARSE:  # loaded before the block is known: the loads overlap the scan
            offs_k = tl.arange(0, BLOCK_K)
            live = offs_k < tl.where(bonus, 0, K)
            ids = tl.load(prob_ids_ptr + draft_row * stride_probs + offs_k, mask=live, other=-1).to(tl.int32)
            probs = tl.load(probs_ptr + draft_row * stride_probs + offs_k, mask=live, other=0.0)
        b = _first_positive_crossing(mass, tl.cumsum(mass, 0), tl_uniform(key, zero) * tl.sum(mass, 0), offs)
        lo = b * BLOCK_V
        e, w = _block_weights(logits_ptr + sample_row * stride_row, probs_ptr + draft_row * stride_probs, ids, probs,
                              lo + tl.arange(0, BLOCK_V), True, lo, lo + BLOCK_V, V, inv_t,
                              tl.load(zmax_ptr + sample_row), tl.load(norm_ptr + sample_row),
                              tl.load(tau_ptr + sample_row), bonus, PROBS)  # fmt: skip
        w = tl.where(fallback, e, w)
        i = _first_positive_crossing(w, tl.cumsum(w, 0), tl_uniform(key, zero + 1) * tl.sum(w, 0),
                                     tl.arange(0, BLOCK_V))  # fmt: skip
        tl.store(out_ptr + sample_row, (b * BLOCK_V + i).to(tl.int64))


def _block(limit: int, size: int) -> int:
    """Power-of-two block no larger than ``limit`` and no larger than needed for ``size`` elements."""
    return max(16, min(limit, triton.next_power_of_2(max(size, 1))))


def _splits(vocab: int, block_v: int, splits: int) -> tuple[int, int]:
    """(split size in whole blocks, number of splits) for about ``splits`` equal splits of a vocabulary."""
    size = triton.cdiv(triton.cdiv(vocab, splits), block_v) * block_v
    return size, triton.cdiv(vocab, size)


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
    if num_req == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return RejectionOutput(num_accepted=empty, output_tokens=empty)
    # every entry of these is written by the kernels: out by the statistics kernel (-1) and the accept chain
    num_acc = torch.empty(num_req, dtype=torch.int64, device=device)
    out = torch.empty(rows, dtype=torch.int64, device=device)

    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    cu = cu_draft_lens.to(torch.int64).contiguous()
    temps = temperature.to(torch.float32).contiguous()
    top_k64 = top_k.to(torch.int64).contiguous()
    top_p32 = top_p.to(torch.float32).contiguous()
    row_req = torch.empty(rows, dtype=torch.int32, device=device)
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
    options = launch_options()

    if reference.CDF_BLOCK < 16 or reference.CDF_BLOCK & (reference.CDF_BLOCK - 1):
        raise ValueError(f"CDF_BLOCK must be a power of two >= 16, got {reference.CDF_BLOCK}")
    # the reference's inverse-CDF blocks (read at call time, tests change them); a smaller vocabulary is one block
    cdf_block = _block(reference.CDF_BLOCK, vocab)
    num_blocks = triton.cdiv(vocab, cdf_block)
    num_words = triton.cdiv(num_blocks, 32)  # of a row's bitmap of listed blocks

    # 1-2: per-row statistics and keep thresholds
    block_v = _block(TUNING["row_block_v"], vocab)
    split_size, num_splits = _splits(vocab, block_v, TUNING["row_splits"])
    groups = min(SKETCH_GROUPS, block_v)
    f32: dict[str, Any] = {"dtype": torch.float32, "device": device}
    part_max = torch.empty((rows, num_splits), **f32)
    part_sum = torch.empty((rows, num_splits), **f32)
    part_arg = torch.empty((rows, num_splits), dtype=torch.int32, device=device)
    sketch = torch.empty((rows, num_splits, groups), **f32)
    _row_stats_kernel[(rows, num_splits)](
        logits, logits.stride(0), cu, num_req, out, row_req, temps, top_k64, top_p32, part_max, part_sum,
        part_arg, sketch,
        vocab, split_size, num_splits, BLOCK_V=block_v, NG=groups, num_warps=TUNING["row_warps"], **options,
    )  # fmt: skip
    argmax = torch.empty(rows, dtype=torch.int32, device=device)
    z_max, norm, tau = (torch.empty(rows, **f32) for _ in range(3))
    state = torch.empty(rows, dtype=torch.int32, device=device)
    cap = min(CANDIDATES, _block(1 << 30, vocab))  # a row never has more candidates than tokens
    cands = torch.empty((rows, cap), dtype=torch.int64, device=device)
    listed = torch.empty((rows, num_words), dtype=torch.int32, device=device)  # read only where _LISTED
    lanes = block_v // groups
    block_sketch = _block(1 << 20, num_splits * groups)
    chunks = max(1, TUNING["select_tile"] // lanes)
    # a filtered row's lists: hit sketch groups, then the chunks of a tile that hold candidates
    hits = torch.empty((rows, block_sketch + chunks), dtype=torch.int32, device=device)
    _row_combine_kernel[(rows,)](
        part_max, part_sum, part_arg, sketch, row_req, temps, top_k64, top_p32, argmax, z_max, norm, tau, state,
        logits, logits.stride(0), hits, cands, listed, vocab, split_size, num_splits, num_words,
        BLOCK_SPLITS=_block(1 << 20, num_splits), BLOCK_SKETCH=block_sketch, NG=groups,
        CAP=cap, SMALL=min(cap, 256), TINY=min(cap, 64), BLOCK_S=_block(512, vocab),
        NCAND=_NCAND_INTERPRETER if interpreting() else _NCAND_GPU, BLOCK_V=block_v, W=lanes,
        CHUNKS=chunks, HIT_CHUNKS=min(chunks, 16), CDF_BLOCK=cdf_block, NW=triton.next_power_of_2(num_words),
        num_warps=TUNING["select_warps"], **options,
    )  # fmt: skip

    # 3: accept chains
    block_k = _block(1024, width) if mode == PROBS_SPARSE else 16
    _accept_chain_kernel[(num_req,)](
        logits, logits.stride(0), ids, probs, width, prob_ids, cu, temps, seeds64, positions64,
        argmax, z_max, norm, tau, out, num_acc, width, PROBS=mode, BLOCK_K=block_k, num_warps=1, **options,
    )  # fmt: skip

    # 4-5: residual / bonus draws by inverse CDF over the reference's blocks
    group = TUNING["cdf_group"]
    mass = torch.empty((num_req, num_blocks), **f32)
    emass = torch.empty((num_req, num_blocks), **f32) if mode != PROBS_NONE else mass
    _cdf_mass_kernel[(num_req, triton.cdiv(num_blocks, group))](
        logits, logits.stride(0), probs, width, prob_ids, cu, temps, z_max, norm, tau, num_acc, state, listed,
        mass, emass, vocab, width, num_blocks, group, num_words,
        PROBS=mode, BLOCK_V=cdf_block, BLOCK_K=block_k, GROUP=triton.next_power_of_2(group),
        num_warps=TUNING["cdf_warps"], **options,
    )  # fmt: skip
    _cdf_draw_kernel[(num_req,)](
        logits, logits.stride(0), probs, width, prob_ids, cu, temps, seeds64, positions64, z_max, norm, tau,
        num_acc, mass, emass, out, vocab, width, num_blocks,
        PROBS=mode, BLOCK_V=cdf_block, BLOCK_NB=_block(1 << 20, num_blocks), BLOCK_K=block_k, num_warps=4,
        **options,
    )  # fmt: skip
    return RejectionOutput(num_accepted=num_acc, output_tokens=out)
