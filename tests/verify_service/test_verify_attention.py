"""varlen_cached_attention equals naive per-token causal attention over each slot, for every batch layout."""

from __future__ import annotations

import pytest
import torch

from verify_service.attention import PAD_LIMIT, CachedAttentionMetadata, store_kv, varlen_cached_attention
from verify_service.kv_cache import RaggedBatch, SlotKVCache

HEAD_DIM = 8


def naive_attention(q: torch.Tensor, cache: SlotKVCache, batch: RaggedBatch, scale: float) -> torch.Tensor:
    """Token by token in float64: softmax(q . K[slot, 0..pos]) V[slot, 0..pos], kv head = h // group."""
    group = q.shape[1] // cache.num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    token_slots = torch.repeat_interleave(batch.slots, torch.tensor(batch.seqlens))
    for n in range(q.shape[0]):
        slot, pos = int(token_slots[n]), int(batch.positions[n])
        for h in range(q.shape[1]):
            keys = cache.k[0, slot, : pos + 1, h // group].double()
            values = cache.v[0, slot, : pos + 1, h // group].double()
            weights = torch.softmax(keys @ q[n, h].double() * scale, dim=0)
            out[n, h] = weights @ values
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)])
def test_matches_naive_for_mixed_prefill_and_verify_chunks(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(num_heads)
    cache = SlotKVCache(1, 5, 96, num_kv_heads, HEAD_DIM)
    # (cached length, chunk length): verify-sized chunks, an anchor-only chunk, a fresh prefill longer than
    # PAD_LIMIT and a long chunk continuing a slot (chunked prefill), all in one batch.
    layout = [(10, 4), (3, 1), (0, PAD_LIMIT + 9), (20, 8), (30, PAD_LIMIT + 3)]
    chunks = []
    for cached, n in layout:
        slot = cache.allocate()
        cache.advance(slot, cached)
        chunks.append((slot, [0] * n))
    # Stale, large entries everywhere: anything read past a query's position would spoil the result.
    cache.k.normal_(generator=gen).mul_(1e3)
    cache.v.normal_(generator=gen).mul_(1e3)
    batch = RaggedBatch.build(cache, chunks, vocab_size=1)
    meta = CachedAttentionMetadata.from_batch(batch, num_heads // num_kv_heads)
    assert meta.padded is not None and len(meta.solo) == 2
    k = torch.randn(batch.num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(batch.num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    store_kv(cache.k[0], cache.v[0], k, v, meta)
    # The cached prefix gets ordinary values again (only the part past each chunk stays stale).
    for (slot, _), (cached, _) in zip(chunks, layout, strict=True):
        cache.k[0, slot, :cached] = torch.randn(cached, num_kv_heads, HEAD_DIM, generator=gen)
        cache.v[0, slot, :cached] = torch.randn(cached, num_kv_heads, HEAD_DIM, generator=gen)
    q = torch.randn(batch.num_tokens, num_heads, HEAD_DIM, generator=gen)
    out = varlen_cached_attention(q, cache.k[0], cache.v[0], meta, HEAD_DIM**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(
        out.double(), naive_attention(q, cache, batch, HEAD_DIM**-0.5), atol=1e-5, rtol=1e-5
    )


def test_store_kv_writes_at_slot_and_position() -> None:
    cache = SlotKVCache(1, 3, 8, 1, HEAD_DIM)
    a, b = cache.allocate(), cache.allocate()
    cache.advance(b, 5)
    batch = RaggedBatch.build(cache, [(b, [0, 0]), (a, [0])], vocab_size=1)
    meta = CachedAttentionMetadata.from_batch(batch, 1)
    k = torch.arange(3, dtype=torch.float32)[:, None, None].expand(3, 1, HEAD_DIM) + 1
    store_kv(cache.k[0], cache.v[0], k, -k, meta)
    assert cache.k[0, b, 5:7, 0, 0].tolist() == [1.0, 2.0]
    assert cache.k[0, a, 0, 0, 0].item() == 3.0
    assert cache.v[0, a, 0, 0, 0].item() == -3.0
    assert int((cache.k != 0).sum()) == 3 * HEAD_DIM, "nothing else is written"


def test_refuses_metadata_built_for_another_head_layout() -> None:
    cache = SlotKVCache(1, 1, 8, 2, HEAD_DIM)
    slot = cache.allocate()
    batch = RaggedBatch.build(cache, [(slot, [0, 0])], vocab_size=1)
    meta = CachedAttentionMetadata.from_batch(batch, 1)
    with pytest.raises(ValueError, match="query heads"):
        varlen_cached_attention(torch.zeros(2, 4, HEAD_DIM), cache.k[0], cache.v[0], meta, 1.0)
