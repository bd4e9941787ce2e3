"""The msgpack codec: exact round trips of values and tensors, and a clear WireError for every bad payload."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.wire import WIRE_DTYPES, ZERO_COPY_MIN_BYTES, WireError, WireLimits, decode, encode


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included), dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy()
    )


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (4, 5), (2, 3, 4)])
def test_tensor_round_trip_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    t = _sample(WIRE_DTYPES[name], shape)
    out = decode(encode({"t": t}))["t"]
    assert isinstance(out, torch.Tensor)
    assert _same(out, t)


def test_bfloat16_travels_by_its_raw_bits() -> None:
    # A NaN with a payload, -inf, a subnormal, 1.0 and an all-ones NaN.
    bits = torch.tensor([0x7FC1, 0xFF80 - 0x10000, 0x0001, 0x3F80, -1], dtype=torch.int16)
    t = bits.view(torch.bfloat16)
    msg = msgpack.unpackb(encode(t))
    assert msg["dtype"] == "bfloat16" and msg["shape"] == [5]
    assert msg["data"] == struct.pack("<5h", *bits.tolist())
    assert torch.equal(decode(encode(t)).view(torch.int16), bits)


def test_nested_message_with_tensors_numpy_and_scalars() -> None:
    probs = torch.rand(4, 8)
    message = {
        "round": 17,
        "ratio": 0.25,
        "name": "verifier-0 ✓",
        "flags": [True, False, None],
        "blob": b"\x00\x01",
        "requests": [
            {"id": "a", "tokens": [1, 2, 3], "probs": probs[:, :4].T},  # non-contiguous view
            {"id": "b", "tokens": [], "hidden": torch.randn(2, 3).bfloat16()},
        ],
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "np_be": np.arange(3, dtype=">f4"),
        "np_scalar": np.float32(1.5),
        "tuple": (1, 2),
    }
    out = decode(encode(message))
    assert out["round"] == 17 and out["ratio"] == 0.25 and out["name"] == "verifier-0 ✓"
    assert out["flags"] == [True, False, None] and out["blob"] == b"\x00\x01" and out["tuple"] == [1, 2]
    assert _same(out["requests"][0]["probs"], probs[:, :4].T.contiguous())
    assert _same(out["requests"][1]["hidden"], message["requests"][1]["hidden"])
    assert out["requests"][1]["tokens"] == []
    assert torch.equal(out["np"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert torch.equal(out["np_be"], torch.arange(3, dtype=torch.float32))
    assert out["np_scalar"] == 1.5


@pytest.mark.parametrize("numel", [1, ZERO_COPY_MIN_BYTES // 4 + 1])
def test_decoded_tensor_is_usable_small_and_large(numel: int) -> None:
    t = torch.arange(numel, dtype=torch.float32)
    out = decode(encode(t))
    assert torch.equal(out, t)
    out.add_(1)  # small ones own a fresh buffer; large ones a private one
    assert torch.equal(out, t + 1)


def test_large_tensors_are_spliced_into_standard_msgpack() -> None:
    big = torch.randn(ZERO_COPY_MIN_BYTES // 4 + 3)
    big_bf16 = torch.randn(300, 300).bfloat16()
    big_np = np.arange(ZERO_COPY_MIN_BYTES, dtype=np.uint8)
    message = {
        "a": [big, 1, {"b": big_bf16}],
        "small": torch.arange(3),
        "again": big,
        "np": big_np,
        "tail": "x",
    }

    def raw(name: str, t: torch.Tensor) -> dict[str, object]:
        data = (t.view(torch.int16) if name == "bfloat16" else t).numpy().tobytes()
        return {"dtype": name, "shape": list(t.shape), "data": data}

    reference = {
        "a": [raw("float32", big), 1, {"b": raw("bfloat16", big_bf16)}],
        "small": raw("int64", torch.arange(3)),
        "again": raw("float32", big),
        "np": {"dtype": "uint8", "shape": [ZERO_COPY_MIN_BYTES], "data": big_np.tobytes()},
        "tail": "x",
    }
    packed = encode(message)
    assert packed == msgpack.packb(reference)  # byte-identical to plain msgpack: nothing special to read
    out = decode(packed)
    assert _same(out["a"][0], big) and _same(out["a"][2]["b"], big_bf16) and _same(out["again"], big)
    with pytest.raises(WireError, match="exceeds the limit"):
        encode(message, limits=WireLimits(max_message_bytes=len(packed) - 1))
    assert len(encode(message, limits=WireLimits(max_message_bytes=len(packed)))) == len(packed)


def test_gpu_style_inputs_are_detached_before_sending() -> None:
    t = torch.ones(3, requires_grad=True) * 2
    assert torch.equal(decode(encode(t)), torch.full((3,), 2.0))


# ---------------------------------------------------------------------------------------------- bad payloads


def _tensor_map(dtype: object = "float32", shape: object = (2,), data: object = b"\x00" * 8) -> bytes:
    return msgpack.packb(
        {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape, "data": data}
    )


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (_tensor_map(dtype="float99"), "dtype 'float99' is not allowed"),
        (_tensor_map(dtype="complex64"), "is not allowed"),
        (_tensor_map(dtype=7), "is not allowed"),
        (_tensor_map(shape=(-2,)), "non-negative ints"),
        (_tensor_map(shape=(True, 2)), "non-negative ints"),
        (_tensor_map(shape=(2.0,)), "non-negative ints"),
        (_tensor_map(shape="2"), "list of at most"),
        (_tensor_map(shape=(1,) * 9, data=b"\x00" * 4), "list of at most 8"),
        (_tensor_map(shape=(3,)), "needs 12 bytes of data, got 8"),
        (_tensor_map(shape=(1 << 40, 1 << 40)), "needs"),
        (_tensor_map(data="abcdefgh"), "raw bytes"),
        (_tensor_map(dtype="bool", shape=(2,), data=b"\x01\x07"), "only 0 and 1"),
        (msgpack.packb({"a": 1})[:-1], "incomplete input"),
        (msgpack.packb([1, 2]) + b"\x01", "trailing bytes"),
        (msgpack.packb({1: "x"}), "map key"),
        (msgpack.packb({"t": msgpack.ExtType(5, b"xx")}), "extension types"),
        (b"\xd6\xff\x00\x00\x00\x00", "extension types"),  # a msgpack timestamp
        (b"\xc7\x00\x05", "extension types"),  # an empty ext
        (b"\xa2\xff\xfe", "invalid message"),  # invalid UTF-8
        (b"\xc1", "malformed msgpack"),
        (b"", "incomplete input"),
        (b"\x91" * 5000 + b"\x01", "nested too deeply"),
        (b"\xdd\x7f\xff\xff\xff", "invalid message"),  # an array header claiming 2**31 elements
        (b"\xdf\x7f\xff\xff\xff", "invalid message"),  # a map header claiming 2**31 entries
        (b"\xc6\x7f\xff\xff\xff", "invalid message"),  # a bin header claiming 2 GiB
    ],
)
def test_bad_payloads_raise_wire_error(payload: bytes, expected: str) -> None:
    with pytest.raises(WireError, match=expected.replace("(", r"\(").replace("[", r"\[")):
        decode(payload)


def test_limits_are_enforced_at_unpack_time() -> None:
    limits = WireLimits(
        max_message_bytes=4096, max_array_len=10, max_map_len=4, max_str_len=16, max_tensor_rank=2
    )
    decode(encode(list(range(10))), limits=limits)
    with pytest.raises(WireError, match="exceeds the limit of 4096 bytes"):
        decode(b"\x00" * 4097, limits=limits)
    with pytest.raises(WireError, match="4097 bytes exceeds the limit"):
        encode(b"x" * 4094, limits=limits)
    with pytest.raises(WireError):
        decode(encode(list(range(11))), limits=limits)
    with pytest.raises(WireError):
        decode(encode({str(i): i for i in range(5)}), limits=limits)
    with pytest.raises(WireError):
        decode(encode("x" * 17), limits=limits)
    with pytest.raises(WireError, match="at most 2"):
        decode(encode(torch.zeros(1, 1, 1)), limits=limits)


@pytest.mark.parametrize(
    "value", [{1, 2}, object(), torch.zeros(2, dtype=torch.complex64), np.zeros(2, "U3")]
)
def test_unsupported_values_refuse_to_encode(value: object) -> None:
    with pytest.raises(WireError, match="cannot encode"):
        encode({"x": value})


def test_ints_beyond_64_bits_refuse_to_encode() -> None:
    assert decode(encode([-(2**63), 2**64 - 1])) == [-(2**63), 2**64 - 1]
    with pytest.raises(WireError, match="cannot encode the int"):
        encode({"x": 2**64})


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="max_array_len"):
        WireLimits(max_array_len=0)
    with pytest.raises(ValueError, match="2 GiB"):
        WireLimits(max_message_bytes=1 << 31)


# ----------------------------------------------------------------------------------------- property tests

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_values = st.recursive(
    _leaf,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(_values)
def test_plain_values_round_trip(value: object) -> None:
    assert decode(encode(value)) == value


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(sorted(WIRE_DTYPES)),
    st.lists(st.integers(min_value=0, max_value=4), max_size=4),
    st.integers(min_value=0, max_value=2**31),
)
def test_random_tensors_round_trip(name: str, shape: list[int], seed: int) -> None:
    t = _sample(WIRE_DTYPES[name], tuple(shape), seed)
    assert _same(decode(encode([t, {"x": t}]))[1]["x"], t)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    try:
        value = decode(data, limits=WireLimits(max_message_bytes=1024))
    except WireError:
        return
    encode(value)  # whatever decodes is a plain wire value that can travel again


@settings(max_examples=150, deadline=None)
@given(_values, st.data())
def test_truncated_messages_always_fail_cleanly(value: object, data: st.DataObject) -> None:
    payload = encode({"v": value, "t": torch.arange(3)})
    cut = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    with pytest.raises(WireError):
        decode(payload[:cut])


def test_float_specials_survive() -> None:
    out = decode(encode([math.inf, -math.inf, -0.0]))
    assert out[0] == math.inf and out[1] == -math.inf and math.copysign(1, out[2]) == -1
    assert math.isnan(decode(encode(math.nan)))
