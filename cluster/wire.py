"""The msgpack codec of the data plane: plain values and tensors, never pickle.

Every per-round message between the scheduler, the drafters and the verifiers goes through :func:`encode` and
:func:`decode`. A tensor travels as a msgpack map with exactly the keys ``dtype`` (a name from
:data:`WIRE_DTYPES`), ``shape`` (a list of non-negative ints) and ``data`` (the raw little-endian bytes of the
contiguous tensor; bfloat16 by its raw bits). That exact key set is therefore reserved: a map whose keys are
exactly ``{"dtype", "shape", "data"}`` always decodes as a tensor, so message schemas must not use it for
anything else.

Why this shape: msgpack is fast, language neutral and cannot execute code on decode (pickle can), and
raw bytes + dtype + shape is what every tensor library can wrap without a conversion. Decoding is defensive
because the bytes come from the network: the message size, every collection length and string length are
bounded *before* anything is allocated, map keys must be strings, extension types are refused, and a tensor's
byte count must match its dtype and shape exactly. Any violation raises :class:`WireError` (a ``ValueError``),
which the gRPC layer turns into ``INVALID_ARGUMENT``.

Decoded tensors are CPU torch tensors. Large ones (at least :data:`ZERO_COPY_MIN_BYTES`) share memory with the
``bytes`` object msgpack produced for them (``torch.frombuffer``, no copy); that buffer is private to the
tensor, but it is formally immutable, so treat such tensors as read-only and ``clone()`` before writing in
place. Small ones are copied into a fresh writable buffer, which costs less than a microsecond and keeps tiny
shared ``bytes`` singletons (``b""``, one-byte strings) out of tensor storage.
"""

from __future__ import annotations

import math
import secrets
import struct
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

#: Default bound on one encoded message (and the gRPC send/receive limit derived from it).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: Decoded tensors at least this large share the received buffer instead of being copied.
ZERO_COPY_MIN_BYTES = 64 * 1024

#: Wire dtype name -> torch dtype. The allow-list: anything else is refused on decode and on encode.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_TORCH_TO_WIRE: dict[torch.dtype, str] = {v: k for k, v in WIRE_DTYPES.items()}
_ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in WIRE_DTYPES.items()}
# numpy has no bfloat16; every other wire dtype has a numpy twin with the same name.
_NUMPY_TO_WIRE: dict[np.dtype, str] = {np.dtype(k): k for k in WIRE_DTYPES if k != "bfloat16"}
# The numpy dtype a wire dtype is read through (bfloat16 through its raw bits).
_NUMPY_TWIN: dict[str, np.dtype] = {k: np.dtype(np.int16 if k == "bfloat16" else k) for k in WIRE_DTYPES}
_TENSOR_KEYS = frozenset(("dtype", "shape", "data"))

# torch warns once per process that a tensor made from an immutable ``bytes`` is not writable. That is the
# documented zero-copy contract of this module, so the one warning is spent here, silently, at import time
# (a warnings filter would not do: test runners reset filters; per-call catch_warnings is not thread-safe).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(8), dtype=torch.uint8)

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("cluster.wire assumes a little-endian host (tensor bytes travel little-endian)")


class WireError(ValueError):
    """A message cannot be encoded, or received bytes are not a valid message.

    ``field_path`` names the offending field (e.g. ``requests[3].draft_tokens``) when a schema check failed.
    """

    def __init__(self, message: str, field_path: str | None = None) -> None:
        super().__init__(message)
        self.field_path = field_path


