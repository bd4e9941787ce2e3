"""``scheduler.decode_steps``: ``auto`` resolves by the verifier's device; explicit values are checked."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import GPU_DECODE_STEPS, SchedulerConfig


def test_decode_steps_auto_is_several_on_cuda_and_one_elsewhere() -> None:
    auto = SchedulerConfig()
    assert auto.decode_steps == "auto"
    assert auto.decode_steps_on("cuda") == auto.decode_steps_on("cuda:1") == GPU_DECODE_STEPS > 1
    assert auto.decode_steps_on("cpu") == 1
    assert SchedulerConfig(decode_steps=3).decode_steps_on("cuda") == 3
    assert SchedulerConfig(decode_steps=3).decode_steps_on("cpu") == 3


@pytest.mark.parametrize("bad", [0, 65, "many", 2.5])
def test_bad_decode_steps_are_rejected(bad: object) -> None:
    with pytest.raises(ValidationError, match="decode_steps"):
        SchedulerConfig(decode_steps=bad)
