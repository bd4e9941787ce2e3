"""The verify engine: one target model, many requests, one ragged forward pass per step.

Each step takes two kinds of work and runs them in ONE target pass:

* prefill items: a new (or re-homed) request's tokens; the pass fills its KV slot, returns the context features of
  every token (the drafter's context), and samples the first new token, which becomes the request's anchor;
* verify items: a running request's ``[anchor, x_1..x_l]`` (``l`` chosen by the scheduler, 0 allowed); rejection
  sampling accepts a prefix of the drafts and emits one correction or bonus token; the KV entries of rejected
  drafts are rolled back and the context features of the committed tokens (anchor + accepted drafts) returned.

Why slots (see :mod:`verify_service.kv_cache`): every request owns a pre-allocated slot, so admission is a free-slot
check, rollback is a length update and shapes stay static for CUDA graphs. The engine knows nothing of Ray, gRPC or
the scheduler; it validates its inputs and raises ``ValueError`` subclasses before touching any cache, so a bad
item never corrupts the running requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kernels.graphs import DEFAULT_BUCKETS, DeviceDrafts, DeviceVerified, check_graph_mode
from kernels.rejection import RejectionOutput, rejection_sample_reference
from kernels.sampling import SamplingParams
from kernels.slot_lookups import SlotLookups
from verify_service.graphs import GraphItem, VerifyGraphRunner
from verify_service.kv_cache import KVCapacityError, NoFreeSlotError

if TYPE_CHECKING:  # a type only: the scheduler imports the item types without loading transformers
    from verify_service.target import TargetModel


class UnknownRequestError(KeyError):
    """The request id is not (or no longer) held by this engine: finished, aborted or never added."""


@dataclass(frozen=True)
class PrefillItem:
    """Tokens to load into a fresh slot. ``anchor`` set = re-prefill after a failover: the anchor is already
    known (the last token the client saw), so nothing is sampled and the request resumes where it was."""

    req_id: str
    token_ids: Sequence[int]
    params: SamplingParams
    anchor: int | None = None


class VerifyItem(NamedTuple):
    """A running request's anchor and the drafts the scheduler admitted, with the exact draft distribution
    (sparse: ``draft_prob_ids``/``draft_probs`` of shape [l, K]) those drafts were sampled from. Greedy requests
    may leave the distribution out. ``position``, when given, is where the sender believes the anchor sits (the
    committed context length): a stale or replayed round is refused instead of being applied twice.
    A NamedTuple like the other per-request items of a round (see ``draft_service.engine.ContextItem``)."""

    req_id: str
    anchor: int
    draft_tokens: Sequence[int]
    draft_prob_ids: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    position: int | None = None


class VerifyBatch(Sequence[VerifyItem]):
    """The verify items of several requests in array form, standing for the list of :class:`VerifyItem` it
    holds: a local verifier reads the arrays (no item, list or conversion per request), anyone else indexes or
    iterates it like that list (the items are made once, on first use).

    Request i: ``anchors[i]`` at ``positions[i]`` and its first ``num_drafts[i]`` drafts of ``drafts[i]``
    (int64 [R] / [R] / [R, gamma] / [R]); ``sampled`` lists the requests whose drafts come with their
    distribution, rows of ``topk_ids`` / ``topk_probs`` [R, gamma, K] (the rest: None, as a greedy request's)."""

    def __init__(
        self,
        req_ids: list[str],
        anchors: np.ndarray,
        positions: np.ndarray,
        drafts: np.ndarray,
        num_drafts: np.ndarray,
        sampled: Sequence[int] = (),
        topk_ids: torch.Tensor | None = None,
        topk_probs: torch.Tensor | None = None,
    ) -> None:
        if any(a.dtype != np.int64 for a in (anchors, positions, drafts, num_drafts)) or drafts.ndim != 2:
            raise ValueError("a verify batch takes int64 arrays (drafts [R, gamma])")
        if num_drafts.size and not 0 <= int(num_drafts.min()) <= int(num_drafts.max()) <= drafts.shape[1]:
            raise ValueError(f"draft counts {num_drafts.tolist()} outside [0, {drafts.shape[1]}]")
        if sampled and (topk_ids is None or topk_probs is None):
            raise ValueError("sampled requests need the draft distributions")
        self.req_ids = req_ids
        self.anchors = anchors
        self.positions = positions
        self.drafts = drafts
        self.num_drafts = num_drafts
        self.sampled = sampled
        self.topk_ids = topk_ids
        self.topk_probs = topk_probs
        self._items: list[VerifyItem] | None = None

    def __len__(self) -> int:
        return len(self.req_ids)

    def items(self) -> list[VerifyItem]:
        """The items (made once): draft tokens as lists of ints, distributions as row views."""
        if self._items is None:
            block = self.drafts.shape[1]
            num_drafts = self.num_drafts.tolist()
            items = [
                VerifyItem(req_id, anchor, drafts if n == block else drafts[:n], None, None, position)
                for req_id, anchor, drafts, n, position in zip(
                    self.req_ids,
                    self.anchors.tolist(),
                    self.drafts.tolist(),
                    num_drafts,
                    self.positions.tolist(),
                    strict=True,
                )
            ]
            if self.sampled:
                assert self.topk_ids is not None and self.topk_probs is not None
                prob_ids, probs = self.topk_ids.unbind(0), self.topk_probs.unbind(0)
                for i in self.sampled:
                    n, ids, p = num_drafts[i], prob_ids[i], probs[i]
                    if n < block:
                        ids, p = ids[:n], p[:n]
                    items[i] = items[i]._replace(draft_prob_ids=ids, draft_probs=p)
            self._items = items
        return self._items

    def __getitem__(self, index):
        return self.items()[index]

    def __iter__(self):
        return iter(self.items())


class StepResult(NamedTuple):
    """What one request got from a step.

    ``tokens``: newly emitted tokens (accepted drafts, then the correction/bonus token; after a prefill, the first
    token; empty for a re-prefill). ``features``: context features of positions ``feature_start ..`` that the
    drafter must append (prompt tokens after a prefill; anchor + accepted drafts after a verify).
    """

    req_id: str
    num_drafts: int
    num_accepted: int
    tokens: list[int]
    feature_start: int
    features: torch.Tensor | None


class StepResults(Sequence[StepResult]):
    """The results of one bucketed step in array form, standing for the list of :class:`StepResult` it
    holds: indexing and iterating build those (features as views of one tensor), while the round driver reads
    the columns and hands ``features`` on whole, without a view, an item or a copy per request.

    ``features`` is a view of the graph step's output, valid until the engine's next step (which overwrites it
    when the step is a captured graph): consume it (copy it, or queue device work reading it) before then."""

    def __init__(
        self,
        req_ids: list[str],
        num_drafts: list[int],
        num_accepted: list[int],
        tokens: list[list[int]],
        feature_starts: list[int],
        features: torch.Tensor | None,
        feature_counts: list[int] | None = None,
        arrays: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.num_drafts = num_drafts
        self.num_accepted = num_accepted
        self.tokens = tokens
        self.feature_starts = feature_starts
        self.features = features  # the committed rows of every request back to back (1 + num_accepted each)
        self.feature_counts = [1 + a for a in num_accepted] if feature_counts is None else feature_counts
        # (feature_starts, feature_counts) as int64 arrays, when the step has them (a local drafter takes them).
        self.arrays = arrays

    @classmethod
    def of(cls, results: Sequence[StepResult]) -> StepResults:
        """``results`` in array form (itself when it is one already). Every result carries features or none
        does (an engine's step gives them for all its requests or for none); the rows are concatenated once."""
        if isinstance(results, StepResults):
            return results
        rows = [r.features for r in results]
        with_features = [f for f in rows if f is not None]
        if with_features and len(with_features) != len(rows):
            raise ValueError("some step results carry context features and others none")
        return cls(
            [r.req_id for r in results],
            [r.num_drafts for r in results],
            [r.num_accepted for r in results],
            [r.tokens for r in results],
            [r.feature_start for r in results],
            torch.cat(with_features) if with_features else None,
            [int(f.shape[0]) for f in with_features] if with_features else None,
        )

    def __len__(self) -> int:
        return len(self.req_ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        i = range(len(self))[index]
        rows = None
        if self.features is not None:
            offset = sum(self.feature_counts[:i])
            rows = self.features[offset : offset + self.feature_counts[i]]
        return StepResult(
            self.req_ids[i], self.num_drafts[i], self.num_accepted[i], self.tokens[i], self.feature_starts[i], rows
        )

    def __iter__(self):
        rows = [None] * len(self) if self.features is None else self.features.split(self.feature_counts)
        return map(StepResult, self.req_ids, self.num_drafts, self.num_accepted, self.tokens, self.feature_starts, rows)


class ChainedVerify(NamedTuple):
    """A chained verify step queued on the device (:meth:`VerifyEngine.start_chained`): ``results`` waits for
    its :class:`StepResults`; ``on_device`` is its outcome where the device has it (None without feature
    layers), for the next round's draft step queued behind it."""

    results: Callable[[], StepResults]
    on_device: DeviceVerified | None


@dataclass
class _Slot:
    slot: int
    params: SamplingParams
    seed: int
    greedy: bool


@dataclass(frozen=True)
class _CheckedVerifies:
    """What validating a step's verify items found out, reused by the run (no second lookup per request)."""

    req_ids: tuple[str, ...]
    entries: list[_Slot]
    slots: np.ndarray  # int64 [R]
    lengths: np.ndarray  # int64 [R]: cached length = the anchor's position
    num_drafts: np.ndarray  # int64 [R]
    tokens: np.ndarray  # int64: the R anchors, then every request's drafts back to back
    any_distribution: bool  # whether some item carries a draft distribution


_NONE_TYPE = {type(None)}


class VerifyEngine:
    """Holds the target and the KV cache of every running request on this replica.

    ``graphs``: how steps run (:mod:`kernels.graphs`): ``off`` (eager), ``static`` (the token-bucketed CUDA-graph
    layout of :mod:`verify_service.graphs` run eagerly; any device) or ``capture`` (one CUDA graph per bucket,
    replayed). A step takes the graph path when it fits a bucket: every verify-only step of up to
    ``max_requests`` requests, and steps with joining prompts whose tokens fit the room left by the verify chunks
    plus ``graph_prefill_rows``; larger steps run eagerly. The bucketed modes need ``max_drafts`` (the drafter's
    block size gamma) and ``draft_top_k`` (the widest sparse draft distribution) and reserve one extra KV slot as
    the padding slot.
    """

    def __init__(
        self,
        target: TargetModel,
        max_requests: int,
        max_seq_len: int,
        use_triton: bool | None = None,
        *,
        graphs: str = "off",
        max_drafts: int | None = None,
        draft_top_k: int = 16,
        graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
        graph_prefill_rows: int = 0,
    ) -> None:
        if max_requests < 1 or max_seq_len < 2:
            raise ValueError("VerifyEngine: max_requests must be >= 1 and max_seq_len >= 2")
        if max_seq_len > target.max_context_len:
            raise ValueError(
                f"VerifyEngine: max_seq_len {max_seq_len} exceeds the target's context limit {target.max_context_len}"
            )
        check_graph_mode(graphs, target.device)
        self.target = target
        self.cache = target.new_kv_cache(max_requests + (graphs != "off"), max_seq_len)
        self.max_seq_len = max_seq_len
        self._requests: dict[str, _Slot] = {}
        # Recent request lookups (entries, slots) by request ids, dropped when a request is added or released.
        self._lookups: SlotLookups[_Slot] = SlotLookups()
        # Sampling parameters per KV slot, set at admission: the bucketed step gathers them with one index.
        self._sampling_float = np.zeros((self.cache.num_slots, 2), dtype=np.float32)  # temperature, top_p
        self._sampling_int = np.zeros((self.cache.num_slots, 2), dtype=np.int64)  # top_k, seed
        self._sampling_float[:, 1] = 1.0
        self._slot_greedy = np.ones(self.cache.num_slots, dtype=bool)
        # The last request list's gathered sampling parameters: (its read-only slots array, (float [R, 2] and
        # int [R, 2] read-only, all greedy)); a kept lookup's slots array is the same object every round.
        self._kept_sampling: tuple[np.ndarray, tuple[np.ndarray, np.ndarray, bool]] | None = None
        if use_triton is None:
            use_triton = target.device.type == "cuda"
        self._sampler = _triton_sampler() if use_triton else rejection_sample_reference
        self.graphs: VerifyGraphRunner | None = None
        if graphs != "off":
            if max_drafts is None or max_drafts < 1:
                raise ValueError(f"VerifyEngine: graphs={graphs!r} needs max_drafts >= 1 (the block size)")
            self.graphs = VerifyGraphRunner(
                target,
                self.cache,
                dummy_slot=self.cache.reserve_last(),
                max_drafts=max_drafts,
                draft_top_k=draft_top_k,
                max_requests=max_requests,
                mode=graphs,
                sampler=self._sampler,
                buckets=graph_buckets,
                prefill_rows=graph_prefill_rows,
            )

    # ----------------------------------------------------------------------------------------- bookkeeping
    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.target.eos_token_ids

    @property
    def num_free_slots(self) -> int:
        return self.cache.num_free_slots

    @property
    def running(self) -> list[str]:
        return list(self._requests)

    def has(self, req_id: str) -> bool:
        return req_id in self._requests

    def slot_of(self, req_id: str) -> int:
        """The KV slot the request holds (for callers that build graph items themselves, e.g. SPS profiling)."""
        return self._get(req_id).slot

    def context_length(self, req_id: str) -> int:
        """Tokens held in the request's KV slot (the anchor's position)."""
        return self.cache.length(self.slot_of(req_id))

    def release_many(self, req_ids: Sequence[str]) -> None:
        """:meth:`release` for each (the round driver frees a round's finished requests together)."""
        for req_id in req_ids:
            self.release(req_id)

    def release(self, req_id: str) -> None:
        """Free the request's slot at once (finish, abort, disconnect). Unknown ids are ignored: release is
        idempotent so that an abort racing a natural finish is harmless."""
        entry = self._requests.pop(req_id, None)
        if entry is not None:
            self._lookups.clear()
            self._kept_sampling = None
            self.cache.free(entry.slot)

    def _get(self, req_id: str) -> _Slot:
        try:
            return self._requests[req_id]
        except KeyError:
            raise UnknownRequestError(f"request {req_id!r} is not running on this verifier") from None

    # ------------------------------------------------------------------------------------------- the step
    # No grad-mode switch around the bucketed path: the graph steps run under no_grad themselves and the host
    # code around them only copies their outputs (a decorator costs microseconds every round).
    def step(self, prefills: Sequence[PrefillItem] = (), verifies: Sequence[VerifyItem] = ()) -> Sequence[StepResult]:
        """Run prefills and verifications in one target pass; results follow the order prefills, then verifies
        (a list, or :class:`StepResults` for a bucketed step)."""
        if not prefills and not verifies:
            return []
        checked = self._validate(prefills, verifies)
        bucketed = self._bucketed(prefills, verifies, checked)
        if bucketed and not prefills:
            return self._run_bucketed(prefills, verifies, checked, bucketed if isinstance(bucketed, tuple) else None)
        new_slots = self._allocate(prefills)
        try:
            if bucketed:
                return self._run_bucketed(prefills, verifies, checked)
            return self._run(prefills, verifies)
        except Exception:
            for req_id in new_slots:
                self.release(req_id)
            raise

    def decode(
        self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem], steps: Sequence[int]
    ) -> list[StepResult]:
        """Plain decoding, several tokens per call: one :meth:`step` of the prefills and ``verifies`` (no drafts),
        then request i of ``verifies`` decodes ``steps[i] - 1`` more tokens, one target pass per step for every
        request that still has steps, each anchored at its last token. Results as :meth:`step`'s, with each
        verification's tokens of all its steps and no features (a caller that drafts needs every step's rows:
        it decodes one step per call). The tokens are the ones the same number of one-step calls would give (the
        same passes, randomness keyed by request and position), so a caller that stops a request early (a stop
        token or string) just drops the rest; the caller caps ``steps`` by the tokens a request may still emit
        and its slot's room, as it caps drafts."""
        if len(steps) != len(verifies) or any(n < 1 for n in steps):
            raise ValueError(f"decode: one step count >= 1 per verification, got {list(steps)}")
        if any(len(v.draft_tokens) for v in verifies):
            raise ValueError("decode: plain decoding verifies no drafts")
        first = self.step(prefills, verifies)
        results = [r._replace(features=None) for r in first]
        done = len(prefills)
        active = [i for i, n in enumerate(steps) if n > 1]
        for k in range(1, max(steps, default=1)):
            active = [i for i in active if steps[i] > k]
            items = []
            for i in active:
                r = results[done + i]
                items.append(VerifyItem(r.req_id, r.tokens[-1], (), None, None, r.feature_start + len(r.tokens)))
            for i, r in zip(active, self.step((), items), strict=True):
                mine = results[done + i]
                results[done + i] = mine._replace(tokens=[*mine.tokens, *r.tokens])
        return results

    def _validate(self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem]) -> _CheckedVerifies:
        req_ids = [item.req_id for item in prefills]
        req_ids += verifies.req_ids if isinstance(verifies, VerifyBatch) else [item.req_id for item in verifies]
        if len(set(req_ids)) != len(req_ids):
            seen: set[str] = set()
            for req_id in req_ids:
                if req_id in seen:
                    raise ValueError(f"request {req_id!r} appears twice in one step")
                seen.add(req_id)
        vocab = self.target.vocab_size
        for p in prefills:
            if p.req_id in self._requests:
                raise ValueError(f"request {p.req_id!r} is already running on this verifier")
            if len(p.token_ids) == 0:
                raise ValueError(f"request {p.req_id!r}: empty prompt")
            _check_ids(p.req_id, p.token_ids, vocab)
            extra = 0 if p.anchor is None else 1
            if len(p.token_ids) + extra + 1 > self.max_seq_len:
                raise KVCapacityError(
                    f"request {p.req_id!r}: {len(p.token_ids)} prompt tokens exceed the context limit "
                    f"{self.max_seq_len - 1}"
                )
            if p.anchor is not None:
                _check_ids(p.req_id, [p.anchor], vocab)
        checked = self._check_verifies(verifies)
        if len(prefills) > self.cache.num_free_slots:
            raise NoFreeSlotError(f"{len(prefills)} new requests but only {self.cache.num_free_slots} free KV slots")
        return checked

    def _check_verifies(self, verifies: Sequence[VerifyItem]) -> _CheckedVerifies:
        """Every verify item checked at once (array checks); on any doubt the item-by-item check runs and raises
        the first error exactly as it would alone."""
        num = len(verifies)
        if not num:
            empty = np.zeros(0, dtype=np.int64)
            return _CheckedVerifies((), [], empty, empty, empty, empty, False)
        if isinstance(verifies, VerifyBatch):
            return self._check_verify_batch(verifies)
        req_ids, anchors, drafts, _, dists, positions = zip(*verifies, strict=True)  # NamedTuples: one transposition
        try:
            entries, slots = self._lookup(req_ids)
        except KeyError:
            self._check_verifies_one_by_one(verifies)  # raises UnknownRequestError
            raise
        lengths = self.cache.lengths_unchecked(slots)  # the slots of held requests: allocated
        num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=num)
        tokens = self._valid_tokens(verifies, anchors, drafts, positions, slots, lengths, num_drafts)
        if tokens is None:
            self._check_verifies_one_by_one(verifies)
            tokens = np.array([*anchors, *itertools.chain.from_iterable(drafts)], dtype=np.int64)
        any_distribution = not set(map(type, dists)) <= _NONE_TYPE  # C-level: no generator step per item
        return _CheckedVerifies(req_ids, entries, slots, lengths, num_drafts, tokens, any_distribution)

    def _check_verify_batch(self, batch: VerifyBatch) -> _CheckedVerifies:
        """:meth:`_check_verifies` of items in array form: the same checks on the arrays; on any doubt the
        item-by-item check of the items it stands for raises the first error exactly as for a list."""
        req_ids = tuple(batch.req_ids)
        try:
            entries, slots = self._lookup(req_ids)
        except KeyError:
            self._check_verifies_one_by_one(batch)  # raises UnknownRequestError
            raise
        lengths = self.cache.lengths_unchecked(slots)
        num_drafts = batch.num_drafts
        tokens = None
        if self._fits_at(lengths, num_drafts, batch.positions) and self._distributions_fit(batch, slots):
            drafts = batch.drafts
            if int(num_drafts.min()) == drafts.shape[1]:
                drafts = drafts.reshape(-1)
            else:
                drafts = drafts[np.arange(drafts.shape[1]) < num_drafts[:, None]]  # row after row
            tokens = np.concatenate((batch.anchors, drafts))
            if int(tokens.view(np.uint64).max()) >= self.target.vocab_size:  # a negative id is huge as uint64
                tokens = None
        if tokens is None:
            self._check_verifies_one_by_one(batch)
            items = batch.items()
            tokens = np.array(
                [*(v.anchor for v in items), *itertools.chain.from_iterable(v.draft_tokens for v in items)],
                dtype=np.int64,
            )
        return _CheckedVerifies(req_ids, entries, slots, lengths, num_drafts, tokens, bool(batch.sampled))

    def _fits_at(self, lengths: np.ndarray, num_drafts: np.ndarray, positions: np.ndarray) -> bool:
        """Whether every request's anchor sits where the sender believes (its cached length) and its slot has
        room for the anchor and its drafts (array checks; [R] each, same shape)."""
        return int((lengths + num_drafts).max()) < self.cache.max_seq_len and bool((positions == lengths).all())

    def _lookup(self, req_ids: tuple[str, ...]) -> tuple[list[_Slot], np.ndarray]:
        """Entries and KV slots (int64, read-only) of a step's verify requests, kept per request list
        (:mod:`kernels.slot_lookups`); raises KeyError for an unknown one."""
        requests = self._requests
        return self._lookups.get(req_ids, lambda ids: [requests[req_id] for req_id in ids])

    def _slot_sampling(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """(temperature, top_p) float32 [R, 2], (top_k, seed) int64 [R, 2] (both read-only) of the slots, and
        whether all are greedy; kept for a kept lookup's (read-only) slots array until a request is added or
        released (the only changes of the per-slot parameters). Read-only: the graph runner then keeps the
        staged copy of them too."""
        kept = self._kept_sampling
        if kept is not None and kept[0] is slots:
            return kept[1]
        sampling_float, sampling_int = self._sampling_float[slots], self._sampling_int[slots]
        sampling_float.flags.writeable = sampling_int.flags.writeable = False
        derived = (sampling_float, sampling_int, bool(self._slot_greedy[slots].all()))
        if not slots.flags.writeable:
            self._kept_sampling = (slots, derived)
        return derived

    def _valid_tokens(
        self,
        verifies: Sequence[VerifyItem],
        anchors: Sequence[int],
        drafts: Sequence[Sequence[int]],
        positions: Sequence[int | None],
        slots: np.ndarray,
        lengths: np.ndarray,
        num_drafts: np.ndarray,
    ) -> np.ndarray | None:
        """The array form of :meth:`_check_verifies_one_by_one`: the anchors then all drafts as one int64 array
        when that check would pass, else None."""
        if int((lengths + num_drafts).max()) >= self.cache.max_seq_len:  # the anchor needs a row too
            return None
        held = tuple(lengths.tolist())
        if None in positions:
            if any(p is not None and p != length for p, length in zip(positions, held, strict=True)):
                return None
        elif positions != held:
            return None
        if not self._distributions_fit(verifies, slots):
            return None
        flat = [*anchors, *itertools.chain.from_iterable(drafts)]  # one list: typed, then converted in C
        if not all(kind is int or _is_int_type(kind) for kind in set(map(type, flat))):
            return None
        try:
            tokens = np.array(flat, dtype=np.int64)
        except OverflowError:
            return None
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.target.vocab_size:
            return None
        return tokens

    def _distributions_fit(self, verifies: Sequence[VerifyItem], slots: np.ndarray) -> bool:
        """Whether every sampled request's drafts come with a distribution of their shape (all greedy: yes)."""
        if self._slot_sampling(slots)[2]:
            return True
        for v, greedy in zip(verifies, self._slot_greedy[slots].tolist(), strict=True):
            if greedy or not len(v.draft_tokens):
                continue
            if v.draft_prob_ids is None or v.draft_probs is None:
                return False
            shape = v.draft_prob_ids.shape
            if shape[:1] != (len(v.draft_tokens),) or v.draft_probs.shape != shape:
                return False
        return True

    def _check_verifies_one_by_one(self, verifies: Sequence[VerifyItem]) -> None:
        vocab = self.target.vocab_size
        for v in verifies:
            entry = self._get(v.req_id)
            if v.position is not None and v.position != self.cache.length(entry.slot):
                raise ValueError(
                    f"request {v.req_id!r}: the round is for anchor position {v.position} but the request is at "
                    f"{self.cache.length(entry.slot)} (a stale or replayed round)"
                )
            _check_ids(v.req_id, [v.anchor, *v.draft_tokens], vocab)
            self.cache.check_extend(entry.slot, len(v.draft_tokens) + 1)
            if not entry.params.greedy and len(v.draft_tokens):
                if v.draft_prob_ids is None or v.draft_probs is None:
                    raise ValueError(f"request {v.req_id!r}: sampled drafts need their draft distribution")
                expected = (len(v.draft_tokens),)
                if v.draft_prob_ids.shape[:1] != expected or v.draft_probs.shape != v.draft_prob_ids.shape:
                    raise ValueError(
                        f"request {v.req_id!r}: draft distribution shape {tuple(v.draft_probs.shape)} / "
                        f"{tuple(v.draft_prob_ids.shape)} does not match {len(v.draft_tokens)} drafts"
                    )

    def _allocate(self, prefills: Sequence[PrefillItem]) -> list[str]:
        for p in prefills:
            params = p.params.with_seed()
            slot = self.cache.allocate()
            self._requests[p.req_id] = _Slot(slot, params, params.seed or 0, params.greedy)
            self._lookups.clear()
            self._kept_sampling = None
            self._sampling_float[slot] = (params.temperature, params.top_p)
            self._sampling_int[slot] = (params.top_k, params.seed or 0)
            self._slot_greedy[slot] = params.greedy
        return [p.req_id for p in prefills]

    @torch.no_grad()
    def _run(self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem]) -> list[StepResult]:
        device = self.target.device
        chunks: list[tuple[int, Sequence[int]]] = []
        starts: list[int] = []
        for p in prefills:
            entry = self._requests[p.req_id]
            chunks.append((entry.slot, list(p.token_ids)))
            starts.append(0)
        for v in verifies:
            entry = self._requests[v.req_id]
            chunks.append((entry.slot, [v.anchor, *v.draft_tokens]))
            starts.append(self.cache.length(entry.slot))
        batch = self.target.prepare(self.cache, chunks)
        cu = batch.cu_seqlens.tolist()
        # Rows scored by the sampler: the last prompt row of a (sampling) prefill, every row of a verify chunk.
        sample_rows: list[int] = []
        sampled_prefills = [p for p in prefills if p.anchor is None]
        for i, p in enumerate(prefills):
            if p.anchor is None:
                sample_rows.append(cu[i + 1] - 1)
        for j in range(len(verifies)):
            i = len(prefills) + j
            sample_rows.extend(range(cu[i], cu[i + 1]))
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=device)
        out = self.target.forward(self.cache, batch, logits_rows=rows)
        sampled = self._sample(out.logits, sampled_prefills, verifies, starts[len(prefills) :])
        results: list[StepResult] = []
        per_request = iter(sampled)
        for i, p in enumerate(prefills):
            features = None if out.features is None else out.features[cu[i] : cu[i + 1]]
            tokens = [] if p.anchor is not None else next(per_request)
            results.append(StepResult(p.req_id, 0, 0, tokens, 0, features))
        for j, v in enumerate(verifies):
            i = len(prefills) + j
            tokens = next(per_request)
            accepted = len(tokens) - 1
            start = starts[i]
            self.cache.truncate(self._requests[v.req_id].slot, start + 1 + accepted)
            features = None if out.features is None else out.features[cu[i] : cu[i] + 1 + accepted]
            results.append(StepResult(v.req_id, len(v.draft_tokens), accepted, tokens, start, features))
        return results

    def _bucketed(
        self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem], checked: _CheckedVerifies
    ) -> bool | tuple[int, int]:
        """Whether the step takes the graph path (for a verify-only step without distributions: its bucket)."""
        if self.graphs is None:
            return False
        if not prefills and not checked.any_distribution:  # the common round: array checks only, its bucket
            return self.graphs.verify_bucket(checked.num_drafts, 0) or False
        widths = (
            [int(v.draft_probs.shape[1]) for v in verifies if v.draft_probs is not None and len(v.draft_tokens)]
            if checked.any_distribution
            else []
        )
        lengths = [(len(p.token_ids), True) for p in prefills]
        lengths += [(1 + n, False) for n in checked.num_drafts.tolist()]
        return self.graphs.fits(lengths, max(widths, default=0))

    def _run_bucketed(
        self,
        prefills: Sequence[PrefillItem],
        verifies: Sequence[VerifyItem],
        checked: _CheckedVerifies,
        key: tuple[int, int] | None = None,
    ) -> Sequence[StepResult]:
        """A step through the ragged graph runner (same results as ``_run``): :class:`StepResults` for a
        verify-only step, a list (prefills first) when prompts join; the prefills' slots are allocated already."""
        assert self.graphs is not None
        if not prefills:
            return self._run_bucketed_verify(verifies, checked, key)
        slots = checked.slots
        num_drafts = checked.num_drafts.tolist()
        lengths = checked.lengths.tolist()
        sampling_float = self._sampling_float[slots].tolist()
        sampling_int = self._sampling_int[slots].tolist()
        tokens = checked.tokens.tolist()
        num = len(verifies)
        items = []
        for p in prefills:
            entry = self._requests[p.req_id]
            items.append(
                GraphItem(entry.slot, 0, list(p.token_ids), _params(entry), prefill=True, sample=p.anchor is None)
            )
        offset = num
        for r, (v, e) in enumerate(zip(verifies, checked.entries, strict=True)):
            n = num_drafts[r]
            dist = (
                None
                if e.greedy or v.draft_probs is None or v.draft_prob_ids is None or not n
                else (v.draft_prob_ids, v.draft_probs)
            )
            (temperature, top_p), (top_k, seed) = sampling_float[r], sampling_int[r]
            chunk = [tokens[r], *tokens[offset : offset + n]]
            offset += n
            items.append(GraphItem(int(slots[r]), lengths[r], chunk, (temperature, int(top_k), top_p, int(seed)), dist))
        out = self.graphs.run(items)
        k = len(prefills)
        accepted = out.num_accepted[k:]
        if not all(0 <= a <= n for a, n in zip(accepted, num_drafts, strict=True)):
            raise RuntimeError(f"the verify step accepted {accepted} of {num_drafts} drafts")
        # The slots are this step's (allocated, distinct) and each had room for all its drafts (validated).
        if num:
            self.cache.set_lengths(slots, checked.lengths + 1 + np.asarray(accepted, dtype=np.int64))
        prefill_slots = np.array([self._requests[p.req_id].slot for p in prefills], dtype=np.int64)
        self.cache.set_lengths(prefill_slots, np.array([len(p.token_ids) for p in prefills], dtype=np.int64))
        results = [
            StepResult(p.req_id, 0, 0, tokens, 0, rows)
            for p, tokens, rows in zip(prefills, out.tokens, out.features, strict=False)
        ]
        results += [
            StepResult(v.req_id, n, a, t, start, rows)
            for v, n, a, t, start, rows in zip(
                verifies, num_drafts, accepted, out.tokens[k:], lengths, out.features[k:], strict=True
            )
        ]
        return results

    def _run_bucketed_verify(
        self,
        verifies: Sequence[VerifyItem],
        checked: _CheckedVerifies,
        key: tuple[int, int] | None = None,
    ) -> StepResults:
        """A verify-only step through the graph runner straight from the checked arrays (the common round)."""
        assert self.graphs is not None
        slots = checked.slots
        sampling_float, sampling_int, all_greedy = self._slot_sampling(slots)
        sampled = []
        if not all_greedy:
            sampled = [
                (r, v.draft_prob_ids, v.draft_probs)
                for r, (v, e) in enumerate(zip(verifies, checked.entries, strict=True))
                if not e.greedy and v.draft_probs is not None and v.draft_prob_ids is not None and len(v.draft_tokens)
            ]
        accepted, tokens, kept = self.graphs.run_verify(
            slots, checked.lengths, checked.tokens, checked.num_drafts, sampling_float, sampling_int, sampled, key
        )
        return self._verified(checked.req_ids, slots, checked.lengths, checked.num_drafts, accepted, tokens, kept)

    def _verified(
        self,
        req_ids: Sequence[str],
        slots: np.ndarray,
        lengths: np.ndarray,
        num_drafts: np.ndarray,
        accepted: np.ndarray,
        tokens: list[list[int]],
        kept: torch.Tensor | None,
    ) -> StepResults:
        """Commit a verify-only graph step's outcome to the KV lengths and wrap it as StepResults."""
        # As uint64 a negative count is huge (the draft counts are >= 0): one comparison checks 0 <= a <= n.
        if bool((accepted.view(np.uint64) > num_drafts.view(np.uint64)).any()):
            raise RuntimeError(f"the verify step accepted {accepted.tolist()} of {num_drafts.tolist()} drafts")
        counts = accepted + 1  # committed rows: the anchor and the accepted drafts
        # The slots are this step's (allocated, distinct) and each had room for all its drafts (validated).
        self.cache.set_lengths(slots, lengths + counts)
        return StepResults(
            list(req_ids),
            num_drafts.tolist(),
            accepted.tolist(),
            tokens,
            lengths.tolist(),
            kept,
            counts.tolist(),
            (lengths, counts),
        )

    def start_chained(
        self,
        req_ids: list[str],
        anchors: np.ndarray,
        positions: np.ndarray,
        num_drafts: np.ndarray,
        drafts: DeviceDrafts,
    ) -> ChainedVerify | None:
        """A verify-only step of greedy requests whose drafts are still being drafted on this device (a chained
        round, :meth:`VerifyGraphRunner.start_verify`): launched behind the draft step, it returns a
        :class:`ChainedVerify` whose ``results`` waits for the results (:class:`StepResults`, as :meth:`step`
        gives) and whose ``on_device`` a draft step may read behind it. Returns None, launching
        nothing, when the step cannot be chained (no graph path or no bucket for it, a request that samples, an
        unknown request or one whose position, anchor or room the checks refuse): the caller then verifies
        the drafts the usual way, where every error is reported as :meth:`step` reports it.

        Request r verifies its anchor and the first ``num_drafts[r]`` (int64 [R]) of its row of ``drafts``;
        those ids are not checked on the host (they are not there yet): the caller vouches for them (drafts of
        a drafter whose vocabulary is the target's)."""
        graphs = self.graphs
        if graphs is None or not req_ids or drafts.flat.device != self.target.device:
            return None
        req_key = tuple(req_ids)
        if len(set(req_key)) != len(req_key):
            return None
        try:
            _, slots = self._lookup(req_key)
        except KeyError:
            return None
        lengths = self.cache.lengths_unchecked(slots)
        if (
            not self._fits_at(lengths, num_drafts, positions)
            or int(anchors.view(np.uint64).max()) >= self.target.vocab_size  # a negative id is huge as uint64
        ):
            return None
        sampling_float, sampling_int, all_greedy = self._slot_sampling(slots)
        key = graphs.verify_bucket(num_drafts, 0)
        if not all_greedy or key is None:
            return None
        finish, on_device = graphs.start_verify(
            slots, lengths, anchors, num_drafts, sampling_float, sampling_int, drafts, key
        )

        def results() -> StepResults:
            accepted, tokens, kept = finish()
            return self._verified(req_key, slots, lengths, num_drafts, accepted, tokens, kept)

        return ChainedVerify(results, on_device)

    def _sample(
        self,
        logits: torch.Tensor,
        prefills: Sequence[PrefillItem],
        verifies: Sequence[VerifyItem],
        verify_starts: Sequence[int],
    ) -> list[list[int]]:
        """Rejection-sample every request's rows (a prefill is a request with 0 drafts: a plain target draw)."""
        device = logits.device
        entries = [self._requests[p.req_id] for p in prefills] + [self._requests[v.req_id] for v in verifies]
        lens = [0] * len(prefills) + [len(v.draft_tokens) for v in verifies]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=device)
        drafts = [int(t) for v in verifies for t in v.draft_tokens]
        draft_ids = torch.tensor(drafts, dtype=torch.int64, device=device)
        positions = [len(p.token_ids) - 1 for p in prefills] + list(verify_starts)
        prob_ids, probs = self._sparse_draft_distribution(verifies, device)
        out: RejectionOutput = self._sampler(
            logits,
            draft_ids,
            probs,
            cu,
            torch.tensor([e.params.temperature for e in entries], dtype=torch.float32, device=device),
            torch.tensor([e.params.top_k for e in entries], dtype=torch.int64, device=device),
            torch.tensor([e.params.top_p for e in entries], dtype=torch.float32, device=device),
            torch.tensor([e.seed for e in entries], dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            draft_prob_ids=prob_ids,
        )
        return out.per_request(cu)

    def _sparse_draft_distribution(
        self, verifies: Sequence[VerifyItem], device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Stack the sparse draft distributions of all drafts into [N, K] (K = the widest one).

        Narrower rows are padded with probability-0 entries (harmless: duplicate ids add up). Greedy requests
        carry no distribution; they get a one-hot row on their draft, which the sampler ignores for them.
        """
        sampled = [v.draft_probs for v in verifies if v.draft_probs is not None and len(v.draft_tokens)]
        if not sampled:
            return None, None
        width = max(int(probs.shape[1]) for probs in sampled)
        id_rows: list[torch.Tensor] = []
        prob_rows: list[torch.Tensor] = []
        for v in verifies:
            n = len(v.draft_tokens)
            if n == 0:
                continue
            if v.draft_probs is None or self._requests[v.req_id].params.greedy:
                ids = torch.tensor([int(t) for t in v.draft_tokens], dtype=torch.int64, device=device)
                ids = ids[:, None].expand(n, width)
                probs = torch.zeros(n, width, dtype=torch.float32, device=device)
                probs[:, 0] = 1.0
            else:
                assert v.draft_prob_ids is not None
                # Stays on the device: a per-request host round trip would be a sync per request on CUDA.
                ids = v.draft_prob_ids.to(device, torch.int64)
                probs = v.draft_probs.to(device, torch.float32)
                pad = width - ids.shape[1]
                if pad:
                    ids = torch.cat([ids, ids[:, :1].expand(n, pad)], dim=1)
                    probs = torch.cat([probs, probs.new_zeros((n, pad))], dim=1)
            id_rows.append(ids)
            prob_rows.append(probs)
        return torch.cat(id_rows), torch.cat(prob_rows)


def _is_int_type(kind: type) -> bool:
    """What :func:`_check_ids` accepts as a token id: an int or numpy integer, never a bool."""
    return issubclass(kind, int | np.integer) and not issubclass(kind, bool)


def _params(entry: _Slot) -> tuple[float, int, float, int]:
    return (entry.params.temperature, entry.params.top_k, entry.params.top_p, entry.seed)


def _check_ids(req_id: str, ids: Sequence[int], vocab: int) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= int(t) < vocab:
            raise ValueError(f"request {req_id!r}: token id {t!r} is outside the vocabulary [0, {vocab})")


def _triton_sampler():
    from kernels.rejection_triton import rejection_sample_triton

    return rejection_sample_triton
