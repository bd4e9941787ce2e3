"""Varlen attention over slot caches: the contract, input validation and the pure-torch reference.

One call attends every request of a ragged batch over its own slot of a pre-allocated cache
(SHARED_DECISIONS: one layer's K/V are [S, T, Hkv, D], a request owns slot ``slots[r]``). Request r owns the
query rows ``query_starts[r] .. query_starts[r] + query_lens[r] - 1`` of ``q [N, Hq, D]``; query i of the chunk
sits at absolute position ``context_lens[r] + i``. Two kinds of keys:

* without ``k_block`` (the target's verify / decode / prefill chunks, whose K/V were stored in the cache
  first): the cache positions ``0 .. context_lens[r] + query_lens[r] - 1``; with ``causal`` query i sees those
  up to its own position ``context_lens[r] + i``;
* with ``k_block`` / ``v_block`` ([N, Hkv, D], rows laid out like q: the drafter's block, whose K/V never enter
  the cache): the cache positions ``0 .. context_lens[r] - 1`` followed by the block rows of the same request;
  with ``causal`` query i sees block rows 0..i, without it the whole block (DSpark's bidirectional block).

GQA: query head h reads kv head ``h // (Hq / Hkv)`` (HF's repeat_kv order). Rows of q that belong to no request
come back as zeros; so do queries of a request with ``query_len`` 0. ``ordered_rows`` promises that the requests'
rows are in order from row 0 (``query_starts[0] == 0``, ``query_starts[r] + query_lens[r] <= query_starts[r + 1]``):
the result is the same, but the Triton kernel then writes the zeros itself instead of starting from a zero fill.

Every length is read from device tensors: the Triton launch shape depends only on R, Hkv and the host bound
``max_query_len`` (the bucket's chunk size), so the call can be captured in a CUDA graph and replayed while the
lengths change. Softmax and both products are computed in float32; the result has q's dtype.
"""

from __future__ import annotations

import torch

from kernels.checks import require

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


def validate_slot_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    max_query_len: int,
    k_block: torch.Tensor | None,
    v_block: torch.Tensor | None,
    ordered_rows: bool = False,
) -> None:
    """Raise ValueError with a clear message on malformed input (reads the small control tensors: syncs)."""
    require(isinstance(q, torch.Tensor) and q.dim() == 3, "q must be a 3-D tensor [N, Hq, D]")
    require(q.dtype in _FLOAT_DTYPES, f"q must be float32, bfloat16 or float16, got {q.dtype}")
    num_rows, num_heads, head_dim = q.shape
    device = q.device
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(
            isinstance(cache, torch.Tensor) and cache.dim() == 4,
            f"{name} must be one layer's cache [S, T, Hkv, D]",
        )
        require(cache.device == device, f"{name} is on {cache.device}, q on {device}")
        require(cache.dtype == q.dtype, f"{name} has dtype {cache.dtype}, q has {q.dtype}")
        require(cache.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    require(k_cache.shape == v_cache.shape, f"k_cache {list(k_cache.shape)} != v_cache {list(v_cache.shape)}")
    num_slots, max_len, num_kv_heads, cache_dim = k_cache.shape
    require(cache_dim == head_dim, f"cache head_dim {cache_dim} != q head_dim {head_dim}")
    require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads",
    )
    require(slots.dim() == 1, "slots must have shape [R]")
    num_req = slots.shape[0]
    for name, tensor in (
        ("slots", slots),
        ("context_lens", context_lens),
        ("query_starts", query_starts),
        ("query_lens", query_lens),
    ):
        require(
            isinstance(tensor, torch.Tensor) and tensor.shape == (num_req,),
            f"{name} must have shape [{num_req}]",
        )
        require(tensor.dtype in _INT_DTYPES, f"{name} must be int32 or int64, got {tensor.dtype}")
        require(tensor.device == device, f"{name} is on {tensor.device}, q on {device}")
    require(isinstance(max_query_len, int) and max_query_len >= 1, "max_query_len must be an int >= 1")
    require((k_block is None) == (v_block is None), "k_block and v_block must be given together")
    if k_block is not None and v_block is not None:
        for name, block in (("k_block", k_block), ("v_block", v_block)):
            require(
                block.shape == (num_rows, num_kv_heads, head_dim),
                f"{name} must have shape [{num_rows}, {num_kv_heads}, {head_dim}], got {list(block.shape)}",
            )
            require(block.device == device and block.dtype == q.dtype, f"{name} must match q's device and dtype")
    if num_req == 0:
        return
    require(bool(((slots >= 0) & (slots < num_slots)).all()), f"slots must be in [0, {num_slots})")
    require(bool((query_lens >= 0).all()), "query_lens must be >= 0")
    require(
        bool((query_lens <= max_query_len).all()),
        f"a chunk is longer than max_query_len={max_query_len}",
    )
    require(bool((context_lens >= 0).all()), "context_lens must be >= 0")
    require(
        bool(((query_starts >= 0) & (query_starts + query_lens <= num_rows)).all()),
        f"query rows must lie in [0, {num_rows})",
    )
    cached = context_lens if k_block is not None else context_lens + query_lens
    require(bool((cached <= max_len).all()), f"keys would be read past the cache length {max_len}")
    if ordered_rows:
        ends = query_starts[:-1] + query_lens[:-1]
        require(
            int(query_starts[0]) == 0 and bool((ends <= query_starts[1:]).all()),
            "ordered_rows: the requests' rows must start at row 0 and each end before the next request's start",
        )


