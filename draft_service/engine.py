"""The draft engine: one DSpark drafter, many requests, one batched backbone pass per round.

Per request it keeps a slot in the drafter's context cache (the K/V of the projected target context features of
every committed token), so each round only appends the features of newly committed tokens. ``propose`` then runs
the parallel backbone for all requests at once on ``[anchor, mask, ..., mask]`` and walks the sequential head
(Markov / gated / RNN) left to right, sampling every draft from a top-K truncated distribution that is returned
sparse: exactly the distribution the verifier's rejection test needs, at a few kilobytes per round. A vanilla
Markov head runs as the fused sampler of :mod:`kernels.markov` (Triton on CUDA), eagerly and in the graph step
alike (``draft_service.sequential_head.sample_block_keyed``).

Randomness is a pure function of (request seed, absolute position) through :mod:`kernels.rng`, so a seeded request
drafts the same tokens whatever else shares the batch, on any replica. The engine knows nothing of Ray or gRPC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from draft_service.graphs import DraftGraphRunner, LaunchedDraft
from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import kernel_backend, sample_block_keyed
from kernels.graphs import DEFAULT_BUCKETS, DeviceDrafts, DeviceVerified, check_graph_mode
from kernels.sampling import SamplingParams
from kernels.slot_lookups import SlotLookups


class UnknownDraftRequestError(KeyError):
    """The request id is not (or no longer) held by this drafter."""


class ConfidenceCalibration(Protocol):
    """Maps raw confidence logits [R, gamma] to calibrated per-position confidences (e.g. STS)."""

    def calibrate(self, logits: np.ndarray) -> np.ndarray: ...


class ContextItem(NamedTuple):
    """Context features of positions ``start .. start + n - 1`` of one request (rows [n, m*H]).

    The per-request items of a round are NamedTuples: immutable like a frozen dataclass, and built several
    times per request and round at a third of its cost."""

    req_id: str
    start: int
    features: torch.Tensor


class ContextBatch(Sequence[ContextItem]):
    """Context rows of several requests in one tensor (``counts[i]`` rows of request i, back to back), standing
    for the list of :class:`ContextItem` it holds: a local drafter takes the tensor whole, anyone else indexes
    or iterates it like that list (features as views)."""

    def __init__(
        self,
        req_ids: list[str],
        starts: list[int],
        counts: list[int],
        features: torch.Tensor,
        arrays: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.starts = starts
        self.counts = counts
        self.features = features
        # (starts, counts) as int64 arrays when the sender has them (a verify step does): no conversion here.
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.req_ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        i = range(len(self))[index]
        offset = sum(self.counts[:i])
        return ContextItem(self.req_ids[i], self.starts[i], self.features[offset : offset + self.counts[i]])

    def __iter__(self):
        return map(ContextItem, self.req_ids, self.starts, self.features.split(self.counts))


class DraftItem(NamedTuple):
    """Draft a block after ``anchor`` sitting at absolute position ``position`` (= committed context length)."""

    req_id: str
    anchor: int
    position: int


class DraftBatch(Sequence[DraftItem]):
    """Draft items of several requests in array form (request ids, anchors and positions, int64 [R]), standing
    for the list of :class:`DraftItem` it holds: a local drafter reads the arrays, anyone else indexes or
    iterates it like that list (the items are made once, on first use)."""

    def __init__(self, req_ids: list[str], anchors: np.ndarray, positions: np.ndarray) -> None:
        if anchors.dtype != np.int64 or positions.dtype != np.int64:
            raise ValueError("a draft batch takes int64 arrays")
        self.req_ids = req_ids
        self.anchors = anchors
        self.positions = positions
        self._items: list[DraftItem] | None = None

    def __len__(self) -> int:
        return len(self.req_ids)

    def items(self) -> list[DraftItem]:
        if self._items is None:
            self._items = list(map(DraftItem, self.req_ids, self.anchors.tolist(), self.positions.tolist()))
        return self._items

    def __getitem__(self, index):
        return self.items()[index]

    def __iter__(self):
        return iter(self.items())


@dataclass(frozen=True)
class Proposal:
    """One round's drafts for R requests (rows in the order of the ``propose`` call).

    tokens [R, gamma] int64 on the host; confidences [R, gamma] float64 in [0, 1] (calibrated c_k, the
    scheduler's input) or None when the drafter has no confidence head; confidence_logits raw [R, gamma] (for
    online calibration); topk_ids / topk_probs [R, gamma, K] on the drafter's device: the sparse draft
    distribution each token was sampled from. With graphs, when every request is greedy (temperature 0: no
    verification reads its distribution), these are views of the step's static outputs, overwritten by the
    next ``propose``; otherwise fresh tensors.
    """

    req_ids: list[str]
    tokens: torch.Tensor
    confidences: np.ndarray | None
    confidence_logits: np.ndarray | None
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor


class PendingProposal:
    """A proposal being drafted (:meth:`DraftEngine.propose_start`): :meth:`result` waits for it, once.

    ``device_tokens``: on the graph path, the drafted ids where the draft step writes them on the device, for
    a verify step queued behind it (a chained round); None when the proposal was made eagerly."""

    def __init__(self, finish: Callable[[], Proposal], device_tokens: DeviceDrafts | None = None) -> None:
        self._finish: Callable[[], Proposal] | None = finish
        self._proposal: Proposal | None = None
        self.device_tokens = device_tokens

    def result(self) -> Proposal:
        if self._proposal is None:
            assert self._finish is not None
            self._proposal, self._finish = self._finish(), None
        return self._proposal


class _Behind(NamedTuple):
    """A draft step launched behind a verify step (:meth:`DraftEngine.propose_behind`): it appends that step's
    rows itself, so the append that reports them (same requests, starts and rows) only advances the lengths."""

    req_ids: tuple[str, ...]
    starts: np.ndarray
    rows_at: int  # the data pointer of the verify step's committed rows


@dataclass
class _Entry:
    slot: int
    params: SamplingParams
    seed: int


class DraftEngine:
    """Holds the drafter and the context cache of every request assigned to this replica.

    ``graphs``: how ``propose`` runs (:mod:`kernels.graphs`): ``off`` (eager), ``static`` (the bucketed
    CUDA-graph layout run eagerly; any device) or ``capture`` (one CUDA graph per bucket, replayed). The
    bucketed modes reserve one extra context slot (empty) for the padding requests. ``projected_context``: the
    kind of context rows the bucketed append expects, raw features [n, m*H] or rows the verifier already
    projected [n, H] (:mod:`draft_service.projection`); the other kind is appended eagerly.
    """

    def __init__(
        self,
        model: DSparkDraftModel,
        max_requests: int,
        max_seq_len: int,
        draft_top_k: int = 16,
        calibration: ConfidenceCalibration | None = None,
        *,
        graphs: str = "off",
        graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
        projected_context: bool = False,
    ) -> None:
        if draft_top_k < 1:
            raise ValueError("DraftEngine: draft_top_k must be >= 1 (the draft distribution is shipped sparse)")
        check_graph_mode(graphs, model.device)
        self.model = model
        self.max_requests = max_requests
        self.cache = model.new_context_cache(max_requests + (graphs != "off"), max_seq_len)
        self.draft_top_k = min(draft_top_k, model.real_vocab_size)
        self.calibration = calibration
        self._requests: dict[str, _Entry] = {}
        # Recent request lookups (entries, slots) by request ids, dropped when a request is added or released.
        self._lookups: SlotLookups[_Entry] = SlotLookups()
        # Per context slot, set when a request is added: the bucketed step gathers them with one index.
        self._slot_temperature = np.zeros(self.cache.num_slots, dtype=np.float32)
        self._slot_int = np.zeros((self.cache.num_slots, 2), dtype=np.int64)  # effective top-k, seed
        # The last request list's gathered per-slot arrays (read-only): (its read-only slots array, (temperature,
        # top-k and seed)), until a request is added or released (the only changes of the per-slot values).
        self._kept_sampling: tuple[np.ndarray, tuple[np.ndarray, np.ndarray]] | None = None
        # The requests of a draft step launched behind a verify step (propose_behind), their context lengths
        # before it and where the verify step's rows are, until append_context reports those rows.
        self._behind: _Behind | None = None
        self.graphs: DraftGraphRunner | None = None
        if graphs != "off":
            self.graphs = DraftGraphRunner(
                model,
                self.cache,
                dummy_slot=self.cache.reserve_last(),
                draft_top_k=self.draft_top_k,
                max_requests=max_requests,
                mode=graphs,
                buckets=graph_buckets,
                projected=projected_context,
            )

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def sampler_backend(self) -> str:
        """The fused Markov sampler's backend on the eager path: the graph runner's when there is one (so graphs
        on / off / static draft the same tokens), else the device's (:func:`kernel_backend`)."""
        return self.graphs.backend if self.graphs is not None else kernel_backend(self.model.device)

    @property
    def has_confidence_head(self) -> bool:
        return self.model.confidence_head is not None

    @property
    def num_free_slots(self) -> int:
        return self.max_requests - len(self._requests)

    def has(self, req_id: str) -> bool:
        return req_id in self._requests

    @property
    def running(self) -> list[str]:
        return list(self._requests)

    def add_request(self, req_id: str, params: SamplingParams) -> None:
        """Reserve a context slot. ``params`` must carry the same seed the verifier uses for this request."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already held by this drafter")
        slot = self.cache.allocate()
        self._requests[req_id] = _Entry(slot, params, params.seed or 0)
        self._lookups.clear()
        self._kept_sampling = None
        self._slot_temperature[slot] = params.temperature
        top_k = params.top_k
        k_eff = min(top_k, self.draft_top_k) if top_k > 0 else self.draft_top_k
        self._slot_int[slot] = (k_eff, params.seed or 0)

    def add_requests(self, requests: Sequence[tuple[str, SamplingParams]]) -> int:
        """:meth:`add_request` for each in order, until one does not fit (no free slot, or a duplicate id);
        returns how many were added (the round driver admits that prefix, the rest wait)."""
        for added, (req_id, params) in enumerate(requests):
            try:
                self.add_request(req_id, params)
            except ValueError:
                return added
        return len(requests)

    def release_many(self, req_ids: Sequence[str]) -> None:
        """:meth:`release` for each (the round driver frees a round's finished requests together)."""
        for req_id in req_ids:
            self.release(req_id)

    def release(self, req_id: str) -> None:
        """Free the request's context slot (idempotent)."""
        entry = self._requests.pop(req_id, None)
        self._behind = None
        if entry is not None:
            self._lookups.clear()
            self._kept_sampling = None
            if self.graphs is not None:
                self.graphs.drop(entry.slot)
            self.cache.release(entry.slot)

    def context_length(self, req_id: str) -> int:
        return self.cache.length(self._get(req_id).slot)

    def _get(self, req_id: str) -> _Entry:
        try:
            return self._requests[req_id]
        except KeyError:
            raise UnknownDraftRequestError(f"request {req_id!r} is not held by this drafter") from None

    def append_context(self, items: Sequence[ContextItem], projected: bool = False) -> None:
        """Append committed context features (``projected``: rows [n, H] the verifier already projected, else raw
        [n, m*H]). Replays are safe: rows already held from ``start`` on are replaced (the cache is cropped back
        to ``start`` first), and a gap (``start`` past the held length) is an error."""
        behind, self._behind = self._behind, None
        if not items:
            return
        num = len(items)
        config = self.model.config
        width = config.hidden_size if projected else config.context_feature_size
        req_ids: Sequence[str]
        features: Sequence[torch.Tensor]
        if isinstance(items, ContextBatch) and items.features.ndim == 2 and items.features.shape[1] == width:
            req_ids = items.req_ids
            if items.arrays is not None:
                starts, counts = items.arrays
            else:
                starts = np.array(items.starts, dtype=np.int64)
                counts = np.array(items.counts, dtype=np.int64)
            features = [items.features]
            total = int(counts.sum())
            if total != items.features.shape[0] or int(counts.min()) < 0:
                raise ValueError(f"context batch: counts {items.counts} do not cover {items.features.shape[0]} rows")
            _, slots, distinct = self._lookups.get_distinct(req_ids, self._entries)
            if (
                behind is not None
                and not projected
                and items.features.data_ptr() == behind.rows_at
                and tuple(req_ids) == behind.req_ids
                and np.array_equal(starts, behind.starts)
            ):  # the rows a draft step launched behind their verify step appended on the device
                self.cache.lengths_np[slots] = starts + counts
                return
            held = self.cache.lengths_np[slots]
            if bool((starts > held).any()):
                self._check_context(items, held, counts, width)
            if (
                self.graphs is not None
                and self.graphs.projected == projected
                and self._append_bucketed(req_ids, slots, starts, counts, features, total, distinct)
            ):
                return
            self._append_eager(slots, starts, counts, features, projected)
            return
        req_ids, item_starts, features = zip(*items, strict=True)  # NamedTuples: one transposition
        counts = np.fromiter(
            (s[0] if len(s) == 2 and s[1] == width else -1 for s in [f.shape for f in features]),
            dtype=np.int64,
            count=num,
        )
        slots = self._lookup(req_ids)[1]
        starts = np.fromiter(item_starts, dtype=np.int64, count=num)
        held = self.cache.lengths_np[slots]
        if bool((counts < 0).any()) or bool((starts > held).any()):
            self._check_context(items, held, counts, width)
        if (
            self.graphs is not None
            and self.graphs.projected == projected
            and self._append_bucketed(req_ids, slots, starts, counts, features, int(counts.sum()))
        ):
            return
        self._append_eager(slots, starts, counts, features, projected)

    @staticmethod
    def _check_context(items: Sequence[ContextItem], held: np.ndarray, counts: np.ndarray, width: int) -> None:
        """Raise the first error of context items the array checks found wrong (a gap, a wrong row width)."""
        for item, length, count in zip(items, held.tolist(), counts.tolist(), strict=True):
            if item.start > length:
                raise ValueError(f"request {item.req_id!r}: context rows from {length} to {item.start} are missing")
            if count < 0:
                raise ValueError(
                    f"request {item.req_id!r}: context features must be [n, {width}], got {tuple(item.features.shape)}"
                )

    @torch.no_grad()
    def _append_eager(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        features: Sequence[torch.Tensor],
        projected: bool,
    ) -> None:
        if self.graphs is not None:
            self.graphs.flush()
        for slot, start in zip(slots.tolist(), starts.tolist(), strict=True):
            self.cache.crop(slot, start)
        cu = np.concatenate([[0], np.cumsum(counts)]).tolist()
        rows = torch.cat([f.to(self.model.device) for f in features])
        self.model.append_context(self.cache, slots.tolist(), rows, cu, projected=projected)

    def _append_bucketed(
        self,
        req_ids: Sequence[str],
        slots: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        features: Sequence[torch.Tensor],
        total: int,
        distinct: bool | None = None,
    ) -> bool:
        """Append through the graph runner when the rows fit its buckets (the per-round appends; prefills do
        not). ``total``: counts.sum(); ``distinct``: whether the request ids are (None: not known). Checks
        everything before writing. Returns whether it did."""
        assert self.graphs is not None
        if not 0 < total <= self.graphs.max_append_rows:
            return False
        if not distinct and len(set(slots.tolist())) != slots.size:
            raise ValueError(f"duplicate requests in one context append: {list(req_ids)}")
        ends = starts + counts
        if bool((ends > self.cache.max_seq_len).any()):
            raise ValueError(
                f"context cache overflow: lengths {ends.tolist()} exceed max_seq_len {self.cache.max_seq_len}"
            )
        self.graphs.append(slots, starts, counts, features, total)
        self.cache.lengths_np[slots] = ends
        return True

    def _entries(self, req_ids: Sequence[str]) -> list[_Entry]:
        requests = self._requests
        try:
            return [requests[req_id] for req_id in req_ids]
        except KeyError:
            return [self._get(req_id) for req_id in req_ids]  # raises UnknownDraftRequestError

    def _lookup(self, req_ids: Sequence[str]) -> tuple[list[_Entry], np.ndarray]:
        """Entries and context slots (int64, read-only) of requests, kept per request list
        (:mod:`kernels.slot_lookups`: a round asks for the same lists several times)."""
        return self._lookups.get(req_ids, self._entries)

    def propose(self, items: Sequence[DraftItem]) -> Proposal:
        """Draft one block for every item in one batched backbone pass plus the sequential head."""
        return self.propose_start(items).result()

    def propose_start(self, items: Sequence[DraftItem]) -> PendingProposal:
        """:meth:`propose`, returning as soon as the drafting is queued on the device (graph path; the eager
        path drafts before it returns): the host may commit a round meanwhile. The engine can be used while it
        drafts; its next ``propose`` waits for this one first."""
        if not items:
            raise ValueError("propose needs at least one request")
        if self.graphs is not None:
            self.graphs.settle()
        req_ids: Sequence[str]
        anchors: np.ndarray | None
        positions: np.ndarray | None
        if isinstance(items, DraftBatch):
            req_ids, anchors, positions = items.req_ids, items.anchors, items.positions
        else:
            req_ids, item_anchors, item_positions = zip(*items, strict=True)  # NamedTuples: one transposition
            anchors = positions = None
        entries, slots, distinct = self._lookups.get_distinct(req_ids, self._entries)
        if self.graphs is not None and len(items) <= self.graphs.max_requests:
            # No grad-mode switch here: the graph step runs under no_grad itself (see VerifyEngine.step).
            num = len(items)
            if anchors is None or positions is None:  # both or neither
                anchors = np.fromiter(item_anchors, dtype=np.int64, count=num)
                positions = np.fromiter(item_positions, dtype=np.int64, count=num)
            return self._propose_bucketed(req_ids, slots, anchors, positions, distinct)
        eager = self._propose_eager(items.items() if isinstance(items, DraftBatch) else items, entries)
        return PendingProposal(lambda: eager)

    def propose_behind(
        self, req_ids: Sequence[str], starts: np.ndarray, verified: DeviceVerified, vocab_size: int
    ) -> PendingProposal | None:
        """Draft the next round for the requests of a verify step still queued on this device, from its outcome
        there (:meth:`DraftGraphRunner.launch_behind`): each request's committed rows are appended and the
        target's last emitted token is its anchor, with no host round trip between the two steps. ``starts``
        (int64 [R]): the verify step's anchor positions, which must be the requests' context lengths here;
        ``vocab_size``: a bound on the target's tokens. The context lengths advance when :meth:`append_context`
        reports the same rows from the verify step's results (then nothing is written again); the drafts'
        anchors and positions are the ones those results give. Returns None, launching nothing, when the step
        cannot run so: no graph path, too many requests, a repeated or unknown request, context rows of
        another kind or on another device, a context length other than ``starts``, no room for a whole block,
        or target tokens outside the drafter's vocabulary."""
        graphs = self.graphs
        features = verified.features
        if (
            graphs is None
            or graphs.projected
            or not req_ids
            or len(req_ids) > graphs.max_requests
            or vocab_size > self.model.real_vocab_size
            or features.device != self.model.device
            or features.shape[1] != self.model.config.context_feature_size
        ):
            return None
        try:
            _, slots, distinct = self._lookups.get_distinct(req_ids, self._entries)
        except UnknownDraftRequestError:
            return None
        if (
            not distinct
            or not np.array_equal(self.cache.lengths_np[slots], starts)
            or int(starts.max()) + self.block_size + 1 > self.cache.max_seq_len
        ):
            return None
        graphs.settle()
        launched = graphs.launch_behind(slots, starts, *self._slot_sampling(slots), verified)
        self._behind = _Behind(tuple(req_ids), starts.copy(), features.data_ptr())
        return self._pending(req_ids, launched)

    @torch.no_grad()
    def _propose_eager(self, items: Sequence[DraftItem], entries: Sequence[_Entry]) -> Proposal:
        if self.graphs is not None:
            self.graphs.flush()
        device = self.model.device
        anchors = torch.tensor([item.anchor for item in items], dtype=torch.int64, device=device)
        positions = torch.tensor([item.position for item in items], dtype=torch.int64)
        slots = [e.slot for e in entries]
        hidden = self.model.draft_block(anchors, positions, slots, self.cache)
        # The per-slot parameters the bucketed step reads too (effective top-k, seed).
        k_eff, seeds = torch.from_numpy(self._slot_int[slots]).to(device).unbind(1)
        sample = sample_block_keyed(
            self.model,
            hidden,
            anchors,
            temperature=torch.from_numpy(self._slot_temperature[slots]).to(device),
            k_eff=k_eff,
            seeds=seeds,
            positions=positions.to(device),
            draft_top_k=self.draft_top_k,
            backend=self.sampler_backend,
            validate=True,
        )
        conf_logits = None if sample.confidence_logits is None else sample.confidence_logits.double().cpu().numpy()
        assert sample.topk_ids is not None and sample.topk_probs is not None  # draft_top_k >= 1
        req_ids = [item.req_id for item in items]
        return self._proposal(req_ids, sample.tokens.cpu(), conf_logits, sample.topk_ids, sample.topk_probs)

    def _propose_bucketed(
        self,
        req_ids: Sequence[str],
        slots: np.ndarray,
        anchors: np.ndarray,
        positions: np.ndarray,
        distinct: bool,
    ) -> PendingProposal:
        """The graph runner's path: the checks of ``draft_block`` on the host, then one bucketed step."""
        assert self.graphs is not None
        vocab = self.model.real_vocab_size
        if int(anchors.view(np.uint64).max()) >= vocab:  # a negative id is huge as uint64
            raise ValueError(f"anchor_ids outside the vocabulary [0, {vocab}): {anchors.tolist()}")
        lengths = self.cache.lengths_np[slots]
        if not bool((lengths == positions).all()):
            raise ValueError(
                f"context cache lengths {lengths.tolist()} must equal anchor positions {positions.tolist()}: append "
                f"the context rows 0..start-1 before drafting"
            )
        graphs = self.graphs
        launched = graphs.launch(anchors, positions, slots, *self._slot_sampling(slots), distinct=distinct)
        return self._pending(req_ids, launched)

    def _pending(self, req_ids: Sequence[str], launched: LaunchedDraft) -> PendingProposal:
        """A launched graph step's drafts as a proposal to wait for."""
        graphs = self.graphs
        assert graphs is not None

        def finish() -> Proposal:
            out = graphs.collect(launched)
            return self._proposal(req_ids, out.tokens, out.confidence_logits, out.topk_ids, out.topk_probs)

        return PendingProposal(finish, launched.tokens)

    def _slot_sampling(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Temperature (float32 [R]) and effective top-k and seed (int64 [R, 2]) of the slots, read-only; kept for
        a kept lookup's (read-only) slots array, so that the graph runner keeps its staged copy too."""
        kept = self._kept_sampling
        if kept is not None and kept[0] is slots:
            return kept[1]
        temperature, ints = self._slot_temperature[slots], self._slot_int[slots]
        temperature.flags.writeable = ints.flags.writeable = False
        if not slots.flags.writeable:
            self._kept_sampling = (slots, (temperature, ints))
        return temperature, ints

    def _proposal(
        self,
        req_ids: Sequence[str],
        tokens: torch.Tensor,
        conf_logits: np.ndarray | None,
        topk_ids: torch.Tensor,
        topk_probs: torch.Tensor,
    ) -> Proposal:
        confidences = None
        if conf_logits is not None:
            confidences = (
                self.calibration.calibrate(conf_logits)
                if self.calibration is not None
                else 1.0 / (1.0 + np.exp(-conf_logits))
            )
        return Proposal(
            req_ids=list(req_ids),
            tokens=tokens,
            confidences=confidences,
            confidence_logits=conf_logits,
            topk_ids=topk_ids,
            topk_probs=topk_probs,
        )
