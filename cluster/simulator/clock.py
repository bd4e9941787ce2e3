"""The simulated clock: a time-ordered queue of events.

Events at the same time run in the order they were scheduled (a sequence number breaks ties), so a run is a
function of its inputs and seed alone. Arrivals are not queued here: the loop merges the sorted arrival array
with the queue (one comparison per event instead of a million queued entries).
"""

from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    """``push(time, kind, payload)``; ``pop()`` returns the earliest (time, kind, payload)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, time: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, kind, payload))

    def push_all(self, times: list[float], kind: int, payloads: list[Any]) -> None:
        """``push(time, kind, payload)`` for each pair, in order."""
        heap, seq = self._heap, self._seq
        for time, payload in zip(times, payloads, strict=True):
            seq += 1
            heapq.heappush(heap, (time, seq, kind, payload))
        self._seq = seq

    def pop(self) -> tuple[float, int, Any]:
        time, _, kind, payload = heapq.heappop(self._heap)
        return time, kind, payload

    def next_time(self) -> float:
        """Time of the earliest event (infinity when empty)."""
        return self._heap[0][0] if self._heap else float("inf")

    def __len__(self) -> int:
        return len(self._heap)
