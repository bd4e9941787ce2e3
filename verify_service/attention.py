"""Causal attention of a ragged flattened batch over the slot KV cache (the torch path; works on CPU).

Everything a layer's attention needs besides q and the cache is computed once per forward pass in
`CachedAttentionMetadata` and shared by all layers. `varlen_cached_attention` is the single function a GPU
kernel replaces; its signature is the contract: q [N, Hq, D], one layer's k_cache / v_cache [S, T, Hkv, D],
metadata, scale -> [N, Hq, D]. Backends:

* ``torch`` (the default on CPU): the padded / per-chunk scaled_dot_product_attention path described below;
* ``triton`` (the default on CUDA): :func:`kernels.slot_attention_triton.slot_attention_triton`, reading the
  slots in place with lengths from device tensors; its launch shape depends only on the number of requests
  and the longest chunk, so a verify step can be captured in a CUDA graph;
* ``reference``: that kernel's torch reference (same layout, no host sync), which lets the CUDA-graph batch
  layout (`CachedAttentionMetadata.bucketed`) run and be tested on CPU.

How the torch path batches: short chunks (verify chunks, decode steps: at most `PAD_LIMIT` tokens) are padded
to [R, max_q] queries and [R, max_k] keys gathered from their slots and run in ONE
scaled_dot_product_attention call with a boolean mask key_position <= query_position; on CPU with small
models one batched call beats a Python loop over requests. Long chunks (prefills) get one call each: padding
every verify chunk up to a prompt's length would multiply the work (docs/benchmarks/engine.md has the CPU
timings of both choices). GQA is handled without copying K/V per query head: the G query heads sharing a
kv head are stacked along the query axis, so each kv head is read once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kernels.slot_attention import slot_attention_reference
from verify_service.kv_cache import RaggedBatch

AttentionBackend = Literal["torch", "triton", "reference"]
ATTENTION_BACKENDS: tuple[str, ...] = ("torch", "triton", "reference")

PAD_LIMIT = 32
"""Chunks up to this many tokens are attended together in the padded call; longer ones each on their own."""


@dataclass(frozen=True)
class PaddedGroup:
    """The short chunks of a batch, laid out padded: P requests x max_q queries x max_k keys."""

    slots: torch.Tensor  # [P] int64
    rows: torch.Tensor  # [Np] int64: batch rows of these requests' tokens, request by request
    pad_index: torch.Tensor  # [P * max_q] int64: batch row of each padded query (padding repeats a real row)
    unpad_index: torch.Tensor  # [Np] int64: flat index p * max_q + i of each real token in the padded layout
    mask: torch.Tensor  # [P, 1, G * max_q, max_k] bool: key visible to query (repeated per query head group)
    max_q: int
    max_k: int


@dataclass(frozen=True)
class SoloChunk:
    """A long chunk attended on its own: batch rows row_start .. row_start + num_rows - 1 of one slot."""

    slot: int
    row_start: int
    num_rows: int
    mask: torch.Tensor  # [1, 1, G * num_rows, start + num_rows] bool


@dataclass(frozen=True)
class CachedAttentionMetadata:
    """Per-forward indexing shared by every layer (built once from a RaggedBatch, or from bucket buffers)."""

    token_slots: torch.Tensor  # [N] int64: slot of each token, where its K/V are written
    positions: torch.Tensor  # [N] int64: absolute position of each token
    slots: torch.Tensor  # [R] int64
    query_groups: int  # G = query heads per kv head
    padded: PaddedGroup | None  # torch backend only
    solo: tuple[SoloChunk, ...]  # torch backend only
    backend: str = "torch"
    # Kernel backends: request r's queries are rows query_starts[r] .. + query_lens[r], at positions
    # context_lens[r] onward; max_query_len bounds query_lens (the launch shape).
    context_lens: torch.Tensor | None = None
    query_starts: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None
    max_query_len: int = 0

    @classmethod
    def from_batch(
        cls, batch: RaggedBatch, query_groups: int, backend: str = "torch"
    ) -> CachedAttentionMetadata:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; use one of {ATTENTION_BACKENDS}")
        device = batch.input_ids.device
        seqlens = torch.tensor(batch.seqlens, dtype=torch.int64, device=device)
        token_slots = torch.repeat_interleave(batch.slots, seqlens, output_size=batch.num_tokens)
        if backend != "torch":
            return cls(
                token_slots=token_slots,
                positions=batch.positions,
                slots=batch.slots,
                query_groups=query_groups,
                padded=None,
                solo=(),
                backend=backend,
                context_lens=torch.tensor(batch.starts, dtype=torch.int64, device=device),
                query_starts=batch.cu_seqlens[:-1],
                query_lens=seqlens,
                max_query_len=batch.max_seqlen_q,
            )
        short = [r for r, n in enumerate(batch.seqlens) if n <= PAD_LIMIT]
        solo = tuple(
            SoloChunk(
                slot=batch.slot_list[r],
                row_start=int(sum(batch.seqlens[:r])),
                num_rows=n,
                mask=_causal_mask(torch.arange(start, start + n, device=device), start + n, query_groups)[
                    None, None
                ],
            )
            for r, (start, n) in enumerate(zip(batch.starts, batch.seqlens, strict=True))
            if n > PAD_LIMIT
        )
        return cls(
            token_slots=token_slots,
            positions=batch.positions,
            slots=batch.slots,
            query_groups=query_groups,
            padded=_padded_group(batch, short, query_groups) if short else None,
            solo=solo,
        )

    @classmethod
    def bucketed(
        cls,
        slots: torch.Tensor,
        context_lens: torch.Tensor,
        query_lens: torch.Tensor,
        width: int,
        dummy_slot: int,
        query_groups: int,
        backend: str,
    ) -> CachedAttentionMetadata:
        """The CUDA-graph layout: request r owns rows r*width .. r*width + width - 1, of which the first
        query_lens[r] are real. Built from device tensors only (no host sync, static shapes).

        Padding rows must still write their K/V somewhere: they go to ``dummy_slot`` (a slot no request owns)
        at positions 0..width-1, never past a real request's chunk, so a request near the end of its slot is
        never overwritten and nothing is written out of bounds.
        """
        if backend == "torch":
            raise ValueError("the bucketed layout needs a kernel backend ('triton' or 'reference')")
        num_req = slots.shape[0]
        offsets = torch.arange(width, dtype=torch.int64, device=slots.device)
        real = offsets[None, :] < query_lens[:, None]
        positions = torch.where(real, context_lens[:, None] + offsets[None, :], offsets[None, :])
        token_slots = torch.where(real, slots[:, None], torch.full_like(slots, dummy_slot)[:, None])
        return cls(
            token_slots=token_slots.reshape(-1),
            positions=positions.reshape(-1),
            slots=slots,
            query_groups=query_groups,
            padded=None,
            solo=(),
            backend=backend,
            context_lens=context_lens,
            query_starts=torch.arange(num_req, dtype=torch.int64, device=slots.device) * width,
            query_lens=query_lens,
            max_query_len=width,
        )


def _causal_mask(query_pos: torch.Tensor, num_keys: int, query_groups: int) -> torch.Tensor:
    """[..., G * q, num_keys] bool from query positions [..., q]: key j is visible iff j <= the query's
    position (the q rows are repeated for the G query heads of a kv head)."""
    key_pos = torch.arange(num_keys, dtype=torch.int64, device=query_pos.device)
    mask = key_pos <= query_pos[..., None]  # [..., q, K]
    lead = mask.shape[:-2]
    mask = mask.unsqueeze(-3).expand(*lead, query_groups, *mask.shape[-2:])
    return mask.reshape(*lead, query_groups * mask.shape[-2], num_keys)


def _padded_group(batch: RaggedBatch, requests: list[int], query_groups: int) -> PaddedGroup:
    device = batch.input_ids.device
    seqlens = [batch.seqlens[r] for r in requests]
    starts = [batch.starts[r] for r in requests]
    first_rows = batch.cu_seqlens[torch.tensor(requests, dtype=torch.int64, device=device)]
    max_q = max(seqlens)
    max_k = max(s + n for s, n in zip(starts, seqlens, strict=True))
    lengths = torch.tensor(seqlens, dtype=torch.int64, device=device)
    offsets = torch.arange(max_q, dtype=torch.int64, device=device)
    real = offsets[None, :] < lengths[:, None]  # [P, max_q]
    # Padded query rows copy the request's first row: they stay finite (key 0 is always visible) and are
    # dropped by unpad_index, so they never reach the output.
    clamped = torch.where(real, offsets[None, :], 0)
    query_pos = torch.tensor(starts, dtype=torch.int64, device=device)[:, None] + clamped
    flat = torch.arange(len(requests), dtype=torch.int64, device=device)[:, None] * max_q + offsets[None, :]
    return PaddedGroup(
        slots=batch.slots[torch.tensor(requests, dtype=torch.int64, device=device)],
        rows=(first_rows[:, None] + offsets[None, :])[real],
        pad_index=(first_rows[:, None] + clamped).reshape(-1),
        unpad_index=flat[real],
        mask=_causal_mask(query_pos, max_k, query_groups)[:, None],
        max_q=max_q,
        max_k=max_k,
    )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: CachedAttentionMetadata,
) -> None:
    """Write the chunk's K/V [N, Hkv, D] into one layer's cache [S, T, Hkv, D] at (slot, position)."""
    k_cache[meta.token_slots, meta.positions] = k.to(k_cache.dtype)
    v_cache[meta.token_slots, meta.positions] = v.to(v_cache.dtype)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [B, q, Hq, D], k/v [B, K, Hkv, D], mask [B, 1, G*q, K] -> [B, q, Hq, D] (G = Hq / Hkv)."""
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    # [B, q, Hkv, G, D] -> [B, Hkv, G * q, D]: query head h = kv head h // G, as in HF's repeat_kv.
    q = q.view(batch, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * num_q, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=mask, scale=scale
    )
    out = out.view(batch, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, num_q, num_heads, head_dim)


