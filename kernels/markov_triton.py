"""Triton Markov-head sampling: the contract of :mod:`kernels.markov`, z_k kept in registers when possible.

Each of the gamma steps is two launches, because step k + 1 needs every request's token x_k, which is a
reduction over the whole vocabulary (a grid-wide dependency; a persistent kernel with a software grid barrier
would deadlock the sequential interpreter and is fragile on GPUs):
1. ``_markov_step_kernel``, programs (block of requests, block of vocabulary): computes the tile
   z = U_k + W1[x_{k-1}] @ W2^T with ``tl.dot`` (the W2 tile is shared by BLOCK_R requests, and consecutive
   programs share it through L2, so W2 is read from memory about once per step), then, in registers, the
   tile's race winner (packed as an int64 (value, id) key) and log-sum-exp partials (full vocabulary), or
   (truncated mode) the tile's maximum packed the same way, writing z_k to memory (the logits output or a
   scratch row per request).
2. ``_markov_combine_kernel``, one program per request: merges the partials into x_k, p_d(x_k) and, in
   truncated mode, the sparse distribution; x_k is written where step k + 1 reads its previous token.
   Full-vocabulary mode: x_k is one max over the packed winners (the race's argmax, ties to the smaller id),
   and greedy requests skip the log-sum-exp (their p_d is 1): the program is latency-bound (one per request,
   each reduction a cross-warp wait), so fewer reductions is what makes it fast.
   Truncated mode finds the exact top-K from the tile maxima: the K-th largest tile maximum L is a lower
   bound on the K-th largest z, and only the K tiles whose maximum is >= L can hold tokens >= L, so only
   those tiles are re-read (see ``_combine_top_k``); z_k is never sorted or scanned in full.

Storage-dtype weights (bf16/fp16) go to ``tl.dot`` as they are on GPUs: their products are exact in the fp32
accumulator, which matches the reference's float32 matmul up to summation order. float32 weights and the
CPU interpreter use an fp32 dot with IEEE precision (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.float_keys_triton import tl_canonical, tl_pack_value_id, tl_unpack_value_id
from kernels.launch import interpreting, launch_options, pdl_options, tl_pdl_wait
from kernels.markov import MarkovSample, confidence_inputs, validate_markov_inputs
from kernels.rng import STREAM_DRAFT_SAMPLE
from kernels.rng_triton import tl_row_key, tl_uniform

_DRAFT = tl.constexpr(STREAM_DRAFT_SAMPLE)
TUNING = {"block_r": 32, "block_v": 128, "topk_block_r": 32, "topk_block_v": 256, "warps": 8}
"""Step-kernel tile sizes (one fixed configuration; 8 warps keep the [32, 128] tile free of register spills
on sm_90); bench/bench_kernels.py --sweep measures others."""
TOPK_TILE_GROUP = 16
"""Candidate tiles gathered per iteration by the truncated-mode combine step."""
_RUNTIME_INTS = ["step", "stride_prev", "R"]
"""Integer arguments compiled as runtime values: by default Triton specialises an int on == 1 and % 16 == 0,
which would give the draft step one compiled variant per (step 0 / 1 / other) x (R = 1 / % 16 / other) at graph
warm-up; they only enter masks and scalar offsets."""
_INT64_MIN = tl.constexpr(-(2**63))
_INT64_MAX = tl.constexpr(2**63 - 1)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _markov_step_kernel(
    base_ptr,
    stride_br,
    stride_bk,
    step,
    prev_ptr,
    stride_prev,
    w1_ptr,
    w2_ptr,
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    logits_ptr,
    stride_lr,
    stride_lk,
    part_f_ptr,
    part_i_ptr,
    cand_ptr,
    R,
    V,
    RANK,
    num_chunks,
    K,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOPK: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    chunk = tl.program_id(1)
    vocab = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < R
    vocab_mask = vocab < V
    tile_mask = row_mask[:, None] & vocab_mask[None, :]
    previous = tl.load(prev_ptr + rows * stride_prev, mask=row_mask, other=0)

    acc = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    for d0 in range(0, RANK, BLOCK_D):
        dims = d0 + tl.arange(0, BLOCK_D)
        dim_mask = dims < RANK
        a = tl.load(
            w1_ptr + previous[:, None] * RANK + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            w2_ptr + vocab[:, None].to(tl.int64) * RANK + dims[None, :],
            mask=vocab_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if NATIVE_DOT:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    base = tl.load(
        base_ptr + rows[:, None].to(tl.int64) * stride_br + step * stride_bk + vocab[None, :],
        mask=tile_mask,
        other=0.0,
    ).to(tl.float32)
    z = base + acc
    if STORE_LOGITS:
        tl.store(
            logits_ptr + rows[:, None].to(tl.int64) * stride_lr + step * stride_lk + vocab[None, :],
            z,
            mask=tile_mask,
        )

    if TOPK == 0:
        temp = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0)
        greedy = temp == 0.0
        scaled = tl_canonical(tl.math.div_rn(z, tl.where(greedy, 1.0, temp)[:, None]))
        key = tl_row_key(
            tl.load(seeds_ptr + rows, mask=row_mask, other=0),
            tl.load(positions_ptr + rows, mask=row_mask, other=0) + 1 + step,
            _DRAFT,
        )
        noise = tl.log(-tl.log(tl_uniform(key[:, None], vocab[None, :])))
        race = tl.where(tile_mask, tl.where(greedy[:, None], z, scaled - noise), float("-inf"))
        winner = tl.argmax(race, 1)
        cols = tl.arange(0, BLOCK_V)
        winner_scaled = tl.sum(tl.where(cols[None, :] == winner[:, None], scaled, 0.0), 1)
        scaled = tl.where(tile_mask, scaled, float("-inf"))
        tile_max = tl.max(scaled, 1)
        safe_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        tile_sum = tl.sum(tl.exp(scaled - safe_max[:, None]), 1)
        # the race winner as one packed (value, id) key: the combine step's argmax over tiles is one max
        part = rows * num_chunks + chunk
        tl.store(part_i_ptr + part, tl_pack_value_id(tl_canonical(tl.max(race, 1)), chunk * BLOCK_V + winner),
                 mask=row_mask)  # fmt: skip
        plane = R * num_chunks
        tl.store(part_f_ptr + part, winner_scaled, mask=row_mask)
        tl.store(part_f_ptr + plane + part, tile_max, mask=row_mask)
        tl.store(part_f_ptr + 2 * plane + part, tile_sum, mask=row_mask)
    else:
        # the tile's maximum as packed (value, id); z itself went to memory above for the combine step
        packed = tl.where(tile_mask, tl_pack_value_id(tl_canonical(z), vocab[None, :]), _INT64_MIN)
        tl.store(cand_ptr + rows.to(tl.int64) * num_chunks + chunk, tl.max(packed, 1), mask=row_mask)


@triton.jit(do_not_specialize=["step"])
def _markov_combine_kernel(
    part_f_ptr,
    part_i_ptr,
    cand_ptr,
    z_ptr,
    stride_lr,
    stride_lk,
    tiles_ptr,
    buffer_ptr,
    step,
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    k_eff_ptr,
    tokens_ptr,
    probs_ptr,
    sparse_ids_ptr,
    sparse_probs_ptr,
    V,
    gamma,
    num_chunks,
    K,
    TOPK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILE_V: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    CAPM: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    r = tl.program_id(0)
    temp = tl.load(temperature_ptr + r)
    greedy = temp == 0.0
    out = r * gamma + step
    if TOPK == 0:
        # One max over the tiles' packed race winners gives x_k (largest key, then smallest id, as the
        # reference's argmax); the log-sum-exp, needed for p_d(x_k) only, is skipped for greedy requests.
        row = r.to(tl.int64) * num_chunks
        best = tl.full((), _INT64_MIN, tl.int64)
        for c0 in range(0, num_chunks, BLOCK_C):
            chunks = c0 + tl.arange(0, BLOCK_C)
            best = tl.maximum(best, tl.max(tl.load(part_i_ptr + row + chunks, mask=chunks < num_chunks,
                                                   other=_INT64_MIN), 0))  # fmt: skip
        _, token = tl_unpack_value_id(best)
        prob = tl.full((), 1.0, tl.float32)
        if not greedy:
            plane = tl.num_programs(0).to(tl.int64) * num_chunks  # one program per request: R x num_chunks
            run_max = tl.full((), float("-inf"), tl.float32)
            run_sum = tl.full((), 0.0, tl.float32)
            for c0 in range(0, num_chunks, BLOCK_C):
                chunks = c0 + tl.arange(0, BLOCK_C)
                mask = chunks < num_chunks
                tile_max = tl.load(part_f_ptr + plane + row + chunks, mask=mask, other=float("-inf"))
                tile_sum = tl.load(part_f_ptr + 2 * plane + row + chunks, mask=mask, other=0.0)
                new_max = tl.maximum(run_max, tl.max(tile_max, 0))
                safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tile_sum * tl.exp(tile_max - safe_max), 0)
                run_max = new_max
            winner_scaled = tl.load(part_f_ptr + row + token // TILE_V)
            prob = tl.exp(winner_scaled - (run_max + tl.log(run_sum)))
        tl.store(tokens_ptr + out, token.to(tl.int64))
        tl.store(probs_ptr + out, prob)
    else:
        _combine_top_k(cand_ptr, z_ptr, stride_lr, stride_lk, tiles_ptr, buffer_ptr, r, step, temp, greedy,
                       seeds_ptr, positions_ptr, tl.load(k_eff_ptr + r), tokens_ptr, probs_ptr, sparse_ids_ptr,
                       sparse_probs_ptr, out, V, num_chunks, K, TOPK, BLOCK_C, TILE_V, TILE_GROUP,
                       CAPM)  # fmt: skip


@triton.jit
def _top_k_tiles(z_ptr, tiles_ptr, r, t0, n_tiles, bound, V, TILE_V: tl.constexpr, TILE_GROUP: tl.constexpr,
                 TOPK: tl.constexpr):  # fmt: skip
    """Packed (value, id) of TILE_GROUP candidate tiles (flattened) and which of them are live and >= bound."""
    t = t0 + tl.arange(0, TILE_GROUP)
    tile = tl.load(tiles_ptr + r * TOPK + t, mask=t < n_tiles, other=0)
    vocab = tile[:, None] * TILE_V + tl.arange(0, TILE_V)[None, :]
    ok = (t < n_tiles)[:, None] & (vocab < V)
    z = tl.load(z_ptr + vocab, mask=ok, other=0.0)
    packed = tl.where(ok, tl_pack_value_id(tl_canonical(z), vocab), _INT64_MIN)
    return tl.reshape(packed, [TILE_GROUP * TILE_V]), tl.reshape(ok & (packed >= bound), [TILE_GROUP * TILE_V])


@triton.jit
def _combine_top_k(
    cand_ptr,
    z_ptr,
    stride_lr,
    stride_lk,
    tiles_ptr,
    buffer_ptr,
    r,
    step,
    temp,
    greedy,
    seeds_ptr,
    positions_ptr,
    k_eff,
    tokens_ptr,
    probs_ptr,
    sparse_ids_ptr,
    sparse_probs_ptr,
    out,
    V,
    num_chunks,
    K,
    TOPK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILE_V: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    CAPM: tl.constexpr,
):
    """Exact top-K of one request's z_k from its tile maxima, then the race over its first k_eff of them.

    Packed keys are distinct. With L the K-th largest tile maximum, K distinct tokens are >= L, so the K
    largest tokens are all >= L, and every token >= L lies in a tile whose maximum is >= L: one of the K top
    tiles. Only those tiles' tokens >= L (usually about K) are gathered, sorted, and the first K kept. If more
    than CAPM tokens pass (massive ties), K rounds of max extraction over the K tiles give the same set."""
    z_ptr = z_ptr + r.to(tl.int64) * stride_lr + step * stride_lk
    chunks = tl.arange(0, BLOCK_C)
    tile_max = tl.load(cand_ptr + r.to(tl.int64) * num_chunks + chunks, mask=chunks < num_chunks,
                       other=_INT64_MIN)  # fmt: skip
    n_tiles = tl.minimum(K, num_chunks)
    ranked = tl.sort(tile_max, descending=True)
    bound = tl.where(num_chunks >= K, tl.sum(tl.where(chunks == n_tiles - 1, ranked, 0), 0), _INT64_MIN)
    top_tile = (chunks < num_chunks) & (tile_max >= bound)
    tl.store(tiles_ptr + r * TOPK + tl.cumsum(top_tile.to(tl.int32), 0) - 1, chunks, mask=top_tile)
    tl.debug_barrier()
    buffer = buffer_ptr + r.to(tl.int64) * CAPM
    count = tl.zeros((), tl.int32)
    for t0 in range(0, n_tiles, TILE_GROUP):
        packed, hit = _top_k_tiles(z_ptr, tiles_ptr, r, t0, n_tiles, bound, V, TILE_V, TILE_GROUP, TOPK)
        slot = count + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(buffer + slot, packed, mask=hit & (slot < CAPM))
        count += tl.sum(hit.to(tl.int32), 0)
    if count > CAPM:
        previous = tl.full((), _INT64_MAX, tl.int64)
        for rank in range(0, K):
            best = tl.full((), _INT64_MIN, tl.int64)
            for t0 in range(0, n_tiles, TILE_GROUP):
                packed, hit = _top_k_tiles(z_ptr, tiles_ptr, r, t0, n_tiles, bound, V, TILE_V, TILE_GROUP, TOPK)
                best = tl.maximum(best, tl.max(tl.where(hit & (packed < previous), packed, _INT64_MIN), 0))
            tl.store(buffer + rank, best)
            previous = best
        count = tl.minimum(count, K)
    tl.debug_barrier()
    slots = tl.arange(0, CAPM)
    ordered = tl.sort(tl.load(buffer + slots, mask=slots < count, other=_INT64_MIN), descending=True)
    live = slots < k_eff  # the request's own top-k_eff; slots k_eff..K-1 are written with probability 0
    values, ids = tl_unpack_value_id(ordered)
    scaled = tl.where(live, tl_canonical(tl.math.div_rn(values, tl.where(greedy, 1.0, temp))), float("-inf"))
    top_max = tl.max(scaled, 0)
    log_norm = top_max + tl.log(tl.sum(tl.where(live, tl.exp(scaled - top_max), 0.0), 0))
    probs = tl.exp(scaled - log_norm)
    key = tl_row_key(tl.load(seeds_ptr + r), tl.load(positions_ptr + r) + 1 + step, _DRAFT)
    noise = tl.log(-tl.log(tl_uniform(key, ids)))
    race = tl.where(live, scaled - noise, float("-inf"))
    winner = tl.where(greedy, 0, tl.argmax(race, 0))
    pick = slots == winner
    token = tl.sum(tl.where(pick, ids, 0), 0)
    prob = tl.where(greedy, 1.0, tl.sum(tl.where(pick, probs, 0.0), 0))
    sparse = tl.where(greedy, tl.where(slots == 0, 1.0, 0.0), probs)
    tl.store(tokens_ptr + out, token.to(tl.int64))
    tl.store(probs_ptr + out, prob)
    tl.store(sparse_ids_ptr + out * K + slots, ids.to(tl.int64), mask=slots < K)
    tl.store(sparse_probs_ptr + out * K + slots, sparse, mask=slots < K)


TOPK_TILES_PER_SLOT = 4
"""Truncated mode: at least this many vocabulary tiles per top-K slot (smaller tiles on a small vocabulary)."""


def _block_v(vocab: int, topk_slots: int) -> int:
    """Vocabulary tile of the step kernel. Truncated mode bounds the top-K by the K-th largest tile maximum L and
    re-reads the tokens >= L of the K top tiles; with only about K tiles (an inflated pair's real vocabulary of
    4096 ids in tiles of 256 is 16 tiles for K = 16) L is the smallest tile maximum, hundreds of tokens pass it
    and the combine step falls back to K rounds of max extraction, several times slower (docs/benchmarks/kernels.md).
    At least TOPK_TILES_PER_SLOT x K tiles keep L tight; a full-size vocabulary keeps the tuned tile."""
    if not topk_slots:
        return max(16, min(TUNING["block_v"], triton.next_power_of_2(vocab)))
    per_tile = triton.next_power_of_2(max(1, vocab // (TOPK_TILES_PER_SLOT * topk_slots)))
    return max(16, min(TUNING["topk_block_v"], per_tile, triton.next_power_of_2(vocab)))


def _combine_block(num_chunks: int) -> int:
    """Tiles the full-vocabulary combine step reads per iteration: all of them in one when they fit (151936
    ids in tiles of 128: 1187), as each iteration ends in cross-warp reductions that a single program waits on."""
    return min(triton.next_power_of_2(num_chunks), 2048)


def markov_sample_triton(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: int = 0,
    return_logits: bool = False,
    validate: bool = True,
    k_eff: torch.Tensor | None = None,
) -> MarkovSample:
    """Triton Markov-head sampling; same signature, semantics and random numbers as the torch reference."""
    if validate:
        validate_markov_inputs(base_logits, anchor_ids, w1, w2, temperature, seeds, positions, top_k, k_eff)
    num_req, gamma, vocab = base_logits.shape
    rank = w1.shape[1]
    device = base_logits.device
    tokens = torch.empty((num_req, gamma), dtype=torch.int64, device=device)
    token_probs = torch.empty((num_req, gamma), dtype=torch.float32, device=device)
    sparse_ids = torch.empty((num_req, gamma, top_k), dtype=torch.int64, device=device) if top_k else None
    sparse_probs = torch.empty((num_req, gamma, top_k), dtype=torch.float32, device=device) if top_k else None
    logits = (
        torch.empty((num_req, gamma, vocab), dtype=torch.float32, device=device) if return_logits else None
    )
    if num_req == 0:
        return MarkovSample(
            tokens, token_probs, confidence_inputs(w1, anchor_ids, tokens), sparse_ids, sparse_probs, logits
        )

    base = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    w1c, w2c = w1.contiguous(), w2.contiguous()
    temps = temperature.to(torch.float32).contiguous()
    seeds64 = seeds.to(torch.int64).contiguous()
    positions64 = positions.to(torch.int64).contiguous()
    anchors = anchor_ids.to(torch.int64).contiguous()
    if k_eff is None:
        k_eff = torch.full((num_req,), top_k, dtype=torch.int32, device=device)
    k_eff32 = k_eff.to(torch.int32).contiguous()
    topk_slots = triton.next_power_of_2(top_k) if top_k else 0
    mode = "topk_" if top_k else ""
    block_r = max(16, min(TUNING[mode + "block_r"], triton.next_power_of_2(num_req)))
    block_v = _block_v(vocab, topk_slots)
    block_d = max(16, min(64, triton.next_power_of_2(rank)))
    num_chunks = triton.cdiv(vocab, block_v)
    native = w1.dtype != torch.float32 and not interpreting()
    # full-vocabulary partials: per (request, tile) the packed race winner, and planes of the winner's scaled
    # logit, the tile maximum and the tile's exp-sum (contiguous per request: the combine's loads coalesce)
    part_f = torch.empty((3, num_req, num_chunks), dtype=torch.float32, device=device)
    part_i = torch.empty((num_req, num_chunks), dtype=torch.int64, device=device)
    tile_max = torch.empty((num_req, num_chunks), dtype=torch.int64, device=device)
    # truncated mode keeps z_k in memory for the combine step: the logits output if asked for, else scratch
    if logits is not None:
        z_buf, stride_lr, stride_lk = logits, logits.stride(0), logits.stride(1)
    elif top_k:
        z_buf, stride_lr, stride_lk = torch.empty((num_req, vocab), dtype=torch.float32, device=device), vocab, 0
    else:
        z_buf, stride_lr, stride_lk = part_f, 0, 0
    capm = max(256, 2 * topk_slots)
    tiles = torch.empty((num_req, max(topk_slots, 1)), dtype=torch.int32, device=device)
    buffer = torch.empty((num_req, capm if top_k else 1), dtype=torch.int64, device=device)
    grid = (triton.cdiv(num_req, block_r), num_chunks)
    pdl = pdl_options(device, num_req * gamma)  # the draft pass's rows: a block per request
    for step in range(gamma):
        previous = anchors if step == 0 else tokens[:, step - 1]
        _markov_step_kernel[grid](
            base, base.stride(0), base.stride(1), step, previous, previous.stride(0), w1c, w2c, temps, seeds64,
            positions64, z_buf, stride_lr, stride_lk, part_f, part_i, tile_max, num_req, vocab, rank,
            num_chunks, top_k, BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_D=block_d, TOPK=topk_slots,
            STORE_LOGITS=logits is not None or top_k > 0, NATIVE_DOT=native, num_warps=TUNING["warps"],
            **launch_options(), **pdl,
        )  # fmt: skip
        _markov_combine_kernel[(num_req,)](
            part_f, part_i, tile_max, z_buf, stride_lr, stride_lk, tiles, buffer, step, temps, seeds64,
            positions64, k_eff32, tokens, token_probs, sparse_ids if sparse_ids is not None else tokens,
            sparse_probs if sparse_probs is not None else part_f, vocab, gamma, num_chunks, top_k,
            TOPK=topk_slots, BLOCK_C=triton.next_power_of_2(num_chunks) if top_k else _combine_block(num_chunks),
            TILE_V=block_v,
            TILE_GROUP=TOPK_TILE_GROUP, CAPM=capm, num_warps=4, **launch_options(), **pdl,
        )  # fmt: skip
    return MarkovSample(
        tokens=tokens,
        token_probs=token_probs,
        confidence_inputs=confidence_inputs(w1, anchors, tokens),
        sparse_ids=sparse_ids,
        sparse_probs=sparse_probs,
        logits=logits,
    )
