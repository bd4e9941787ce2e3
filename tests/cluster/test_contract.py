"""The wire contract (cluster/contract.py): every server serves exactly the contract's methods of its service with
their request schemas, the round messages survive build -> wire -> parse unchanged, and a client refuses a reply
that breaks the contract (WireError naming the field) instead of failing later on a missing key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cluster import contract
from cluster.messages import validate
from cluster.rpc import ServerThread, Service, SyncRpcClient
from cluster.wire import WireError, decode, encode
from draft_service.engine import DraftItem, Proposal
from kernels.sampling import SamplingParams
from verify_service.engine import PrefillItem, StepResult, StepResults, VerifyBatch, VerifyItem


def _methods_of(service: str) -> set[str]:
    return {
        m.name for m in vars(contract).values() if isinstance(m, contract.Method) and m.service == service
    } | ({m.name for m in contract.BACKEND_METHODS[service]} if service in contract.BACKEND_METHODS else set())


def test_every_method_is_declared_once_per_service() -> None:
    assert _methods_of(contract.VERIFIER) == {"Info", "Step", "Release"}
    assert _methods_of(contract.DRAFTER) == {
        "Info", "AddRequests", "AppendContext", "Propose", "Release", "OpenLink", "CloseLink"
    }
    assert _methods_of(contract.SCHEDULER) == {"Generate", "Abort", "Metrics", "Info", "ModelInfo", "Route", "Release"}
    assert _methods_of(contract.ENGINE) == {"Generate", "Abort", "Metrics", "Info", "ModelInfo"}


def test_a_service_refuses_a_method_of_another_service() -> None:
    async def handler(request: dict[str, Any]) -> dict[str, Any]:
        return {}

    with pytest.raises(ValueError, match="cannot serve"):
        contract.service(contract.DRAFTER, {contract.STEP: handler})


def _wire(message: dict[str, Any], schema: Any) -> dict[str, Any]:
    """What the other end reads: encoded, decoded and validated as the transport does."""
    return validate(schema, decode(encode(message)))


def test_step_request_and_reply_round_trip() -> None:
    prefills = [PrefillItem("p", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4)),
                PrefillItem("q", [4], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, seed=3), anchor=9)]
    verifies = [
        VerifyItem("g", 5, [6, 7], position=12),  # greedy: no distribution, one-hot rows on the wire
        VerifyItem("s", 8, [9], torch.tensor([[9, 2]]), torch.tensor([[0.75, 0.25]]), position=4),
        VerifyItem("e", 3, []),
    ]
    message = contract.step_request(
        prefills, verifies, {"d0": ["g", "s"]}, inline_features=True, relay_drafts=True
    )
    got_prefills, got_verifies = contract.parse_step_request(_wire(message, contract.STEP.request))
    assert [(p.req_id, list(p.token_ids), p.params, p.anchor) for p in got_prefills] == [
        (p.req_id, list(p.token_ids), p.params, p.anchor) for p in prefills
    ]
    assert [(v.req_id, v.anchor, list(v.draft_tokens), v.position) for v in got_verifies] == [
        ("g", 5, [6, 7], 12), ("s", 8, [9], 4), ("e", 3, [], None)
    ]
    g, s = got_verifies[0], got_verifies[1]
    assert g.draft_prob_ids is not None and g.draft_probs is not None
    assert g.draft_prob_ids[:, 0].tolist() == [6, 7] and g.draft_probs[:, 0].tolist() == [1.0, 1.0]
    assert s.draft_prob_ids is not None and s.draft_probs is not None
    assert s.draft_prob_ids.tolist() == [[9, 2]] and s.draft_probs.tolist() == [[0.75, 0.25]]

    features = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    results = [StepResult("g", 2, 1, [6, 11], 12, None), StepResult("e", 0, 0, [4], 3, features)]
    inline = contract.InlineFeatures(["e"], [3], features)
    reply = contract.step_reply(StepResults.of([r._replace(features=None) for r in results]), inline, engine_s=0.002)
    parsed = contract.parse_step_reply(_wire(reply, contract.STEP.reply))
    assert [(r.req_id, r.num_drafts, r.num_accepted, r.tokens, r.feature_start) for r in parsed] == [
        ("g", 2, 1, [6, 11], 12), ("e", 0, 0, [4], 3)
    ]
    assert parsed[0].features is None and parsed[1].features is not None
    assert torch.equal(parsed[1].features, features)


def test_a_verify_batch_travels_as_its_items_do() -> None:
    """A :class:`VerifyBatch` (the round driver's arrays) makes the same ``Step`` as the items it stands for, and
    a ``Step`` whose positions are all given parses back into a batch of those items."""
    batch = VerifyBatch(
        ["g", "s", "z"],
        np.array([5, 8, 3]),
        np.array([12, 4, 7]),
        np.array([[6, 7, 1], [9, 2, 4], [1, 1, 1]]),
        np.array([2, 3, 0]),
        [1],
        torch.tensor([[[0, 0]] * 3, [[9, 2], [2, 9], [4, 5]], [[0, 0]] * 3]),
        torch.tensor([[[0.0, 0.0]] * 3, [[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]], [[0.0, 0.0]] * 3]),
    )
    from_batch = _wire(contract.step_request((), batch, {}, inline_features=True), contract.STEP.request)
    from_items = _wire(contract.step_request((), list(batch), {}, inline_features=True), contract.STEP.request)
    assert from_batch.keys() == from_items.keys()
    for key, value in from_batch.items():
        assert torch.equal(value, from_items[key]) if isinstance(value, torch.Tensor) else value == from_items[key]
    _, parsed = contract.parse_step_request(from_batch)
    assert isinstance(parsed, VerifyBatch)
    for got, want in zip(parsed, batch, strict=True):
        assert (got.req_id, got.anchor, list(got.draft_tokens), got.position) == (
            want.req_id, want.anchor, list(want.draft_tokens), want.position
        )
    g, s, z = parsed
    assert g.draft_prob_ids is not None and g.draft_prob_ids[:, 0].tolist() == [6, 7]  # one-hot rows, as before
    assert s.draft_probs is not None and batch.topk_probs is not None
    assert torch.equal(s.draft_probs, batch.topk_probs[1])
    assert z.draft_prob_ids is None and not z.draft_tokens


def test_a_relayed_step_names_lengths_and_no_draft_tokens() -> None:
    """A relayed ``Step`` carries each verification's planned length instead of its drafts; a message that mixes
    both, or leaves a position out, is refused."""
    prefills = [PrefillItem("p", [1, 2], SamplingParams(temperature=0.0, max_tokens=4))]
    message = contract.relayed_step_request(
        prefills, ["a", "b"], [5, 6], [10, 3], [4, 0], {"d0": ["a", "b", "p"]}, inline_features=False
    )
    wired = _wire(message, contract.STEP.request)
    assert wired["verify_lengths"] == [4, 0] and wired["relay_drafts"] and wired["verify_tokens"].numel() == 0
    got_prefills, got_verifies = contract.parse_step_request(wired)
    assert [p.req_id for p in got_prefills] == ["p"]
    assert [(v.req_id, v.anchor, list(v.draft_tokens), v.position) for v in got_verifies] == [
        ("a", 5, [], 10), ("b", 6, [], 3)
    ]
    for broken in (
        {**wired, "verify_lengths": [4]},
        {**wired, "verify_positions": [10, -1]},
        {**wired, "verify_counts": [1, 0], "verify_tokens": torch.tensor([7])},
    ):
        with pytest.raises(ValueError, match="relayed step"):
            contract.parse_step_request(broken)
    confidences = torch.tensor([[0.9, 0.5], [0.0, 0.0]], dtype=torch.float64)
    reply = contract.step_reply(
        StepResults.of([]), None, engine_s=0.001, relayed_confidences=confidences, relay_missing=1, drafts_s=0.003
    )
    wired_reply = _wire(reply, contract.STEP.reply)
    assert torch.equal(wired_reply["relayed_confidences"], confidences) and wired_reply["relay_missing"] == 1
    assert wired_reply["drafts_ms"] == pytest.approx(3.0)


def test_propose_and_appended_drafts_round_trip() -> None:
    items = [DraftItem("a", 1, 5), DraftItem("b", 2, 9)]
    assert contract.parse_propose_request(_wire(contract.propose_request(items), contract.PROPOSE.request)) == items
    proposal = Proposal(
        req_ids=["a", "b"],
        tokens=torch.tensor([[3, 4], [5, 6]]),
        confidences=torch.tensor([[0.9, 0.5], [0.8, 0.1]], dtype=torch.float64).numpy(),
        confidence_logits=None,
        topk_ids=torch.tensor([[[3, 1], [4, 1]], [[5, 1], [6, 1]]]),
        topk_probs=torch.tensor([[[0.6, 0.4], [0.7, 0.3]], [[0.5, 0.5], [0.9, 0.1]]]),
    )
    reply = {**contract.proposal_reply(proposal, {"a"}), "engine_ms": 0.5, "wait_ms": 0.0}
    got = _wire(reply, contract.PROPOSE.reply)
    assert got["distribution_rows"] == [1]  # "a" is greedy: only "b"'s distribution travels
    assert got["topk_ids"].tolist() == [[[5, 1], [6, 1]]]
    assert torch.equal(got["tokens"], proposal.tokens)
    drafted = {**contract.proposal_reply(proposal, set()), "req_ids": ["a", "b"], "anchors": [1, 2]}
    drafted["positions"] = [5, 9]
    appended = _wire({"drafts": drafted}, contract.APPEND_CONTEXT.reply)
    assert appended["drafts"]["positions"] == [5, 9] and appended["drafts"]["distribution_rows"] is None


def test_a_reply_that_breaks_the_contract_fails_the_call_naming_the_field() -> None:
    """A 'verifier' whose Info reply lacks fields and mistypes one: the client's call raises WireError."""

    async def info(request: dict[str, Any]) -> dict[str, Any]:
        return {"vocab_size": "many", "max_seq_len": 64}

    server = ServerThread([Service(contract.VERIFIER, {"Info": (info, contract.VERIFIER_INFO.request)})])
    try:
        with SyncRpcClient(server.address, timeout_s=10) as client:
            assert client.call(contract.VERIFIER, "Info", {})["vocab_size"] == "many"  # unchecked transport
            with pytest.raises(WireError, match=r"VerifierInfo: vocab_size: expected int, got str"):
                contract.VERIFIER_INFO.call(client, {})
    finally:
        server.stop()
