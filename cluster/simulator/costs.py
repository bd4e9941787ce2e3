"""The cost file: what one GPU type charges for every step the simulator models (format ``dspark-sim-costs/1``).

Every number the simulation uses comes from such a file, never from code, so a new GPU type or a calibration
against served measurements is a new file. Schema (JSON object; every section carries a ``source`` string that
says where its numbers were measured):

- ``format``: ``"dspark-sim-costs/1"``; ``gpu``, ``model``: what was measured (free text);
  ``calibrated``: false until the numbers were fitted to HTTP measurements of the served product;
  ``block_size``: the drafter's block (gamma) the tables were measured with.
- ``verify``: ``{"sps": <SPS JSON>}``, an SPS table in either :mod:`scheduler.sps` format (tables by request
  count preferred). The verify step of R requests holding B tokens takes 1 / SPS_R(B) seconds, the price the
  policies themselves use; ``scale`` (optional, default 1) multiplies every verify step (calibration: steps
  under load with long contexts take longer than the profile of idle requests says).
- ``prefill``: ``{"sps": <dspark-sps/1 token table>}``. P prompt tokens joining a round's target pass add
  1 / SPS(P) - 1 / SPS(1) seconds to it (the table's cost of P tokens beyond the fixed cost of a step).
- ``draft``: ``{"requests": [R...], "seconds": [s...]}``, one draft step (backbone + head) for R requests;
  linear in between, the last two points' slope beyond the last one, the first value below it.
- ``host``: ``{"requests": [R...], "drafted_s": [...], "plain_s": [...]}``, host time per round of R requests
  outside the device steps (admission, schedule, commit), for a drafted and a plain (no draft) round.
- ``hops``: ``{"colocated_s": x, "disaggregated_s": y}``, latency of one data-plane message (scheduler to a
  replica or back) for each placement; a round sends one to the drafters and one back, one to the verifier
  and one back. ``round_overhead_s`` (optional, default 0): any further per-round time of the served path.
- ``replica_start_s``: ``{"verifier": s, "drafter": s}``, from the autoscaler's decision to a replica that
  takes requests.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.sps import SPSMonotonicityWarning, SPSSource, SPSTable, load_sps

FORMAT = "dspark-sim-costs/1"
PLACEMENTS = ("colocated", "disaggregated")


class CostFileError(ValueError):
    """A cost file that cannot be used, with the file and the field at fault in its message."""


class CountCurve:
    """Seconds as a function of a request count: linear between measured counts, the first value below the
    first count, the slope of the last two points beyond the last (flat for a single point). Values are kept
    per count once asked for (a simulation asks for the same few counts millions of times)."""

    def __init__(self, requests: np.ndarray, seconds: np.ndarray) -> None:
        self.requests = requests
        self.seconds = seconds
        self._values: dict[int, float] = {}

    def __call__(self, count: int) -> float:
        value = self._values.get(count)
        if value is None:
            r, s = self.requests, self.seconds
            if count <= r[-1] or r.size == 1:
                value = float(np.interp(count, r, s))
            else:
                value = float(s[-1] + (s[-1] - s[-2]) / (r[-1] - r[-2]) * (count - r[-1]))
            self._values[count] = value
        return value


@dataclass(frozen=True)
class Costs:
    """One GPU type's costs (see the module docstring for the file behind each field)."""

    gpu: str
    model: str
    calibrated: bool
    block_size: int
    sps: SPSSource
    verify_scale: float
    prefill_sps: SPSTable
    draft: CountCurve
    host_drafted: CountCurve
    host_plain: CountCurve
    hops: dict[str, float]
    round_overhead_s: float
    verifier_start_s: float
    drafter_start_s: float
    _verify: dict[tuple[int, int], float] = field(default_factory=dict, repr=False, compare=False)

    def verify_s(self, num_requests: int, batch_tokens: int) -> float:
        """One verify step of ``num_requests`` requests holding ``batch_tokens`` tokens (anchors + drafts)."""
        key = (num_requests, batch_tokens)
        value = self._verify.get(key)
        if value is None:
            table = self.sps.table_for(num_requests)
            value = self._verify[key] = self.verify_scale * float(table.dense_step_time(batch_tokens)[batch_tokens])
        return value

    def prefill_s(self, prompt_tokens: int) -> float:
        """What ``prompt_tokens`` prompt tokens add to a round's target pass (0 for none)."""
        if prompt_tokens <= 0:
            return 0.0
        times = self.prefill_sps.dense_step_time(prompt_tokens)
        return self.verify_scale * float(times[prompt_tokens] - times[1])

    def hop_s(self, placement: str) -> float:
        return self.hops[placement]


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise CostFileError(f"{where}: expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _section(data: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    section = data.get(name)
    if not isinstance(section, dict):
        raise CostFileError(f"{path}: missing section {name!r} (an object)")
    if not isinstance(section.get("source"), str) or not section["source"]:
        raise CostFileError(f"{path}: {name}.source must say where the numbers come from")
    return section


def _curve(section: dict[str, Any], key: str, where: str) -> CountCurve:
    requests, seconds = section.get("requests"), section.get(key)
    if not isinstance(requests, list) or not isinstance(seconds, list) or not requests:
        raise CostFileError(f"{where}: needs non-empty lists 'requests' and {key!r}")
    if len(requests) != len(seconds):
        raise CostFileError(f"{where}: 'requests' has {len(requests)} entries, {key!r} {len(seconds)}")
    counts = [_number(r, f"{where}.requests", positive=True) for r in requests]
    if any(b <= a for a, b in itertools.pairwise(counts)):
        raise CostFileError(f"{where}.requests must increase strictly, got {requests}")
    values = [_number(s, f"{where}.{key}") for s in seconds]
    return CountCurve(np.array(counts), np.array(values))


def _sps(section: dict[str, Any], where: str) -> SPSSource:
    """The section's SPS table; a measured table that needed the monotone fix-up is taken as fixed, silently
    (measurements of neighbouring batch sizes are noisy; the rule is :mod:`scheduler.sps`'s own)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SPSMonotonicityWarning)
            return load_sps(section.get("sps"))  # type: ignore[arg-type]
    except ValueError as error:
        raise CostFileError(f"{where}.sps: {error}") from None


def parse_costs(data: Any, path: str = "<costs>") -> Costs:
    """Validate a cost-file object; raises CostFileError naming the field at fault."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CostFileError(f"{path}: not a cost file (expected format {FORMAT!r})")
    block = data.get("block_size")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise CostFileError(f"{path}: block_size must be an integer >= 1, got {block!r}")
    verify = _section(data, "verify", path)
    prefill = _section(data, "prefill", path)
    prefill_sps = _sps(prefill, f"{path}: prefill")
    if not isinstance(prefill_sps, SPSTable):
        raise CostFileError(f"{path}: prefill.sps must be a token table (dspark-sps/1)")
    draft = _section(data, "draft", path)
    host = _section(data, "host", path)
    hops = _section(data, "hops", path)
    start = _section(data, "replica_start_s", path)
    return Costs(
        gpu=str(data.get("gpu", "")),
        model=str(data.get("model", "")),
        calibrated=bool(data.get("calibrated", False)),
        block_size=block,
        sps=_sps(verify, f"{path}: verify"),
        verify_scale=_number(verify.get("scale", 1.0), f"{path}: verify.scale", positive=True),
        prefill_sps=prefill_sps,
        draft=_curve(draft, "seconds", f"{path}: draft"),
        host_drafted=_curve(host, "drafted_s", f"{path}: host"),
        host_plain=_curve(host, "plain_s", f"{path}: host"),
        hops={p: _number(hops.get(f"{p}_s"), f"{path}: hops.{p}_s") for p in PLACEMENTS},
        round_overhead_s=_number(hops.get("round_overhead_s", 0.0), f"{path}: hops.round_overhead_s"),
        verifier_start_s=_number(start.get("verifier"), f"{path}: replica_start_s.verifier"),
        drafter_start_s=_number(start.get("drafter"), f"{path}: replica_start_s.drafter"),
    )


def load_costs(path: str | Path) -> Costs:
    """Read and validate a cost file; raises CostFileError with the file and field at fault."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise CostFileError(f"{path}: cannot read ({error.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CostFileError(f"{path}: not valid JSON ({error})") from None
    return parse_costs(data, str(path))
