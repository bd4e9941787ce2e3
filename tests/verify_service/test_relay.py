"""The verifier's store of relayed blocks: each request verifies the block drafted for its anchor and position."""

from __future__ import annotations

import numpy as np
import torch

from cluster import contract
from draft_service.engine import Proposal
from verify_service.relay import RelayedDrafts


def _drafted(req_ids: list[str], anchors: list[int], positions: list[int], greedy: set[str]) -> dict:
    """A drafter's ``Drafted`` reply (as an ``AppendContext`` with ``return_drafts`` returns it)."""
    num = len(req_ids)
    tokens = torch.arange(num * 3).reshape(num, 3) + 100
    ids = torch.stack([tokens, tokens + 1], dim=-1)
    probs = torch.tensor([0.75, 0.25]).expand(num, 3, 2).clone()
    proposal = Proposal(req_ids, tokens, np.linspace(0.9, 0.1, num * 3).reshape(num, 3), None, ids, probs)
    return {**contract.proposal_reply(proposal, greedy), "req_ids": req_ids, "anchors": anchors,
            "positions": positions}


def test_each_request_verifies_its_block_up_to_its_length_and_a_block_is_used_once() -> None:
    relayed = RelayedDrafts()
    relayed.store(_drafted(["g", "s"], [5, 6], [10, 20], greedy={"g"}))
    out = relayed.take(["s", "g"], [6, 5], [20, 10], [2, 5])
    items = list(out.batch)
    assert out.missing == 0 and len(relayed) == 0
    assert [(i.req_id, i.anchor, list(i.draft_tokens), i.position) for i in items] == [
        ("s", 6, [103, 104], 20), ("g", 5, [100, 101, 102], 10)  # "g" asked 5 of a block of 3: all 3
    ]
    assert items[1].draft_prob_ids is None  # greedy: its distribution stayed on the drafter
    assert items[0].draft_prob_ids is not None and items[0].draft_probs is not None
    assert items[0].draft_prob_ids[:, 1].tolist() == [104, 105] and items[0].draft_probs[:, 0].tolist() == [0.75] * 2
    assert out.confidences is not None
    assert torch.allclose(out.confidences[0], torch.tensor(np.linspace(0.9, 0.1, 6)[3:]))
    again = relayed.take(["s"], [6], [20], [2])  # taken already: verified with no drafts
    assert again.missing == 1 and again.batch[0].draft_tokens == [] and again.confidences is None


def test_a_block_drafted_for_another_anchor_or_position_or_released_is_missing() -> None:
    relayed = RelayedDrafts()
    relayed.store(_drafted(["a", "b", "c"], [1, 2, 3], [7, 8, 9], greedy={"a", "b", "c"}))
    relayed.drop(["c"])
    out = relayed.take(["a", "b", "c"], [1, 9, 3], [7, 8, 9], [3, 3, 3])
    assert out.missing == 2
    assert out.batch.num_drafts.tolist() == [3, 0, 0]
    assert out.confidences is not None and out.confidences[1:].abs().sum() == 0
    relayed.store(_drafted(["a"], [1], [7], greedy=set()))
    relayed.store(_drafted(["a"], [4], [8], greedy=set()))  # a newer block replaces the older
    assert relayed.take(["a"], [1], [7], [3]).missing == 1
