"""The continuation of a stream cut by its scheduler's loss, as the ingress builds it: the prompt followed by every
token streamed, ``max_tokens`` less those, the counts of tokens and text the client has, no token twice; and the
wire contract's check of it."""

from __future__ import annotations

import pytest

from cluster import contract
from cluster.backend import BackendUnavailableError, GenerateDelta, Resume
from cluster.messages import validate
from cluster.remote_backend import StreamSeam
from cluster.wire import WireError
from kernels.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=10, stop=("\n\n",), stop_token_ids=(2,))


def _delta(ids: tuple[int, ...], text: str, finished: bool = False) -> GenerateDelta:
    return GenerateDelta(ids, text, finished, "length" if finished else None, 3, 0)


def test_before_any_token_the_request_is_the_original() -> None:
    seam = StreamSeam("cmpl-1", [7, 8, 9], PARAMS)
    request = seam.request()
    assert request == {"req_id": "cmpl-1", "prompt_ids": [7, 8, 9], "params": PARAMS.to_dict()}
    assert validate(contract.GENERATE_REQUEST, request)["emitted"] == 0
    assert seam.request() == request  # a retry before any token is the same request


def test_a_continuation_carries_every_streamed_token_once_and_the_rest_of_the_budget() -> None:
    seam = StreamSeam("cmpl-1", [7, 8, 9], PARAMS)
    for delta in (_delta((11,), "a"), _delta((12, 13), ""), _delta((14,), "bcd")):  # "" : text held back
        assert seam.add(delta) is delta
    first = validate(contract.GENERATE_REQUEST, seam.request())
    assert first["prompt_ids"] == [7, 8, 9, 11, 12, 13, 14]
    assert (first["emitted"], first["emitted_chars"]) == (4, 4)
    assert first["req_id"] == "cmpl-1+1"  # a scheduler that still knows the cut attempt sees another request
    params = SamplingParams.from_dict(first["params"])
    assert params.max_tokens == 6
    assert params.to_dict() == {**PARAMS.to_dict(), "max_tokens": 6}  # everything else as asked

    # A continuation that failed before any token is sent again the same (under a new id); one cut after more
    # tokens carries them all, each once.
    again = validate(contract.GENERATE_REQUEST, seam.request())
    assert again["req_id"] == "cmpl-1+2" and again["prompt_ids"] == first["prompt_ids"]
    seam.add(_delta((15, 16), "ef"))
    second = validate(contract.GENERATE_REQUEST, seam.request())
    assert second["prompt_ids"] == [7, 8, 9, 11, 12, 13, 14, 15, 16]
    assert (second["emitted"], second["emitted_chars"]) == (6, 6)
    assert SamplingParams.from_dict(second["params"]).max_tokens == 4


def test_a_continued_request_continued_again_counts_from_its_own_start() -> None:
    """The scheduler relays a continuation to an engine replica through the same class: the counts add up."""
    seam = StreamSeam("r", [7, 8, 9, 11, 12], SamplingParams(temperature=0.0, max_tokens=5), Resume(2, 3))
    assert validate(contract.GENERATE_REQUEST, seam.request())["emitted"] == 2
    seam.add(_delta((13,), "x"))
    request = seam.request()
    assert request["prompt_ids"] == [7, 8, 9, 11, 12, 13]
    assert (request["emitted"], request["emitted_chars"]) == (3, 4)
    assert request["params"]["max_tokens"] == 4


def test_a_stream_cut_after_its_last_token_is_not_continued() -> None:
    seam = StreamSeam("r", [7], SamplingParams(temperature=0.0, max_tokens=2))
    seam.add(_delta((1, 2), "xy"))
    with pytest.raises(BackendUnavailableError):
        seam.request()


def test_long_request_ids_stay_within_the_contract() -> None:
    seam = StreamSeam("x" * 128, [7], SamplingParams(temperature=0.0, max_tokens=4))
    seam.add(_delta((1,), "a"))
    validate(contract.GENERATE_REQUEST, seam.request())


@pytest.mark.parametrize("emitted", [3, 4])
def test_the_contract_refuses_an_output_that_leaves_no_prompt(emitted: int) -> None:
    request = contract.generate_request("r", [7, 8, 9], PARAMS, Resume(emitted, 0))
    with pytest.raises(WireError, match="emitted"):
        validate(contract.GENERATE_REQUEST, request)
