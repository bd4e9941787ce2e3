"""Per-request draft context cache in slot form.

A draft layer turns each projected context row into keys and values with its own k_proj / v_proj (+ k_norm and
RoPE at the row's absolute position). Those K/V depend on nothing else (not on the block, not on later rows),
so they are computed once when the row's context features arrive and kept here; a round only appends the rows
of newly accepted tokens. This is DeepSpec's bookkeeping too: its DynamicCache gets context rows and block
rows, then is cropped back to ``start`` after every block, which leaves exactly the context rows.

Layout (SHARED_DECISIONS): K and V are [num_layers, num_slots, max_seq_len, num_kv_heads, head_dim]; a request
owns one slot for its lifetime and ``lengths[slot]`` valid rows (positions 0..length-1). Rollback is setting
the length back. Static shapes keep CUDA graphs possible and avoid fragmentation bookkeeping.
"""

from __future__ import annotations

import torch


class DraftContextCache:
    """Pre-allocated context K/V of every draft layer, one slot per request."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_slots, max_seq_len, num_kv_heads, head_dim) <= 0:
            raise ValueError("DraftContextCache: every dimension must be positive")
        shape = (num_layers, num_slots, max_seq_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Host-side lengths: bookkeeping and validation never need a device sync. `lengths_np` is a numpy view
        # of the same memory: per-slot reads and writes through it cost nanoseconds, not a torch op each.
        self.lengths = torch.zeros(num_slots, dtype=torch.int64)
        self.lengths_np = self.lengths.numpy()
        self._in_use = [False] * num_slots

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    @property
    def device(self) -> torch.device:
        return self.k.device

    def allocate(self) -> int:
        """Take a free slot (length 0) for a new request."""
        for slot, used in enumerate(self._in_use):
            if not used:
                self._in_use[slot] = True
                self.lengths_np[slot] = 0
                return slot
        raise ValueError(f"DraftContextCache: all {self.num_slots} slots are in use")

    def reserve_last(self) -> int:
        """Take the highest slot out of circulation for good (the CUDA-graph runner's dummy slot: padding
        requests of a bucketed batch read its context, which stays empty). Returns it."""
        slot = self.num_slots - 1
        if self._in_use[slot]:
            raise ValueError(f"DraftContextCache: slot {slot} is in use and cannot be reserved")
        self._in_use[slot] = True
        self.lengths_np[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        self._in_use[slot] = False
        self.lengths_np[slot] = 0

    def length(self, slot: int) -> int:
        self._check_slot(slot)
        return int(self.lengths_np[slot])

    def crop(self, slot: int, length: int) -> None:
        """Roll back to ``length`` rows; stale rows past it are never read and get overwritten."""
        self._check_slot(slot)
        if not 0 <= length <= int(self.lengths_np[slot]):
            raise ValueError(f"crop: length {length} outside [0, {int(self.lengths_np[slot])}] for slot {slot}")
        self.lengths_np[slot] = length

    def check_slots(self, slots: torch.Tensor) -> None:
        """Slots must be allocated and distinct (two rows writing one slot would corrupt it)."""
        values = slots.tolist()
        if len(set(values)) != len(values):
            raise ValueError(f"duplicate slots in one batch: {values}")
        for slot in values:
            self._check_slot(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
        if not self._in_use[slot]:
            raise ValueError(f"slot {slot} is not allocated")
