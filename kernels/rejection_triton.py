"""Triton rejection sampler: the contract of :mod:`kernels.rejection`, reading the target logits ~once.

The big tensor is the target logits [N + R, V]; everything else is small. It is read once in full by the
statistics kernel; an unfiltered sparse (or draft-less, or bonus) draw then reads only K support logits, the
row's block masses and one block of BLOCK_V ids; an unfiltered dense residual draw reads its row and its draft
row once more (block masses, no per-entry random numbers); a raced draw (top-k / top-p) reads its row once
more, and filtered rows a second time for their threshold. Launches:

1. ``_row_stats_kernel``, programs (row, vocabulary split): every row of every request at once. Greedy rows
   keep a per-lane running argmax (reduced once at the end of the split). Sampled rows write, per block of
   BLOCK_V ids, the max of z = logits * (1 / T) and sum exp(z - block max) over the block's ids outside the
   row's sparse draft support (one exp per token; the few support ids in a block are dropped from it in id
   order); these block masses serve both the normaliser and the inverse-CDF draw. Rows with top-k / top-p
   also write a *sketch*: the maxima of NG disjoint groups of lanes, i.e. NG distinct entries of the split.
2. ``_row_combine_kernel``, one program per row: argmax from the splits, or max z and the normaliser Z from
   the blocks plus e at the distinct support ids; a filtered row then turns its sketch into a lower bound L on
   the keep threshold, writes every token with z >= L (packed (order key, id), :mod:`kernels.float_keys`) to
   CAP candidate slots, sorts them and finds tau exactly (top-k: the k-th value; top-p: the crossing of the
   cumulative mass in descending order) and the kept set's normaliser; rows whose candidates do not certify
   the answer take the exact fallback search (below).
3. ``_accept_chain_kernel``, one program per request: the short accept chain from scalars (p_t and p_d at the
   draft tokens, one uniform each) up to the first rejection; writes the accepted drafts and the count; then
   the final token of greedy requests (argmax) and of unfiltered requests whose residual differs from p_t on
   at most K known ids (sparse drafts, no drafts, bonus rows) by inverse CDF with one uniform (below).
4. ``_race_kernel``, programs (request, vocabulary split): for filtered requests the exponential race on its
   split of the residual (or bonus) row with per-lane winners, keys log w_v - log E_v as defined in
   :mod:`kernels.rejection` (w = norm * max(0, p_t - p_d); off the draft support log w_v = z_v - max z, so no
   exp and no division); for unfiltered dense residual rows the residual mass of each block of its split.
   Programs of requests drawn in the accept chain kernel (the product's sparse path) exit at once.
5. ``_finalize_kernel``, one program per request: combines the per-split race winners (with sparse drafts it
   also runs the fallback race for an all-zero residual, which can only be won inside the draft's support), or
   draws an unfiltered dense residual row by inverse CDF from its block masses and one block.

Why the inverse CDF is exact: with e_v = exp(z_v - max z), the residual weight is w_s = max(0, e_s - Z p_d(s))
on the support and w_v = e_v elsewhere, so its total is sum_s w_s + sum_b M_b with the block masses
M_b = exp(m_b - max z) * sum_{v in b, v not in S} exp(z_v - m_b), m_b the block's max: all read from the
statistics pass, none recomputed by subtraction (no cancellation). For t = u * total, u uniform, the first
token of the fixed order [support slots, blocks in id order] whose running weight exceeds t is distributed
exactly as norm(w); finding the block by its running mass and then the token inside it by the running sum
of exp(z_v - m_b) against (t - mass before the block) / exp(m_b - max z) is the same search, split in two. In
floats every search takes the first entry of positive weight past the target, or the last positive one when
rounding lets the target pass the end; inside a block the weights are in the block's own units, whose max
is exactly 1, so no chosen block is empty and no zero-weight (-inf, masked, or fully-covered) token is ever
drawn. A dense residual has no short support, so its block masses are sums of the residual weights
max(0, e_v - Z p_d(v)) themselves (race kernel), and the chosen block's weights are recomputed by the same
float operations (``_dense_weights``), so a block of positive mass has a positive entry. The reference
(:func:`kernels.rejection.inverse_cdf_draw`, ``dense_residual_draw``) runs the same search with the same uniform;
the two differ only where exp and the summation order round differently, i.e. when t lies within float
rounding of a boundary. The block partition only changes rounding too, so a swept ``row_block_v`` stays exact.

Why the race is exact: for independent E_v ~ Exp(1), P(argmax_v w_v / E_v = v) = w_v / sum_u w_u, and taking
logs does not move the argmax, so the winner of log w_v - log E_v is a draw from norm(w) without knowing the
normaliser; splits combine by a max. The reference evaluates the same keys from the same counter-based uniforms
(only exp / log rounding can differ in the last bit between torch and the GPU). The residual is all zero only if
every kept token v has p_t(v) <= p_d(v); with a sparse draft, a kept token outside the support has residual
p_t(v) > 0, so then every kept token is in the support and the p_t race over the support ids has the winner of
the p_t race over the whole vocabulary.

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
graph; the race launches run always and exit at once for requests that have nothing to do there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.float_keys import tl_key_to_float, tl_ordered_key
from kernels.launch import interpreting, launch_options
from kernels.rejection import RejectionOutput, validate_rejection_inputs
from kernels.rng import STREAM_ACCEPT, STREAM_TARGET_SAMPLE, tl_row_key, tl_uniform

_ACCEPT = tl.constexpr(STREAM_ACCEPT)
_TARGET = tl.constexpr(STREAM_TARGET_SAMPLE)
_NCAND_GPU = 16  # fallback search: candidate thresholds per pass, a [BLOCK_S, 16] tile stays in registers
_NCAND_INTERPRETER = 256  # numpy does not care about tile size, but every pass costs interpreter overhead
_BIG = tl.constexpr(2147483647)
_INT64_MIN = tl.constexpr(-(2**63))
TUNING = {
    "row_block_v": 2048, "row_warps": 4, "row_splits": 4, "race_block_v": 1024, "race_warps": 4, "race_splits": 16,
}  # fmt: skip
"""Launch sizes (one fixed configuration, no autotuning): vocabulary block per loop step, warps, and the number
of programs a row is split over (the statistics kernel runs every row, the race one row per request, so it
splits finer). ``row_block_v`` is also the inverse-CDF block (default = ``kernels.rejection.CDF_BLOCK``, so
the Triton draw follows the reference's rounding; any other value draws from the same distribution), and
``race_block_v`` the dense-residual one (``kernels.rejection.DENSE_CDF_BLOCK``, likewise). Set from
``bench/bench_kernels.py --sweep --tune`` on an H200 (docs/benchmarks/kernels.md)."""
SKETCH_GROUPS = 128
"""Sketch entries per (row, split) of a filtered row (fewer when a split has fewer lanes)."""
CANDIDATES = 2048
"""Candidate slots per filtered row: rows with more tokens above the bound take the fallback search."""
SUPPORT_CHUNK = 16
"""Sparse support slots compared at once against the whole support (duplicate detection, a [16, K] tile)."""

PROBS_NONE, PROBS_DENSE, PROBS_SPARSE = 0, 1, 2  # how the draft distribution arrives (kernel constexpr)
_DENSE = tl.constexpr(PROBS_DENSE)
_SPARSE = tl.constexpr(PROBS_SPARSE)
_CANDIDATES, _SEARCH = tl.constexpr(1), tl.constexpr(2)  # how a filtered row finds its threshold


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
def _support_chunk(
    prob_ids_ptr, base, c, k_live, ids, probs, row_ptr, inv_t, z_max, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Slots c .. c + CHUNK - 1 of a sparse draft row: (ids, slots, first occurrence of a live id, p_d summed
    over the row's duplicates of the id, e = exp(z - max z) at first occurrences and 0 elsewhere).

    ``ids`` / ``probs`` hold the whole row (BLOCK_K slots, dead slots -1 and 0). Duplicate ids count once, at
    their first slot, with their summed probability (the contract: duplicates add up)."""
    slot = c + tl.arange(0, CHUNK)
    live = slot < k_live
    ids_c = tl.load(prob_ids_ptr + base + slot, mask=live, other=-2)
    same = ids_c[:, None] == ids[None, :]
    earlier = same & (tl.arange(0, BLOCK_K)[None, :] < slot[:, None])
    first = live & (tl.max(earlier.to(tl.int32), 1) == 0)
    p_d = tl.sum(tl.where(same, probs[None, :], 0.0), 1)
    z = tl.load(row_ptr + ids_c, mask=live, other=float("-inf")).to(tl.float32) * inv_t
    return ids_c, slot, first, p_d, tl.where(first, tl.exp(z - z_max), 0.0)


@triton.jit
def _draws_by_cdf(top_k_ptr, top_p_ptr, req, V, bonus, PROBS: tl.constexpr):
    """Whether sampled request ``req`` draws by inverse CDF (else by the race): it is unfiltered and its
    residual differs from p_t on at most K known ids (sparse or no drafts, or the bonus row)."""
    _, _, use_k, use_p = _filters(top_k_ptr, top_p_ptr, req, V)
    cdf = (use_k | use_p) == 0
    if PROBS == _DENSE:
        cdf = cdf & bonus
    return cdf


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
    prob_ids_ptr,
    stride_probs,
    K,
    part_max_ptr,
    part_arg_ptr,
    bmax_ptr,
    bsum_ptr,
    sketch_ptr,
    V,
    split_size,
    num_splits,
    num_blocks,
    PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NG: tl.constexpr,
):
    """Per (row, split): argmax (greedy), or per vocabulary block of BLOCK_V ids the max and the sum of
    exp(z - block max) over the block's ids outside the row's sparse draft support (sampled), and the sketch
    (filtered rows).

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
        if PROBS == _SPARSE:
            # the support of this row's residual: draft row (row - req); the bonus row has none. The support
            # ids are visited in increasing order (nxt), usually zero or one per block.
            draft_row = row - req
            k_live = tl.where(draft_row < tl.load(cu_ptr + req + 1), K, 0)
            offs_k = tl.arange(0, BLOCK_K)
            ids = tl.load(prob_ids_ptr + draft_row.to(tl.int64) * stride_probs + offs_k, mask=offs_k < k_live,
                          other=_BIG)  # fmt: skip
            nxt = tl.min(tl.where(ids >= lo_v, ids, _BIG), 0)
        lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane, for the sketch
        for start in range(lo_v, hi_v, BLOCK_V):
            idx = start + offs
            z = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
            lane_max = tl.maximum(lane_max, z)
            if PROBS == _SPARSE:
                while nxt < start + BLOCK_V:
                    z = tl.where(idx == nxt, float("-inf"), z)
                    nxt = tl.min(tl.where(ids > nxt, ids, _BIG), 0)
            top = tl.max(z, 0)
            total = tl.sum(tl.exp(z - tl.where(top == float("-inf"), 0.0, top)), 0)
            block = row.to(tl.int64) * num_blocks + start // BLOCK_V
            tl.store(bmax_ptr + block, top)
            tl.store(bsum_ptr + block, total)
        _, _, use_k, use_p = _filters(top_k_ptr, top_p_ptr, req, V)
        if use_k | use_p:
            groups = tl.max(tl.reshape(lane_max, [NG, BLOCK_V // NG]), 1)
            tl.store(sketch_ptr + part.to(tl.int64) * NG + tl.arange(0, NG), groups)


@triton.jit
def _row_combine_kernel(
    logits_ptr,
    stride_row,
    cu_ptr,
    probs_ptr,
    prob_ids_ptr,
    stride_probs,
    K,
    part_max_ptr,
    part_arg_ptr,
    bmax_ptr,
    bsum_ptr,
    sketch_ptr,
    row_req_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    argmax_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    cand_ptr,
    V,
    num_splits,
    num_blocks,
    PROBS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
    BLOCK_SKETCH: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NCAND: tl.constexpr,
):
    """Per row: combine the splits (argmax) or the blocks and the support (max z, normaliser Z = sum of the
    block masses + e at the distinct support ids); for a filtered row derive the candidate bound L from the
    sketch and find the exact keep threshold and the kept set's normaliser (:func:`_keep_threshold`)."""
    row = tl.program_id(0)
    req = tl.load(row_req_ptr + row)
    temp = tl.load(temperature_ptr + req)
    if temp == 0.0:
        offs = tl.arange(0, BLOCK_SPLITS)
        live = offs < num_splits
        part = row * num_splits + offs
        tops = tl.load(part_max_ptr + part, mask=live, other=float("-inf"))
        args = tl.load(part_arg_ptr + part, mask=live, other=_BIG)
        tl.store(argmax_ptr + row, tl.min(tl.where(live & (tops == tl.max(tops, 0)), args, _BIG), 0))
    else:
        inv_t = tl.math.div_rn(1.0, temp)
        offs_b = tl.arange(0, BLOCK_NB)
        bmax = tl.load(bmax_ptr + row.to(tl.int64) * num_blocks + offs_b, mask=offs_b < num_blocks,
                       other=float("-inf"))  # fmt: skip
        bsum = tl.load(bsum_ptr + row.to(tl.int64) * num_blocks + offs_b, mask=offs_b < num_blocks, other=0.0)
        top = tl.max(bmax, 0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        if PROBS == _SPARSE:
            draft_row = row - req
            k_live = tl.where(draft_row < tl.load(cu_ptr + req + 1), K, 0)
            base = draft_row.to(tl.int64) * stride_probs
            offs_k = tl.arange(0, BLOCK_K)
            ids = tl.load(prob_ids_ptr + base + offs_k, mask=offs_k < k_live, other=-1)
            probs = tl.load(probs_ptr + base + offs_k, mask=offs_k < k_live, other=0.0)
            z_support = tl.load(row_ptr + ids, mask=offs_k < k_live, other=float("-inf")).to(tl.float32) * inv_t
            top = tl.maximum(top, tl.max(z_support, 0))
        safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(bsum * tl.exp(bmax - safe), 0)
        if PROBS == _SPARSE:
            for c in range(0, k_live, CHUNK_K):
                _, _, _, _, e = _support_chunk(prob_ids_ptr, base, c, k_live, ids, probs, row_ptr, inv_t, safe,
                                               CHUNK_K, BLOCK_K)  # fmt: skip
                total += tl.sum(e, 0)
        tl.store(zmax_ptr + row, top)
        tl.store(norm_ptr + row, total)
        tl.store(tau_ptr + row, float("-inf"))
        top_k, top_p, use_k, use_p = _filters(top_k_ptr, top_p_ptr, req, V)
        if use_k | use_p:
            n_sketch = num_splits * NG
            pos = tl.arange(0, BLOCK_SKETCH)
            sketch = tl.load(sketch_ptr + row.to(tl.int64) * n_sketch + pos, mask=pos < n_sketch,
                             other=float("-inf"))  # fmt: skip
            sketch = tl.sort(sketch, descending=True)
            if use_k:
                # the k-th sketch value: k distinct entries are >= it, so it is <= the k-th largest z
                j = tl.where(top_k <= n_sketch, top_k.to(tl.int32) - 1, _BIG)
            else:
                mass = tl.cumsum(tl.where(pos < n_sketch, tl.exp(sketch - safe), 0.0), 0)
                j = tl.min(tl.where(mass >= top_p * total, pos, _BIG), 0)
            _keep_threshold(
                row_ptr, V, inv_t, top, total, top_k, top_p, use_k, use_p, tl.where(j < _BIG, _CANDIDATES, _SEARCH),
                tl.sum(tl.where(pos == j, sketch, 0.0), 0), cand_ptr, row, tau_ptr + row, norm_ptr + row,
                BLOCK_V, CAP, SMALL, BLOCK_S, NCAND,
            )  # fmt: skip


@triton.jit
def _compact(row_ptr, V, inv_t, bound, cand_ptr, row, BLOCK_V: tl.constexpr, CAP: tl.constexpr):
    """Write every token with z >= L of a filtered row to its CAP candidate slots (packed (order key, id), see
    :mod:`kernels.float_keys`, in id order); returns how many tokens are >= L (may exceed CAP)."""
    count = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
        hit = (idx < V) & (z >= bound)
        slot = count + tl.cumsum(hit.to(tl.int32), 0) - 1
        bits = tl.where(z == 0.0, 0.0, z).to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        packed = (key.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)
        tl.store(cand_ptr + row.to(tl.int64) * CAP + slot, packed, mask=hit & (slot < CAP))
        count += tl.sum(hit.to(tl.int32), 0)
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
    cand_ptr, row, count, z_max, total_all, top_k, top_p, use_k, use_p, CAP: tl.constexpr, SIZE: tl.constexpr
):
    """(found, tau, norm of the kept set) from a row's count <= SIZE candidates, sorted descending.

    Top-k: tau_k is the k-th candidate (fewer than k candidates only happens when fewer than k tokens are
    finite, and then the k-th largest z is -inf). Top-p: the crossing of the running mass within the
    candidates; not found when the mass of all candidates stays below p * total (float rounding)."""
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
    return found, tau, tl.sum(tl.where(z >= tau, tl.exp(z - z_max), 0.0), 0)


