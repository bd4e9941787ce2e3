"""The request router: the scheduler hub's routing and the round drivers' admission, on simulated replicas.

Every decision is one of :mod:`scheduler.admission`'s functions, the ones the hub, the drafter pool and the
round drivers call: a new request goes to the accepting verifier group holding the fewest requests and stays
there; a round admits as many waiting requests as both engines have free slots for (a pipelined group up to
its even share); each admitted request gets the accepting drafter with the most free context slots (its own
replica's drafter when colocated). A request that no verifier accepts is rejected, as the hub rejects it.
"""

from __future__ import annotations

from cluster.simulator.replicas import DrafterReplica, RoundDriver, VerifierReplica
from scheduler.admission import free_slots, group_share, least_loaded, place_by_free_slots


class Router:
    """Routing state of the hub: accepting verifiers with their loads, the drafter pool."""

    def __init__(self, colocated: bool, uses_drafter: bool, groups: int) -> None:
        self.colocated = colocated
        self.uses_drafter = uses_drafter
        self.groups = groups
        self.verifiers: dict[str, VerifierReplica] = {}  # accepting (ready, not draining)
        self._loads: dict[str, int] = {}
        self.drafters: dict[str, DrafterReplica] = {}  # the shared pool's accepting drafters (disaggregated)

    def add_verifier(self, replica: VerifierReplica) -> None:
        self.verifiers[replica.name] = replica
        self._loads[replica.name] = replica.active

    def stop_routing_to(self, replica: VerifierReplica) -> None:
        """Drain: the replica keeps its requests and takes no new ones."""
        self.verifiers.pop(replica.name, None)
        self._loads.pop(replica.name, None)

    def add_drafter(self, replica: DrafterReplica) -> None:
        self.drafters[replica.name] = replica

    def stop_placing_on(self, replica: DrafterReplica) -> None:
        self.drafters.pop(replica.name, None)

    def route(self) -> VerifierReplica | None:
        """The verifier a new request goes to (None: no verifier accepts requests, the hub rejects it)."""
        if not self._loads:
            return None
        name = least_loaded(self._loads)
        self._loads[name] += 1
        replica = self.verifiers[name]
        replica.active += 1
        return replica

    def left(self, replica: VerifierReplica, count: int = 1) -> None:
        """``count`` requests of ``replica`` finished."""
        replica.active -= count
        if replica.name in self._loads:
            self._loads[replica.name] -= count

    def admit(self, driver: RoundDriver) -> list[tuple[int, DrafterReplica | None]]:
        """The waiting requests this round of ``driver`` admits, each with its drafter (None: no drafter)."""
        replica = driver.replica
        waiting = replica.waiting
        if not waiting:
            return []
        limit = None
        if self.groups > 1:
            limit = group_share(replica.running + len(waiting), self.groups, len(driver.members))
        if not self.uses_drafter:
            count = min(free_slots(replica.slots - replica.running, None, replica.running, None, limit), len(waiting))
            return [(waiting.popleft(), None) for _ in range(count)]
        if self.colocated:  # its own drafter only
            own = replica.drafter
            assert own is not None
            free = own.free
            count = free_slots(replica.slots - replica.running, free, replica.running, None, limit)
            placed = place_by_free_slots({own.name: free}, min(count, len(waiting)))
            own.held += len(placed)
            return [(waiting.popleft(), own) for _ in placed]
        pool = {name: d.free for name, d in self.drafters.items()}
        count = free_slots(replica.slots - replica.running, sum(pool.values()), replica.running, None, limit)
        placed = place_by_free_slots(pool, min(count, len(waiting)))
        admitted: list[tuple[int, DrafterReplica | None]] = []
        for name in placed:
            drafter = self.drafters[name]
            drafter.held += 1
            admitted.append((waiting.popleft(), drafter))
        return admitted
