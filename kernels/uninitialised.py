"""Module trees built only to receive checkpoint weights: their ``torch.nn.init`` calls are skipped.

Why: a loader builds the model's modules and then assigns every parameter from the checkpoint, so the random
initialisation the modules' constructors run is thrown away. Building on the meta device avoids the allocation
but not the initialisation: ``torch.nn.init`` on meta tensors runs through torch's reference decompositions,
whose first use imports ``torch._dynamo``, 1.2-1.6 s of a replica's start on the 2-core CPU VM.

Contract: inside :func:`uninitialised`, on this thread, the ``torch.nn.init`` functions that dispatch torch
functions return their tensor unchanged: the ones torch's modules initialise with (``nn.Linear``:
``kaiming_uniform_``, ``uniform_``; ``nn.Embedding``: ``normal_``), also ``constant_``. The others and every
other torch call run as usual. Parameters so built hold ``torch.empty`` memory (pages not yet touched, so not yet
resident): the caller must assign or overwrite every one before use. Other threads are unaffected (torch
function modes are per thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.overrides import TorchFunctionMode


class _SkipInit(TorchFunctionMode):
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextmanager
def uninitialised() -> Iterator[None]:
    """Skip torch modules' weight initialisation on this thread while they are built (see the module doc)."""
    with _SkipInit():
        yield
