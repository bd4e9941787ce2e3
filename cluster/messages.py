"""Declarative message schemas and their validation: the shape of a decoded message, checked every round.

A schema is built from a handful of small type objects::

    BLOCK = Message("Block", {
        "request_id": Str(max_len=128),
        "draft_tokens": List(Int(min=0), max_len=64),
        "draft_probs": Tensor(("float32",), rank=2),
        "seed": Opt(Int(min=0)),
    })
    ROUND = Message("DraftRound", {"requests": List(BLOCK, max_len=4096)})

    checked = validate(ROUND, decode(payload))   # a plain dict, defaults filled in

``validate`` either returns a new plain dict (declared fields only, optional ones filled with their
default, ints given for floats turned into floats) or raises :class:`~cluster.wire.WireError` naming the
offending field path, e.g. ``invalid DraftRound: requests[3].draft_tokens: expected list[int], got str``.

Why hand-rolled: this runs on the hot path of every round for every request, so it is a few direct type checks
per field with fast paths for homogeneous lists (``all(type(x) is int ...)`` and ``min``/``max`` in C), and
it must not pull in a dependency. The field path is only assembled when something is wrong, so a valid message
pays nothing for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from cluster.wire import WIRE_DTYPES, WireError

_MISSING = object()


class _InvalidError(Exception):
    """Internal: a check failed; containers append their path part while it propagates (cheap when valid)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.parts: list[str] = []