def slot_attention_reference(
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
) -> torch.Tensor:
    """Pure-torch reference (the oracle of the Triton kernel): padded to [R, max_query_len] queries and all T
    cache positions of each slot, masked. No host sync and static shapes, so it is graph-capturable too; it
    copies every slot's whole cache row, which is fine for tests and small CPU models only. ``ordered_rows`` is
    only checked (with ``validate``): it changes nothing here."""
    if validate:
        validate_slot_attention_inputs(
            q, k_cache, v_cache, slots, context_lens, query_starts, query_lens, max_query_len, k_block, v_block,
            ordered_rows,
        )  # fmt: skip
    num_rows, num_heads, head_dim = q.shape
    _, max_len, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_req = slots.shape[0]
    device = q.device
    out = torch.zeros((num_rows + 1, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_req == 0 or num_rows == 0:
        return out[:num_rows]
    offsets = torch.arange(max_query_len, device=device)
    ctx = context_lens.to(torch.int64)
    lens = query_lens.to(torch.int64)
    q_valid = offsets[None, :] < lens[:, None]  # [R, M]
    rows = (query_starts.to(torch.int64)[:, None] + offsets[None, :]).clamp(0, num_rows - 1)
    queries = q[rows].to(torch.float32).view(num_req, max_query_len, num_kv_heads, group, head_dim)

    slot_idx = slots.to(torch.int64)
    keys = k_cache[slot_idx].to(torch.float32)  # [R, T, Hkv, D]
    values = v_cache[slot_idx].to(torch.float32)
    key_pos = torch.arange(max_len, device=device)
    num_cached = ctx if k_block is not None else ctx + lens
    visible = (key_pos[None, None, :] < num_cached[:, None, None]).expand(num_req, max_query_len, max_len)
    if causal and k_block is None:
        visible = visible & (key_pos[None, None, :] <= (ctx[:, None] + offsets[None, :])[:, :, None])
    if k_block is not None and v_block is not None:
        keys = torch.cat([keys, k_block[rows].to(torch.float32)], dim=1)
        values = torch.cat([values, v_block[rows].to(torch.float32)], dim=1)
        block_visible = q_valid[:, None, :].expand(num_req, max_query_len, max_query_len)
        if causal:
            block_visible = block_visible & (offsets[None, None, :] <= offsets[None, :, None])
        visible = torch.cat([visible, block_visible], dim=2)
    visible = visible & q_valid[:, :, None]

    scores = torch.einsum("rmhgd,rkhd->rhgmk", queries, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    any_key = visible.any(dim=-1)[:, None, None, :, None]
    weights = torch.where(any_key, torch.softmax(scores, dim=-1), 0.0)
    attended = torch.einsum("rhgmk,rkhd->rmhgd", weights, values).reshape(num_req * max_query_len, num_heads, head_dim)
    # Padded query slots land on a trash row past the end, so the scatter needs no data-dependent shape.
    dest = torch.where(q_valid, rows, num_rows).reshape(-1)
    out.index_copy_(0, dest, attended.to(q.dtype))
    return out[:num_rows]