@triton.jit
def _keep_threshold(
    row_ptr,
    V,
    inv_t,
    z_max,
    total_all,
    top_k,
    top_p,
    use_k,
    use_p,
    state,
    bound,
    cand_ptr,
    row,
    tau_ptr,
    norm_ptr,
    BLOCK_V: tl.constexpr,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NCAND: tl.constexpr,
):
    """Exact tau and normaliser of a filtered row's kept set: from the sorted candidates (z >= L), or by the
    fallback search when the bound does not exist, too many tokens pass it, or it does not certify top-p."""
    if state == _CANDIDATES:
        count = _compact(row_ptr, V, inv_t, bound, cand_ptr, row, BLOCK_V, CAP)
        tl.debug_barrier()  # the candidates were stored by other threads of this program
        if count <= CAP:
            if count <= SMALL:  # the usual case: sort a short buffer
                found, tau, norm = _candidate_threshold(
                    cand_ptr, row, count, z_max, total_all, top_k, top_p, use_k, use_p, CAP, SMALL
                )
            else:
                found, tau, norm = _candidate_threshold(
                    cand_ptr, row, count, z_max, total_all, top_k, top_p, use_k, use_p, CAP, CAP
                )
            if found:
                tl.store(tau_ptr, tau)
                tl.store(norm_ptr, norm)
            else:
                state = _SEARCH  # the top-p crossing lies below the candidates (float rounding): search
        else:
            state = _SEARCH
    if state == _SEARCH:
        lo = tl_ordered_key(tl.full((), float("-inf"), tl.float32))  # f(lo) = every token
        hi = tl_ordered_key(z_max)
        if use_k:
            lo = _search_threshold(row_ptr, V, inv_t, z_max, lo, hi, top_k.to(tl.float32), False, BLOCK_S, NCAND)
        if use_p:
            kept_mass = _mass_at_least(row_ptr, V, inv_t, z_max, lo, BLOCK_S)
            lo = _search_threshold(row_ptr, V, inv_t, z_max, lo, hi, top_p * kept_mass, True, BLOCK_S, NCAND)
        tl.store(tau_ptr, tl_key_to_float(lo))
        tl.store(norm_ptr, _mass_at_least(row_ptr, V, inv_t, z_max, lo, BLOCK_S))


