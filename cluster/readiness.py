"""Readiness of a serving backend: whether a completion can be served end to end now, waiting for it, and saying
so once per interval instead of once per refused request.

A backend that is still starting (no verifier registered yet, no drafter for a policy that drafts) or that lost
its replicas is *not ready*. Requests that arrive then wait for readiness up to a bound
(``network.readiness_timeout_s``) and are served like any other once it comes; after the bound they are refused
with :class:`~cluster.backend.BackendNotReadyError`, which the HTTP layer answers 503 with a ``Retry-After``
header. Neither the wait nor the refusal logs per request: a retrying client can send thousands per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

#: Seconds a refused client is told to wait before retrying (HTTP ``Retry-After`` of every 503).
RETRY_AFTER_S = 5
#: Refusals are logged at most once per this many seconds (with the count since the last line).
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Readiness:
    """``ready``: a completion can be served end to end now; ``reason`` says what is missing when not."""

    ready: bool
    reason: str = ""


class ReadinessGate:
    """The current :class:`Readiness`, set from any thread, awaited from any event loop.

    ``wait`` returns as soon as the state is ready (at once when it already is) or after ``timeout_s``; a state
    change wakes every waiter on its own loop, so waiting costs nothing while nothing changes.
    """

    def __init__(self, initial: Readiness) -> None:
        self._lock = threading.Lock()
        self._state = initial
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    @property
    def state(self) -> Readiness:
        return self._state

    @property
    def waiters(self) -> int:
        """How many calls are waiting for readiness now."""
        with self._lock:
            return len(self._waiters)

    def set(self, state: Readiness) -> None:
        with self._lock:
            self._state = state
            waiters = list(self._waiters) if state.ready else []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its waiter is gone with it
                loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, timeout_s: float) -> Readiness:
        """The state once ready, or the (not ready) state after ``timeout_s`` seconds."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            if self._state.ready or timeout_s <= 0:
                return self._state
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(entry)
        return self._state


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class IntervalLog:
    """Logs an event at most once per ``interval_s``, with how many occurrences the line stands for (``what``:
    the occurrences' name in that line)."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S, what: str = "request(s) refused"
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._what = what
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._count = 0

    def record(self, message: str) -> None:
        """Count one occurrence; log ``message`` (with the count) when the interval since the last line passed."""
        now = time.monotonic()
        with self._lock:
            self._count += 1
            if now - self._last < self._interval_s:
                return
            count, self._count, self._last = self._count, 0, now
        self._logger.warning("%d %s since the last report: %s", count, self._what, message)
