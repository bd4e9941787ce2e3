"""Helpers shared by the engine gRPC services: one engine thread, request-id errors, common field types.

Engines are synchronous and compute-bound; each service runs every engine call on ONE dedicated thread so calls
are serialised (the engines are single-threaded by design) while the gRPC event loop stays free to answer health
checks and to accept the next message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.messages import Int, List, Str
from cluster.rpc import NotFoundError

T = TypeVar("T")

MAX_BATCH = 4096
REQ_IDS = List(Str(min_len=1, max_len=128), max_len=MAX_BATCH)
COUNTS = List(Int(min=0, max=1 << 20), max_len=MAX_BATCH)
TOKENS = List(Int(min=0, max=(1 << 31) - 1), max_len=MAX_BATCH)


class EngineThread:
    """Runs engine calls one at a time on a private thread; maps unknown-request KeyErrors to NOT_FOUND."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except KeyError as exc:  # the engines raise KeyError subclasses for unknown request ids
            raise NotFoundError(str(exc.args[0]) if exc.args else str(exc)) from None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def split_rows(counts: list[int], total: int, what: str) -> list[tuple[int, int]]:
    """(start, end) row ranges of a flat batch from per-request counts; checks that they add up."""
    if sum(counts) != total:
        raise ValueError(f"{what}: counts add up to {sum(counts)} but {total} rows were sent")
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out
