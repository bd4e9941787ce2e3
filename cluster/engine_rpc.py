"""Helpers shared by the engine gRPC services: one engine thread, request-id errors, idle slots. (Their messages
are in :mod:`cluster.contract`.)

Engines are synchronous and compute-bound; each service runs every engine call on ONE dedicated thread so calls
are serialised (the engines are single-threaded by design) while the gRPC event loop stays free to answer health
checks and to accept the next message. That is the one thread hand-off a per-round message meets in a replica
(event loop -> engine thread -> event loop): running the engine on the loop itself would leave a wedged or long
step unobservable (no health answer) and hold back the verifier's feature pushes, which the loop sends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.rpc import NotFoundError

T = TypeVar("T")

#: An engine call running longer than this means a wedged engine (health reports NOT_SERVING, Serve restarts
#: the replica). Far above any real step: a long prefill on a slow CPU takes seconds, not a minute.
DEFAULT_WEDGE_TIMEOUT_S = 60.0


class EngineThread:
    """Runs engine calls one at a time on a private thread; maps unknown-request KeyErrors to NOT_FOUND.

    It also times the call in progress (:attr:`busy_s`): the gRPC event loop answers health checks while the
    engine computes, so without this a replica whose engine thread hangs forever would still look healthy.
    """

    def __init__(self, name: str, wedge_timeout_s: float = DEFAULT_WEDGE_TIMEOUT_S) -> None:
        if not wedge_timeout_s > 0:
            raise ValueError(f"wedge_timeout_s must be > 0, got {wedge_timeout_s}")
        self.wedge_timeout_s = wedge_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._started: float | None = None
        self.busy_total_s = 0.0  # engine time of all finished calls: busy fraction = its growth / wall time

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return (await self.run_timed(fn, *args))[0]

    async def run_timed(self, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """``fn(*args)`` on the engine thread, and the seconds it ran there (what a reply reports as the
        server's engine time: the round driver tells transfer from compute with it)."""
        loop = asyncio.get_running_loop()

        def timed() -> tuple[T, float]:
            self._started = started = time.monotonic()
            try:
                return fn(*args), time.monotonic() - started
            finally:
                self._started = None
                self.busy_total_s += time.monotonic() - started

        try:
            return await loop.run_in_executor(self._executor, timed)
        except KeyError as exc:  # the engines raise KeyError subclasses for unknown request ids
            raise NotFoundError(str(exc.args[0]) if exc.args else str(exc)) from None

    @property
    def busy_s(self) -> float:
        """Seconds the current engine call has been running (0 when idle)."""
        started = self._started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def wedged(self) -> bool:
        return self.busy_s > self.wedge_timeout_s

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


#: A slot that no call has named for this long belongs to no live round loop (see IdleSlots).
DEFAULT_IDLE_RECLAIM_S = 30.0


class IdleSlots:
    """When each request a replica holds was last named by a call, so that slots nobody drives can be reclaimed.

    The scheduler's round loop names every request it runs on a replica in every round (milliseconds apart, a
    pipelined loop's other group one tick later), and releases it when it ends; a restarted scheduler releases
    what its predecessor left. A slot idle for ``idle_s`` while the replica is asked for a slot it does not
    have is therefore held by nobody who still drives it: a caller that allocated and left (hostile, or a
    client that died between its calls). Reclaiming those slots, only under that pressure, bounds what one
    caller can take from the others. A wrongly reclaimed request would fail its next round with NOT_FOUND,
    which failover answers by re-prefilling it: nothing is lost either way.
    """

    def __init__(self, idle_s: float = DEFAULT_IDLE_RECLAIM_S) -> None:
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.idle_s = idle_s
        self._seen: dict[str, float] = {}

    def touch(self, req_ids: Iterable[str]) -> None:
        now = time.monotonic()
        for req_id in req_ids:
            self._seen[req_id] = now

    def idle(self, held: Iterable[str]) -> list[str]:
        """The requests of ``held`` (what the engine holds now) idle for ``idle_s``; forgets the ones not held."""
        now = time.monotonic()
        seen = {req_id: self._seen.get(req_id, now) for req_id in held}
        self._seen = seen
        return [req_id for req_id, at in seen.items() if now - at > self.idle_s]