@dataclass(frozen=True)
class WireLimits:
    """Bounds enforced while unpacking, before memory is allocated for the value being read.

    The defaults fit the largest legitimate messages of this system (a prefill of a long prompt as a token
    list, a round of thousands of requests, context features of a few thousand tokens) with room to spare,
    while refusing payloads that would make a receiver allocate far more than the message itself.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_array_len: int = 1 << 20
    max_map_len: int = 1 << 16
    max_str_len: int = 1 << 20
    max_tensor_rank: int = 8

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_array_len", "max_map_len", "max_str_len", "max_tensor_rank"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"WireLimits.{name} must be a positive int, got {value!r}")
        if self.max_message_bytes > (1 << 31) - 1:
            raise ValueError("WireLimits.max_message_bytes must fit gRPC's 2 GiB message limit")


DEFAULT_LIMITS = WireLimits()


# ----------------------------------------------------------------------------------------------------------
# Encoding


def _tensor_array(t: torch.Tensor) -> tuple[str, np.ndarray]:
    name = _TORCH_TO_WIRE.get(t.dtype)
    if name is None:
        raise WireError(f"cannot encode a tensor of dtype {t.dtype}; allowed: {sorted(WIRE_DTYPES)}")
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    t = t.detach()
    # bfloat16 has no numpy twin: it travels as its raw 16-bit patterns.
    return name, (t.view(torch.int16) if name == "bfloat16" else t).numpy()


def _numpy_array(a: np.ndarray) -> tuple[str, np.ndarray]:
    dtype = a.dtype.newbyteorder("=") if a.dtype.byteorder == ">" else a.dtype
    name = _NUMPY_TO_WIRE.get(dtype)
    if name is None:
        raise WireError(f"cannot encode a numpy array of dtype {a.dtype}; allowed: {sorted(_NUMPY_TO_WIRE)}")
    return name, np.ascontiguousarray(a, dtype=dtype)


class _Packer:
    """One encode call: msgpack's ``default`` hook plus the large buffers it set aside.

    Small arrays are copied out as bytes (fewest calls: what costs for the many small tensors of a round).
    Large ones (at least :data:`ZERO_COPY_MIN_BYTES`) are not fed to msgpack, whose growing output buffer
    copies them several times (most of the time of a 16 MiB message): each becomes a placeholder, an
    extension value holding a random 16-byte nonce drawn for this call, and :meth:`splice` then writes a
    standard msgpack ``bin`` header + the buffer in its place with a single copy. The receiver sees plain
    msgpack; the nonce is unguessable, so data cannot forge a placeholder.
    """

    def __init__(self) -> None:
        self.large: list[memoryview] = []
        self._placeholder: msgpack.ExtType | None = None

    def default(self, obj: Any) -> Any:
        """msgpack's hook for the types it does not know: tensors, arrays, numpy scalars; others fail."""
        if isinstance(obj, torch.Tensor):
            name, a = _tensor_array(obj)
        elif isinstance(obj, np.ndarray):
            name, a = _numpy_array(obj)
        elif isinstance(obj, np.generic):
            return obj.item()
        elif isinstance(obj, int):  # msgpack hands over the ints it cannot represent
            raise WireError(f"cannot encode the int {obj}: msgpack ints are limited to [-2**63, 2**64 - 1]")
        else:
            raise WireError(f"cannot encode a value of type {type(obj).__name__}")
        if a.nbytes < ZERO_COPY_MIN_BYTES:
            return {"dtype": name, "shape": a.shape, "data": a.tobytes()}
        if self._placeholder is None:
            self._placeholder = msgpack.ExtType(_SPLICE_EXT, secrets.token_bytes(16))
        self.large.append(a.reshape(-1).view(np.uint8).data)
        return {"dtype": name, "shape": a.shape, "data": self._placeholder}

    def splice(self, packed: bytes, limit: int) -> bytes:
        """Replace the placeholders, in order, by ``bin 32`` headers and their buffers."""
        if self._placeholder is None:
            return packed
        marker = bytes([0xD8, _SPLICE_EXT]) + self._placeholder.data  # msgpack fixext 16
        size = len(packed) + sum(5 + len(b) - len(marker) for b in self.large)
        if size > limit:
            raise WireError(f"message of {size} bytes exceeds the limit of {limit} bytes")
        pieces: list[bytes | memoryview] = []
        view, pos = memoryview(packed), 0
        for buffer in self.large:
            at = packed.index(marker, pos)
            pieces += (view[pos:at], struct.pack(">BI", 0xC6, len(buffer)), buffer)
            pos = at + len(marker)
        pieces.append(view[pos:])
        return b"".join(pieces)


# Extension code of the placeholders that never leave encode() (any ext received is refused).
_SPLICE_EXT = 0x5A


