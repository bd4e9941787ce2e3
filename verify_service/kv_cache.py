"""Slot KV cache of the target: one pre-allocated row of K/V memory per running request.

Why slots rather than paged blocks:
- Static shapes. K and V are two fixed tensors [num_layers, num_slots, max_seq_len, num_kv_heads, head_dim];
  a request is an integer slot index, so a verify step touches the same buffers every round and can be
  captured in a CUDA graph for bucketed batch sizes without re-capturing when requests come and go.
- O(1) rollback. Rejected draft tokens are dropped by moving the slot's length counter back; the stale K/V
  behind it are never read (attention only looks at positions <= the query's) and are overwritten by the next
  chunk.
- No fragmentation bookkeeping. This product serves short chat-style contexts with a fixed context limit, so
  reserving max_seq_len per request costs little and removes block tables, block allocation per round and
  copy-on-write. The price (memory reserved for the worst case) is explicit: `SlotKVCache.bytes_per_slot`.

Lengths live on the host (a numpy array): the engine needs them every round to build positions and to check
capacity, and keeping them off the device avoids a device sync per round. The cache itself never changes a
length behind the caller's back; `RaggedBatch.build` checks capacity before a forward pass writes anything,
so a request that does not fit is refused without touching any other slot.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class KVCapacityError(ValueError):
    """The cache cannot take this request or chunk now; the caller can make the request wait or reject it."""


class NoFreeSlotError(KVCapacityError):
    """Every slot is owned by a running request."""


class SlotOverflowError(KVCapacityError):
    """A chunk would grow a request past max_seq_len (the per-request context limit)."""


class SlotKVCache:
    """Pre-allocated K/V for `num_slots` requests of up to `max_seq_len` tokens each, and per-slot lengths."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("max_seq_len", max_seq_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SlotKVCache: {name} must be a positive int, got {value!r}")
        shape = (num_layers, num_slots, max_seq_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._lengths = np.zeros(num_slots, dtype=np.int64)
        self._allocated = np.zeros(num_slots, dtype=bool)
        # Lowest free slot first: deterministic placement makes runs reproducible and keeps used slots dense.
        self._free: list[int] = list(range(num_slots))

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @staticmethod
    def bytes_per_slot(
        num_layers: int, max_seq_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one slot reserves (K and V), for sizing num_slots from a memory budget."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * max_seq_len * num_kv_heads * head_dim * itemsize

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (length 0) for a new request; NoFreeSlotError when all are in use."""
        if not self._free:
            raise NoFreeSlotError(f"SlotKVCache: all {self.num_slots} slots are in use")
        slot = heapq.heappop(self._free)
        self._allocated[slot] = True
        self._lengths[slot] = 0
        return slot

    def reserve_last(self) -> int:
        """Take the highest slot out of circulation for good and return it: the CUDA-graph runner's dummy
        slot, where padding rows of a bucketed batch write their K/V. No request is ever given it."""
        slot = self.num_slots - 1
        if self._allocated[slot]:
            raise ValueError(f"SlotKVCache: slot {slot} is in use and cannot be reserved")
        self._free.remove(slot)
        heapq.heapify(self._free)
        self._allocated[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a finished or aborted request's slot back; its K/V are simply forgotten (length 0)."""
        self._check_allocated(slot)
        self._allocated[slot] = False
        self._lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._allocated[slot])

    def length(self, slot: int) -> int:
        """Number of valid cached positions of the slot (the position the next token will take)."""
        self._check_allocated(slot)
        return int(self._lengths[slot])

    def lengths(self, slots: Sequence[int]) -> np.ndarray:
        """Lengths of several slots as an int64 array (a copy)."""
        index = np.asarray(slots)
        if index.dtype.kind not in "iu" or (
            index.size
            and (index.min() < 0 or index.max() >= self.num_slots or not bool(self._allocated[index].all()))
        ):
            for slot in slots:
                self._check_allocated(slot)
        return self._lengths[index.astype(np.int64, copy=False)]  # integer indexing copies

    def lengths_unchecked(self, slots: np.ndarray) -> np.ndarray:
        """:meth:`lengths` of slots known to be allocated (int64 indices: the verify engine's own requests'), without
        the checks: this runs every round."""
        return self._lengths[slots]  # integer indexing copies

    def remaining(self, slot: int) -> int:
        """How many more tokens the slot can take before reaching max_seq_len."""
        return self.max_seq_len - self.length(slot)

    def check_extend(self, slot: int, num_tokens: int) -> None:
        """Raise SlotOverflowError if appending `num_tokens` would pass max_seq_len (nothing is changed)."""
        length = self.length(slot)
        if length + num_tokens > self.max_seq_len:
            raise SlotOverflowError(
                f"SlotKVCache: slot {slot} holds {length} tokens; {num_tokens} more would exceed "
                f"max_seq_len={self.max_seq_len}"
            )

    def truncate(self, slot: int, new_length: int) -> None:
        """Roll the slot back to `new_length` valid positions (drops rejected tokens' K/V in O(1))."""
        length = self.length(slot)
        if not 0 <= new_length <= length:
            raise ValueError(
                f"SlotKVCache: truncate slot {slot} to {new_length} is outside [0, current length {length}]"
            )
        self._lengths[slot] = new_length

    def advance(self, slot: int, num_tokens: int) -> None:
        """Mark `num_tokens` more positions valid after a forward pass wrote them (capacity-checked)."""
        if num_tokens < 0:
            raise ValueError(f"SlotKVCache: advance by a negative count {num_tokens}")
        self.check_extend(slot, num_tokens)
        self._lengths[slot] += num_tokens

    def advance_many(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """`advance` for several distinct allocated slots at once: one vectorized capacity check, then all
        lengths move (nothing moves if any slot would overflow)."""
        index = np.asarray(slots, dtype=np.int64)
        steps = np.asarray(counts, dtype=np.int64)
        if index.size and (
            index.min() < 0 or index.max() >= self.num_slots or not bool(self._allocated[index].all())
        ):
            raise ValueError(f"SlotKVCache: slots {index.tolist()} are not all allocated")
        if bool((steps < 0).any()):
            raise ValueError(f"SlotKVCache: advance by negative counts {steps.tolist()}")
        new = self._lengths[index] + steps
        if bool((new > self.max_seq_len).any()):
            raise SlotOverflowError(
                f"SlotKVCache: lengths {new.tolist()} would exceed max_seq_len={self.max_seq_len}"
            )
        self._lengths[index] = new

    def set_lengths(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """Set the lengths of allocated slots, unchecked: for a caller that read them with :meth:`lengths` and
        verified the room (a bucketed verify step commits its rows with it: no per-step re-validation)."""
        self._lengths[slots] = lengths

    def _check_allocated(self, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise ValueError(f"SlotKVCache: slot {slot!r} is not in [0, {self.num_slots})")
        if not self._allocated[slot]:
            raise ValueError(f"SlotKVCache: slot {slot} is not allocated")


@dataclass(frozen=True)
class RaggedBatch:
    """One forward pass worth of chunks, flattened: request r's tokens are rows cu_seqlens[r]:cu_seqlens[r+1].

    Each chunk continues its slot: positions run from the slot's cached length upward, so a prefill chunk
    (the prompt, or part of it) and a verify chunk ([anchor, x1..x_l]) have the same form and mix freely in
    one batch. The tensors live on the cache's device; the host copies (`slot_list`, `starts`, `seqlens`) let
    the model and engine check and index without a device sync.
    """

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [R] int64
    cu_seqlens: torch.Tensor  # [R+1] int64
    slot_list: tuple[int, ...]
    starts: tuple[int, ...]  # cached length of each slot when the batch was built (= first position)
    seqlens: tuple[int, ...]  # chunk length of each request (>= 1)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return len(self.slot_list)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens)

    @property
    def max_seqlen_k(self) -> int:
        return max(s + n for s, n in zip(self.starts, self.seqlens, strict=True))

    def last_rows(self) -> torch.Tensor:
        """Row index of each request's last token [R] (e.g. the only logits a prefill chunk needs)."""
        return self.cu_seqlens[1:] - 1

    @classmethod
    def build(
        cls, cache: SlotKVCache, chunks: Sequence[tuple[int, Sequence[int] | torch.Tensor]], vocab_size: int
    ) -> RaggedBatch:
        """Validate (slot, token ids) chunks against the cache and flatten them.

        Raises ValueError for an empty batch, an empty chunk, a slot listed twice or not allocated, and token
        ids outside [0, vocab_size); SlotOverflowError (a KVCapacityError) if a chunk would pass max_seq_len.
        Nothing in the cache changes here, so a refused batch leaves every request as it was.
        """
        if len(chunks) == 0:
            raise ValueError("RaggedBatch: no chunks")
        slot_list: list[int] = []
        token_lists: list[torch.Tensor] = []
        for slot, tokens in chunks:
            slot = int(slot)
            ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).cpu()
            if ids.numel() == 0:
                raise ValueError(
                    f"RaggedBatch: chunk for slot {slot} is empty (a verify chunk holds the anchor)"
                )
            if slot in slot_list:
                raise ValueError(f"RaggedBatch: slot {slot} appears twice in one batch")
            bad = (ids < 0) | (ids >= vocab_size)
            if bool(bad.any()):
                raise ValueError(
                    f"RaggedBatch: token id {int(ids[bad][0])} for slot {slot} is outside [0, {vocab_size})"
                )
            cache.check_extend(slot, int(ids.numel()))
            slot_list.append(slot)
            token_lists.append(ids)
        starts = tuple(int(s) for s in cache.lengths(slot_list))
        seqlens = tuple(int(t.numel()) for t in token_lists)
        positions = torch.cat(
            [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, seqlens, strict=True)]
        )
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0)
        device = cache.device
        return cls(
            input_ids=torch.cat(token_lists).to(device),
            positions=positions.to(device),
            slots=torch.tensor(slot_list, dtype=torch.int64, device=device),
            cu_seqlens=cu.to(device),
            slot_list=tuple(slot_list),
            starts=starts,
            seqlens=seqlens,
        )
