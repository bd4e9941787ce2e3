"""SamplingParams: valid values pass, every invalid one names its field."""

from __future__ import annotations

import pytest

from kernels.sampling import SamplingError, SamplingParams


def test_defaults_and_roundtrip() -> None:
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=32, seed=3, stop=("\n\n",))
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert not p.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -5}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple(str(i) for i in range(100))}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kwargs)


def test_unknown_keys_rejected() -> None:
    with pytest.raises(SamplingError, match="unknown"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_single_stop_string_accepted_like_openai() -> None:
    assert SamplingParams.from_dict({"stop": "END"}).stop == ("END",)


def test_with_seed_fixes_a_seed_only_for_sampled_requests() -> None:
    assert SamplingParams(temperature=0).with_seed().seed is None
    assert SamplingParams(temperature=1).with_seed().seed is not None
