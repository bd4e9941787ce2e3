"""The bucketed draft steps, each replayable as one CUDA graph: proposing blocks, and appending context rows.

Proposing: backbone + sequential head + sampling for R requests.

For a bucket of B requests the step reads its inputs from static device buffers (anchor, anchor position =
context length, slot, temperature, effective top-k, seed per request; requests r >= R pad the bucket with the
anchor 0 over the reserved dummy slot, whose context is empty) and runs exactly what the eager
:meth:`DraftEngine.propose` runs: ``draft_block``'s layers with the context read in place by the slot
attention kernel and ``sample_block_keyed`` (the fused Markov sampler for a vanilla head). The
drafted tokens and the raw confidence logits come back in one [B, 2 * bs] float64 tensor (token ids and
float32 logits are exact in float64), copied to the host once into page-locked memory; the sparse draft
distributions stay on the device for the verifier, copied out of the static outputs only when some request of
the batch samples: a greedy request's (temperature 0) distribution is read by no verification, so a batch of
greedy requests only gets views, which the next step overwrites.

Appending: the context rows a verify step committed (at most block_size + 1 per request and round) are
projected (``fc`` + ``hidden_norm``, unless the runner takes rows the verifier already projected) and turned into
every draft layer's K/V, written at (slot, position). A per-round append is staged (rows copied into a static
buffer, nothing launched) and done by the next propose step, inside its graph, before the backbone reads the
context: one launch, one upload and no fence less per round. Request r of the bucket appends its
``counts[r]`` staged rows (at most block_size + 1) at positions ``starts[r]`` onward; its other rows of the
B * (block_size + 1) write to position 0 of the dummy slot, whose context length stays 0, so nothing reads
them. A staged append that the next propose does not cover (another append first, an eager propose, a
request missing from the batch) runs as its own bucketed append step first; a released request's staged rows
are dropped. Longer appends (prefills) run eagerly.

Drafting behind a verify step (:meth:`DraftGraphRunner.launch_behind`): the propose step's anchors, positions and
append fields, and its context rows, are written on the device from a verify step's outcome queued before it on
the same stream (``kernels.graphs.DeviceVerified``), so the next round drafts before the host has the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from draft_service.context_cache import DraftContextCache
from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import kernel_backend, sample_block_keyed
from kernels.graphs import (
    DEFAULT_BUCKETS,
    DeviceDrafts,
    DeviceVerified,
    GraphStep,
    StagingFence,
    bucket_sizes,
    device_event,
    pick_bucket,
    pinned_empty,
    split_views,
)


@dataclass
class LaunchedDraft:
    """A draft step queued on the device (:meth:`DraftGraphRunner.launch`): its request count, graph step,
    sparse distributions (device tensors), the event after its result copy, the drafted ids where the step
    wrote them on the device (a verify step may read them there before the host has them), and once
    collected its result."""

    num: int
    step: GraphStep
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor
    done: torch.Event | None
    tokens: DeviceDrafts
    result: BucketedDraft | None = None


@dataclass(frozen=True)
class BucketedDraft:
    """One bucketed step's drafts for R requests: tokens / confidence logits on the host, the sparse draft
    distribution [R, bs, K] on the device (fresh tensors; views of the static outputs, which the next step
    overwrites, when every request is greedy)."""

    tokens: torch.Tensor
    confidence_logits: np.ndarray | None
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor


class DraftGraphRunner:
    """Static buffers and one (captured) draft step per bucket size for a DraftEngine."""

    def __init__(
        self,
        model: DSparkDraftModel,
        cache: DraftContextCache,
        *,
        dummy_slot: int,
        draft_top_k: int,
        max_requests: int,
        mode: str,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        projected: bool = False,
    ) -> None:
        if not 1 <= draft_top_k <= model.real_vocab_size:
            raise ValueError("DraftGraphRunner: draft_top_k must be in [1, vocab] (sparse proposals)")
        self.model = model
        self.cache = cache
        self.dummy_slot = dummy_slot
        self.draft_top_k = draft_top_k
        self.sizes = bucket_sizes(max_requests, buckets)
        self.device = model.device
        self.backend = kernel_backend(self.device)  # slot attention and the fused Markov sampler
        self.has_confidence = model.confidence_head is not None
        self.timed = False
        self.behind = 0  # steps launched behind a verify step (for reports: how many rounds drafted so)
        top = self.sizes[-1]
        self._int_fields = {
            "anchors": top,
            "positions": top,
            "slots": top,
            "k_eff": top,
            "seeds": top,
            "append_counts": top,  # the staged context rows this step appends, per request
            "append_offsets": top,  # where they start in context_rows
            "append_starts": top,  # the position of the first one
        }
        # One int64 staging buffer; its tail holds the float32 temperatures (a view): one copy uploads everything.
        num_int = sum(self._int_fields.values())
        self._host_int = pinned_empty((num_int + (top + 1) // 2,), torch.int64, self.device)
        self._dev_int = torch.zeros_like(self._host_int, device=self.device)
        self._host_temp = self._host_int[num_int:].view(torch.float32)[:top]
        self._dev_temp = self._dev_int[num_int:].view(torch.float32)[:top]
        # No fence for this buffer: every launch is collected (a wait for its result copy, queued after its
        # upload on the same stream) before the next one writes it.
        self._where_fence = StagingFence(self.device)
        self.host = split_views(self._host_int.numpy(), self._int_fields)
        self.host["temperature"] = self._host_temp.numpy()
        self.dev = split_views(self._dev_int, self._int_fields)
        self.dev["temperature"] = self._dev_temp
        # Page-locked result rows; per bucket a view of its first rows made once (a slice is a torch call).
        self._host_result = pinned_empty((top, 2 * model.block_size), torch.float64, self.device)
        self._result_np = self._host_result.numpy()
        # Context append: rows [top * W, F] (F = H when they arrive projected) in the model dtype, and (slot,
        # position) per row.
        self.append_width = model.block_size + 1
        self.projected = projected
        rows = top * self.append_width
        width = model.config.hidden_size if projected else model.config.context_feature_size
        self.context_rows = torch.zeros((rows, width), dtype=model.dtype, device=self.device)
        self._host_where = pinned_empty((2 * rows,), torch.int64, self.device)
        self._dev_where = torch.zeros_like(self._host_where, device=self.device)
        # The staged append, per context slot (count 0: nothing staged), and its total number of rows.
        num_slots = cache.num_slots
        self._staged_counts = np.zeros(num_slots, dtype=np.int64)
        self._staged_offsets = np.zeros(num_slots, dtype=np.int64)
        self._staged_starts = np.zeros(num_slots, dtype=np.int64)
        self._staged_rows = 0
        self._row_views: dict[int, torch.Tensor] = {}  # context_rows[:n] by n
        self._unsettled: list[GraphStep] = []  # append steps run since the last propose (their timing pending)
        # The last step's bucket, per-request-list arrays (kept when read-only and passed again) and whether
        # some request samples: see launch.
        self._kept_fields: tuple[int, tuple[np.ndarray, ...], bool] | None = None
        self._launched: LaunchedDraft | None = None  # launched, not yet collected: it owns the buffers
        # Recorded after each step's result copy (one launch in flight at a time: one event, made once).
        self._result_event = device_event(device=self.device) if self.device.type == "cuda" else None
        self._fill_padding(top)
        self._fill_append_padding(rows)
        # The staging buffers with every field at its padding value: one copy resets them before each step.
        self._host_np, self._where_np = self._host_int.numpy(), self._host_where.numpy()
        self._padding, self._where_padding = self._host_np.copy(), self._where_np.copy()
        self._upload()
        self._dev_where.copy_(self._host_where, non_blocking=True)
        if model.use_fused:
            model.fused_drafter()  # the stacked weights, made before any warm-up or capture
        pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        self.steps: dict[int, GraphStep] = {}
        self.append_steps: dict[int, GraphStep] = {}
        self._result_views = {size: self._host_result[:size] for size in self.sizes}
        for size in reversed(self.sizes):
            self.steps[size] = GraphStep(partial(self._step, size), mode, pool)
            self.append_steps[size] = GraphStep(partial(self._append_step, size), mode, pool)

    @property
    def max_requests(self) -> int:
        return self.sizes[-1]

    @property
    def step_time_s(self) -> float:
        """Accumulated time inside the steps (device time of the graph replays) while ``timed`` was set."""
        return sum(step.time_s for step in [*self.steps.values(), *self.append_steps.values()])

    @property
    def max_append_rows(self) -> int:
        return self.sizes[-1] * self.append_width

    def append(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        features: Sequence[torch.Tensor],
        total: int | None = None,
    ) -> None:
        """Stage the K/V writes of context rows (the concatenation of ``features``, [n, F] with n <=
        max_append_rows): request i's ``counts[i]`` rows (at most block_size + 1) go to slot ``slots[i]`` (distinct)
        from position ``starts[i]`` on. The caller validated them and updates the host-side lengths; the rows
        are written by the next propose step (or :meth:`flush`). ``total``: counts.sum(), if known."""
        self.flush()
        num = int(counts.sum()) if total is None else total
        rows = self._row_views.get(num)
        if rows is None:  # a view per row count, made once (a slice is a torch call every round)
            rows = self._row_views[num] = self.context_rows[:num]
        first = features[0]
        if len(features) == 1 and first.shape == rows.shape:
            rows.copy_(first)  # the round's rows in one tensor (converted if need be): one device copy
        else:
            try:
                if first.device != rows.device or first.dtype != rows.dtype:
                    raise TypeError("the rows need a conversion")
                torch.cat(tuple(features), out=rows)  # straight into the static buffer: one device copy
            except (TypeError, RuntimeError):
                rows.copy_(torch.cat([f.to(rows.device) for f in features]))
        self._staged_counts[slots] = counts
        self._staged_offsets[slots] = np.cumsum(counts) - counts
        self._staged_starts[slots] = starts
        self._staged_rows = num
        if int(counts.max()) > self.append_width:  # longer than a propose step's rows per request
            self.flush()

    def drop(self, slot: int) -> None:
        """Forget the staged rows of a released slot (nothing reads them; a new owner starts from 0)."""
        self._staged_rows -= int(self._staged_counts[slot])
        self._staged_counts[slot] = 0

    def flush(self) -> None:
        """Write the staged context rows now, with the bucketed append step (before anything else touches
        the context cache)."""
        num = self._staged_rows
        if not num:
            return
        counts = self._staged_counts
        slots = np.flatnonzero(counts)
        order = np.argsort(self._staged_offsets[slots], kind="stable")  # the rows' order in context_rows
        slots = slots[order]
        per_slot = counts[slots]
        first_row = np.cumsum(per_slot) - per_slot
        positions = np.repeat(self._staged_starts[slots] - first_row, per_slot) + np.arange(num)
        counts[:] = 0
        self._staged_rows = 0
        size = next(s for s in self.sizes if s * self.append_width >= num)
        self._where_fence.wait_before_write()
        where = self._where_np
        np.copyto(where, self._where_padding)
        half = self.max_append_rows
        where[:num] = np.repeat(slots, per_slot)
        where[half : half + num] = positions
        self._dev_where.copy_(self._host_where, non_blocking=True)
        self._where_fence.copies_issued()
        step = self.append_steps[size]
        step(self.timed)  # its device time is settled after the next propose's wait
        if step not in self._unsettled:
            self._unsettled.append(step)

    def _fill_append_padding(self, rows: int) -> None:
        where = self._host_where.numpy()
        half = where.shape[0] // 2
        where[:rows] = self.dummy_slot
        where[half : half + rows] = 0

    def launch(
        self,
        anchors: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        temperatures: np.ndarray,
        k_eff_and_seeds: np.ndarray,
        distinct: bool = False,
    ) -> LaunchedDraft:
        """Start drafting for R requests: anchor, anchor position and slot (int64 [R] each), temperature (float32
        [R]), effective top-k (in [1, draft_top_k]) and seed (int64 [R, 2]); ``distinct``: the slots are known to
        be. Returns once the step and its result copy are queued on the stream: the host may do other work
        while the device drafts, then :meth:`collect` (which must come before the runner is used again: the
        staging and result buffers are the launch's until then). Validated by the caller: anchors in the
        vocabulary, each slot holding exactly ``positions[r]`` context rows."""
        if self._launched is not None:
            raise RuntimeError("DraftGraphRunner: the last launched step was not collected")
        num = len(anchors)
        size = pick_bucket(num, self.sizes)
        if size is None:
            raise ValueError(f"{num} requests exceed the largest bucket {self.sizes[-1]}")
        appended = None
        if self._staged_rows:
            appended = self._staged_counts[slots]
            if distinct:  # _staged_rows is the sum of all staged counts
                outside = int(appended.sum()) != self._staged_rows
            else:
                left = self._staged_counts.copy()
                left[slots] = 0
                outside = bool(left.any())
            if outside:  # staged rows of a request outside this batch: write them all first
                self.flush()
                appended = None
        sampled = self._stage_requests(size, slots, temperatures, k_eff_and_seeds, clear_appends=appended is None)
        host = self.host
        host["anchors"][:num] = anchors
        host["positions"][:num] = positions
        if appended is not None:
            host["append_counts"][:num] = appended
            host["append_offsets"][:num] = self._staged_offsets[slots]
            host["append_starts"][:num] = self._staged_starts[slots]
            self._staged_counts[:] = 0
            self._staged_rows = 0
        self._upload()
        return self._run_step(size, num, sampled)

    def launch_behind(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        temperatures: np.ndarray,
        k_eff_and_seeds: np.ndarray,
        verified: DeviceVerified,
    ) -> LaunchedDraft:
        """Start drafting for the R requests of a verify step still queued on this device (same stream), from
        its outcome there: request r (slot ``slots[r]``, distinct, whose context holds the ``starts[r]`` rows
        before that step's anchor) appends its 1 + a_r committed rows at ``starts[r]`` onward and drafts after
        the target's last emitted token at position ``starts[r]`` + 1 + a_r. Small device ops fill the step's
        anchors, positions and append fields from ``verified`` and copy its rows into ``context_rows``, then the
        step runs as :meth:`launch`'s does: the device goes from verifying to drafting without waiting for the
        host (the next round's drafting, launched before this round's results reach the host). The caller
        vouches that the verify step's features are this runner's kind of context rows and its tokens are in
        the drafter's vocabulary, and learns the anchors, positions and appended counts from the verify step's
        results."""
        if self._launched is not None:
            raise RuntimeError("DraftGraphRunner: the last launched step was not collected")
        num = slots.size
        size = pick_bucket(num, self.sizes)
        if size is None:
            raise ValueError(f"{num} requests exceed the largest bucket {self.sizes[-1]}")
        self.flush()  # rows staged by an append since the last step are written first, in their order
        sampled = self._stage_requests(size, slots, temperatures, k_eff_and_seeds, clear_appends=False)
        self.host["append_starts"][:num] = starts
        self._upload()
        self._inputs_behind(num, verified)
        self.behind += 1
        return self._run_step(size, num, sampled)

    def _stage_requests(
        self,
        size: int,
        slots: np.ndarray,
        temperatures: np.ndarray,
        k_eff_and_seeds: np.ndarray,
        clear_appends: bool,
    ) -> bool:
        """Write the per-request fields of a step of bucket ``size`` into the staging buffer (padding rows, slots,
        sampling parameters; unless the same request list as the last step's, which the buffer still holds);
        ``clear_appends``: the kept buffer's append counts are reset (the step appends nothing). Returns whether
        some request samples."""
        host = self.host
        num = slots.size
        per_list = (slots, temperatures, k_eff_and_seeds)
        kept = self._kept_fields
        if (
            kept is not None
            and kept[0] == size
            and all(a is b and not a.flags.writeable for a, b in zip(per_list, kept[1], strict=True))
        ):
            # The same request list as the last step (an engine's kept read-only arrays): the staging buffer
            # still holds its padding rows and per-request fields; only the per-round ones are written.
            if clear_appends:
                host["append_counts"][:num] = 0
            return kept[2]
        np.copyto(self._host_np, self._padding)
        host["slots"][:num] = slots
        host["temperature"][:num] = temperatures
        host["k_eff"][:num] = k_eff_and_seeds[:, 0]
        host["seeds"][:num] = k_eff_and_seeds[:, 1]
        sampled = bool(temperatures.any())
        self._kept_fields = (size, per_list, sampled)
        return sampled

    @torch.no_grad()
    def _inputs_behind(self, num: int, verified: DeviceVerified) -> None:
        """The anchors, positions and append fields of the first ``num`` requests and their context rows, from a
        verify step's outcome on the device (queued after the upload, which wrote the append starts)."""
        dev = self.dev
        packed = verified.packed[:num]
        counts = dev["append_counts"][:num]
        torch.add(packed[:, 0], 1, out=counts)  # the anchor and the accepted drafts
        torch.gather(packed, 1, counts[:, None], out=dev["anchors"][:num, None])  # the last emitted token
        torch.add(dev["append_starts"][:num], counts, out=dev["positions"][:num])
        offsets = dev["append_offsets"][:num]
        torch.cumsum(counts, 0, out=offsets)
        offsets.sub_(counts)
        rows = min(verified.features.shape[0], num * self.append_width)
        self.context_rows[:rows].copy_(verified.features[:rows])

    def _run_step(self, size: int, num: int, sampled: bool) -> LaunchedDraft:
        """Replay the bucket's step on the uploaded inputs and queue its result copy (see :meth:`launch`)."""
        step = self.steps[size]
        packed, topk_ids, topk_probs = step(self.timed)
        ids, probs = (topk_ids, topk_probs) if num == size else (topk_ids[:num], topk_probs[:num])
        if sampled:  # start the device-side copies before waiting on the host copy
            ids, probs = ids.clone(), probs.clone()
        # The one device -> host copy of the step, into page-locked rows: queued, waited for by collect.
        self._result_views[size].copy_(packed, non_blocking=True)
        done = self._result_event
        if done is not None:
            done.record()
        # The packed rows [size, 2 * bs] hold each request's drafted ids first (float64, exact).
        self._launched = LaunchedDraft(num, step, ids, probs, done, DeviceDrafts(packed.view(-1), packed.shape[1]))
        return self._launched

    def collect(self, launched: LaunchedDraft) -> BucketedDraft:
        """Wait for a launched step's drafts (once; later calls return the same result)."""
        if launched.result is not None:
            return launched.result
        if launched is not self._launched:
            raise RuntimeError("DraftGraphRunner: this step was launched before the last one")
        if launched.done is not None:
            launched.done.synchronize()
        self._launched = None
        launched.step.settle_timing()
        for done in self._unsettled:
            done.settle_timing()
        self._unsettled.clear()
        bs = self.model.block_size
        num = launched.num
        result = self._result_np[:num]
        tokens = torch.from_numpy(result[:, :bs].astype(np.int64))
        conf = result[:, bs:].copy() if self.has_confidence else None
        launched.result = BucketedDraft(
            tokens=tokens, confidence_logits=conf, topk_ids=launched.topk_ids, topk_probs=launched.topk_probs
        )
        return launched.result

    def settle(self) -> None:
        """Collect a launched step that nobody collected yet (before anything else uses the buffers)."""
        if self._launched is not None:
            self.collect(self._launched)

    def _fill_padding(self, size: int) -> None:
        host = self.host
        host["anchors"][:size] = 0
        host["positions"][:size] = 0
        host["slots"][:size] = self.dummy_slot
        host["k_eff"][:size] = self.draft_top_k
        host["seeds"][:size] = 0
        host["temperature"][:size] = 0.0
        host["append_counts"][:size] = 0
        host["append_offsets"][:size] = 0
        host["append_starts"][:size] = 0

    def _upload(self) -> None:
        self._dev_int.copy_(self._host_int, non_blocking=True)  # the temperatures too

    def _write_context(self, rows: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """K/V of context rows [n, F] (features, or projected rows) into the cache at (slots[i], positions[i])."""
        self.model.write_context(self.cache, rows, slots, positions, projected=self.projected)

    @torch.no_grad()
    def _append_step(self, size: int) -> tuple[()]:
        rows = size * self.append_width
        half = self.max_append_rows
        self._write_context(self.context_rows[:rows], self._dev_where[:rows], self._dev_where[half : half + rows])
        return ()

    def _staged_append(self, size: int) -> None:
        """The staged rows of the bucket's requests, B * (block_size + 1) rows (see the module docstring)."""
        dev = self.dev
        k = torch.arange(self.append_width, device=self.device)[None, :]
        counts = dev["append_counts"][:size, None]
        real = k < counts
        source = torch.where(real, dev["append_offsets"][:size, None] + k, 0).reshape(-1)
        slots = torch.where(real, dev["slots"][:size, None], self.dummy_slot).reshape(-1)
        positions = torch.where(real, dev["append_starts"][:size, None] + k, 0).reshape(-1)
        self._write_context(self.context_rows[source], slots, positions)

    @torch.no_grad()
    def _step(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev, model = self.dev, self.model
        self._staged_append(size)
        anchors = dev["anchors"][:size]
        positions = dev["positions"][:size]
        x, cos, sin = model._block_inputs(anchors, positions)
        hidden = model.backbone_slots(x, cos, sin, self.cache, dev["slots"][:size], positions, self.backend)
        sample = sample_block_keyed(
            model,
            hidden,
            anchors,
            temperature=dev["temperature"][:size],
            k_eff=dev["k_eff"][:size],
            seeds=dev["seeds"][:size],
            positions=positions,
            draft_top_k=self.draft_top_k,
            backend=self.backend,
        )
        conf = sample.confidence_logits
        if conf is None:
            conf = torch.zeros((size, model.block_size), dtype=torch.float32, device=self.device)
        packed = torch.cat([sample.tokens.double(), conf.double()], dim=1)
        assert sample.topk_ids is not None and sample.topk_probs is not None
        return packed, sample.topk_ids, sample.topk_probs