def encode(obj: Any, *, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    """Pack ``obj`` (None, bool, int, float, str, bytes, list/tuple, str-keyed dict, tensor, ndarray).

    Raises :class:`WireError` for an unsupported type or dtype, or when the result exceeds
    ``limits.max_message_bytes`` (checked here so a sender learns it before the receiver rejects it).
    """
    packer = _Packer()
    try:
        data = msgpack.packb(obj, default=packer.default, use_bin_type=True, datetime=False)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot encode message: {exc}") from exc
    if packer.large:
        return packer.splice(data, limits.max_message_bytes)
    if len(data) > limits.max_message_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {limits.max_message_bytes} bytes")
    return data


# ----------------------------------------------------------------------------------------------------------
# Decoding


def _map_to_tensor(m: dict[str, Any], max_rank: int) -> torch.Tensor:
    name, shape, data = m["dtype"], m["shape"], m["data"]
    if type(name) is not str or name not in WIRE_DTYPES:
        shown = repr(name)[:40]
        raise WireError(f"tensor dtype {shown} is not allowed; allowed: {sorted(WIRE_DTYPES)}")
    if type(shape) is not list or len(shape) > max_rank:
        raise WireError(f"tensor shape must be a list of at most {max_rank} non-negative ints")
    for d in shape:
        if type(d) is not int or d < 0:
            raise WireError(f"tensor shape must be a list of at most {max_rank} non-negative ints")
    if type(data) is not bytes:
        raise WireError(f"tensor data must be raw bytes (msgpack bin), got {type(data).__name__}")
    numel = math.prod(shape)
    expected = numel * _ITEMSIZE[name]
    if expected != len(data):
        raise WireError(
            f"tensor of dtype {name} and shape {shape} needs {expected} bytes of data, got {len(data)}"
        )
    dtype = WIRE_DTYPES[name]
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # A bool byte other than 0/1 is undefined behaviour in torch; refuse it instead of computing garbage.
    if dtype is torch.bool and int(np.frombuffer(data, dtype=np.uint8).max()) > 1:
        raise WireError("bool tensor data must contain only 0 and 1 bytes")
    if len(data) >= ZERO_COPY_MIN_BYTES:
        return torch.frombuffer(data, dtype=dtype).view(shape)
    # Small: a private writable copy through numpy, the cheapest path for the many small tensors of a round.
    tensor = torch.from_numpy(np.frombuffer(data, dtype=_NUMPY_TWIN[name]).reshape(shape).copy())
    return tensor.view(torch.bfloat16) if name == "bfloat16" else tensor


def _object_hook(max_rank: int) -> Callable[[dict[str, Any]], Any]:
    def hook(m: dict[str, Any]) -> Any:
        if len(m) == 3 and m.keys() == _TENSOR_KEYS:
            return _map_to_tensor(m, max_rank)
        return m

    return hook


_HOOKS: dict[int, Callable[[dict[str, Any]], Any]] = {}


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension types are not accepted (got ext type {code})")


def decode(data: bytes | bytearray | memoryview, *, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """Unpack one message; tensor maps become torch tensors (the module docstring has the memory contract).

    Raises :class:`WireError` with a clear message for oversized, truncated, trailing-garbage or otherwise
    invalid input, non-string map keys, extension types, invalid UTF-8 and inconsistent tensors.
    """
    n = len(data)
    if n > limits.max_message_bytes:
        raise WireError(f"message of {n} bytes exceeds the limit of {limits.max_message_bytes} bytes")
    hook = _HOOKS.get(limits.max_tensor_rank)
    if hook is None:
        hook = _HOOKS.setdefault(limits.max_tensor_rank, _object_hook(limits.max_tensor_rank))
    try:
        # Each element takes at least one byte (a map entry two), so a length above that bound is a lie told
        # to make us allocate: capping by n refuses it before msgpack pre-allocates the container.
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_hook=hook,
            ext_hook=_refuse_ext,
            max_str_len=min(limits.max_str_len, n),
            max_bin_len=n,
            max_array_len=min(limits.max_array_len, n),
            max_map_len=min(limits.max_map_len, n // 2),
            max_ext_len=0,  # also refuses msgpack timestamps, which bypass ext_hook
        )
    except WireError:
        raise
    except msgpack.ExtraData as exc:
        raise WireError(f"invalid message: trailing bytes after a complete value ({exc})") from exc
    except msgpack.StackError as exc:
        raise WireError("invalid message: nested too deeply") from exc
    except (ValueError, TypeError, OverflowError) as exc:
        detail = str(exc) or f"malformed msgpack ({type(exc).__name__})"
        if "max_ext_len" in detail:  # how msgpack words the refusal of any extension type (max_ext_len=0)
            detail = "msgpack extension types are not accepted"
        raise WireError(f"invalid message: {detail}") from exc
