"""Admission and routing rules of the scheduler, as pure functions of counts.

The hub, the drafter pool and the round drivers apply these rules to their live state; the cluster simulator
(:mod:`cluster.simulator`) applies the same functions to simulated state, so what it predicts follows the
rules the served system runs. Every rule reads counts only (requests held, free slots, tokens left, positions),
never token values, so none of them can bias decoding.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)


def least_loaded(loads: Mapping[K, int]) -> K:
    """The verifier group a new request goes to: the one holding the fewest requests (running or waiting for
    a slot); on a tie the first in the mapping's order. Raises ValueError for no candidate."""
    if not loads:
        raise ValueError("no verifier group to route to")
    smallest = min(loads.values())  # (then the first holding it: no Python call per group, as a key= would make)
    return next(key for key, count in loads.items() if count == smallest)


def place_by_free_slots(free: Mapping[K, int], count: int) -> list[K]:
    """Drafters for ``count`` new requests, in order: each goes to the drafter with the most free context slots
    (the first on a tie), until none has one. Returns the placements, a prefix of the requests (shorter than
    ``count`` when the slots run out); ``free`` itself is not changed."""
    if len(free) == 1:  # (one drafter: it takes them while it has free slots)
        [(key, room)] = free.items()
        return [key] * min(count, room) if room > 0 else []
    left = dict(free)
    placed: list[K] = []
    if not left:
        return placed
    for _ in range(count):
        key = max(left, key=left.__getitem__)
        if left[key] <= 0:
            break
        left[key] -= 1
        placed.append(key)
    return placed


def free_slots(
    verify_free: int, draft_free: int | None, running: int, max_running: int | None, limit: int | None = None
) -> int:
    """How many waiting requests a round driver admits this round: as many as both engines have free slots
    for (``draft_free`` None: no drafter), at most ``max_running`` running in all and at most ``limit``."""
    free = verify_free if limit is None else min(limit, verify_free)
    if draft_free is not None:
        free = min(free, draft_free)
    if max_running is not None:
        free = min(free, max_running - running)
    return max(free, 0)


def draft_caps(tokens_left: np.ndarray, positions: np.ndarray, max_seq_len: int, block_size: int) -> np.ndarray:
    """Per request, the most drafts a round may verify: never past ``max_tokens`` (``tokens_left`` more tokens
    may be emitted, one of them the target's own) nor past the KV slot (anchor at ``positions``), at most the
    block."""
    caps = np.minimum(tokens_left, max_seq_len - positions)
    caps -= 1
    np.minimum(caps, block_size, out=caps)
    return np.maximum(caps, 0, out=caps)


def group_share(total: int, groups: int, members: int) -> int:
    """How many waiting requests a request group of a pipelined driver may take now: it fills up to an even
    split of all the driver's requests (``total``: running and waiting; ``members``: the group's)."""
    return math.ceil(total / groups) - members
