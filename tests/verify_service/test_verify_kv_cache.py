"""Slot KV cache bookkeeping: allocation, rollback, capacity errors, and ragged batch validation."""

from __future__ import annotations

import pytest
import torch

from verify_service.kv_cache import (
    KVCapacityError,
    NoFreeSlotError,
    RaggedBatch,
    SlotKVCache,
    SlotOverflowError,
)


def make_cache(num_slots: int = 3, max_seq_len: int = 10) -> SlotKVCache:
    return SlotKVCache(2, num_slots, max_seq_len, 2, 4)


def test_shapes_and_bytes_per_slot() -> None:
    cache = SlotKVCache(2, 3, 10, 2, 4, dtype=torch.bfloat16)
    assert cache.k.shape == cache.v.shape == (2, 3, 10, 2, 4)
    assert cache.dtype == torch.bfloat16
    assert SlotKVCache.bytes_per_slot(2, 10, 2, 4, torch.bfloat16) == 2 * 2 * 10 * 2 * 4 * 2
    with pytest.raises(ValueError, match="num_slots"):
        SlotKVCache(2, 0, 10, 2, 4)


def test_allocate_lowest_free_slot_and_reuse_after_free() -> None:
    cache = make_cache()
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    assert cache.num_free_slots == 0
    with pytest.raises(NoFreeSlotError, match="all 3 slots"):
        cache.allocate()
    cache.advance(1, 4)
    cache.free(1)
    assert not cache.is_allocated(1)
    assert cache.allocate() == 1
    assert cache.length(1) == 0, "a reused slot starts empty"


def test_advance_truncate_and_overflow() -> None:
    cache = make_cache(max_seq_len=10)
    slot = cache.allocate()
    cache.advance(slot, 7)
    assert cache.remaining(slot) == 3
    with pytest.raises(SlotOverflowError, match="max_seq_len=10"):
        cache.advance(slot, 4)
    assert cache.length(slot) == 7, "a refused advance changes nothing"
    cache.truncate(slot, 5)
    assert cache.length(slot) == 5
    with pytest.raises(ValueError, match="outside"):
        cache.truncate(slot, 6)
    with pytest.raises(ValueError, match="outside"):
        cache.truncate(slot, -1)
    assert issubclass(SlotOverflowError, KVCapacityError) and issubclass(KVCapacityError, ValueError)


def test_unallocated_or_out_of_range_slots_are_refused() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="not allocated"):
        cache.length(0)
    with pytest.raises(ValueError, match="not in"):
        cache.length(5)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(2)


def test_ragged_batch_layout_continues_each_slot() -> None:
    cache = make_cache()
    a, b = cache.allocate(), cache.allocate()
    cache.advance(b, 4)
    batch = RaggedBatch.build(cache, [(a, [1, 2, 3]), (b, torch.tensor([7, 8]))], vocab_size=16)
    assert batch.input_ids.tolist() == [1, 2, 3, 7, 8]
    assert batch.positions.tolist() == [0, 1, 2, 4, 5]
    assert batch.slots.tolist() == [a, b]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.last_rows().tolist() == [2, 4]
    assert (batch.max_seqlen_q, batch.max_seqlen_k) == (3, 6)
    assert cache.length(a) == 0 and cache.length(b) == 4, "building a batch does not touch the cache"


@pytest.mark.parametrize(
    ("chunks", "error", "message"),
    [
        ([], ValueError, "no chunks"),
        ([(0, [])], ValueError, "empty"),
        ([(0, [1]), (0, [2])], ValueError, "twice"),
        ([(0, [1, 16])], ValueError, "outside"),
        ([(0, [-1])], ValueError, "outside"),
        ([(2, [1])], ValueError, "not allocated"),
        ([(0, [1]), (1, [1, 2, 3, 4, 5, 6, 7])], SlotOverflowError, "exceed"),
    ],
)
def test_ragged_batch_refuses_bad_chunks_without_side_effects(chunks, error, message) -> None:
    cache = make_cache(max_seq_len=10)
    a, b = cache.allocate(), cache.allocate()
    cache.advance(b, 4)
    with pytest.raises(error, match=message):
        RaggedBatch.build(cache, chunks, vocab_size=16)
    assert (cache.length(a), cache.length(b)) == (0, 4)
