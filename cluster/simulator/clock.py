"""The simulated clock: a time-ordered queue of events.

Events at the same time run in the order they were scheduled (a sequence number breaks ties), so a run is a
function of its inputs and seed alone. Arrivals are not queued here: the loop merges the sorted arrival array
with the queue (one comparison per event instead of a million queued entries).
"""

from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    """``push(time, kind, payload)``; ``pop()`` returns the earliest (time, kind, payload). ``heap`` is the heap
    itself, entries (time, sequence number, kind, payload): a hot loop may read its head and pop it with heapq
    directly, without a method call per event."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, time: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (time, self._seq, kind, payload))

    def push_all(self, times: list[float], kind: int, payloads: list[Any]) -> None:
        """``push(time, kind, payload)`` for each pair, in order."""
        heap, seq = self.heap, self._seq
        for time, payload in zip(times, payloads, strict=True):
            seq += 1
            heapq.heappush(heap, (time, seq, kind, payload))
        self._seq = seq

    def pop(self) -> tuple[float, int, Any]:
        time, _, kind, payload = heapq.heappop(self.heap)
        return time, kind, payload

    def next_time(self) -> float:
        """Time of the earliest event (infinity when empty)."""
        return self.heap[0][0] if self.heap else float("inf")

    def __len__(self) -> int:
        return len(self.heap)