def varlen_cached_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: CachedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each token over its slot's cached positions 0..its own position.

    q: [N, Hq, D]; k_cache, v_cache: one layer's cache [S, T, Hkv, D] that already holds this chunk's K/V
    (call `store_kv` first); returns [N, Hq, D] in q's dtype. Query head h reads kv head h // (Hq / Hkv).
    """
    _, num_heads, head_dim = q.shape
    if num_heads != meta.query_groups * k_cache.shape[2]:
        raise ValueError(
            f"varlen_cached_attention: {num_heads} query heads over {k_cache.shape[2]} kv heads, but the "
            f"metadata was built for {meta.query_groups} query heads per kv head"
        )
    if meta.backend != "torch":
        assert meta.context_lens is not None and meta.query_starts is not None and meta.query_lens is not None
        impl = _triton_slot_attention() if meta.backend == "triton" else slot_attention_reference
        return impl(
            q,
            k_cache,
            v_cache,
            meta.slots,
            meta.context_lens,
            meta.query_starts,
            meta.query_lens,
            scale,
            max_query_len=meta.max_query_len,
            causal=True,
            validate=False,
            ordered_rows=True,  # every kernel layout: from_batch, bucketed, the ragged graph step (graphs.py)
        )
    out = torch.empty_like(q)
    group = meta.padded
    if group is not None:
        num_requests = group.slots.shape[0]
        q_pad = q.index_select(0, group.pad_index).view(num_requests, group.max_q, num_heads, head_dim)
        # narrow + index_select: a plain copy per slot, several times faster on CPU than advanced indexing.
        k = k_cache.narrow(1, 0, group.max_k).index_select(0, group.slots)
        v = v_cache.narrow(1, 0, group.max_k).index_select(0, group.slots)
        o = _grouped_attention(q_pad, k, v, group.mask, scale)
        out[group.rows] = o.reshape(num_requests * group.max_q, num_heads, head_dim)[group.unpad_index]
    for chunk in meta.solo:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_rows)
        num_keys = chunk.mask.shape[-1]
        k = k_cache[chunk.slot, :num_keys][None]
        v = v_cache[chunk.slot, :num_keys][None]
        out[rows] = _grouped_attention(q[rows][None], k, v, chunk.mask, scale)[0]
    return out


def _triton_slot_attention():
    """Imported on first use: the Triton module is only needed where the triton backend is chosen."""
    from kernels.slot_attention_triton import slot_attention_triton

    return slot_attention_triton
