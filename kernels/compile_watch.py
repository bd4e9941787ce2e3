"""Triton specialisations built while serving: a warm-up gap shows in the log, not as one slow request.

Triton builds one binary per kernel and specialisation (constexpr values, integer arguments equal to 1 or
divisible by 16, pointer alignment) the first time a process launches it, from its on-disk cache when the
binary is there (milliseconds) and by compiling it otherwise (seconds). Start-up warm-up
(``verify_service.warmup``, ``draft_service.warmup``, ``scheduler.warmup``) exists so that no request pays
that; :func:`watch_compiles` hooks Triton's JIT cache so that any specialisation built after
:meth:`CompileWatch.arm` (the end of warm-up) is logged once as a warning with its kernel, specialisation and
build time, and counted. It reads and changes nothing of what kernels compute.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Counts of the specialisations Triton built in this process, before and after :meth:`arm`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[str, float] = {}
        self.armed = False
        self.before_armed = 0
        self.after_armed = 0
        self.after_armed_s = 0.0

    def arm(self) -> None:
        """From now on every specialisation built is a warm-up gap: logged and counted."""
        self.armed = True

    def on_cache_miss(self, **hook: Any) -> None:
        """Triton's ``jit_cache_hook``: a specialisation is about to be built. Returns None: build it."""
        with self._lock:
            self._started[str(hook.get("key"))] = time.perf_counter()

    def on_built(self, **hook: Any) -> None:
        """Triton's ``jit_post_compile_hook``: the specialisation exists (compiled or read from the disk
        cache); after :meth:`arm`, logged with its build time and counted."""
        with self._lock:
            started = self._started.pop(str(hook.get("key")), None)
            seconds = 0.0 if started is None else time.perf_counter() - started
            if not self.armed:
                self.before_armed += 1
                return
            self.after_armed += 1
            self.after_armed_s += seconds
        fn, built = hook.get("fn"), hook.get("compile") or {}
        logger.warning(
            "Triton built kernel %s while serving (%.2f s, a specialisation the warm-up did not launch): "
            "constants %s, signature %s",
            getattr(fn, "name", fn), seconds, _one_line(built.get("constants")), _one_line(built.get("signature")),
        )  # fmt: skip


def _one_line(value: object) -> str:
    """``value`` as one log line (Triton's reprs of specialisations span lines)."""
    return " ".join(str(value).split())


#: The process's watch (Triton's hooks are per process).
WATCH = CompileWatch()


def watch_compiles() -> CompileWatch:
    """Install the hooks in this process (idempotent; another hook already installed is left alone) and return
    the process's :class:`CompileWatch`. Without Triton's knobs (a Triton too old or absent) it watches
    nothing and counts stay 0."""
    try:
        from triton import knobs
    except ImportError:
        return WATCH
    runtime = knobs.runtime
    if runtime.jit_cache_hook in (None, WATCH.on_cache_miss) and runtime.jit_post_compile_hook in (
        None, WATCH.on_built
    ):
        runtime.jit_cache_hook = WATCH.on_cache_miss
        runtime.jit_post_compile_hook = WATCH.on_built
    return WATCH
