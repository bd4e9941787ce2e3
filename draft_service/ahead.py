"""Drafting ahead: a request's next block drafted as soon as its context rows arrive from the verifier.

The verifier knows each request's next anchor (the last token it emitted) and position (the committed length) the
moment its step ends, and it pushes the committed context features to the drafter itself. A drafter told the
anchors in that push drafts their blocks right away, while the verifier's reply travels to the scheduler and the
scheduler commits the round; the scheduler's ``Propose`` then collects the drafts instead of waiting for them.

Nothing about the drafts changes: they come from the same ``propose`` over the same context (randomness is keyed
by request seed and position, never by the batch), and a ``Propose`` whose anchor or position differs from what was
drafted ahead (or for a request without a draft ahead) is drafted afresh. Only the batch a draft shares can differ
from an in-process round (e.g. by a request that finished meanwhile), which may change the float rounding of the
drafter's matmuls (so, rarely, a draft), never the output: the verifier decides every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from draft_service.engine import DraftItem, Proposal


class DraftAhead:
    """Per request, the row of a proposal drafted ahead for (anchor, position); used once, then dropped."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, int, Proposal, int]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def store(self, items: Sequence[DraftItem], proposal: Proposal) -> None:
        for row, item in enumerate(items):
            self._rows[item.req_id] = (item.anchor, item.position, proposal, row)

    def drop(self, req_id: str) -> None:
        self._rows.pop(req_id, None)

    def take(self, items: Sequence[DraftItem]) -> Proposal | None:
        """The proposal for exactly these items when every one was drafted ahead for its anchor and position."""
        found = [self._rows.get(item.req_id) for item in items]
        for entry, item in zip(found, items, strict=True):
            if entry is None or entry[0] != item.anchor or entry[1] != item.position:
                return None
        for item in items:
            del self._rows[item.req_id]
        rows = [(e[2], e[3]) for e in found if e is not None]
        first = rows[0][0]
        if len(rows) == len(first.req_ids) and all(p is first and r == i for i, (p, r) in enumerate(rows)):
            return first
        return gather_rows(rows)


def gather_rows(rows: list[tuple[Proposal, int]]) -> Proposal:
    """A proposal made of rows of other proposals (same drafter, so the same shapes)."""

    def stack(name: str) -> torch.Tensor:
        return torch.stack([getattr(p, name)[r] for p, r in rows])

    def stack_np(name: str) -> np.ndarray | None:
        if getattr(rows[0][0], name) is None:
            return None
        return np.stack([getattr(p, name)[r] for p, r in rows])

    return Proposal(
        req_ids=[p.req_ids[r] for p, r in rows],
        tokens=stack("tokens"),
        confidences=stack_np("confidences"),
        confidence_logits=stack_np("confidence_logits"),
        topk_ids=stack("topk_ids"),
        topk_probs=stack("topk_probs"),
    )