def _got(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class Type:
    """Base of every field type: ``check`` returns the (possibly normalised) value or raises ``_Invalid``."""

    name = "value"

    def check(self, value: Any) -> Any:
        raise NotImplementedError

    def _fail(self, value: Any) -> _InvalidError:
        return _InvalidError(f"expected {self.name}, got {_got(value)}")


def _check_bounds(kind: str, low: float | None, high: float | None) -> None:
    if low is not None and high is not None and low > high:
        raise ValueError(f"{kind}: min {low} is greater than max {high}")


class Int(Type):
    """An int (bools are refused) within ``[min, max]`` when given."""

    name = "int"

    def __init__(self, min: int | None = None, max: int | None = None) -> None:
        _check_bounds("Int", min, max)
        self.min, self.max = min, max

    def check(self, value: Any) -> Any:
        if type(value) is not int:
            raise self._fail(value)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise _InvalidError(f"{value} is outside {_range(self.min, self.max)}")
        return value


class Float(Type):
    """A float (an int is converted) within ``[min, max]``; NaN and infinities are refused by default."""

    name = "float"

    def __init__(self, min: float | None = None, max: float | None = None, finite: bool = True) -> None:
        _check_bounds("Float", min, max)
        self.min, self.max, self.finite = min, max, finite

    def check(self, value: Any) -> Any:
        kind = type(value)
        if kind is not float:
            if kind is not int:
                raise self._fail(value)
            value = float(value)
        if self.finite and not math.isfinite(value):
            raise _InvalidError(f"expected a finite float, got {value}")
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise _InvalidError(f"{value} is outside {_range(self.min, self.max)}")
        return value


class Bool(Type):
    name = "bool"

    def check(self, value: Any) -> Any:
        if type(value) is not bool:
            raise self._fail(value)
        return value


class Str(Type):
    """A str of at most ``max_len`` characters (at least ``min_len``), optionally one of ``choices``."""

    name = "str"

    def __init__(
        self, min_len: int = 0, max_len: int | None = None, choices: Iterable[str] | None = None
    ) -> None:
        _check_bounds("Str", min_len, max_len)
        self.min_len, self.max_len = min_len, max_len
        self.choices = frozenset(choices) if choices is not None else None

    def check(self, value: Any) -> Any:
        if type(value) is not str:
            raise self._fail(value)
        if len(value) < self.min_len or (self.max_len is not None and len(value) > self.max_len):
            bounds = _range(self.min_len, self.max_len)
            raise _InvalidError(f"string of length {len(value)} is outside {bounds}")
        if self.choices is not None and value not in self.choices:
            raise _InvalidError(f"{value[:64]!r} is not one of {sorted(self.choices)}")
        return value


class Bytes(Type):
    """Raw bytes (msgpack bin) of at most ``max_len`` bytes."""

    name = "bytes"

    def __init__(self, max_len: int | None = None) -> None:
        self.max_len = max_len

    def check(self, value: Any) -> Any:
        if type(value) is not bytes:
            raise self._fail(value)
        if self.max_len is not None and len(value) > self.max_len:
            raise _InvalidError(f"{len(value)} bytes exceed the maximum of {self.max_len}")
        return value


class AnyValue(Type):
    """Anything the codec produced; for opaque payloads (e.g. a health report) the receiver only passes on."""

    name = "any"

    def check(self, value: Any) -> Any:
        return value


class Tensor(Type):
    """A torch tensor with a dtype in ``dtypes`` (wire names), a rank and a ``shape`` (None = any size)."""

    def __init__(
        self,
        dtypes: Sequence[str] | str,
        rank: int | None = None,
        shape: Sequence[int | None] | None = None,
    ) -> None:
        names = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
        unknown = [d for d in names if d not in WIRE_DTYPES]
        if unknown or not names:
            raise ValueError(f"Tensor: unknown dtypes {unknown}; allowed: {sorted(WIRE_DTYPES)}")
        if shape is not None:
            if rank is not None and rank != len(shape):
                raise ValueError(f"Tensor: rank {rank} contradicts shape {list(shape)}")
            rank = len(shape)
        self.dtypes = frozenset(WIRE_DTYPES[d] for d in names)
        self.rank = rank
        self.shape = tuple(shape) if shape is not None else None
        dims = "" if rank is None else f", rank {rank}" if shape is None else f", shape {list(shape)}"
        self.name = f"tensor[{'|'.join(names)}{dims}]"

    def check(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            raise self._fail(value)
        if value.dtype not in self.dtypes:
            raise _InvalidError(f"expected {self.name}, got dtype {str(value.dtype).removeprefix('torch.')}")
        if self.rank is not None and value.dim() != self.rank:
            raise _InvalidError(f"expected {self.name}, got shape {list(value.shape)}")
        if self.shape is not None:
            for want, got in zip(self.shape, value.shape, strict=True):
                if want is not None and want != got:
                    raise _InvalidError(f"expected {self.name}, got shape {list(value.shape)}")
        return value


class Opt(Type):
    """An optional field: missing or null gives ``default``; otherwise ``inner`` must hold."""

    def __init__(self, inner: Type, default: Any = None) -> None:
        self.inner, self.default = inner, default
        self.name = f"{inner.name} or null"

    def check(self, value: Any) -> Any:
        if value is None:
            return self.default
        return self.inner.check(value)


class List(Type):
    """A list of ``elem``, ``min_len <= len <= max_len``; lists of ints, floats or strs take a vectorised path."""

    def __init__(self, elem: Type, min_len: int = 0, max_len: int | None = None) -> None:
        _check_bounds("List", min_len, max_len)
        self.elem, self.min_len, self.max_len = elem, min_len, max_len
        self.name = f"list[{elem.name}]"

    def check(self, value: Any) -> Any:
        if type(value) is not list:
            raise self._fail(value)
        n = len(value)
        if n < self.min_len or (self.max_len is not None and n > self.max_len):
            raise _InvalidError(f"list of length {n} is outside {_range(self.min_len, self.max_len)}")
        elem = self.elem
        if type(elem) is Int and all(type(x) is int for x in value):
            if n and (
                (elem.min is not None and min(value) < elem.min)
                or (elem.max is not None and max(value) > elem.max)
            ):
                self._locate(value)
            return value
        if type(elem) is Str and elem.choices is None and all(type(x) is str for x in value):
            if n:
                lengths = list(map(len, value))
                if min(lengths) < elem.min_len or (elem.max_len is not None and max(lengths) > elem.max_len):
                    self._locate(value)
            return value
        if type(elem) is Float and all(type(x) is float for x in value):
            finite_ok = not elem.finite or all(map(math.isfinite, value))
            if n and (
                not finite_ok
                or (elem.min is not None and min(value) < elem.min)
                or (elem.max is not None and max(value) > elem.max)
            ):
                self._locate(value)
            return value
        out = None
        check = elem.check
        for i, x in enumerate(value):
            try:
                y = check(x)
            except _InvalidError as exc:
                exc.parts.append(f"[{i}]")
                raise
            if y is not x:
                if out is None:
                    out = value[:i]
                out.append(y)
            elif out is not None:
                out.append(y)
        return value if out is None else out

    def _locate(self, value: list[Any]) -> None:
        """Slow path, only on failure: find the first bad element so the error names its index."""
        for i, x in enumerate(value):
            try:
                self.elem.check(x)
            except _InvalidError as exc:
                exc.parts.append(f"[{i}]")
                raise


class Map(Type):
    """A map from str keys (at most ``max_len`` of them) to ``value`` type."""

    def __init__(self, value: Type, max_len: int | None = None) -> None:
        self.value, self.max_len = value, max_len
        self.name = f"map[str, {value.name}]"

    def check(self, value: Any) -> Any:
        if type(value) is not dict:
            raise self._fail(value)
        if self.max_len is not None and len(value) > self.max_len:
            raise _InvalidError(f"map with {len(value)} entries exceeds the maximum of {self.max_len}")
        out: dict[str, Any] = {}
        check = self.value.check
        for k, v in value.items():
            if type(k) is not str:
                raise _InvalidError(f"map keys must be str, got {_got(k)}")
            try:
                out[k] = check(v)
            except _InvalidError as exc:
                exc.parts.append(f"[{k[:64]!r}]")
                raise
        return out


#: A cross-field check on a validated message: returns an error message, or None when the message is fine.
Check = Callable[[dict[str, Any]], str | None]


class Message(Type):
    """A map with named fields; unknown fields are refused unless ``allow_extra`` (typos must not pass).

    ``checks`` run after every field is valid, for constraints spanning fields (e.g. a token list and a probs
    tensor of the same length); their error message is reported at this message's path.
    """

    def __init__(
        self,
        name: str,
        fields: Mapping[str, Type],
        *,
        allow_extra: bool = False,
        checks: Sequence[Check] = (),
    ) -> None:
        for key, t in fields.items():
            if not isinstance(t, Type):
                kind = type(t).__name__
                raise TypeError(f"Message {name}: field {key!r} must be a schema Type, not {kind}")
        self.name = name
        self.fields = dict(fields)
        self.allow_extra = allow_extra
        self.checks = tuple(checks)
        self._required = [(k, t) for k, t in fields.items() if not isinstance(t, Opt)]
        self._optional = [(k, t) for k, t in fields.items() if isinstance(t, Opt)]

    def check(self, value: Any) -> Any:
        if type(value) is not dict:
            raise self._fail(value)
        out: dict[str, Any] = {}
        for key, t in self._required:
            try:
                field_value = value[key]
            except KeyError:
                exc = _InvalidError(f"missing required field (expected {t.name})")
                exc.parts.append("." + key)
                raise exc from None
            try:
                out[key] = t.check(field_value)
            except _InvalidError as exc:
                exc.parts.append("." + key)
                raise
        present = len(self._required)
        for key, t in self._optional:
            field_value = value.get(key, _MISSING)
            if field_value is _MISSING:
                out[key] = t.default
                continue
            present += 1
            try:
                out[key] = t.check(field_value)
            except _InvalidError as exc:
                exc.parts.append("." + key)
                raise
        if present != len(value):
            extra = [k for k in value if k not in self.fields]
            if extra and not self.allow_extra:
                shown = ", ".join(repr(k)[:64] for k in extra[:5])
                raise _InvalidError(f"unknown field(s) {shown} in {self.name}")
            for k in extra:
                out[k] = value[k]
        for check in self.checks:
            problem = check(out)
            if problem is not None:
                raise _InvalidError(problem)
        return out


def _range(low: float | None, high: float | None) -> str:
    return f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"


def validate(schema: Type, obj: Any) -> Any:
    """Check ``obj`` (a decoded message) against ``schema``; return the normalised value (dict for a Message).

    Raises :class:`WireError` whose message and ``field_path`` name the offending field.
    """
    try:
        return schema.check(obj)
    except _InvalidError as exc:
        path = "".join(reversed(exc.parts)).removeprefix(".")
        where = f"{path}: " if path else ""
        raise WireError(f"invalid {schema.name}: {where}{exc.message}", field_path=path) from None
