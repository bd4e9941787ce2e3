"""Per-request sampling parameters, validated once at the edge.

Every service (HTTP ingress, scheduler, drafter, verifier) passes the same small record along, so validation lives
in one place: a request that reaches an engine is known to be well formed, and a bad one is rejected with a
message that names the field before any work is queued.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

#: Upper bound on stop strings per request: bounds the per-round matching work (issue: "thousands of stop strings").
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
#: The sampling kernels reject anything else in a batch, failing the whole round: the edge must be as strict.
MIN_TEMPERATURE = 1e-5  # kernels/checks.py: temperature is 0 (greedy) or >= this
MIN_TOP_P = 2.0**-126  # smallest normal float32: smaller values become 0 (or denormal) on the device
MAX_TPOT_SLO_MS = 1e6
#: Service-level settings a request may carry (applied by :mod:`scheduler.service_levels`).
Speculative = Literal["auto", "off", "on"]
SPECULATIVE_MODES: tuple[str, ...] = ("auto", "off", "on")
#: Priority tiers: a bounded range keeps the per-tier metric series bounded.
MIN_PRIORITY, MAX_PRIORITY = -100, 100


class SamplingError(ValueError):
    """A sampling parameter is invalid; the message names the field and the accepted range."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature == 0`` means greedy (and makes top-k/top-p irrelevant)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1.0 = no nucleus truncation
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Service level (scheduler.service_levels); None = the server's default.
    speculative: str | None = None  # auto | off | on
    priority: int | None = None  # tier: a smaller value is served first
    tpot_slo_ms: float | None = None  # target time per output token
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, low=0.0, high=100.0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingError(f"temperature: must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        _check_int("top_k", self.top_k, low=0, high=1 << 31)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.top_p < MIN_TOP_P:
            raise SamplingError(f"top_p: must be in [{MIN_TOP_P:.3g}, 1.0], got {self.top_p}")
        _check_int("max_tokens", self.max_tokens, low=1, high=1 << 31)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=(1 << 63) - 1)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingError("stop: expected a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingError(f"stop: each stop string must have 1..{MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, low=0, high=1 << 31)
        if self.speculative is not None and self.speculative not in SPECULATIVE_MODES:
            raise SamplingError(f"speculative: must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if self.priority is not None:
            _check_int("priority", self.priority, low=MIN_PRIORITY, high=MAX_PRIORITY)
        if self.tpot_slo_ms is not None:
            _check_number("tpot_slo_ms", self.tpot_slo_ms, low=0.0, high=MAX_TPOT_SLO_MS, low_open=True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed: sampled requests need one so every replica draws the same numbers."""
        if self.seed is not None or self.greedy:
            return self
        return replace(self, seed=secrets.randbits(62))

    def to_dict(self) -> dict[str, Any]:
        """Plain, msgpack-able form (lists instead of tuples)."""
        out = asdict(self)
        out.pop("extra")
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a decoded wire/JSON map; unknown keys are an error so typos do not pass silently."""
        known = {"temperature", "top_k", "top_p", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "speculative", "priority", "tpot_slo_ms"}
        unknown = set(data) - known
        if unknown:
            raise SamplingError(f"unknown sampling parameter(s): {sorted(unknown)}")
        kwargs = dict(data)
        for key in ("stop", "stop_token_ids"):
            if key in kwargs:
                value = kwargs[key]
                if isinstance(value, str) and key == "stop":
                    value = [value]
                if not isinstance(value, list | tuple):
                    raise SamplingError(f"{key}: expected a list")
                kwargs[key] = tuple(value)
        return cls(**kwargs)


def _check_number(
    name: str, value: object, *, low: float, high: float, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SamplingError(f"{name}: expected a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise SamplingError(f"{name}: must be in {bracket}{low}, {high}], got {value}")


def _check_int(name: str, value: object, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"{name}: expected an integer, got {value!r}")
    if not low <= value <= high:
        raise SamplingError(f"{name}: must be in [{low}, {high}], got {value}")
