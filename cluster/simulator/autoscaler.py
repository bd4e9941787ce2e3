"""A pool's autoscaler in simulated time: the project's policy inside Ray Serve's rules around it.

The desired replica count comes from :func:`cluster.autoscaling.engine_load_policy` itself, called with an
autoscaling context built from the simulated replicas' reports (requests each engine holds, averaged per
replica over ``look_back_period_s``). Around it the rules Ray Serve 2.60 applies to a custom policy
(``ray.serve.autoscaling_policy._apply_autoscaling_config``): the change is scaled by ``upscaling_factor`` /
``downscaling_factor`` (rounded up, and at least one replica down when the desired count is lower), it only
takes effect once the same direction has been wanted for ``upscale_delay_s`` / ``downscale_delay_s``, scaling
down keeps at least one replica, and the result is clamped to ``min_replicas`` .. ``max_replicas``. Serve's
own implementation reads the wall clock, which is why these rules are restated here on the simulated one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from cluster.autoscaling import HELD_REQUESTS, POLICY_PATH, engine_load_policy


class ScalingConfigError(ValueError):
    """An autoscaling_config the simulator cannot use (message names the field)."""


@dataclass(frozen=True)
class PoolScaling:
    """One pool's ``autoscaling_config`` (Serve's field names and defaults)."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0
    look_back_period_s: float = 30.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str) -> PoolScaling:
        """From a Serve ``autoscaling_config`` mapping; its ``policy`` must be the project's engine-load policy."""
        if not isinstance(config, dict):
            raise ScalingConfigError(f"{where}: expected a mapping of autoscaling_config fields")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in config.items():
            if key == "policy":
                path = value.get("policy_function") if isinstance(value, dict) else value
                if path != POLICY_PATH:
                    raise ScalingConfigError(f"{where}.policy: the simulator runs {POLICY_PATH}, got {path!r}")
                continue
            if key not in known:
                raise ScalingConfigError(f"{where}: unknown field {key!r} (known: {sorted(known)}, policy)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ScalingConfigError(f"{where}.{key}: expected a number, got {value!r}")
            values[key] = value
        scaling = cls(**values)
        if not 0 <= scaling.min_replicas <= scaling.max_replicas or scaling.max_replicas < 1:
            raise ScalingConfigError(f"{where}: need 0 <= min_replicas <= max_replicas, max_replicas >= 1")
        if scaling.target_ongoing_requests <= 0 or scaling.look_back_period_s <= 0:
            raise ScalingConfigError(f"{where}: target_ongoing_requests and look_back_period_s must be > 0")
        if min(scaling.upscale_delay_s, scaling.downscale_delay_s) < 0:
            raise ScalingConfigError(f"{where}: delays must be >= 0")
        if min(scaling.upscaling_factor, scaling.downscaling_factor) <= 0:
            raise ScalingConfigError(f"{where}: scaling factors must be > 0")
        return scaling

    def get_target_ongoing_requests(self) -> float:
        """What :func:`engine_load_policy` reads from Serve's config object."""
        return self.target_ongoing_requests


@dataclass
class _Context:
    """The part of Serve's AutoscalingContext that :func:`engine_load_policy` reads."""

    config: PoolScaling
    target_num_replicas: int
    current_num_replicas: int
    aggregated_metrics: dict[str, dict[str, float]]


class PoolAutoscaler:
    """Decides a pool's target replica count at each control tick from the replicas' reported loads."""

    def __init__(self, scaling: PoolScaling, initial: int) -> None:
        self.scaling = scaling
        self.target = initial
        self._reports: deque[tuple[float, dict[str, float]]] = deque()
        self._wanted_since: float | None = None
        self._direction = 0  # +1 up, -1 down, 0 none: the direction wanted since _wanted_since

    def tick(self, now: float, held: dict[str, float], current: int, queued: int = 0) -> int:
        """Record the replicas' held requests at ``now`` and return the new target replica count. ``queued``:
        requests waiting for this pool; with no replica running, any of them starts one at once (Serve's cold
        start)."""
        if current == 0 and queued > 0:
            scaling = self.scaling
            self.target = min(
                max(math.ceil(scaling.upscaling_factor), self.target, scaling.min_replicas, 1), scaling.max_replicas
            )
            return self.target
        self._reports.append((now, held))
        while self._reports and self._reports[0][0] < now - self.scaling.look_back_period_s:
            self._reports.popleft()
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for _, report in self._reports:
            for replica, value in report.items():
                if replica in held:  # replicas gone since are not part of the pool any more
                    sums[replica] = sums.get(replica, 0.0) + value
                    counts[replica] = counts.get(replica, 0) + 1
        averaged = {r: sums[r] / counts[r] for r in sums}
        context = _Context(self.scaling, self.target, current, {HELD_REQUESTS: averaged})
        desired, _ = engine_load_policy(context)  # type: ignore[arg-type]
        self.target = self._apply_rules(float(desired), current, now)
        return self.target

    def _apply_rules(self, desired: float, current: int, now: float) -> int:
        scaling = self.scaling
        if current == 0:
            wanted = math.ceil(desired)
            if wanted > 0:  # Serve scales up from zero at once
                self.target = min(max(wanted, scaling.min_replicas), scaling.max_replicas)
                return self.target
        else:
            delta = desired - current
            factor = scaling.upscaling_factor if delta > 0 else scaling.downscaling_factor
            wanted = math.ceil(current + factor * delta)
            if math.ceil(desired) < current and wanted == current:
                wanted -= 1
        wanted = max(0, wanted)
        decision = self.target
        direction = (wanted > self.target) - (wanted < self.target)
        if direction != self._direction:
            self._direction, self._wanted_since = direction, (now if direction else None)
        if direction > 0 and now - self._wanted_since >= scaling.upscale_delay_s:  # type: ignore[operator]
            decision, self._direction, self._wanted_since = wanted, 0, None
        elif direction < 0:
            if self.target > 1:
                wanted = max(1, wanted)
            if now - self._wanted_since >= scaling.downscale_delay_s:  # type: ignore[operator]
                decision, self._direction, self._wanted_since = wanted, 0, None
        return min(max(decision, scaling.min_replicas), scaling.max_replicas)
