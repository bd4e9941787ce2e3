"""Arrival counters of split launches: the last program of a tile to arrive finishes the tile.

The skinny GEMMs' split K and the slot attention's split keys both write per-program partials and let the last
program of an output tile (an int32 ticket from ``tl.atomic_add``) combine them in one launch. The counters
must start at zero, and the kernels reset them after use, so one zeroed buffer serves forever. A buffer made
during a CUDA graph capture would be zeroed only at the first replay and could come from the graph's private
pool, handed out again once the graph is gone; hence the per-device default is made on first eager use (the
captured callers warm up eagerly first: kernels.graphs.GraphStep) and refused inside a capture.
"""

from __future__ import annotations

import torch


class ArrivalCounters:
    """The counter buffers of one kernel family: ``slots`` int32 counters each (one per output tile of a split
    launch). Launches that may run concurrently (different streams) need separate buffers (:meth:`new`)."""

    def __init__(self, owner: str, slots: int) -> None:
        self.owner = owner  # named in errors
        self.slots = slots
        self.defaults: dict[torch.device, torch.Tensor] = {}

    def new(self, device: torch.device | str) -> torch.Tensor:
        """A zeroed buffer of ``slots`` counters."""
        return torch.zeros(self.slots, dtype=torch.int32, device=device)

    def default(self, device: torch.device) -> torch.Tensor:
        """This process's shared buffer for ``device``, made on first use, never during a CUDA graph capture."""
        if device not in self.defaults:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.owner}: pass counters=new_counters(device), or run a split launch once "
                                   "before capturing")  # fmt: skip
            self.defaults[device] = self.new(device)
        return self.defaults[device]

    def check(self, tiles: int) -> None:
        """Refuse a launch with more tiles than counters (each tile needs its own)."""
        if tiles > self.slots:
            raise ValueError(f"{self.owner}: {tiles} split tiles exceed the {self.slots} arrival counters")
