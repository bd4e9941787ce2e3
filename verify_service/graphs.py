"""The bucketed verify step: target pass + rejection sampling for R requests, replayable as one CUDA graph.

Layout (static for a bucket of B requests, W = max_drafts + 1 rows each): request r owns rows r*W .. r*W+W-1
of the flattened batch and fills the first ``query_len`` of them with [anchor, x_1..x_l]; the other rows, and
the requests r >= R that only pad the bucket, are padding whose K/V go to a reserved dummy slot (see
:meth:`CachedAttentionMetadata.bucketed`). Everything the step needs lives in device buffers the host fills
with one copy per dtype; the step itself never reads a device value on the host.

The rejection sampler wants a ragged layout with N + R target rows. Inside the step the real rows are
gathered into that layout and one extra greedy request (the "sink") takes all the draft slots the real
requests did not use, so the sampler sees static sizes (N = B * max_drafts drafts, B + 1 requests) while
every real request gets exactly its own l_r drafts. Results are packed into one [B, 1 + W] int64 tensor
(accepted count, then the emitted tokens), copied to the host once; the context features of the committed
rows (anchor + accepted drafts) are compacted on the device, request after request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from cluster.graphs import DEFAULT_BUCKETS, GraphStep, StagingFence, bucket_sizes, pick_bucket, pinned_empty
from kernels.rejection import RejectionOutput
from verify_service.attention import CachedAttentionMetadata
from verify_service.kv_cache import SlotKVCache
from verify_service.target import TargetModel

Sampler = Callable[..., RejectionOutput]


@dataclass(frozen=True)
class BucketedVerifyOutput:
    """Results of one bucketed step, per request in call order.

    ``features``: the committed rows (anchor + accepted drafts, 1 + num_accepted[r] each) of every request
    back to back, a fresh tensor; None without feature layers.
    """

    num_accepted: list[int]
    tokens: list[list[int]]
    features: torch.Tensor | None


class VerifyGraphRunner:
    """Static buffers and one (captured) step per bucket size for a VerifyEngine's target and KV cache."""

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
    ) -> None:
        if max_drafts < 1 or draft_top_k < 1:
            raise ValueError("VerifyGraphRunner: max_drafts and draft_top_k must be >= 1")
        if cache.max_seq_len < max_drafts + 1:
            raise ValueError("VerifyGraphRunner: the KV slots are shorter than one verify chunk")
        self.target = target
        self.cache = cache
        self.dummy_slot = dummy_slot
        self.gamma = max_drafts
        self.width = max_drafts + 1
        self.draft_top_k = draft_top_k
        self.sizes = bucket_sizes(max_requests, buckets)
        self.sampler = sampler
        self.device = target.device
        self.backend = "triton" if self.device.type == "cuda" else "reference"
        self.timed = False
        top = self.sizes[-1]
        width, gamma = self.width, self.gamma
        # One int64 staging buffer whose tail holds the float32 fields (a float32 view of it): the host fills it
        # and one copy moves all the inputs to the device.
        self._int_fields = {
            "ids": top * width,
            "slots": top,
            "context_lens": top,
            "query_lens": top,
            "top_k": top,
            "seeds": top,
            "dist_rows": top * gamma,
        }
        self._float_fields = {"temperature": top, "top_p": top}
        num_int, num_float = sum(self._int_fields.values()), sum(self._float_fields.values())
        self._host_int = pinned_empty((num_int + (num_float + 1) // 2,), torch.int64, self.device)
        self._dev_int = torch.zeros_like(self._host_int, device=self.device)
        self._host_float = self._host_int[num_int:].view(torch.float32)[:num_float]
        self._dev_float = self._dev_int[num_int:].view(torch.float32)[:num_float]
        self._fence = StagingFence(self.device)
        self.host = _split(self._host_int.numpy(), self._int_fields) | _split(
            self._host_float.numpy(), self._float_fields
        )
        self.dev = _split(self._dev_int, self._int_fields) | _split(self._dev_float, self._float_fields)
        self.dist_ids = torch.zeros((top * gamma, draft_top_k), dtype=torch.int64, device=self.device)
        self.dist_probs = torch.zeros((top * gamma, draft_top_k), dtype=torch.float32, device=self.device)
        # Warm-up and capture run the step for real: with every request padding, it only writes the dummy slot.
        self._fill_padding(top)
        # Every field of the staging buffer at its padding value: one copy resets it before each step.
        self._host_np = self._host_int.numpy()
        self._padding = self._host_np.copy()
        self._upload()
        pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        self.steps: dict[int, GraphStep] = {}
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            self.steps[size] = GraphStep(partial(self._step, size), mode, pool)

    # ------------------------------------------------------------------------------------------------ host
    def fits(self, num_requests: int, max_chunk: int, max_dist_width: int) -> bool:
        """Whether a verify-only batch can take the bucketed path (else the engine runs it eagerly)."""
        return (
            1 <= num_requests <= self.sizes[-1]
            and max_chunk <= self.width
            and max_dist_width <= self.draft_top_k
        )

    @property
    def step_time_s(self) -> float:
        """Accumulated time inside the step (device time of the graph replays) while ``timed`` was set."""
        return sum(step.time_s for step in self.steps.values())

    def run(
        self,
        slots: np.ndarray,
        context_lens: np.ndarray,
        tokens: np.ndarray,
        num_drafts: np.ndarray,
        sampling_float: np.ndarray,
        sampling_int: np.ndarray,
        dists: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> BucketedVerifyOutput:
        """Verify request r's anchor ``tokens[r]`` and its ``num_drafts[r]`` drafts (``tokens[R:]`` holds every
        request's drafts back to back) given its slot, cached length (int64 [R] each), (temperature, top_p)
        float32 [R, 2] and (top_k, seed) int64 [R, 2], and the sparse draft distributions (r, ids, probs)
        [l_r, <=K] of the requests that sample (greedy ones need none).

        The caller has validated everything (VerifyEngine._validate) and advances the slot lengths after.
        """
        num = len(slots)
        size = pick_bucket(num, self.sizes)
        if size is None:
            raise ValueError(f"{num} requests exceed the largest bucket {self.sizes[-1]}")
        self._fence.wait_before_write()
        np.copyto(self._host_np, self._padding)
        host, width, gamma = self.host, self.width, self.gamma
        host["slots"][:num] = slots
        host["context_lens"][:num] = context_lens
        host["temperature"][:num] = sampling_float[:, 0]
        host["top_p"][:num] = sampling_float[:, 1]
        host["top_k"][:num] = sampling_int[:, 0]
        host["seeds"][:num] = sampling_int[:, 1]
        host["query_lens"][:num] = num_drafts + 1
        ids = host["ids"][: num * width].reshape(num, width)
        ids[:, 0] = tokens[:num]
        flat = tokens[num:]
        total = flat.size
        if total == num * gamma:  # every request verifies its whole block
            ids[:, 1:] = flat.reshape(num, gamma)
        elif total:
            first = np.cumsum(num_drafts) - num_drafts
            columns = np.arange(1, total + 1) - np.repeat(first, num_drafts)
            ids[np.repeat(np.arange(num), num_drafts), columns] = flat
        dist_ids: list[torch.Tensor] = []
        dist_probs: list[torch.Tensor] = []
        dist_rows: list[int] = []
        for r, prob_ids, probs in dists:
            wide_ids, wide_probs = _widen(prob_ids, probs, self.draft_top_k)
            dist_ids.append(wide_ids)
            dist_probs.append(wide_probs)
            dist_rows.extend(range(r * gamma, r * gamma + int(num_drafts[r])))
        host["dist_rows"][: len(dist_rows)] = dist_rows
        self._upload()
        if dist_rows:
            index = self.dev["dist_rows"][: len(dist_rows)]
            with torch.no_grad():  # the caller's tensors may carry grad; the static buffers never do
                self.dist_ids.index_copy_(0, index, torch.cat(dist_ids).to(self.device))
                self.dist_probs.index_copy_(0, index, torch.cat(dist_probs).to(self.device))
        step = self.steps[size]
        packed, features = step(self.timed)
        result = packed[:num].cpu().numpy()  # the one device -> host copy (and wait) of the step
        step.settle_timing()
        accepted = result[:, 0].tolist()
        rows = result[:, 1:].tolist()
        tokens = [row[: 1 + a] for row, a in zip(rows, accepted, strict=True)]
        kept = None if features is None else features[: num + sum(accepted)].clone()
        return BucketedVerifyOutput(accepted, tokens, kept)

    def _fill_padding(self, size: int) -> None:
        """Every request of the bucket padding: one anchor row in the dummy slot, greedy, no drafts."""
        host = self.host
        host["ids"][: size * self.width] = 0
        host["slots"][:size] = self.dummy_slot
        host["context_lens"][:size] = 0
        host["query_lens"][:size] = 1
        host["top_k"][:size] = 0
        host["seeds"][:size] = 0
        host["temperature"][:size] = 0.0
        host["top_p"][:size] = 1.0

    def _upload(self) -> None:
        self._dev_int.copy_(self._host_int, non_blocking=True)  # the float fields too
        self._fence.copies_issued()

    # ------------------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def _step(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device-only: target pass over the bucket, sampler layout, rejection sampling, packed results."""
        dev, width, gamma = self.dev, self.width, self.gamma
        device = self.device
        slots = dev["slots"][:size]
        context_lens = dev["context_lens"][:size]
        query_lens = dev["query_lens"][:size]
        ids = dev["ids"][: size * width]
        meta = CachedAttentionMetadata.bucketed(
            slots, context_lens, query_lens, width, self.dummy_slot, self.target.query_groups, self.backend
        )
        out = self.target.run_layers(self.cache, ids, meta)

        # Sampler layout: request r's target rows at cu[r] + r + k (k = 0..l_r), its drafts at cu[r] + k - 1;
        # the sink request (index `size`) owns the unused draft slots up to size * gamma.
        k = torch.arange(width, device=device)
        requests = torch.arange(size, device=device)
        num_drafts = query_lens - 1
        cu = torch.zeros(size + 2, dtype=torch.int64, device=device)
        cu[1 : size + 1] = torch.cumsum(num_drafts, 0)
        # fill_, never cu[i] = x: on CUDA that writes a host scalar with a copy, which a graph capture refuses.
        cu[size + 1 :].fill_(size * gamma)
        real = k[None, :] < query_lens[:, None]  # [B, W]
        num_rows = size * width + 1
        row_dest = torch.where(real, cu[:size, None] + requests[:, None] + k[None, :], num_rows)
        source_row = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        source_row.index_copy_(0, row_dest.reshape(-1), torch.arange(size * width, device=device))
        logits = out.logits[source_row[:num_rows]]

        is_draft = real & (k[None, :] >= 1)
        draft_dest = torch.where(is_draft, cu[:size, None] + k[None, :] - 1, size * gamma).reshape(-1)
        draft_tokens = torch.zeros(size * gamma + 1, dtype=torch.int64, device=device)
        draft_tokens = draft_tokens.index_copy(0, draft_dest, ids)[: size * gamma]
        # Draft distribution rows: draft j of request r sits at dist row r * gamma + j.
        dist_dest = draft_dest.view(size, width)[:, 1:].reshape(-1)
        prob_ids = torch.zeros((size * gamma + 1, self.draft_top_k), dtype=torch.int64, device=device)
        prob_ids = prob_ids.index_copy(0, dist_dest, self.dist_ids[: size * gamma])[: size * gamma]
        probs = torch.zeros((size * gamma + 1, self.draft_top_k), dtype=torch.float32, device=device)
        probs = probs.index_copy(0, dist_dest, self.dist_probs[: size * gamma])[: size * gamma]
        # The sink's probability rows stay 0: it is greedy, so the sampler never reads them.

        def with_sink(values: torch.Tensor, sink: float) -> torch.Tensor:
            return torch.cat([values[:size], torch.full((1,), sink, dtype=values.dtype, device=device)])

        sampled = self.sampler(
            logits,
            draft_tokens,
            probs,
            cu,
            with_sink(dev["temperature"], 0.0),
            with_sink(dev["top_k"], 0),
            with_sink(dev["top_p"], 1.0),
            with_sink(dev["seeds"], 0),
            with_sink(context_lens, 0),
            draft_prob_ids=prob_ids,
            validate=False,
        )
        accepted = sampled.num_accepted[:size]
        first_row = cu[:size] + requests
        emitted = sampled.output_tokens[(first_row[:, None] + k[None, :]).clamp(max=num_rows - 1)]
        emitted = torch.where(k[None, :] <= accepted[:, None], emitted, -1)
        packed = torch.cat([accepted[:, None], emitted], dim=1)

        features = None
        if out.features is not None:
            committed = k[None, :] <= accepted[:, None]  # anchor + accepted drafts
            counts = accepted + 1
            offsets = torch.cumsum(counts, 0) - counts
            feature_dest = torch.where(committed, offsets[:, None] + k[None, :], size * width).reshape(-1)
            features = torch.zeros(
                (size * width + 1, out.features.shape[1]), dtype=out.features.dtype, device=device
            )
            features = features.index_copy(0, feature_dest, out.features)[: size * width]
        return packed, features


def _split(buffer: torch.Tensor | np.ndarray, fields: dict[str, int]) -> dict:
    """Named consecutive views of a flat buffer."""
    views = {}
    offset = 0
    for name, length in fields.items():
        views[name] = buffer[offset : offset + length]
        offset += length
    return views


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
