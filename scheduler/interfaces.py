"""What a round driver needs from a verifier and a drafter: the interfaces :class:`~scheduler.engine.SpeculativeEngine`
and :class:`~scheduler.pipeline.PipelinedEngine` are typed against.

Two kinds of implementation meet each interface structurally (neither imports this module): the in-process
engines (:class:`verify_service.engine.VerifyEngine`, :class:`draft_service.engine.DraftEngine`, and the draft
engine behind one worker thread, :class:`scheduler.pipeline.SerialDrafter`) and the gRPC clients of the
replicas (:class:`scheduler.remote.RemoteVerifier`, :class:`scheduler.remote.DrafterPool`). The base protocols
are what every round needs; the optional capabilities below them are runtime-checkable, and the round driver
enables the overlap or split that needs one only when its engine offers it (``isinstance``):

- :class:`ChainingVerifier` and :class:`LaunchingDrafter`: an in-process pair on one device queues a round's
  verify step behind its draft step, and the next draft step behind the verify step (chained rounds, drafts
  launched ahead of a commit).
- :class:`DecodingVerifier`: a verifier that decodes several tokens per call for a round driver without a
  drafter (one message per several tokens across the data plane).
- :class:`RelayingVerifier`: a verifier replica whose drafters return their next blocks to it, so that a round
  whose lengths are planned before its drafts exist is one message to the verifier (relayed rounds).
- :class:`DetachingDrafter`: a drafter pool that may lose every replica and then runs requests detached.
- :class:`RemoteTimed`: a remote engine reports its replicas' time of its last call, from which the round
  driver splits a phase into compute and transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from draft_service.engine import ContextItem, DraftItem, PendingProposal, Proposal
from kernels.graphs import DeviceDrafts, DeviceVerified
from kernels.sampling import SamplingParams
from verify_service.engine import ChainedVerify, PrefillItem, StepResult, VerifyItem


class Verifier(Protocol):
    """The target side of a round: prefill and verify in one ragged step, slots per request."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int:
        """The longest context (prompt, output and one verified block) a request may reach."""
        ...

    @property
    def num_free_slots(self) -> int: ...

    def release_many(self, req_ids: Sequence[str]) -> None:
        """Free the requests' caches; unknown ids are ignored."""
        ...

    def step(self, prefills: Sequence[PrefillItem] = (), verifies: Sequence[VerifyItem] = ()) -> Sequence[StepResult]:
        """One target pass: results of the prefills first, then of the verifies, in the order given."""
        ...


@runtime_checkable
class ChainingVerifier(Verifier, Protocol):
    """A verifier that can queue a verify step behind a draft step on its device."""

    def start_chained(
        self,
        req_ids: list[str],
        anchors: np.ndarray,
        positions: np.ndarray,
        num_drafts: np.ndarray,
        drafts: DeviceDrafts,
    ) -> ChainedVerify | None:
        """Launch the verify step reading ``drafts`` where the drafter wrote them; None when it cannot be
        chained (nothing launched: the round verifies the usual way)."""
        ...


@runtime_checkable
class DecodingVerifier(Verifier, Protocol):
    """A verifier that runs several plain decoding steps in one call."""

    def decode(
        self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem], steps: Sequence[int]
    ) -> Sequence[StepResult]:
        """The prefills and verifications (no drafts) as one step, then verification i decodes ``steps[i] - 1``
        more tokens; each result holds all of its tokens."""
        ...


class RelayedStep(NamedTuple):
    """A relayed step's outcome: the results (prefills first), the confidences of the drafts it verified ([R,
    gamma], None without a confidence head) and how many verifications found no block (verified with none)."""

    results: Sequence[StepResult]
    confidences: np.ndarray | None
    missing: int


@runtime_checkable
class RelayingVerifier(Verifier, Protocol):
    """A verifier whose drafters can return their next blocks to it instead of to the round driver."""

    @property
    def relay(self) -> bool:
        """Whether its steps ask the drafters to return the next blocks to it (then a relayed step may follow)."""
        ...

    def step_relayed(
        self,
        prefills: Sequence[PrefillItem],
        req_ids: list[str],
        anchors: np.ndarray,
        positions: np.ndarray,
        num_drafts: np.ndarray,
    ) -> RelayedStep:
        """One target pass: the prefills, and request i verifying the first ``num_drafts[i]`` drafts of the block
        its drafter returned for (``anchors[i]``, ``positions[i]``) (fewer when the block is shorter, none when
        there is none)."""
        ...


class Drafter(Protocol):
    """The drafter side of a round: a context cache per request and one block of drafts per request a round."""

    @property
    def block_size(self) -> int:
        """gamma: drafts per block."""
        ...

    @property
    def has_confidence_head(self) -> bool: ...

    @property
    def num_free_slots(self) -> int: ...

    def add_requests(self, requests: Sequence[tuple[str, SamplingParams]]) -> int:
        """Give the requests a context slot each, in order; returns how many got one (a prefix)."""
        ...

    def release_many(self, req_ids: Sequence[str]) -> None: ...

    def append_context(self, items: Sequence[ContextItem]) -> None:
        """Append committed context features; items without rows are allowed (nothing to append)."""
        ...

    def propose(self, items: Sequence[DraftItem]) -> Proposal:
        """Draft one block for every item."""
        ...


@runtime_checkable
class LaunchingDrafter(Drafter, Protocol):
    """A drafter that returns as soon as its draft step is queued on the device, and can queue the next draft
    step behind a verify step there."""

    def propose_start(self, items: Sequence[DraftItem]) -> PendingProposal: ...

    def propose_behind(
        self, req_ids: Sequence[str], starts: np.ndarray, verified: DeviceVerified, vocab_size: int
    ) -> PendingProposal | None: ...


@runtime_checkable
class DetachingDrafter(Drafter, Protocol):
    """A drafter pool whose requests can run detached (no replica holds them: placeholder drafts only)."""

    def is_detached(self, req_id: str) -> bool: ...


@runtime_checkable
class RemoteTimed(Protocol):
    """An engine whose calls run on replicas: the replicas' time of the calling thread's last call."""

    @property
    def last_server_s(self) -> float: ...

    @property
    def last_held_s(self) -> float:
        """How long the replicas' processes held that call (its engine time included)."""
        ...

    @property
    def last_drafts_s(self) -> float:
        """Of ``last_server_s``: the time that call waited for its drafts (a relayed step waiting for the blocks
        its drafters return), drafting rather than verifying."""
        ...
