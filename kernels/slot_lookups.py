"""The entries and cache slots of the last few request lists an engine was asked about.

A round asks both engines about the same requests in the same order several times (the verify step; the drafter's
propose, then its context append, then the next propose; with request groups, the same few lists in turn). Keeping
each list's answer until a request is added or released makes a steady round cost one tuple hash and comparison
per call instead of a lookup per request. Shared by the draft and verify engines; knows nothing of either.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

#: Request lists whose answers are kept (a round driver's request groups: a few at most).
LOOKUPS_KEPT = 8


class _HasSlot(Protocol):
    slot: int


E = TypeVar("E", bound=_HasSlot)
_SLOT = operator.attrgetter("slot")


class SlotLookups(Generic[E]):
    """``get(req_ids, entries_of)``: (entries, read-only int64 slots) of a request list, computed once per list."""

    def __init__(self, kept: int = LOOKUPS_KEPT) -> None:
        self._kept = kept
        self._answers: dict[tuple[str, ...], tuple[list[E], np.ndarray, bool]] = {}

    def get(
        self, req_ids: Sequence[str], entries_of: Callable[[tuple[str, ...]], list[E]]
    ) -> tuple[list[E], np.ndarray]:
        """The kept answer for exactly this list, else ``entries_of(req_ids)`` (which may raise for an unknown
        request: nothing is kept then) and their slots."""
        entries, slots, _ = self.get_distinct(req_ids, entries_of)
        return entries, slots

    def get_distinct(
        self, req_ids: Sequence[str], entries_of: Callable[[tuple[str, ...]], list[E]]
    ) -> tuple[list[E], np.ndarray, bool]:
        """:meth:`get`, and whether the list names every request once (checked once per list)."""
        key = req_ids if type(req_ids) is tuple else tuple(req_ids)
        found = self._answers.get(key)
        if found is not None:
            return found
        entries = entries_of(key)
        slots = np.fromiter(map(_SLOT, entries), dtype=np.int64, count=len(entries))
        slots.flags.writeable = False
        if len(self._answers) >= self._kept:
            self._answers.clear()
        answer = self._answers[key] = entries, slots, len(set(key)) == len(key)
        return answer

    def clear(self) -> None:
        """A request was added or released: every kept answer may be stale."""
        self._answers.clear()
