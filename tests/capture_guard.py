"""A static check of code meant for CUDA-graph capture, runnable without a GPU.

A captured region may only launch device work on device memory: no host read of a device value (``.item()``,
``bool(t)``, ``.tolist()``, ops whose output shape depends on data), no host <-> device copy (a Python scalar
written into one element of a CUDA tensor is such a copy), no tensor built from Python data, no torch RNG.
On CUDA, capture refuses these one at a time; :class:`CaptureGuard` records every aten op run inside it with a
``TorchDispatchMode`` and lists all of them at once, on CPU.

Two ways to run a region under the guard, each seeing what the other cannot:

* on the ``meta`` device (every model weight, cache and static buffer moved there): any CPU tensor inside is
  a host tensor (a factory call without ``device=``, ``torch.tensor(...)``, a cross-device copy), and a
  host read fails outright, since meta tensors hold no data. Triton kernels cannot run there;
* on CPU with Triton through its interpreter: the exact code the GPU runs, kernels included. Devices cannot
  be told apart here, but Python data turning into tensors (``aten.lift_fresh``), syncing ops and host
  reads still show.

The rules follow what PyTorch does on CUDA: ``t[i] = 3`` on a CUDA tensor builds a CPU scalar and copies it
into the 0-dim element (a host-to-device copy), while ``t[a:b] = 3`` fills (a kernel with the value as an
argument); ``torch.where(c, t, 3.0)`` builds the scalar on t's device (capture-safe).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that read a device value on the host or whose output shape depends on the data (a hidden sync).
SYNCING_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::equal",
        "aten::allclose",
        "aten::nonzero",
        "aten::nonzero_numpy",
        "aten::argwhere",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::bincount",
        "aten::histc",
        "aten::_assert_tensor_metadata_async",
    }
)
# Ops that draw from torch's generators: a graph replays the captured offsets unless the generator is
# registered with the graph; the engines use counter-based random numbers (kernels/rng.py) instead.
RNG_OPS = frozenset(
    {
        "aten::rand",
        "aten::rand_like",
        "aten::randn",
        "aten::randn_like",
        "aten::randint",
        "aten::randint_like",
        "aten::randperm",
        "aten::normal",
        "aten::normal_",
        "aten::uniform_",
        "aten::bernoulli",
        "aten::bernoulli_",
        "aten::exponential_",
        "aten::geometric_",
        "aten::random_",
        "aten::multinomial",
        "aten::native_dropout",
        "aten::poisson",
    }
)
INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
REPEAT_INTERLEAVE = "aten::repeat_interleave"
PYTHON_DATA_OPS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy"})
# A CPU 0-dim tensor given to fill_ as the value is read on the host (no device involved): t[a:b] = 3 on CUDA.
HOST_SCALAR_OK = frozenset({"aten::fill_"})
_REPO = Path(__file__).resolve().parents[1]


class CaptureGuard(TorchDispatchMode):
    """Records every violation of the capture rules by the ops run inside ``with guard:``.

    ``device``: where the region's tensors live (``meta`` or ``cpu``, see the module docstring).
    ``host_tensors``: host memory the region must not touch (pinned staging buffers, host-side lengths).
    """

    def __init__(self, device: torch.device | str, host_tensors: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.violations: list[str] = []
        self.ops: list[str] = []  # every op run inside, for "the region did run" checks
        self._python_data: dict[int, str] = {}  # id -> origin of tensors built from Python values
        self._host_scalars: set[int] = set()  # ids of 0-dim scalars made inside the region (scalar_tensor)
        self._keep: list[torch.Tensor] = []  # keeps the tracked tensors alive, so their ids stay unique
        self._host_ptrs = {t.untyped_storage().data_ptr() for t in host_tensors}

    @contextlib.contextmanager
    def active(self) -> Iterator[CaptureGuard]:
        """The dispatch mode plus host reads that bypass the dispatcher (``tolist``, ``numpy``)."""
        saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

        def refuse(name: str):
            def method(tensor: torch.Tensor, *args, **kwargs):
                self._flag(f"host read: Tensor.{name}() of a {list(tensor.shape)} tensor")
                return saved[name](tensor, *args, **kwargs)

            return method

        for name in saved:
            setattr(torch.Tensor, name, refuse(name))
        try:
            with self:
                yield self
        finally:
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops.append(str(func))
        self._check(func, name, args, kwargs)
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.device.type != "cpu":
            for t in outputs:
                if t.device != self.device:
                    self._flag(f"{func} made a tensor on {t.device} (factory without device=?)")
        if name in PYTHON_DATA_OPS:
            for t in outputs:
                self._track(self._python_data, t, f"{func} (torch.tensor / Python value)")
        if name == "aten::scalar_tensor":
            for t in outputs:
                self._host_scalars.add(id(t))
                self._keep.append(t)
        return out

    def _flag(self, message: str) -> None:
        """Record a violation with the innermost line of project code that led to it."""
        here = Path(__file__).resolve()
        for frame in reversed(traceback.extract_stack()):
            path = Path(frame.filename).resolve()
            if path != here and path.is_relative_to(_REPO) and ".venv" not in path.parts:
                message += f"  [{path.relative_to(_REPO)}:{frame.lineno}: {frame.line}]"
                break
        self.violations.append(message)

    def _track(self, table: dict[int, str], tensor: torch.Tensor, origin: str) -> None:
        table[id(tensor)] = origin
        self._keep.append(tensor)

    def _check(self, func, name: str, args, kwargs) -> None:
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if name in SYNCING_OPS:
            self._flag(f"{func}: reads a device value on the host / data-dependent shape")
        if name in RNG_OPS:
            self._flag(f"{func}: torch RNG inside the region")
        if name == REPEAT_INTERLEAVE and kwargs.get("output_size") is None and "Tensor" in str(func):
            self._flag(f"{func} without output_size: syncs to size its output")
        if name in INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            for index in indices or ():
                if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                    self._flag(f"{func} with a boolean mask: data-dependent shape (nonzero)")
        for position, t in enumerate(tensors):
            origin = self._python_data.get(id(t))
            if origin is not None and not (name in HOST_SCALAR_OK and position > 0):
                self._flag(f"{func} uses a tensor built from Python data by {origin}")
            if self._host_ptrs and t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._host_ptrs:
                self._flag(f"{func} touches a host staging buffer")
            host_scalar_value = name in HOST_SCALAR_OK and position > 0 and t.dim() == 0
            if self.device.type != "cpu" and t.device != self.device and not host_scalar_value:
                self._flag(f"{func} reads a {t.device} tensor {list(t.shape)} (host -> device)")
        if name == "aten::copy_" and len(tensors) >= 2:
            dst, src = tensors[0], tensors[1]
            if dst.device != src.device:
                self._flag(f"{func}: copy {src.device} -> {dst.device}")
            if dst.dim() == 0 and id(src) in self._host_scalars:
                self._flag(
                    f"{func}: a Python scalar written into one element (t[i] = x: a host -> device copy on CUDA)"
                )
        if name == "aten::_to_copy" and tensors:
            target = kwargs.get("device")
            if target is not None and torch.device(target) != tensors[0].device:
                self._flag(f"{func}: copy {tensors[0].device} -> {target}")

    def report(self) -> str:
        """Violations, one a line, each once (a region usually repeats the same op per layer)."""
        return "\n".join(dict.fromkeys(self.violations))
