"""Declarative message schemas: valid messages come back normalised, invalid ones name the offending field."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.messages import (
    AnyValue,
    Bool,
    Bytes,
    Float,
    Int,
    List,
    Map,
    Message,
    Opt,
    Str,
    Tensor,
    validate,
)
from cluster.wire import WireError, decode, encode


def _lengths_match(block: dict[str, Any]) -> str | None:
    n = len(block["draft_tokens"])
    if block["draft_probs"].shape[0] != n:
        return f"draft_probs has {block['draft_probs'].shape[0]} rows for {n} draft tokens"
    return None


BLOCK = Message(
    "Block",
    {
        "request_id": Str(min_len=1, max_len=64),
        "draft_tokens": List(Int(min=0, max=151_935), max_len=16),
        "draft_probs": Tensor(("float32", "bfloat16"), shape=(None, 8)),
        "confidences": List(Float(min=0.0, max=1.0), max_len=16),
        "temperature": Opt(Float(min=0.0), default=0.0),
        "seed": Opt(Int(min=0)),
        "greedy": Opt(Bool(), default=True),
    },
    checks=[_lengths_match],
)
ROUND = Message(
    "DraftRound",
    {
        "replica": Str(choices=("verifier-0", "verifier-1")),
        "round": Int(min=0),
        "requests": List(BLOCK, max_len=4096),
        "stats": Opt(Map(Float(), max_len=8), default=None),
        "blob": Opt(Bytes(max_len=4)),
        "extra": Opt(AnyValue()),
    },
)


def _block(i: int = 0, n: int = 3) -> dict[str, Any]:
    return {
        "request_id": f"req-{i}",
        "draft_tokens": list(range(n)),
        "draft_probs": torch.rand(n, 8),
        "confidences": [0.5] * n,
    }


def _round(n_requests: int = 4) -> dict[str, Any]:
    return {"replica": "verifier-0", "round": 7, "requests": [_block(i) for i in range(n_requests)]}


def _error(schema: Message, obj: Any) -> WireError:
    with pytest.raises(WireError) as info:
        validate(schema, obj)
    return info.value


def test_valid_message_is_normalised() -> None:
    message = _round()
    message["requests"][0]["confidences"] = [1, 0.5, 0]  # ints where floats are declared
    message["stats"] = {"load": 3}
    out = validate(ROUND, decode(encode(message)))
    first = out["requests"][0]
    assert first["confidences"] == [1.0, 0.5, 0.0] and all(type(c) is float for c in first["confidences"])
    assert first["temperature"] == 0.0 and first["seed"] is None and first["greedy"] is True
    assert out["stats"] == {"load": 3.0} and out["blob"] is None
    assert torch.equal(first["draft_probs"], message["requests"][0]["draft_probs"])
    assert out["requests"][1]["request_id"] == "req-1" and out["requests"][1]["draft_tokens"] == [0, 1, 2]
    assert set(out["requests"][1]) == set(BLOCK.fields)


@pytest.mark.parametrize(
    ("mutate", "path", "expected"),
    [
        (
            lambda m: m["requests"][3].__setitem__("draft_tokens", "x"),
            "requests[3].draft_tokens",
            "expected list[int]",
        ),
        (
            lambda m: m["requests"][2]["draft_tokens"].__setitem__(1, "7"),
            "requests[2].draft_tokens[1]",
            "expected int",
        ),
        (
            lambda m: m["requests"][2]["draft_tokens"].__setitem__(2, True),
            "requests[2].draft_tokens[2]",
            "got bool",
        ),
        (
            lambda m: m["requests"][1]["draft_tokens"].__setitem__(0, -1),
            "requests[1].draft_tokens[0]",
            "outside",
        ),
        (
            lambda m: m["requests"][1]["draft_tokens"].extend(range(20)),
            "requests[1].draft_tokens",
            "length 23",
        ),
        (lambda m: m["requests"][0].pop("request_id"), "requests[0].request_id", "missing required field"),
        (lambda m: m["requests"][0].__setitem__("request_id", ""), "requests[0].request_id", "length 0"),
        (
            lambda m: m["requests"][0].__setitem__("temprature", 1.0),
            "requests[0]",
            "unknown field(s) 'temprature'",
        ),
        (lambda m: m["requests"][0].__setitem__("temperature", -1.0), "requests[0].temperature", "outside"),
        (lambda m: m["requests"][0].__setitem__("seed", 1.5), "requests[0].seed", "expected int, got float"),
        (lambda m: m["requests"][0].__setitem__("greedy", 1), "requests[0].greedy", "expected bool"),
        (
            lambda m: m["requests"][0]["confidences"].__setitem__(1, math.nan),
            "requests[0].confidences[1]",
            "finite",
        ),
        (
            lambda m: m["requests"][0]["confidences"].__setitem__(2, 1.5),
            "requests[0].confidences[2]",
            "outside",
        ),
        (
            lambda m: m["requests"][0].__setitem__("draft_probs", torch.rand(3, 8).double()),
            "requests[0].draft_probs",
            "got dtype float64",
        ),
        (
            lambda m: m["requests"][0].__setitem__("draft_probs", torch.rand(3, 4)),
            "requests[0].draft_probs",
            "shape [None, 8]",
        ),
        (
            lambda m: m["requests"][0].__setitem__("draft_probs", [[0.1] * 8] * 3),
            "requests[0].draft_probs",
            "got list",
        ),
        (
            lambda m: m["requests"][0].__setitem__("draft_probs", torch.rand(2, 8)),
            "requests[0]",
            "2 rows for 3 draft tokens",
        ),
        (lambda m: m.__setitem__("replica", "verifier-9"), "replica", "not one of"),
        (lambda m: m.__setitem__("round", None), "round", "expected int, got null"),
        (lambda m: m.__setitem__("stats", {"a": "b"}), "stats['a']", "expected float"),
        (lambda m: m.__setitem__("stats", {str(i): 1.0 for i in range(9)}), "stats", "9 entries"),
        (lambda m: m.__setitem__("blob", b"12345"), "blob", "5 bytes"),
        (lambda m: m.__setitem__("requests", {}), "requests", "expected list[Block], got dict"),
        (lambda m: m["requests"].__setitem__(0, [1]), "requests[0]", "expected Block, got list"),
    ],
)
def test_errors_name_the_offending_field(mutate: Any, path: str, expected: str) -> None:
    message = _round()
    mutate(message)
    error = _error(ROUND, message)
    assert error.field_path == path
    assert str(error).startswith(f"invalid DraftRound: {path}: ")
    assert expected in str(error)


def test_top_level_must_be_a_map() -> None:
    error = _error(ROUND, [1, 2])
    assert str(error) == "invalid DraftRound: expected DraftRound, got list" and error.field_path == ""


def test_extra_fields_pass_through_when_allowed() -> None:
    open_schema = Message("Open", {"a": Int()}, allow_extra=True)
    assert validate(open_schema, {"a": 1, "b": [2]}) == {"a": 1, "b": [2]}
    closed = Message("Closed", {"a": Int(), "b": Opt(Int())})
    assert validate(closed, {"a": 1}) == {"a": 1, "b": None}
    # An unknown key must be caught even when an optional field is missing (equal counts).
    assert "unknown field(s) 'c'" in str(_error(closed, {"a": 1, "c": 2}))


def test_tensor_rank_constraint_and_any_size_dims() -> None:
    schema = Message("T", {"t": Tensor("int64", rank=1), "u": Tensor(["bool"], shape=(2, None))})
    ok = {"t": torch.zeros(0, dtype=torch.int64), "u": torch.zeros(2, 5, dtype=torch.bool)}
    assert validate(schema, ok)["u"].shape == (2, 5)
    assert _error(schema, {**ok, "t": torch.zeros(1, 1, dtype=torch.int64)}).field_path == "t"
    assert "tensor[bool, shape [2, None]]" in str(
        _error(schema, {**ok, "u": torch.zeros(3, 5, dtype=torch.bool)})
    )


def test_schema_definition_errors_are_caught_early() -> None:
    with pytest.raises(ValueError, match="unknown dtypes"):
        Tensor("float8")
    with pytest.raises(ValueError, match="contradicts"):
        Tensor("float32", rank=1, shape=(2, 2))
    with pytest.raises(ValueError, match="greater than max"):
        Int(min=3, max=1)
    with pytest.raises(TypeError, match="schema Type"):
        Message("M", {"a": int})  # type: ignore[dict-item]


# ----------------------------------------------------------------------------------------- property tests

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_WRONG = {
    "request_id": [_INT64, st.none(), st.binary(), st.lists(st.text())],
    "draft_tokens": [st.text(), _INT64, st.dictionaries(st.text(), _INT64, min_size=1)],
    "draft_probs": [st.floats(), st.text(), st.lists(st.floats(), min_size=1)],
    "confidences": [st.text(), st.lists(st.text(), min_size=1), st.booleans()],
    "temperature": [st.text(min_size=1), st.lists(st.floats()), st.booleans()],
}


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_wrong_field_type_is_reported_at_its_path(data: st.DataObject) -> None:
    message = _round(n_requests=5)
    index = data.draw(st.integers(min_value=0, max_value=4))
    name = data.draw(st.sampled_from(sorted(_WRONG)))
    message["requests"][index][name] = data.draw(st.one_of(_WRONG[name]))
    error = _error(ROUND, decode(encode(message)))
    assert error.field_path is not None
    assert error.field_path.startswith(f"requests[{index}].{name}")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=20))
def test_int_lists_fast_path_agrees_with_element_checks(values: list[int]) -> None:
    schema = Message("L", {"v": List(Int(min=0, max=1000))})
    bad = [i for i, v in enumerate(values) if not 0 <= v <= 1000]
    if bad:
        assert _error(schema, {"v": values}).field_path == f"v[{bad[0]}]"
    else:
        assert validate(schema, {"v": values}) == {"v": values}