@triton.jit
def _first_positive_crossing(weight, cum, target, index):
    """The first index with running mass ``cum`` > target and positive weight; if rounding lets the target pass
    every entry, the last index of positive weight (-1 when none has positive weight)."""
    first = tl.min(tl.where((cum > target) & (weight > 0.0), index, _BIG), 0)
    return tl.where(first < _BIG, first, tl.max(tl.where(weight > 0.0, index, -1), 0))


@triton.jit
def _inverse_cdf(
    logits_ptr,
    stride_row,
    probs_ptr,
    prob_ids_ptr,
    stride_probs,
    bmax_ptr,
    bsum_ptr,
    sample_row,
    draft_row,
    k_live,
    num_blocks,
    inv_t,
    z_max,
    norm,
    u,
    V,
    PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """One draw from norm(max(0, p_t - p_d)) of an unfiltered row with one uniform ``u`` (module doc of
    :mod:`kernels.rejection`): the support slots first, then the blocks; only the chosen block is read."""
    row_ptr = logits_ptr + sample_row.to(tl.int64) * stride_row
    s_support = tl.zeros((), tl.float32)
    s_e = tl.zeros((), tl.float32)
    if PROBS == _SPARSE:
        base = draft_row.to(tl.int64) * stride_probs
        offs_k = tl.arange(0, BLOCK_K)
        ids = tl.load(prob_ids_ptr + base + offs_k, mask=offs_k < k_live, other=-1)
        probs = tl.load(probs_ptr + base + offs_k, mask=offs_k < k_live, other=0.0)
        for c in range(0, k_live, CHUNK_K):
            _, _, _, p_d, e = _support_chunk(prob_ids_ptr, base, c, k_live, ids, probs, row_ptr, inv_t, z_max,
                                             CHUNK_K, BLOCK_K)  # fmt: skip
            s_support += tl.sum(tl.maximum(e - norm * p_d, 0.0), 0)  # 0 off first occurrences (e = 0)
            s_e += tl.sum(e, 0)
    offs_b = tl.arange(0, BLOCK_NB)
    bmax = tl.load(bmax_ptr + sample_row.to(tl.int64) * num_blocks + offs_b, mask=offs_b < num_blocks,
                   other=float("-inf"))  # fmt: skip
    scale = tl.exp(bmax - z_max)
    mass = tl.load(bsum_ptr + sample_row.to(tl.int64) * num_blocks + offs_b, mask=offs_b < num_blocks,
                   other=0.0) * scale  # fmt: skip
    s_block = tl.sum(mass, 0)
    empty = (s_support + s_block) <= 0.0  # all-zero residual: p_t over the support (module doc)
    s_support = tl.where(empty, s_e, s_support)
    s_block = tl.where(empty, 0.0, s_block)
    target = u * (s_support + s_block)
    token = tl.zeros((), tl.int32)
    if (target < s_support) | (s_block <= 0.0):
        if PROBS == _SPARSE:  # otherwise unreachable: without a support the row max lies in a block
            run = tl.zeros((), tl.float32)
            pick = tl.full((), _BIG, tl.int32)
            last = tl.full((), -1, tl.int32)
            for c in range(0, k_live, CHUNK_K):
                _, slot, _, p_d, e = _support_chunk(prob_ids_ptr, base, c, k_live, ids, probs, row_ptr, inv_t,
                                                    z_max, CHUNK_K, BLOCK_K)  # fmt: skip
                w = tl.where(empty, e, tl.maximum(e - norm * p_d, 0.0))
                cum = run + tl.cumsum(w, 0)
                pick = tl.minimum(pick, tl.min(tl.where((cum > target) & (w > 0.0), slot, _BIG), 0))
                last = tl.maximum(last, tl.max(tl.where(w > 0.0, slot, -1), 0))
                run += tl.sum(w, 0)
            token = tl.load(prob_ids_ptr + base + tl.maximum(tl.where(pick < _BIG, pick, last), 0)).to(tl.int32)
    else:
        t_block = target - s_support
        cum = tl.cumsum(mass, 0)
        b = _first_positive_crossing(mass, cum, t_block, offs_b)  # >= 0: s_block > 0
        chosen = offs_b == b
        before = tl.sum(tl.where(chosen, cum - mass, 0.0), 0)
        # scan in the block's own units exp(z - block max): its maximum entry weighs 1, never 0
        t_inner = tl.math.div_rn(t_block - before, tl.sum(tl.where(chosen, scale, 0.0), 0))
        b_max = tl.sum(tl.where(chosen, bmax, 0.0), 0)
        start = b * BLOCK_V
        idx = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
        if PROBS == _SPARSE:
            nxt = tl.min(tl.where(ids >= start, ids, _BIG), 0)
            while nxt < start + BLOCK_V:
                z = tl.where(idx == nxt, float("-inf"), z)
                nxt = tl.min(tl.where(ids > nxt, ids, _BIG), 0)
        e = tl.exp(z - b_max)
        token = start + tl.maximum(_first_positive_crossing(e, tl.cumsum(e, 0), t_inner, tl.arange(0, BLOCK_V)), 0)
    return token


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
    top_k_ptr,
    top_p_ptr,
    seeds_ptr,
    positions_ptr,
    argmax_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    bmax_ptr,
    bsum_ptr,
    out_ptr,
    num_acc_ptr,
    K,
    V,
    num_blocks,
    PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """Per request: accept drafts left to right until the first rejection; greedy requests finish here, and so
    do unfiltered sampled requests whose draw takes the inverse CDF (sparse drafts, no drafts, bonus rows)."""
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
    sample_row = row0 + n_acc
    if greedy:
        tl.store(out_ptr + sample_row, tl.load(argmax_ptr + sample_row).to(tl.int64))
    elif _draws_by_cdf(top_k_ptr, top_p_ptr, r, V, n_acc == num_draft, PROBS):
        u = tl_uniform(tl_row_key(seed, position + 1 + n_acc, _TARGET), zero)
        token = _inverse_cdf(
            logits_ptr, stride_row, probs_ptr, prob_ids_ptr, stride_probs, bmax_ptr, bsum_ptr, sample_row,
            d0 + n_acc, tl.where(n_acc == num_draft, 0, K), num_blocks, inv_t, tl.load(zmax_ptr + sample_row),
            tl.load(norm_ptr + sample_row), u, V, PROBS, BLOCK_V, BLOCK_NB, BLOCK_K, CHUNK_K,
        )  # fmt: skip
        tl.store(out_ptr + sample_row, token.to(tl.int64))


@triton.jit
def _dense_weights(row_ptr, probs_row_ptr, idx, V, inv_t, z_max, norm):
    """Residual weights max(0, e - Z * p_d) of a dense draft at ``idx`` (0 past the end); the same float
    operations wherever they are evaluated, so a block's recomputed weights sum to its stored mass."""
    z = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
    p_d = tl.load(probs_row_ptr + idx, mask=idx < V, other=0.0)
    return tl.maximum(tl.exp(z - z_max) - norm * p_d, 0.0)


@triton.jit
def _dense_residual_masses(
    logits_ptr, stride_row, probs_ptr, stride_probs, zmax_ptr, norm_ptr, mass_ptr, sample_row, draft_row, r, split,
    inv_t, V, split_size, num_blocks, BLOCK_V: tl.constexpr,
):
    """Residual mass of every block of BLOCK_V ids in this split of an unfiltered dense residual row (row units:
    a block whose weights all underflow has mass 0 and is never chosen)."""
    row_ptr = logits_ptr + sample_row.to(tl.int64) * stride_row
    probs_row_ptr = probs_ptr + draft_row.to(tl.int64) * stride_probs
    z_max = tl.load(zmax_ptr + sample_row)
    norm = tl.load(norm_ptr + sample_row)
    for start in range(split * split_size, tl.minimum(split * split_size + split_size, V), BLOCK_V):
        w = _dense_weights(row_ptr, probs_row_ptr, start + tl.arange(0, BLOCK_V), V, inv_t, z_max, norm)
        tl.store(mass_ptr + r.to(tl.int64) * num_blocks + start // BLOCK_V, tl.sum(w, 0))


@triton.jit
def _dense_pick(
    logits_ptr, stride_row, probs_ptr, stride_probs, zmax_ptr, norm_ptr, mass_ptr, bmax_ptr, bsum_ptr, sample_row,
    draft_row, r, inv_t, u, V, num_mass, num_blocks, BLOCK_R: tl.constexpr, BLOCK_MASS: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Inverse-CDF draw from an unfiltered dense residual with one uniform: the block by its running mass, then
    the id inside it (weights recomputed exactly as summed); p_t (statistics blocks) if the residual is all 0."""
    offs = tl.arange(0, BLOCK_MASS)
    mass = tl.load(mass_ptr + r.to(tl.int64) * num_mass + offs, mask=offs < num_mass, other=0.0)
    total = tl.sum(mass, 0)
    z_max = tl.load(zmax_ptr + sample_row)
    norm = tl.load(norm_ptr + sample_row)
    token = tl.zeros((), tl.int32)
    if total > 0.0:
        target = u * total
        cum = tl.cumsum(mass, 0)
        b = _first_positive_crossing(mass, cum, target, offs)  # >= 0: total > 0
        before = tl.sum(tl.where(offs == b, cum - mass, 0.0), 0)
        inner = tl.arange(0, BLOCK_R)
        w = _dense_weights(logits_ptr + sample_row.to(tl.int64) * stride_row,
                           probs_ptr + draft_row.to(tl.int64) * stride_probs, b * BLOCK_R + inner, V, inv_t, z_max,
                           norm)  # fmt: skip
        token = b * BLOCK_R + tl.maximum(_first_positive_crossing(w, tl.cumsum(w, 0), target - before, inner), 0)
    else:
        token = _inverse_cdf(
            logits_ptr, stride_row, probs_ptr, probs_ptr, stride_probs, bmax_ptr, bsum_ptr, sample_row, draft_row,
            0, num_blocks, inv_t, z_max, norm, u, V, 0, BLOCK_V, BLOCK_NB, 16, 16,
        )  # fmt: skip
    return token


@triton.jit
def _race_kernel(
    logits_ptr,
    stride_row,
    probs_ptr,
    stride_probs,
    prob_ids_ptr,
    cu_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seeds_ptr,
    positions_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    num_acc_ptr,
    part_key_ptr,
    part_id_ptr,
    mass_ptr,
    V,
    K,
    split_size,
    num_splits,
    num_mass,
    PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Exponential race on one vocabulary split of a filtered request's residual (or bonus) row; for an
    unfiltered dense residual row, its split's block masses (:func:`_dense_residual_masses`). The other sampled
    requests drew by inverse CDF in the accept chain kernel."""
    r = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temperature_ptr + r)
    d0 = tl.load(cu_ptr + r)
    num_draft = (tl.load(cu_ptr + r + 1) - d0).to(tl.int32)
    n_acc = tl.load(num_acc_ptr + r).to(tl.int32)
    _, _, use_k, use_p = _filters(top_k_ptr, top_p_ptr, r, V)
    if PROBS == _DENSE:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if (temp != 0.0) & ((use_k | use_p) == 0) & (n_acc < num_draft):
            _dense_residual_masses(
                logits_ptr, stride_row, probs_ptr, stride_probs, zmax_ptr, norm_ptr, mass_ptr, d0 + r + n_acc,
                d0 + n_acc, r, split, tl.math.div_rn(1.0, temp), V, split_size, num_mass, BLOCK_V,
            )  # fmt: skip
    if (temp != 0.0) & (use_k | use_p):
        inv_t = tl.math.div_rn(1.0, temp)
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
        # per lane: the first maximal key of the residual race and of the p_t race (fallback)
        best_res = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_fb = tl.full([BLOCK_V], float("-inf"), tl.float32)
        arg_res = tl.full([BLOCK_V], _BIG, tl.int32)
        arg_fb = tl.full([BLOCK_V], _BIG, tl.int32)
        for start in range(split * split_size, tl.minimum(split * split_size + split_size, V), BLOCK_V):
            idx = start + tl.arange(0, BLOCK_V)
            mask = idx < V  # splits are whole blocks: only the row's end needs a mask
            z = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            log_weight = tl.where(mask & (z >= tau), z - z_max, float("-inf"))  # log(norm * p_t)
            if PROBS == _DENSE:
                limit = tl.where(bonus, 0, V)
                p_d = tl.load(probs_ptr + draft_row * stride_probs + idx, mask=idx < limit, other=0.0)
            elif PROBS == _SPARSE:
                # scatter the few sparse entries that fall into this chunk (usually none or one)
                here = (ids >= start) & (ids < start + BLOCK_V)
                p_d = tl.zeros([BLOCK_V], tl.float32)
                previous = tl.zeros((), tl.int64) + (start - 1)
                for _hit in range(0, tl.sum(here.to(tl.int32), 0)):
                    current = tl.min(tl.where(here & (ids > previous), ids, 2147483647), 0)
                    p_d = tl.where(idx == current, tl.sum(tl.where(ids == current, probs, 0.0), 0), p_d)
                    previous = current
            log_race = tl.log(-tl.log(tl_uniform(key, idx)))
            key_fb = log_weight - log_race
            if PROBS == 0:
                key_res = key_fb
            else:
                weight = tl.where(log_weight > float("-inf"), tl.exp(z - z_max), 0.0)
                residual = tl.log(tl.maximum(weight - norm * p_d, 0.0))
                key_res = tl.where(p_d > 0.0, residual - log_race, key_fb)
            better = key_res > best_res
            best_res = tl.where(better, key_res, best_res)
            arg_res = tl.where(better, idx, arg_res)
            if PROBS == _DENSE:
                better = key_fb > best_fb
                best_fb = tl.where(better, key_fb, best_fb)
                arg_fb = tl.where(better, idx, arg_fb)
        top_res = tl.max(best_res, 0)
        part = (r * num_splits + split) * 2
        tl.store(part_key_ptr + part, top_res)
        tl.store(part_id_ptr + part, tl.min(tl.where(best_res == top_res, arg_res, _BIG), 0))
        if PROBS == _DENSE:
            top_fb = tl.max(best_fb, 0)
            tl.store(part_key_ptr + part + 1, top_fb)
            tl.store(part_id_ptr + part + 1, tl.min(tl.where(best_fb == top_fb, arg_fb, _BIG), 0))


@triton.jit
def _finalize_kernel(
    logits_ptr,
    stride_row,
    probs_ptr,
    prob_ids_ptr,
    stride_probs,
    part_key_ptr,
    part_id_ptr,
    mass_ptr,
    bmax_ptr,
    bsum_ptr,
    cu_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seeds_ptr,
    positions_ptr,
    zmax_ptr,
    norm_ptr,
    tau_ptr,
    num_acc_ptr,
    out_ptr,
    K,
    V,
    num_splits,
    num_mass,
    num_blocks,
    PROBS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_MASS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):
    """Per filtered request: the race winner over all splits (an all-zero residual falls back to p_t); per
    unfiltered dense residual row: the inverse-CDF pick from the block masses (:func:`_dense_pick`).

    The fallback race over p_t is only needed when every residual key is -inf. With sparse drafts that means
    every kept token lies in the draft's support (outside it the residual is p_t itself), so the fallback
    winner is the best p_t key among those <= K ids, computed here instead of in the vocabulary loop."""
    r = tl.program_id(0)
    temp = tl.load(temperature_ptr + r)
    d0 = tl.load(cu_ptr + r)
    n_acc = tl.load(num_acc_ptr + r)
    bonus = n_acc == tl.load(cu_ptr + r + 1) - d0
    _, _, use_k, use_p = _filters(top_k_ptr, top_p_ptr, r, V)
    if PROBS == _DENSE:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if (temp != 0.0) & ((use_k | use_p) == 0) & (bonus == 0):
            sample_row = d0 + r + n_acc
            position = tl.load(positions_ptr + r) + 1 + n_acc
            token = _dense_pick(
                logits_ptr, stride_row, probs_ptr, stride_probs, zmax_ptr, norm_ptr, mass_ptr, bmax_ptr, bsum_ptr,
                sample_row, d0 + n_acc, r, tl.math.div_rn(1.0, temp),
                tl_uniform(tl_row_key(tl.load(seeds_ptr + r), position, _TARGET), tl.zeros((), tl.int32)), V,
                num_mass, num_blocks, BLOCK_R, BLOCK_MASS, BLOCK_V, BLOCK_NB,
            )  # fmt: skip
            tl.store(out_ptr + sample_row, token.to(tl.int64))
    if (temp != 0.0) & (use_k | use_p):
        offs = tl.arange(0, BLOCK_SPLITS)
        live = offs < num_splits
        part = (r * num_splits + offs) * 2
        key_res = tl.load(part_key_ptr + part, mask=live, other=float("-inf"))
        top_res = tl.max(key_res, 0)
        winner = tl.min(tl.where(live & (key_res == top_res), tl.load(part_id_ptr + part, mask=live, other=_BIG),
                                 _BIG), 0)  # fmt: skip
        sample_row = d0 + r + n_acc
        if top_res == float("-inf"):
            if PROBS == _DENSE:
                key_fb = tl.load(part_key_ptr + part + 1, mask=live, other=float("-inf"))
                ids_fb = tl.load(part_id_ptr + part + 1, mask=live, other=_BIG)
                winner = tl.min(tl.where(live & (key_fb == tl.max(key_fb, 0)), ids_fb, _BIG), 0)
            elif PROBS == _SPARSE:
                offs_k = tl.arange(0, BLOCK_K)
                ids = tl.load(prob_ids_ptr + (d0 + n_acc) * stride_probs + offs_k, mask=offs_k < K, other=0)
                z = tl.load(logits_ptr + sample_row * stride_row + ids, mask=offs_k < K, other=float("-inf"))
                z = z.to(tl.float32) * tl.math.div_rn(1.0, temp)
                position = tl.load(positions_ptr + r) + 1 + n_acc
                log_race = tl.log(-tl.log(tl_uniform(tl_row_key(tl.load(seeds_ptr + r), position, _TARGET), ids)))
                z_max = tl.load(zmax_ptr + sample_row)
                keys = tl.where((offs_k < K) & (z >= tl.load(tau_ptr + sample_row)), z - z_max - log_race,
                                float("-inf"))  # fmt: skip
                winner = tl.min(tl.where(keys == tl.max(keys, 0), ids.to(tl.int32), _BIG), 0)
        tl.store(out_ptr + sample_row, winner.to(tl.int64))


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

    # 1-2: per-row statistics and keep thresholds
    block_v = _block(TUNING["row_block_v"], vocab)
    split_size, num_splits = _splits(vocab, block_v, TUNING["row_splits"])
    num_blocks = triton.cdiv(vocab, block_v)
    groups = min(SKETCH_GROUPS, block_v)
    block_k = _block(1024, width) if mode == PROBS_SPARSE else 16
    chunk_k = min(SUPPORT_CHUNK, block_k)
    f32 = dict(dtype=torch.float32, device=device)
    part_max = torch.empty((rows, num_splits), **f32)
    part_arg = torch.empty((rows, num_splits), dtype=torch.int32, device=device)
    block_max = torch.empty((rows, num_blocks), **f32)
    block_sum = torch.empty((rows, num_blocks), **f32)
    sketch = torch.empty((rows, num_splits, groups), **f32)
    _row_stats_kernel[(rows, num_splits)](
        logits, logits.stride(0), cu, num_req, out, row_req, temps, top_k64, top_p32, prob_ids, width, width,
        part_max, part_arg, block_max, block_sum, sketch, vocab, split_size, num_splits, num_blocks,
        PROBS=mode, BLOCK_V=block_v, BLOCK_K=block_k, NG=groups, num_warps=TUNING["row_warps"], **options,
    )  # fmt: skip
    argmax = torch.empty(rows, dtype=torch.int32, device=device)
    z_max, norm, tau = (torch.empty(rows, **f32) for _ in range(3))
    cap = min(CANDIDATES, _block(1 << 30, vocab))  # a row never has more candidates than tokens
    cands = torch.empty((rows, cap), dtype=torch.int64, device=device)
    block_nb = _block(1 << 20, num_blocks)
    _row_combine_kernel[(rows,)](
        logits, logits.stride(0), cu, probs, prob_ids, width, width, part_max, part_arg, block_max, block_sum,
        sketch, row_req, temps, top_k64, top_p32, argmax, z_max, norm, tau, cands, vocab, num_splits, num_blocks,
        PROBS=mode, BLOCK_SPLITS=_block(1 << 20, num_splits), BLOCK_NB=block_nb,
        BLOCK_K=block_k, CHUNK_K=chunk_k, BLOCK_SKETCH=_block(1 << 20, num_splits * groups), NG=groups,
        BLOCK_V=block_v, CAP=cap, SMALL=min(cap, 256), BLOCK_S=_block(512, vocab),
        NCAND=_NCAND_INTERPRETER if interpreting() else _NCAND_GPU, num_warps=8, **options,
    )  # fmt: skip

    # 3: accept chains; greedy requests and the inverse-CDF draws finish here
    _accept_chain_kernel[(num_req,)](
        logits, logits.stride(0), ids, probs, width, prob_ids, cu, temps, top_k64, top_p32, seeds64, positions64,
        argmax, z_max, norm, tau, block_max, block_sum, out, num_acc, width, vocab, num_blocks,
        PROBS=mode, BLOCK_V=block_v, BLOCK_NB=block_nb, BLOCK_K=block_k, CHUNK_K=chunk_k, num_warps=4, **options,
    )  # fmt: skip

    # 4-5: the raced requests' residual / bonus draws
    race_block = _block(TUNING["race_block_v"], vocab)
    race_split, race_splits = _splits(vocab, race_block, TUNING["race_splits"])
    part_key = torch.empty((num_req, race_splits, 2), **f32)
    part_id = torch.empty((num_req, race_splits, 2), dtype=torch.int32, device=device)
    num_mass = triton.cdiv(vocab, race_block) if mode == PROBS_DENSE else 1
    mass = torch.empty((num_req, num_mass), **f32)
    _race_kernel[(num_req, race_splits)](
        logits, logits.stride(0), probs, width, prob_ids, cu, temps, top_k64, top_p32, seeds64, positions64, z_max,
        norm, tau, num_acc, part_key, part_id, mass, vocab, width, race_split, race_splits, num_mass,
        PROBS=mode, BLOCK_V=race_block, BLOCK_K=block_k, num_warps=TUNING["race_warps"], **options,
    )  # fmt: skip
    _finalize_kernel[(num_req,)](
        logits, logits.stride(0), probs, prob_ids, width, part_key, part_id, mass, block_max, block_sum, cu, temps,
        top_k64, top_p32, seeds64, positions64, z_max, norm, tau, num_acc, out, width, vocab, race_splits, num_mass,
        num_blocks, PROBS=mode, BLOCK_SPLITS=_block(1 << 20, race_splits), BLOCK_K=block_k, BLOCK_R=race_block,
        BLOCK_MASS=_block(1 << 20, num_mass), BLOCK_V=block_v, BLOCK_NB=block_nb, num_warps=4, **options,
    )  # fmt: skip
    return RejectionOutput(num_accepted=num_acc, output_tokens=out)
