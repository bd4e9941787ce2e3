"""The scheduler's admission and routing rules as pure functions (shared by the served code and the simulator)."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.admission import draft_caps, free_slots, group_share, least_loaded, place_by_free_slots


def test_least_loaded_takes_the_fewest_requests_and_the_first_on_a_tie() -> None:
    assert least_loaded({"a": 3, "b": 1, "c": 2}) == "b"
    assert least_loaded({"a": 2, "b": 1, "c": 1}) == "b"
    with pytest.raises(ValueError, match="no verifier"):
        least_loaded({})


def test_place_by_free_slots_fills_the_freest_drafter_first_and_stops_when_full() -> None:
    free = {"x": 2, "y": 3}
    assert place_by_free_slots(free, 4) == ["y", "x", "y", "x"]
    assert free == {"x": 2, "y": 3}  # not changed
    assert place_by_free_slots(free, 9) == ["y", "x", "y", "x", "y"]
    assert place_by_free_slots({"x": 0}, 3) == []
    assert place_by_free_slots({}, 3) == []


def test_free_slots_is_the_tightest_bound() -> None:
    assert free_slots(5, 7, running=2, max_running=None) == 5
    assert free_slots(5, 3, running=2, max_running=None) == 3
    assert free_slots(5, None, running=2, max_running=4) == 2
    assert free_slots(5, 7, running=2, max_running=None, limit=1) == 1
    assert free_slots(5, 7, running=6, max_running=4) == 0


def test_draft_caps_never_pass_max_tokens_the_kv_slot_or_the_block() -> None:
    caps = draft_caps(np.array([1, 3, 50, 50]), np.array([10, 10, 10, 197]), max_seq_len=200, block_size=7)
    assert caps.tolist() == [0, 2, 7, 2]


def test_group_share_is_an_even_split() -> None:
    assert group_share(total=5, groups=2, members=1) == 2
    assert group_share(total=4, groups=2, members=2) == 0
