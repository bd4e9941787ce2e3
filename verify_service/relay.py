"""Relayed drafts: the drafters' next blocks, returned to the verifier with its feature pushes and verified there.

A verifier's feature push names each request's next anchor, so the drafter drafts the next block at once
(:mod:`draft_service.ahead`); a push that says ``return_drafts`` gets that block back in its reply. The verifier
keeps the blocks here, per request, with the anchor and position they were drafted for. A relayed ``Step`` names
each request's anchor, position and planned length, and the verifier verifies the first ``length`` drafts of the
block drafted for exactly that anchor and position. So the drafts never travel through the scheduler, and a round
whose lengths were planned before its drafts exist costs one message each way between the scheduler and the
verifier; the drafting runs while the previous step's reply travels and the scheduler commits it.

Lossless: the blocks are the ones a ``Propose`` would have returned (the same drafts made ahead, with their
distributions for sampled requests), the lengths come from the scheduler (counts and earlier rounds'
confidences), and a request whose block is missing (its push failed or is late, or the block was drafted for
another anchor) is verified with no drafts: a plain target round for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from verify_service.engine import VerifyBatch


class _Row(NamedTuple):
    """Where a request's block sits: row ``row`` of a drafter's reply, distribution row ``dist_row`` (None: the
    request is greedy and its distribution stayed on the drafter)."""

    anchor: int
    position: int
    reply: dict[str, Any]
    row: int
    dist_row: int | None


class Relayed(NamedTuple):
    """A relayed step's verifications: the batch, the confidences of its blocks ([R, gamma], zeros for a missing
    block; None when the drafter has no confidence head or no block was found) and how many were missing."""

    batch: VerifyBatch
    confidences: torch.Tensor | None
    missing: int


class RelayedDrafts:
    """Per request, the last block its drafter returned; each block is verified at most once."""

    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def store(self, drafted: dict[str, Any]) -> None:
        """Keep the blocks of a drafter's ``Drafted`` reply (they replace the requests' earlier blocks)."""
        dist_rows = drafted["distribution_rows"]
        where = None if dist_rows is None else {row: k for k, row in enumerate(dist_rows)}
        for row, (req_id, anchor, position) in enumerate(
            zip(drafted["req_ids"], drafted["anchors"], drafted["positions"], strict=True)
        ):
            dist_row = row if where is None else where.get(row)
            self._rows[req_id] = _Row(int(anchor), int(position), drafted, row, dist_row)

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._rows.pop(req_id, None)

    def take(
        self, req_ids: list[str], anchors: Sequence[int], positions: Sequence[int], lengths: Sequence[int]
    ) -> Relayed:
        """The verifications of a relayed step: request i verifies the first ``lengths[i]`` drafts of the block
        drafted for (``anchors[i]``, ``positions[i]``), all of it when shorter, none when there is no such
        block. The blocks taken are forgotten."""
        found: list[_Row | None] = []
        for req_id, anchor, position in zip(req_ids, anchors, positions, strict=True):
            entry = self._rows.pop(req_id, None)
            ok = entry is not None and entry.anchor == int(anchor) and entry.position == int(position)
            found.append(entry if ok else None)
        rows = [e for e in found if e is not None]
        num = len(req_ids)
        gamma = max((int(e.reply["tokens"].shape[1]) for e in rows), default=0)
        drafts = np.zeros((num, gamma), dtype=np.int64)
        num_drafts = np.zeros(num, dtype=np.int64)
        with_confidence = bool(rows) and all(e.reply["confidences"] is not None for e in rows)
        confidences = torch.zeros(num, gamma, dtype=torch.float64) if with_confidence else None
        sampled = [i for i, e in enumerate(found) if e is not None and e.dist_row is not None and lengths[i]]
        width = max((int(e.reply["topk_ids"].shape[-1]) for e in rows if e.dist_row is not None), default=1)
        topk_ids = torch.zeros(num, gamma, width, dtype=torch.int64) if sampled else None
        topk_probs = torch.zeros(num, gamma, width, dtype=torch.float32) if sampled else None
        for i, entry in enumerate(found):
            if entry is None:
                continue
            block = entry.reply["tokens"][entry.row]
            n = int(block.shape[0])
            drafts[i, :n] = block.numpy()
            num_drafts[i] = min(int(lengths[i]), n)
            if confidences is not None:
                confidences[i, :n] = entry.reply["confidences"][entry.row].to(torch.float64)
            if topk_ids is not None and topk_probs is not None and entry.dist_row is not None:
                ids, probs = entry.reply["topk_ids"][entry.dist_row], entry.reply["topk_probs"][entry.dist_row]
                topk_ids[i, :n, : ids.shape[-1]] = ids.to(torch.int64)
                topk_probs[i, :n, : probs.shape[-1]] = probs.to(torch.float32)
        batch = VerifyBatch(
            req_ids,
            np.asarray(anchors, dtype=np.int64),
            np.asarray(positions, dtype=np.int64),
            drafts,
            num_drafts,
            sampled,
            topk_ids,
            topk_probs,
        )
        return Relayed(batch, confidences, num - len(rows))
