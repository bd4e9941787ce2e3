"""The ragged verify step: target pass + rejection sampling over a token-bucketed batch, replayable as a CUDA graph.

Layout. A step's work is cut into *chunks* of at most W = max_drafts + 1 rows, each with its own slot and start
position: a verify item is one chunk ``[anchor, x_1..x_l]``; a prefill of P tokens is its first P - 1 tokens in
chunks of W (scored greedily and discarded: they only write K/V and features) plus a one-row chunk for the last
token, which samples the request's first token. Chunks are flattened back to back (no per-request padding), so
a step costs what the tokens it verifies cost. Within one layer every row's K/V is stored before attention
reads the slots, so a prefill chunk sees the chunks before it in the same pass: chunked prefill in one pass.

Buckets. The static shapes are (A, T) = (chunks, rows). A batch of a chunks and t rows takes the smallest bucket
with A >= a and T >= t + (A - a) + 1: each of the A - a padding chunks owns one row, and one extra greedy
request (the "sink") takes the remaining rows, so the rejection sampler sees static sizes (T rows, A + 1
requests, T - A - 1 drafts) and the flattened rows are already its layout (request c's target rows start at
row qs[c] = cu[c] + c). Padding and sink rows write their K/V into position 0 of a reserved dummy slot, which
nothing reads (padding chunks attend over nothing). Row buckets grow by about 1.5x, so padding costs at most
a third of a step, and the profiled SPS curve has the shape of the real one.

Everything the step needs lives in device buffers the host fills with one copy (the float32 fields are a view
of the int64 buffer's tail); the step never reads a device value on the host. Results are packed into one
[A, 1 + W] int64 tensor (accepted count, then the emitted tokens), copied to the host once, into page-locked
rows; the features of the kept rows (a verify chunk's anchor + accepted drafts, a prefill's every row) are
compacted on the device, chunk after chunk. A verify-only step hands them out as a view of the step's output
(the round driver's drafter copies them into its own buffer before the next step runs); a step with prefills
copies them. The staging buffers need no fence: a step ends in that blocking result copy on the upload's
stream, so the host writes them again only after the upload has read them; a step started without waiting
(:meth:`VerifyGraphRunner.start_verify`, a chained round) holds them until its finish has waited for its copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.graphs import (
    DEFAULT_BUCKETS,
    DeviceDrafts,
    DeviceVerified,
    GraphStep,
    bucket_sizes,
    device_event,
    pinned_empty,
    split_views,
)
from kernels.rejection import RejectionOutput
from verify_service.attention import CachedAttentionMetadata
from verify_service.kv_cache import SlotKVCache

if TYPE_CHECKING:  # a type only: the scheduler imports this module without loading transformers
    from verify_service.target import TargetModel

Sampler = Callable[..., RejectionOutput]
Params = tuple[float, int, float, int]  # temperature, top_k, top_p, seed
_GREEDY: Params = (0.0, 0, 1.0, 0)
_FLOAT_PADDING = np.array([[0.0], [1.0]], dtype=np.float32)  # a padding chunk's temperature and top_p


@dataclass(frozen=True)
class GraphItem:
    """One request's work in a ragged step.

    Verify (``prefill`` False): ``tokens`` = [anchor, drafts...] at positions ``start`` onward, ``dist`` the sparse
    draft distribution (ids, probs) [l, <=K] or None (greedy). Prefill: ``tokens`` = the prompt (``start`` 0 for
    a fresh slot); ``sample`` False for a re-prefill whose anchor is known (nothing is sampled).
    """

    slot: int
    start: int
    tokens: Sequence[int]
    params: Params
    dist: tuple[torch.Tensor, torch.Tensor] | None = None
    prefill: bool = False
    sample: bool = True


@dataclass(frozen=True)
class RaggedVerifyOutput:
    """Per item in call order: accepted drafts (0 for a prefill), emitted tokens, and the kept features (a
    verify: anchor + accepted drafts; a prefill: every prompt row), or None without feature layers."""

    num_accepted: list[int]
    tokens: list[list[int]]
    features: list[torch.Tensor | None]
    kept: torch.Tensor | None  # every item's kept rows back to back (``features`` are views of it)


def row_buckets(low: int, high: int) -> list[int]:
    """Row counts in [low, high]: 2^k and 3 * 2^(k-1) (steps of at most 1.5x), and ``high`` itself."""
    grid = {high}
    value = 1
    while value < high:
        grid |= {value, 3 * value // 2} if value > 1 else {1}
        value *= 2
    return sorted(v for v in grid if low <= v <= high)


class VerifyGraphRunner:
    """Static buffers and one (captured) step per (chunks, rows) bucket for a VerifyEngine's target and KV cache.

    ``max_requests`` verify chunks of up to W rows always fit; ``prefill_rows`` more rows (and the chunks they
    make) are room for prompts joining in the same step. Larger steps run eagerly (``fits`` says which).
    """

    def __init__(
        self,
        target: TargetModel,
        cache: SlotKVCache,
        *,
        dummy_slot: int,
        max_drafts: int,
        draft_top_k: int,
        max_requests: int,
        mode: str,
        sampler: Sampler,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        prefill_rows: int = 0,
    ) -> None:
        if max_drafts < 1 or draft_top_k < 1:
            raise ValueError("VerifyGraphRunner: max_drafts and draft_top_k must be >= 1")
        if cache.max_seq_len < max_drafts + 1:
            raise ValueError("VerifyGraphRunner: the KV slots are shorter than one verify chunk")
        if prefill_rows < 0:
            raise ValueError(f"VerifyGraphRunner: prefill_rows must be >= 0, got {prefill_rows}")
        self.target = target
        self.cache = cache
        self.dummy_slot = dummy_slot
        self.gamma = max_drafts
        self.width = width = max_drafts + 1
        self.draft_top_k = draft_top_k
        self.sampler = sampler
        self.device = target.device
        self.backend = "triton" if self.device.type == "cuda" else "reference"
        self.timed = False
        self.replays = 0  # steps run through the runner (for reports: how many rounds took the graph path)
        self.chained = 0  # of them, steps chained behind the drafter (for reports: how many rounds chained)
        self.max_rows = max_requests * width + 1 + prefill_rows
        max_chunks = max_requests + 2 * -(-prefill_rows // width)
        self.chunk_sizes = bucket_sizes(max_chunks, buckets)
        self.buckets: dict[int, list[int]] = {
            a: row_buckets(a + 1, min(a * width + 1, self.max_rows)) for a in self.chunk_sizes
        }
        top_a, top_t = self.chunk_sizes[-1], self.max_rows
        # One int64 and one float32 buffer, each filled from pinned host memory with a single copy.
        self._int_fields = {
            "ids": top_t,
            "token_slots": top_t,
            "positions": top_t,
            "row_chunk": top_t,
            "row_k": top_t,
            "drafts": top_t,
            "dist_rows": top_t,
            "chain_src": top_t,  # a chained step's drafts: where each is in the drafter's output (DeviceDrafts)
            "chain_rows": top_t,  # and which row of ``ids`` it goes to
            "slots": top_a,
            "starts": top_a + 1,
            "query_starts": top_a,
            "query_lens": top_a,
            "cu": top_a + 2,
            "keep": top_a + 1,
            "top_k": top_a + 1,
            "seeds": top_a + 1,
        }
        self._float_fields = {"temperature": top_a + 1, "top_p": top_a + 1}
        # The float32 fields are a view of the int64 buffer's tail: one copy uploads everything.
        num_int, num_float = sum(self._int_fields.values()), sum(self._float_fields.values())
        self._host_int = pinned_empty((num_int + (num_float + 1) // 2,), torch.int64, self.device)
        self._dev_int = torch.zeros_like(self._host_int, device=self.device)
        self._host_float = self._host_int[num_int:].view(torch.float32)[:num_float]
        self._dev_float = self._dev_int[num_int:].view(torch.float32)[:num_float]
        self.host = split_views(self._host_int.numpy(), self._int_fields) | split_views(
            self._host_float.numpy(), self._float_fields
        )
        # The sampling parameters as [2, top_a + 1] views (fields next to each other): two writes fill them.
        self._float_params = self._host_float.numpy().reshape(2, top_a + 1)
        names = list(self._int_fields)
        top_k_at = sum(self._int_fields[name] for name in names[: names.index("top_k")])
        assert names[names.index("top_k") + 1] == "seeds"
        self._int_params = self._host_int.numpy()[top_k_at : top_k_at + 2 * (top_a + 1)].reshape(2, top_a + 1)
        self._arange = np.arange(self.max_rows + 1, dtype=np.int64)
        # run_verify's kept staging fields (see _verify_layout_for, _verify_slot_fields): the host buffers still
        # hold them from the last verify-only step as long as nothing else packed a step since.
        self._kept_layout: tuple | None = None
        self._kept_slots: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._row_views: dict[tuple[int, int], dict[int, torch.Tensor]] = {}  # see _first_rows
        self.dev = split_views(self._dev_int, self._int_fields) | split_views(self._dev_float, self._float_fields)
        # Page-locked result rows (accepted count, emitted tokens) and per chunk bucket a view of its first rows,
        # made once: the step's one device -> host copy lands there (no allocation, no pageable staging).
        self._host_result = pinned_empty((top_a, 1 + width), torch.int64, self.device)
        self._result_np = self._host_result.numpy()
        self._result_views = {a: self._host_result[:a] for a in self.chunk_sizes}
        # A started step (start_verify) whose result copy the host has not waited for: the staging and result
        # buffers are its until then. Its copy is waited for through this event (CUDA; elsewhere copies block).
        self._started: tuple[int, int] | None = None
        self._result_event = device_event(device=self.device) if self.device.type == "cuda" else None
        self.dist_ids = torch.zeros((top_t, draft_top_k), dtype=torch.int64, device=self.device)
        self.dist_probs = torch.zeros((top_t, draft_top_k), dtype=torch.float32, device=self.device)
        pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        self.steps: dict[tuple[int, int], GraphStep] = {}
        keys = [(a, t) for a in self.chunk_sizes for t in self.buckets[a]]
        for key in sorted(keys, key=lambda k: (k[1], k[0]), reverse=True):  # largest first: reuse its pool memory
            self.pad_for(key)  # warm-up and capture run the step for real: on padding, they write the dummy slot
            self.steps[key] = GraphStep(partial(self._step, *key), mode, pool)

    # ------------------------------------------------------------------------------------------------ host
    def pad_for(self, key: tuple[int, int]) -> None:
        """Fill the device buffers with an all-padding batch of bucket ``key`` (a valid step of that shape).
        Build time only: it waits for the previous bucket's upload before rewriting the staging buffers."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._pack([], *key)
        self._upload()

    def bucket(self, num_chunks: int, num_rows: int) -> tuple[int, int] | None:
        """The smallest (chunks, rows) bucket holding a batch, or None (then the engine runs it eagerly)."""
        for a in self.chunk_sizes:
            if a < num_chunks:
                continue
            need = num_rows + (a - num_chunks) + 1
            for t in self.buckets[a]:
                if t >= need:
                    return a, t
        return None

    def chunk_count(self, item_len: int, prefill: bool) -> int:
        """Chunks an item takes: a verify item one; a prefill of P tokens ceil((P - 1) / W) + 1."""
        return 1 + (-(-(item_len - 1) // self.width) if prefill else 0)

    def fits(self, lengths: Sequence[tuple[int, bool]], max_dist_width: int) -> bool:
        """Whether items of (token count, is a prefill) can take the graph path (verify chunks must fit W)."""
        if not lengths or max_dist_width > self.draft_top_k:
            return False
        if any(n > self.width for n, prefill in lengths if not prefill):
            return False
        chunks = sum(self.chunk_count(n, prefill) for n, prefill in lengths)
        return self.bucket(chunks, sum(n for n, _ in lengths)) is not None

    def fits_verify(self, num_drafts: np.ndarray, max_dist_width: int) -> bool:
        """:meth:`fits` for verify items only, from their draft counts (int64 [R]): no per-item Python."""
        return self.verify_bucket(num_drafts, max_dist_width) is not None

    def verify_bucket(self, num_drafts: np.ndarray, max_dist_width: int) -> tuple[int, int] | None:
        """The bucket of a verify-only step from its draft counts (int64 [R]), or None when it does not fit
        (what :meth:`fits_verify` says); :meth:`run_verify` takes it (no second look-up)."""
        if not num_drafts.size or max_dist_width > self.draft_top_k or int(num_drafts.max()) >= self.width:
            return None
        return self.bucket(num_drafts.size, num_drafts.size + int(num_drafts.sum()))

    @property
    def step_time_s(self) -> float:
        """Accumulated time inside the step (device time of the graph replays) while ``timed`` was set."""
        return sum(step.time_s for step in self.steps.values())

    def run(self, items: Sequence[GraphItem]) -> RaggedVerifyOutput:
        """Run the items in one step. The caller has validated everything (VerifyEngine._validate), allocated
        the prefills' slots, and advances the slot lengths after (a verify by 1 + accepted, a prefill by P)."""
        if self._started is not None:
            raise RuntimeError("VerifyGraphRunner: the last started step was not finished")
        chunks = self._chunks(items)
        num_rows = sum(len(c[2]) for c in chunks)
        key = self.bucket(len(chunks), num_rows)
        if key is None:
            raise ValueError(f"{len(chunks)} chunks / {num_rows} rows exceed the largest bucket")
        packed, features = self._replay(key, *self._pack(chunks, *key))
        result = self._copy_result(key, packed)[: len(chunks)]
        accepted = result[:, 0]
        counts = [len(c[2]) if c[3] >= 0 else 1 + int(a) for c, a in zip(chunks, accepted, strict=True)]
        kept = None if features is None else features[: sum(counts)].clone()
        out_accepted, out_tokens, out_features = [], [], []
        chunk, row = 0, 0
        for item in items:
            n_chunks = self.chunk_count(len(item.tokens), item.prefill)
            last = chunk + n_chunks - 1
            a = 0 if item.prefill else int(accepted[last])
            tokens = result[last, 1 : 2 + a].tolist() if item.sample or not item.prefill else []
            n_kept = sum(counts[chunk : last + 1])
            out_accepted.append(a)
            out_tokens.append(tokens)
            out_features.append(None if kept is None else kept[row : row + n_kept])
            chunk, row = last + 1, row + n_kept
        return RaggedVerifyOutput(out_accepted, out_tokens, out_features, kept)

    def run_verify(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        tokens: np.ndarray,
        num_drafts: np.ndarray,
        sampling_float: np.ndarray,
        sampling_int: np.ndarray,
        dists: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        key: tuple[int, int] | None = None,
    ) -> tuple[np.ndarray, list[list[int]], torch.Tensor | None]:
        """A verify-only step from arrays (the common round, without per-item Python): request r's anchor
        ``tokens[r]`` and its ``num_drafts[r]`` drafts (``tokens[R:]``: every request's drafts back to back) at
        slot ``slots[r]`` from position ``starts[r]``, (temperature, top_p) float32 [R, 2], (top_k, seed) int64
        [R, 2], sparse draft distributions (r, ids, probs) of the requests that sample; ``key``: the bucket
        :meth:`verify_bucket` gave for ``num_drafts``, if known. Returns accepted counts (int64 [R]), emitted
        tokens and the committed features (1 + accepted rows per request, back to back).

        Read-only ``slots``, ``sampling_float`` and ``sampling_int`` (an engine's kept per-request-list arrays)
        passed again as the same objects are taken as unchanged: their fields are not rewritten.

        The features are a view of the step's output, not a copy: with captured graphs the next step overwrites
        them, so they must be consumed (copied, or read by work queued on the device) before the next step."""
        key, packed, features = self._launch_verify(
            slots, starts, tokens, num_drafts, sampling_float, sampling_int, dists, key, None
        )
        return self._verify_outputs(key, self._copy_result(key, packed), features, slots.size)

    def start_verify(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        anchors: np.ndarray,
        num_drafts: np.ndarray,
        sampling_float: np.ndarray,
        sampling_int: np.ndarray,
        drafts: DeviceDrafts,
        key: tuple[int, int] | None = None,
    ) -> tuple[Callable[[], tuple[np.ndarray, list[list[int]], torch.Tensor | None]], DeviceVerified | None]:
        """:meth:`run_verify` of greedy requests whose drafts are still on the device (a chained round): the
        step is queued right behind the draft step that writes ``drafts`` (same stream), so the device runs
        both without waiting for the host in between. Returns once the step and its result copy are queued:
        a function that waits for them and gives what :meth:`run_verify` gives (call it before the runner is
        used again: the staging and result buffers are the step's until then), and the step's outcome on the
        device (None without feature layers), which a draft step queued next may read. ``anchors``: int64
        [R]; the drafts are request r's first ``num_drafts[r]`` of its row of ``drafts``, ids the caller
        vouches for (in the target's vocabulary: the drafter's own output)."""
        key, packed, features = self._launch_verify(
            slots, starts, anchors, num_drafts, sampling_float, sampling_int, (), key, drafts
        )
        self._result_views[key[0]].copy_(packed, non_blocking=True)
        event = self._result_event
        if event is not None:
            event.record()
        self._started = key
        num = slots.size

        def finish() -> tuple[np.ndarray, list[list[int]], torch.Tensor | None]:
            if self._started is not None:
                if event is not None:
                    event.synchronize()
                self.steps[key].settle_timing()
                self._started = None
            return self._verify_outputs(key, self._result_np, features, num)

        return finish, None if features is None else DeviceVerified(packed, features)

    def _launch_verify(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        tokens: np.ndarray,
        num_drafts: np.ndarray,
        sampling_float: np.ndarray,
        sampling_int: np.ndarray,
        dists: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        key: tuple[int, int] | None,
        device_drafts: DeviceDrafts | None,
    ) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor | None]:
        """Stage and launch a verify-only step: its bucket, packed results and features (device tensors).
        ``tokens``: the anchors, then the drafts unless ``device_drafts`` holds them."""
        if self._started is not None:
            raise RuntimeError("VerifyGraphRunner: the last started step was not finished")
        num = slots.size
        if key is None:
            key = self.verify_bucket(num_drafts, 0)
            if key is None:
                lens = num_drafts + 1
                raise ValueError(f"{num} verify chunks / {int(lens.sum())} rows do not fit a bucket")
        anchor_rows, draft_rows, row_chunk, row_k = self._verify_layout_for(key, num_drafts)
        self._verify_slot_fields(key, row_chunk.size, slots, sampling_float, sampling_int)
        # What changes every round: the tokens, the positions and the starts (the rest is the kept layout).
        host = self.host
        ids = host["ids"]
        ids[anchor_rows] = tokens[:num]
        if device_drafts is None:
            drafts = tokens[num:]
            ids[draft_rows] = drafts
            host["drafts"][: drafts.size] = drafts
        else:  # where each draft is in the drafter's output: request r's j-th (row k = j + 1) at r * stride + j
            n = draft_rows.size
            host["chain_rows"][:n] = draft_rows
            source = host["chain_src"][:n]
            np.multiply(row_chunk[draft_rows], device_drafts.row_stride, out=source)
            source += row_k[draft_rows]
            source -= 1
        np.add(starts[row_chunk], row_k, out=host["positions"][: row_k.size])
        host["starts"][:num] = starts
        dist_rows, dist_ids, dist_probs = self._pack_dists(dists, num_drafts + 1) if dists else (0, [], [])
        packed, features = self._replay(key, dist_rows, dist_ids, dist_probs, device_drafts, draft_rows.size)
        return key, packed, features

    def _verify_outputs(
        self, key: tuple[int, int], result: np.ndarray, features: torch.Tensor | None, num: int
    ) -> tuple[np.ndarray, list[list[int]], torch.Tensor | None]:
        """Accepted counts, emitted tokens and committed features of a verify-only step from its result rows."""
        result = result[:num]
        accepted = result[:, 0].copy()
        emitted = [row[1 : 2 + row[0]] for row in result.tolist()]
        kept = None if features is None else self._first_rows(key, features, num + int(accepted.sum()))
        return accepted, emitted, kept

    def _first_rows(self, key: tuple[int, int], features: torch.Tensor, num: int) -> torch.Tensor:
        """``features[:num]``; of a captured step's static output, a view made once per (bucket, rows) (a
        slice is a torch call every round, a dictionary look-up is not)."""
        if self.steps[key].graph is None:  # eager: fresh outputs every step
            return features[:num]
        views = self._row_views.setdefault(key, {})
        view = views.get(num)
        if view is None:
            view = views[num] = features[:num]
        return view

    def _verify_layout_for(
        self, key: tuple[int, int], num_drafts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Write the fields of a verify-only step that only depend on its bucket and draft counts (row and
        chunk layout, padding, the sink), unless the last verify-only step had the same (kept: a steady round
        verifies the same counts); returns the anchors' rows, the drafts' rows and each real row's chunk and
        offset in it. :meth:`_pack_layout` (the other steps) forgets the kept layout."""
        counts = num_drafts.tobytes()
        kept = self._kept_layout
        if kept is not None and kept[0] == key and kept[1] == counts:
            return kept[2]
        self._kept_layout = self._kept_slots = None
        num = num_drafts.size
        lens = num_drafts + 1
        total = int(lens.sum())
        # Placeholders for what the callers write over it: tokens and starts (run_verify), slots and sampling
        # parameters (_verify_slot_fields).
        zeros = np.zeros((num, 2), dtype=np.int64)
        self._pack_layout(
            zeros[:, 0], zeros[:, 0], lens, np.zeros(total, dtype=np.int64), -1, zeros.astype(np.float32), zeros, *key
        )
        row_chunk = self.host["row_chunk"][:total].copy()
        row_k = self.host["row_k"][:total].copy()
        is_anchor = row_k == 0
        layout = (np.flatnonzero(is_anchor), np.flatnonzero(~is_anchor), row_chunk, row_k)
        self._kept_layout = (key, counts, layout)
        return layout

    def _verify_slot_fields(
        self,
        key: tuple[int, int],
        num_real_rows: int,
        slots: np.ndarray,
        sampling_float: np.ndarray,
        sampling_int: np.ndarray,
    ) -> None:
        """Write the fields that depend on the requests' slots (slots, each row's slot, sampling parameters)
        over the kept layout, unless they are the last step's read-only arrays again."""
        kept = self._kept_slots
        if (
            kept is not None
            and slots is kept[0]
            and sampling_float is kept[1]
            and sampling_int is kept[2]
            and not (slots.flags.writeable or sampling_float.flags.writeable or sampling_int.flags.writeable)
        ):
            return
        num_chunks, num_rows = key
        num = slots.size
        host = self.host
        all_slots = np.full(num_chunks + 1, self.dummy_slot, dtype=np.int64)
        all_slots[:num] = slots
        host["token_slots"][:num_rows] = all_slots[host["row_chunk"][:num_rows]]
        host["slots"][:num_chunks] = all_slots[:num_chunks]
        self._float_params[:, :num] = sampling_float.T
        self._int_params[:, :num] = sampling_int.T
        self._kept_slots = (slots, sampling_float, sampling_int)

    def _copy_result(self, key: tuple[int, int], packed: torch.Tensor) -> np.ndarray:
        """The step's one device -> host copy, into the page-locked result rows; a blocking copy on the stream
        of the replay, so the rows are complete when it returns (and the upload before it is done)."""
        self._result_views[key[0]].copy_(packed)
        self.steps[key].settle_timing()
        return self._result_np

    def _replay(
        self,
        key: tuple[int, int],
        dist_rows: int,
        dist_ids: list[torch.Tensor],
        dist_probs: list[torch.Tensor],
        device_drafts: DeviceDrafts | None = None,
        num_drafts: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Upload the staged batch and run the bucket's step (replay its graph); ``device_drafts``: the
        ``num_drafts`` drafts are gathered from the drafter's output on the device first (a chained step)."""
        self._upload()
        if dist_rows:
            index = self.dev["dist_rows"][:dist_rows]
            with torch.no_grad():  # the caller's tensors may carry grad; the static buffers never do
                self.dist_ids.index_copy_(0, index, torch.cat(dist_ids).to(self.device))
                self.dist_probs.index_copy_(0, index, torch.cat(dist_probs).to(self.device))
        if device_drafts is not None:
            self.chained += 1
            if num_drafts:
                dev = self.dev
                drafts = dev["drafts"][:num_drafts]
                drafts.copy_(device_drafts.flat.index_select(0, dev["chain_src"][:num_drafts]))  # ids, as int64
                dev["ids"].index_copy_(0, dev["chain_rows"][:num_drafts], drafts)
        self.replays += 1
        return self.steps[key](self.timed)

    def _chunks(self, items: Sequence[GraphItem]) -> list[tuple]:
        """(slot, start, tokens, keep, params, dist) per chunk; keep -1 = anchor + accepted, else that many rows."""
        chunks: list[tuple] = []
        width = self.width
        for item in items:
            if not item.prefill:
                chunks.append((item.slot, item.start, item.tokens, -1, item.params, item.dist))
                continue
            body = len(item.tokens) - 1
            for begin in range(0, body, width):
                piece = item.tokens[begin : min(begin + width, body)]
                chunks.append((item.slot, item.start + begin, piece, len(piece), _GREEDY, None))
            params = item.params if item.sample else _GREEDY
            chunks.append((item.slot, item.start + body, item.tokens[body:], 1, params, None))
        return chunks

    def _pack(self, chunks: Sequence[tuple], num_chunks: int, num_rows: int):
        """Fill the host buffers for bucket (num_chunks, num_rows) from chunk tuples; returns the
        draft-distribution rows to copy (count, ids, probs)."""
        real = len(chunks)
        lens = np.array([len(c[2]) for c in chunks], dtype=np.int64)
        ids = np.fromiter(chain.from_iterable(c[2] for c in chunks), dtype=np.int64, count=int(lens.sum()))
        float_params = int_params = None
        if real:  # a chunk's params are (temperature, top_k, top_p, seed)
            float_params = np.array([(c[4][0], c[4][2]) for c in chunks], dtype=np.float32)
            int_params = np.array([(c[4][1], c[4][3]) for c in chunks], dtype=np.int64)
        self._pack_layout(
            np.array([c[0] for c in chunks], dtype=np.int64),
            np.array([c[1] for c in chunks], dtype=np.int64),
            lens,
            ids,
            np.array([c[3] for c in chunks], dtype=np.int64),
            float_params,
            int_params,
            num_chunks,
            num_rows,
        )
        dists = [(c, chunk[5][0], chunk[5][1]) for c, chunk in enumerate(chunks) if chunk[5] is not None]
        return self._pack_dists(dists, lens)

    def _pack_layout(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        lens: np.ndarray,
        ids: np.ndarray,
        keep: np.ndarray | int,
        float_params: np.ndarray | None,
        int_params: np.ndarray | None,
        num_chunks: int,
        num_rows: int,
        drafts: np.ndarray | None = None,
    ) -> None:
        """The real chunks (arrays over them; ``ids`` their tokens back to back; ``float_params`` (temperature,
        top_p) float32 [n, 2] and ``int_params`` (top_k, seed) int64 [n, 2], None when there are no real chunks;
        ``drafts``, when known, the ids of every row but the chunks' first ones), then one-row padding chunks,
        then the sink, into the host buffers. Few array operations: this runs every round."""
        self._kept_layout = self._kept_slots = None  # run_verify's kept fields are overwritten
        host = self.host
        real = lens.size
        num_real_rows = ids.size
        all_lens = np.ones(num_chunks + 1, dtype=np.int64)
        all_lens[:real] = lens
        all_lens[num_chunks] = num_rows - num_real_rows - (num_chunks - real)  # the sink: >= 1 row (bucket rule)
        qs = np.zeros(num_chunks + 1, dtype=np.int64)
        np.cumsum(all_lens[:-1], out=qs[1:])
        # (temperature, top_p) and (top_k, seed) as [2, A + 1] views: padding values, then the real chunks'.
        float_params_view = self._float_params[:, : num_chunks + 1]
        int_params_view = self._int_params[:, : num_chunks + 1]
        float_params_view[...] = _FLOAT_PADDING
        int_params_view[...] = 0
        if real:
            float_params_view[:, :real] = float_params.T  # type: ignore[union-attr]
            int_params_view[:, :real] = int_params.T  # type: ignore[union-attr]  # int64: seeds need every bit
        all_slots = np.full(num_chunks + 1, self.dummy_slot, dtype=np.int64)
        all_slots[:real] = slots
        row_chunk = host["row_chunk"][:num_rows]
        row_chunk[:] = np.repeat(self._arange[: num_chunks + 1], all_lens)
        row_k = host["row_k"][:num_rows]
        np.subtract(self._arange[:num_rows], qs[row_chunk], out=row_k)
        host["ids"][:num_real_rows] = ids
        host["ids"][num_real_rows:num_rows] = 0
        host["token_slots"][:num_rows] = all_slots[row_chunk]
        positions = host["positions"][:num_rows]
        positions[num_real_rows:] = 0
        real_positions = positions[:num_real_rows]
        np.add(np.repeat(starts, lens), row_k[:num_real_rows], out=real_positions)
        num_drafts = num_rows - num_chunks - 1
        if drafts is None:
            host["drafts"][:num_drafts] = host["ids"][:num_rows][row_k > 0]
        else:  # the real chunks' drafts, then the sink's rows past its first (ids 0)
            host["drafts"][: drafts.size] = drafts
            host["drafts"][drafts.size : num_drafts] = 0
        host["slots"][:num_chunks] = all_slots[:num_chunks]
        host["starts"][:real] = starts
        host["starts"][real : num_chunks + 1] = 0
        host["query_starts"][:num_chunks] = qs[:num_chunks]
        query_lens = host["query_lens"][:num_chunks]
        query_lens[:real] = lens
        query_lens[real:] = 0  # padding chunks attend over nothing
        host["cu"][0] = 0
        np.cumsum(all_lens - 1, out=host["cu"][1 : num_chunks + 2])
        host["keep"][:real] = keep
        host["keep"][real : num_chunks + 1] = 0

    def _pack_dists(
        self, dists: Sequence[tuple[int, torch.Tensor, torch.Tensor]], lens: np.ndarray
    ) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """Sparse draft distributions (chunk, ids, probs) widened to draft_top_k, and their sampler rows."""
        dist_ids: list[torch.Tensor] = []
        dist_probs: list[torch.Tensor] = []
        dist_rows = 0
        cu = self.host["cu"]
        for c, prob_ids, probs in dists:
            n = int(lens[c]) - 1
            if n < 1:
                continue
            wide_ids, wide_probs = _widen(prob_ids, probs, self.draft_top_k)
            dist_ids.append(wide_ids)
            dist_probs.append(wide_probs)
            self.host["dist_rows"][dist_rows : dist_rows + n] = np.arange(cu[c], cu[c] + n)
            dist_rows += n
        return dist_rows, dist_ids, dist_probs

    def _upload(self) -> None:
        self._dev_int.copy_(self._host_int, non_blocking=True)  # the float fields too

    # ------------------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def _step(self, num_chunks: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device-only: target pass over the flattened rows, rejection sampling, packed results."""
        dev, width, device = self.dev, self.width, self.device
        a, t = num_chunks, num_rows
        num_drafts = t - a - 1
        meta = CachedAttentionMetadata(
            token_slots=dev["token_slots"][:t],
            positions=dev["positions"][:t],
            slots=dev["slots"][:a],
            query_groups=self.target.query_groups,
            padded=None,
            solo=(),
            backend=self.backend,
            context_lens=dev["starts"][:a],
            query_starts=dev["query_starts"][:a],
            query_lens=dev["query_lens"][:a],
            max_query_len=width,
        )
        out = self.target.run_layers(self.cache, dev["ids"][:t], meta)
        sampled = self.sampler(
            out.logits,
            dev["drafts"][:num_drafts],
            self.dist_probs[:num_drafts],
            dev["cu"][: a + 2],
            dev["temperature"][: a + 1],
            dev["top_k"][: a + 1],
            dev["top_p"][: a + 1],
            dev["seeds"][: a + 1],
            dev["starts"][: a + 1],
            draft_prob_ids=self.dist_ids[:num_drafts],
            validate=False,
        )
        k = torch.arange(width, device=device)
        accepted = sampled.num_accepted[:a]
        rows = (dev["query_starts"][:a, None] + k[None, :]).clamp(max=t - 1)
        emitted = torch.where(k[None, :] <= accepted[:, None], sampled.output_tokens[rows], -1)
        packed = torch.cat([accepted[:, None], emitted], dim=1)

        features = None
        if out.features is not None:
            keep = dev["keep"][: a + 1]
            counts = torch.where(keep < 0, sampled.num_accepted + 1, keep)
            offsets = torch.cumsum(counts, 0) - counts
            row_chunk, row_k = dev["row_chunk"][:t], dev["row_k"][:t]
            dest = torch.where(row_k < counts[row_chunk], offsets[row_chunk] + row_k, t)
            features = torch.zeros((t + 1, out.features.shape[1]), dtype=out.features.dtype, device=device)
            features = features.index_copy(0, dest, out.features)[:t]
        return packed, features


def _widen(ids: torch.Tensor, probs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a sparse distribution [l, k] to [l, width]: the extra ids repeat the first one with probability 0
    (duplicate ids add up, so the distribution is unchanged)."""
    ids, probs = ids.to(torch.int64), probs.to(torch.float32)
    pad = width - ids.shape[1]
    if pad == 0:
        return ids, probs
    return (
        torch.cat([ids, ids[:, :1].expand(-1, pad)], dim=1),
        torch.cat([probs, probs.new_zeros((probs.shape[0], pad))], dim=1),
    )
