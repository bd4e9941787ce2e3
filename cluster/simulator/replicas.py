"""Replica models: GPUs that run one step at a time, verifier and drafter replicas, round drivers.

A :class:`Gpu` serves the steps sent to it in the order they arrive: a step arriving while the GPU is busy
starts when the previous one ends. That one rule gives both placements: ``colocated`` puts a replica's drafter
and verifier steps on the same GPU (they serialise), ``disaggregated`` gives each drafter and verifier replica
its own (steps overlap only when different round drivers keep both busy, i.e. pipelined request groups or
several verifiers sharing the drafter pool).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Gpu:
    """One device: ``run(arrival, seconds)`` queues a step and returns when it ends."""

    __slots__ = ("busy_s", "free_at")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def run(self, arrival: float, seconds: float) -> float:
        start = arrival if arrival > self.free_at else self.free_at
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at


@dataclass(eq=False)
class DrafterReplica:
    """Context-cache slots on one GPU (shared with a verifier when colocated)."""

    name: str
    index: int
    slots: int
    gpu: Gpu
    created_s: float
    ready_s: float
    held: int = 0
    draining: bool = False
    removed_s: float | None = None

    @property
    def free(self) -> int:
        return self.slots - self.held


@dataclass(eq=False)
class RoundDriver:
    """One round loop over a request group of a verifier replica, with its own policy instance (as each
    verifier group and each pipelined group has in the served system)."""

    replica: VerifierReplica
    policy: Any
    members: list[int] = field(default_factory=list)
    idle: bool = True
    # The round in flight: its requests, joiners, drafting decision, caps and (after the schedule) outcome.
    verified: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    drafting: bool = False
    caps: np.ndarray | None = None
    rows: list[int] | None = None  # the trace rows the round's drafts replayed (drafted rounds)
    accepted: list[int] | None = None  # per request of ``verified`` (drafted rounds)
    steps: list[int] | None = None  # per request of ``verified``: its tokens in a plain round of several decode steps
    draft_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0
    verify_tokens: int = 0
    # Batched rounds (cluster.simulator.simulation, a replica's own GPU): what the round's end must do, decided
    # when its lengths were: requests that finish (in the order the round ends them), requests whose recorded
    # prompt ran out.
    finishing: list[int] | None = None
    moving: list[int] | None = None
    observe: Callable[..., None] | None = field(init=False, default=None)  # the policy's observe_round, if any
    # Planned rounds (the policy's planned_lengths and observe_drafts, if any; see Simulation._verify): whether
    # this round's drafts, launched ahead after the last round, cover requests that finished in it (then the
    # served engine's in-process round driver cannot chain the round: the policy decides on the drafts).
    plans: Callable[[np.ndarray, int], np.ndarray | None] | None = field(init=False, default=None)
    observe_drafts: Callable[[np.ndarray, np.ndarray], None] | None = field(init=False, default=None)
    thinned: bool = False

    def __post_init__(self) -> None:
        self.observe = getattr(self.policy, "observe_round", None)
        self.plans = getattr(self.policy, "planned_lengths", None)
        self.observe_drafts = getattr(self.policy, "observe_drafts", None)


@dataclass(eq=False)
class VerifierReplica:
    """KV slots on one GPU, the requests routed to it (``active``: running or waiting), its round drivers."""

    name: str
    index: int
    slots: int
    gpu: Gpu
    created_s: float
    ready_s: float
    drafter: DrafterReplica | None = None  # its own drafter when colocated
    drivers: list[RoundDriver] = field(default_factory=list)
    waiting: deque[int] = field(default_factory=deque)
    running: int = 0
    active: int = 0
    draining: bool = False
    removed_s: float | None = None
