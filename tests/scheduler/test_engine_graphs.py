"""The CUDA-graph path of the engines: bucketing, the padded (bucketed) verify and draft steps, exactness.

On CPU the bucketed steps run in mode ``static`` (the exact code a CUDA graph records, run eagerly, with the
slot attention's torch reference), so the padding / dummy-slot / sampler-layout logic is tested here; the GPU
test at the end captures real CUDA graphs and runs through the device tool. That the step bodies hold nothing a
capture refuses is checked on CPU by test_graph_capture_guard.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_factory import PairSpec, write_pair

from draft_service.checkpoint import load_draft_model
from draft_service.engine import ContextBatch, ContextItem, DraftEngine, DraftItem
from kernels.graphs import DeviceDrafts, bucket_sizes, check_graph_mode, pick_bucket
from kernels.launch import interpreting
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.service_levels import ServiceLevels
from scheduler.sps import SPSTable
from verify_service.engine import PrefillItem, VerifyEngine, VerifyItem
from verify_service.target import TargetModel

BUCKETS = (1, 2, 4, 8)


def _sps() -> SPSTable:
    return SPSTable([1, 8, 16, 32, 64, 128, 256], [1000, 990, 960, 900, 700, 450, 250])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[TargetModel, object]:
    spec = PairSpec(vocab=128, hidden=32, block_size=5, markov_rank=8, target_layer_ids=(-1, 1, 2), seed=5)
    target_dir, draft_dir = write_pair(tmp_path_factory.mktemp("graphs"), spec)
    drafter = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=drafter.config.target_layer_ids)
    return target, drafter


def test_bucket_sizes_and_pick() -> None:
    assert bucket_sizes(12, BUCKETS) == (1, 2, 4, 8, 12)
    assert bucket_sizes(8, BUCKETS) == (1, 2, 4, 8)
    assert bucket_sizes(3, (1, 2, 4, 8, 16)) == (1, 2, 3)
    sizes = bucket_sizes(128)
    assert sizes == (1, 2, 4, 8, 16, 32, 64, 128)
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 5, 32, 33, 128)] == [1, 2, 4, 8, 32, 64, 128]
    assert pick_bucket(129, sizes) is None
    with pytest.raises(ValueError, match="at least one request"):
        pick_bucket(0, sizes)
    with pytest.raises(ValueError, match="max_requests"):
        bucket_sizes(0)


def test_graph_modes_are_checked(pair) -> None:
    target, drafter = pair
    with pytest.raises(ValueError, match="unknown graph mode"):
        check_graph_mode("eager", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        VerifyEngine(target, 2, 32, graphs="capture", max_drafts=5)
    with pytest.raises(ValueError, match="needs max_drafts"):
        VerifyEngine(target, 2, 32, graphs="static")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DraftEngine(drafter, 2, 32, graphs="capture")


def test_dummy_slots_are_reserved_not_counted(pair) -> None:
    target, drafter = pair
    verify = VerifyEngine(target, 3, 32, graphs="static", max_drafts=5, graph_buckets=BUCKETS)
    draft = DraftEngine(drafter, 3, 32, graphs="static", graph_buckets=BUCKETS)
    assert verify.cache.num_slots == 4 and verify.num_free_slots == 3
    assert draft.cache.num_slots == 4 and draft.num_free_slots == 3
    verify.step([PrefillItem(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0)) for i in range(3)])
    for i in range(3):
        draft.add_request(f"r{i}", SamplingParams(temperature=0.0))
    assert verify.num_free_slots == 0 and draft.num_free_slots == 0
    used = {verify._requests[f"r{i}"].slot for i in range(3)}
    assert verify.graphs is not None and verify.graphs.dummy_slot not in used
    with pytest.raises(ValueError):
        draft.add_request("r3", SamplingParams(temperature=0.0))


def _prefilled(target: TargetModel, mode: str, prompts: list[list[int]], params: list[SamplingParams], seq: int):
    engine = VerifyEngine(target, 8, seq, graphs=mode, max_drafts=5, draft_top_k=4, graph_buckets=BUCKETS)
    results = engine.step([PrefillItem(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))])
    return engine, [r.tokens[0] for r in results]


def test_bucketed_verify_step_equals_eager(pair) -> None:
    """Mixed draft counts (0..gamma), greedy and sampled requests with narrower sparse distributions, and a
    request whose chunk ends exactly at the end of its KV slot: same tokens, KV and features as eager."""
    target, _ = pair
    seq = 40
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 127, size=n).tolist() for n in (3, 9, 1, seq - 6, 15)]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=12),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=13),
    ]
    eager, anchors = _prefilled(target, "off", prompts, params, seq)
    static, anchors_static = _prefilled(target, "static", prompts, params, seq)
    assert anchors == anchors_static
    gen = torch.Generator().manual_seed(0)
    items = []
    for i, n in enumerate([5, 3, 0, 5, 2]):  # request 3: prompt seq-6 + anchor + 5 drafts = seq exactly
        drafts = rng.integers(0, 127, size=n).tolist()
        ids = probs = None
        if not params[i].greedy and n:
            width = 3  # narrower than the runner's draft_top_k = 4: padded with probability-0 entries
            ids = torch.stack([torch.randperm(128, generator=gen)[:width] for _ in range(n)])
            ids[:, 0] = torch.tensor(drafts)
            probs = torch.softmax(torch.randn(n, width, generator=gen), dim=-1)
        items.append(VerifyItem(f"r{i}", anchors[i], drafts, ids, probs))
    order = [3, 0, 4, 1, 2]  # not the prefill order: the bucket rows follow the call
    got_eager = eager.step([], [items[j] for j in order])
    got_static = static.step([], [items[j] for j in order])
    for a, b in zip(got_eager, got_static, strict=True):
        assert (a.req_id, a.tokens, a.num_accepted, a.feature_start) == (
            b.req_id,
            b.tokens,
            b.num_accepted,
            b.feature_start,
        )
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=1e-5)
        slot_a, slot_b = eager._requests[a.req_id].slot, static._requests[b.req_id].slot
        length = eager.cache.length(slot_a)
        assert static.cache.length(slot_b) == length
        torch.testing.assert_close(
            eager.cache.k[:, slot_a, :length], static.cache.k[:, slot_b, :length], atol=1e-5, rtol=1e-5
        )
    assert static.cache.length(static._requests["r3"].slot) <= seq


def test_chained_verify_step_equals_the_host_one(pair) -> None:
    """A chained step (drafts read on the device from a draft step's output layout: ids first in rows of
    2 * gamma float64) gives what the same step from the host gives: tokens, accepted counts, features, KV
    lengths; mixed draft counts, a request ending at its slot's end. What it cannot chain it refuses (None)
    before launching anything: a sampling request, a stale position, an unknown or repeated request."""
    from verify_service.engine import VerifyBatch

    target, _ = pair
    seq = 40
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 127, size=n).tolist() for n in (3, 9, seq - 6, 15)]
    greedy = [SamplingParams(temperature=0.0)] * len(prompts)
    host, anchors = _prefilled(target, "static", prompts, greedy, seq)
    chained, _ = _prefilled(target, "static", prompts, greedy, seq)
    order = [2, 0, 3, 1]
    req_ids = [f"r{i}" for i in order]
    num = len(order)
    num_drafts = np.array([5, 3, 0, 2], dtype=np.int64)  # r2: prompt seq-6 + anchor + 5 drafts = seq exactly
    drafts = rng.integers(0, 127, size=(num, 5))
    positions = np.array([len(prompts[i]) for i in order], dtype=np.int64)
    anchor_ids = np.array([anchors[i] for i in order], dtype=np.int64)
    packed = torch.full((num + 2, 10), -1.0, dtype=torch.float64)  # a bucket of 6 rows, confidences after ids
    packed[:num, :5] = torch.from_numpy(drafts).double()
    device_drafts = DeviceDrafts(packed.view(-1), 10)
    refused = [
        (["r0", "r0", "r3", "r1"], positions),
        (["r0", "r9", "r3", "r1"], positions),
        (req_ids, positions + 1),
    ]
    for ids, at in refused:
        assert chained.start_chained(ids, anchor_ids, at, num_drafts, device_drafts) is None
    finish = chained.start_chained(req_ids, anchor_ids, positions, num_drafts, device_drafts)
    assert finish is not None
    got = finish.results()
    want = host.step([], VerifyBatch(req_ids, anchor_ids, positions, drafts.astype(np.int64), num_drafts))
    assert got.req_ids == want.req_ids and got.tokens == want.tokens and got.num_accepted == want.num_accepted
    assert got.num_drafts == num_drafts.tolist()
    torch.testing.assert_close(got.features, want.features)
    for req_id in req_ids:
        slot = chained._requests[req_id].slot
        assert chained.cache.length(slot) == host.cache.length(host._requests[req_id].slot)
    sampler, _ = _prefilled(target, "static", prompts, [SamplingParams(temperature=1.0, seed=1)] * 4, seq)
    assert sampler.start_chained(req_ids, anchor_ids, positions, num_drafts, device_drafts) is None


def _context_batch(results) -> ContextBatch:
    """A verify step's committed rows as the round driver hands them to the drafter."""
    return ContextBatch(
        results.req_ids, results.feature_starts, results.feature_counts, results.features, results.arrays
    )


def test_drafting_behind_a_chained_verify_equals_the_host_round(pair) -> None:
    """The next round's draft step queued behind a chained verify step (anchors, positions and the context
    append taken from the step's outcome on the device) drafts what the host round drafts after reading the
    results: the same tokens and confidences, and the same context K/V and lengths once the results' append
    has been reported (it writes nothing again); the round after agrees too. What it cannot draft so it
    refuses (None) before launching anything: an unknown or repeated request, a context length other than the
    verify step's anchor positions, target tokens past the drafter's vocabulary, no room for a block."""
    from draft_service.engine import DraftBatch
    from verify_service.engine import VerifyBatch

    target, drafter = pair
    seq = 40
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 127, size=n).tolist() for n in (3, 11, 7)]
    greedy = [SamplingParams(temperature=0.0)] * len(prompts)
    req_ids = [f"r{i}" for i in range(len(prompts))]
    positions = np.array([len(p) for p in prompts], dtype=np.int64)
    num_drafts = np.array([5, 2, 4], dtype=np.int64)
    runs = {}
    for way in ("host", "behind"):
        verify = VerifyEngine(target, 8, seq, graphs="static", max_drafts=5, draft_top_k=4, graph_buckets=BUCKETS)
        prefilled = verify.step([PrefillItem(r, p, sp) for r, p, sp in zip(req_ids, prompts, greedy, strict=True)])
        anchors = np.array([r.tokens[0] for r in prefilled], dtype=np.int64)
        draft = DraftEngine(drafter, 8, seq, draft_top_k=4, graphs="static", graph_buckets=BUCKETS)
        for r, sp in zip(req_ids, greedy, strict=True):
            draft.add_request(r, sp)
        draft.append_context([ContextItem(r.req_id, 0, r.features) for r in prefilled])
        pending = draft.propose_start(DraftBatch(req_ids, anchors, positions))
        chained = verify.start_chained(req_ids, anchors, positions, num_drafts, pending.device_tokens)
        assert chained is not None and chained.on_device is not None
        first = pending.result()
        if way == "behind":
            on_device = chained.on_device
            refused = [
                (["r0", "r9", "r2"], positions, target.vocab_size),
                (["r0", "r0", "r2"], positions, target.vocab_size),
                (req_ids, positions + 1, target.vocab_size),
                (req_ids, positions, drafter.real_vocab_size + 1),
                (req_ids, np.array([3, 11, seq - 6], dtype=np.int64), target.vocab_size),
            ]
            for ids, at, vocab in refused:
                assert draft.propose_behind(ids, at, on_device, vocab) is None
            behind = draft.propose_behind(req_ids, positions, on_device, target.vocab_size)
            assert behind is not None
        results = chained.results()
        draft.append_context(_context_batch(results))
        accepted = np.array(results.num_accepted, dtype=np.int64)
        next_batch = DraftBatch(req_ids, np.array([t[-1] for t in results.tokens]), positions + 1 + accepted)
        second = behind.result() if way == "behind" else draft.propose(next_batch)
        lengths = [draft.context_length(r) for r in req_ids]
        assert lengths == (positions + 1 + accepted).tolist()
        # A plain target round after it (no drafts): its rows go after the ones drafting behind appended.
        plain = verify.step(
            [],
            VerifyBatch(
                req_ids, next_batch.anchors, next_batch.positions, np.zeros((3, 0), np.int64), np.zeros(3, np.int64)
            ),
        )
        draft.append_context(_context_batch(plain))
        after = np.array([t[-1] for t in plain.tokens], dtype=np.int64)
        third = draft.propose(DraftBatch(req_ids, after, next_batch.positions + 1))
        slots = [draft._requests[r].slot for r in req_ids]
        runs[way] = (first, results, second, third, draft.cache.k[:, slots].clone(), lengths)
    host, behind_run = runs["host"], runs["behind"]
    assert behind_run[1].tokens == host[1].tokens and behind_run[1].num_accepted == host[1].num_accepted
    for got, want in zip(behind_run[2:4], host[2:4], strict=True):
        assert torch.equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.confidences, want.confidences, atol=1e-6)
    torch.testing.assert_close(behind_run[4], host[4])
    assert behind_run[5] == host[5]


def test_bucketed_propose_equals_eager(pair) -> None:
    _, drafter = pair
    engines = {
        mode: DraftEngine(drafter, 6, 48, draft_top_k=6, graphs=mode, graph_buckets=BUCKETS)
        for mode in ("off", "static")
    }
    gen = torch.Generator().manual_seed(2)
    lengths = [7, 1, 12, 4, 9]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.5, top_k=3, seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, seed=5),
    ]
    features = [torch.randn(n, drafter.config.context_feature_size, generator=gen) for n in lengths]
    proposals = {}
    for mode, engine in engines.items():
        for i, sp in enumerate(params):
            engine.add_request(f"r{i}", sp)
        engine.append_context([ContextItem(f"r{i}", 0, f) for i, f in enumerate(features)])
        items = [DraftItem(f"r{i}", 10 + i, n) for i, n in enumerate(lengths)]
        proposals[mode] = engine.propose(items[::-1])
    # The context append took the bucketed path (33 rows <= 6 * (block + 1)) and wrote the same K/V.
    assert sum(lengths) <= engines["static"].graphs.max_append_rows
    for i, n in enumerate(lengths):
        slot_off, slot_static = engines["off"]._requests[f"r{i}"].slot, engines["static"]._requests[f"r{i}"].slot
        assert engines["static"].context_length(f"r{i}") == n
        torch.testing.assert_close(
            engines["static"].cache.k[:, slot_static, :n], engines["off"].cache.k[:, slot_off, :n], atol=1e-5, rtol=1e-5
        )
    off, static = proposals["off"], proposals["static"]
    assert static.tokens.device.type == "cpu" and off.tokens.device.type == "cpu"
    assert torch.equal(off.tokens, static.tokens)
    assert torch.equal(off.topk_ids, static.topk_ids)
    torch.testing.assert_close(off.topk_probs, static.topk_probs, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(off.confidences, static.confidences, atol=1e-5)
    assert static.topk_probs.shape == (5, drafter.block_size, 6)


def test_staged_context_appends_equal_eager(pair) -> None:
    """Per-round appends are staged and written by the next propose step; one staged for a request missing
    from the next batch, an eager propose or a second append is written first; a released request's rows
    are dropped. Drafts, distributions and the context K/V stay those of the eager engine."""
    _, drafter = pair
    width, gen = drafter.config.context_feature_size, torch.Generator().manual_seed(7)
    engines = {
        mode: DraftEngine(drafter, 6, 64, draft_top_k=6, graphs=mode, graph_buckets=BUCKETS)
        for mode in ("off", "static")
    }
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    held = {f"r{i}": 0 for i in range(6)}
    # (requests appending this round (rows each), requests proposing, released after the append)
    plan = [
        ({"r0": 3, "r1": 2, "r2": 6, "r3": 1, "r4": 4, "r5": 5}, ["r5", "r1", "r3", "r0", "r2", "r4"], []),
        ({"r0": 2, "r1": 6, "r2": 1, "r4": 3}, ["r0", "r1", "r2", "r4"], ["r3"]),  # r5 appends nothing
        ({"r0": 1, "r1": 1, "r4": 6}, ["r4", "r0"], []),  # r1 staged, not proposed: written first
        ({"r0": 2, "r2": 2, "r4": 2, "r5": 3}, ["r0", "r2", "r4"], ["r5"]),  # r5 staged, then released
        ({"r0": 4}, ["r0", "r2", "r4"], []),
    ]
    rows = {name: [] for name in held}
    for appends, _, _ in plan:
        for name, n in appends.items():
            rows[name].append(torch.randn(n, width, generator=gen))
    last = torch.randn(2, width, generator=gen)
    proposals: dict[str, list] = {mode: [] for mode in engines}
    for mode, engine in engines.items():
        for i, sp in enumerate(params):
            engine.add_request(f"r{i}", sp)
        starts = dict.fromkeys(held, 0)
        taken = dict.fromkeys(held, 0)
        for appends, proposing, released in plan:
            items = []
            for name in appends:
                features = rows[name][taken[name]]
                taken[name] += 1
                items.append(ContextItem(name, starts[name], features))
                starts[name] += features.shape[0]
            engine.append_context(items)
            for name in released:
                engine.release(name)
            proposal = engine.propose([DraftItem(n, 5 + i, starts[n]) for i, n in enumerate(proposing)])
            # An all-greedy batch gets views of the static outputs (the next propose overwrites them): copies.
            proposals[mode].append((proposal.tokens, proposal.topk_ids.clone(), proposal.topk_probs.clone()))
        engine.append_context([ContextItem("r2", starts["r2"], last)])
        starts["r2"] += 2
        proposal = engine._propose_eager([DraftItem("r2", 1, starts["r2"])], engine._entries(["r2"]))
        proposals[mode].append((proposal.tokens, proposal.topk_ids, proposal.topk_probs))
        for name in ("r0", "r2", "r4"):
            slot, n = engine._requests[name].slot, starts[name]
            assert engine.context_length(name) == n
            proposals[mode].append((engine.cache.k[:, slot, :n].clone(), engine.cache.v[:, slot, :n].clone()))
    for off, static in zip(proposals["off"], proposals["static"], strict=True):
        if len(off) == 2:  # context K/V
            torch.testing.assert_close(static, off, atol=1e-5, rtol=1e-5)
            continue
        assert torch.equal(off[0], static[0]) and torch.equal(off[1], static[1])
        torch.testing.assert_close(off[2], static[2], atol=1e-5, rtol=1e-5)


def _generate(
    target,
    drafter,
    mode: str,
    temperature: float,
    prefill_rows: int = 0,
    draft_ahead: bool = False,
    chain_verify: bool = False,
    policy: str = "dspark",
    chain_draft: bool = False,
) -> list[list[int]]:
    verify = VerifyEngine(
        target,
        12,
        96,
        graphs=mode,
        max_drafts=drafter.block_size,
        graph_buckets=BUCKETS,
        graph_prefill_rows=prefill_rows,
    )
    draft = DraftEngine(drafter, 12, 96, graphs=mode, graph_buckets=BUCKETS)
    ragged = _count_graph_steps(verify)
    chained = _count_launches(verify, "start_chained", "chained")
    engine = SpeculativeEngine(
        verify,
        draft,
        make_policy(policy, _sps(), drafter.block_size),
        draft_ahead=draft_ahead,
        chain_verify=chain_verify,
        chain_draft=chain_draft,
    )
    calls = _count_proposals(draft)
    behind = _count_launches(draft, "propose_behind", "launched")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 127, size=int(rng.integers(1, 30))).tolist() for _ in range(20)]
    max_tokens = [int(rng.integers(1, 30)) for _ in range(20)]
    outputs: dict[str, list[int]] = {}
    order = []
    pending = list(range(20))
    while pending or engine.has_unfinished():
        for _ in range(min(3, len(pending))):  # requests join at different rounds
            i = pending.pop(0)
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens[i], seed=i, top_k=0 if i % 2 else 20)
            rid = engine.add_request(prompts[i], sp)
            order.append(rid)
            outputs[rid] = []
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    if temperature == 0.0:
        expected = target.generate(prompts, max_new_tokens=max(max_tokens))
        assert [outputs[r] for r in order] == [e[:m] for e, m in zip(expected, max_tokens, strict=True)]
    assert verify.num_free_slots == 12 and draft.num_free_slots == 12
    if mode != "off":
        verify_only = ragged["verify"] + chained["chained"]
        assert verify_only > 0 and (ragged["prefill"] > 0 or not prefill_rows), (ragged, chained)
    # Drafting behind a chained verify step: in chained rounds (of greedy requests).
    assert (behind["launched"] > 0) == (chain_draft and chain_verify and mode != "off" and temperature == 0.0), behind
    assert not behind["refused"], behind
    if chain_verify and mode != "off" and temperature == 0.0:  # dspark: the rounds of few requests (flat SPS)
        assert chained["chained"] > 0 and not chained["refused"], chained
        assert policy != "dspark" or calls["in_round"] > 0, calls  # its other rounds drafted and scheduled as usual
    elif chain_verify:  # sampled requests (or eager steps): never chained, drafted and scheduled as usual
        assert chained["chained"] == 0 and calls["in_round"] > 0, (chained, calls)
        assert temperature == 0.0 or not chained["refused"], chained  # sampled rounds are not even planned
    elif draft_ahead:  # most rounds drafted ahead (launched before the previous commit), not in the round itself
        assert calls["ahead"] > calls["in_round"] > 0, calls
    else:
        assert calls["ahead"] == 0 and calls["in_round"] > 0 and not any(chained.values()), (calls, chained)
    return [outputs[r] for r in order]


def _count_proposals(draft: DraftEngine) -> dict[str, int]:
    """Counts of blocks drafted in their own round (``propose``) and launched ahead (``propose_start`` alone)."""
    counts = {"in_round": 0, "ahead": 0}
    propose, propose_start = draft.propose, draft.propose_start
    inside = False

    def counted_propose(items):
        nonlocal inside
        counts["in_round"] += 1
        inside = True
        try:
            return propose(items)
        finally:
            inside = False

    def counted_start(items):
        if not inside:
            counts["ahead"] += 1
        return propose_start(items)

    draft.propose, draft.propose_start = counted_propose, counted_start
    return counts


def _count_graph_steps(verify: VerifyEngine) -> dict[str, int]:
    """Counts of graph-path steps with joining prompts (``run``) and verify-only (``run_verify``)."""
    counts = {"verify": 0, "prefill": 0}
    runner = verify.graphs
    if runner is None:
        return counts
    run, run_verify = runner.run, runner.run_verify

    def counted(items):
        counts["prefill" if any(i.prefill for i in items) else "verify"] += 1
        return run(items)

    def counted_verify(*args):
        counts["verify"] += 1
        return run_verify(*args)

    runner.run, runner.run_verify = counted, counted_verify
    return counts


def _count_launches(engine: object, method: str, launched: str) -> dict[str, int]:
    """Counts of the engine's ``method`` calls that launched a step (``launched``) and that refused (None):
    chained verify steps (``start_chained``), draft steps behind a verify step (``propose_behind``)."""
    counts = {launched: 0, "refused": 0}
    start = getattr(engine, method)

    def counted(*args):
        started = start(*args)
        counts["refused" if started is None else launched] += 1
        return started

    setattr(engine, method, counted)
    return counts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_bucketed_steps_equals_eager(pair, temperature: float) -> None:
    """Continuous batching (20 requests joining over rounds, 12 running at most, buckets 1..12): the same
    outputs with and without the bucketed steps, greedy (== target greedy) and sampled (same random numbers)."""
    target, drafter = pair
    assert _generate(target, drafter, "static", temperature) == _generate(target, drafter, "off", temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_drafting_ahead_equals_drafting_in_round(pair, temperature: float) -> None:
    """Drafting the next round ahead (launched right after the context append, before the commit) gives the
    same outputs as drafting in the round: greedy == target greedy, sampled with the same random numbers (the
    same context, anchors and positions, and randomness keyed by request and position); requests finish and
    join in between, so rounds also take a subset of the launched rows or drop them. Bucketed steps (the graph
    path, where a verify-only round's results come as one StepResults): what drafting ahead applies to."""
    target, drafter = pair
    ahead = _generate(target, drafter, "static", temperature, draft_ahead=True)
    assert ahead == _generate(target, drafter, "static", temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("policy", ["dspark", "full", "dspark-async"])
@pytest.mark.parametrize("draft_ahead", [False, True])
def test_chained_rounds_equal_unchained(pair, temperature: float, policy: str, draft_ahead: bool) -> None:
    """Rounds whose lengths the policy fixes before the drafts exist (DSpark's planned uniform lengths, the
    whole block for ``full``, the caps for the asynchronous variant when its capacity holds every draft) queue
    the verify step behind the draft step, reading the drafts on the device:
    greedy == target greedy, as without chaining; with the next round drafted ahead too. Rounds of sampled
    requests are not chained (nor planned): the same outputs and random numbers as without chaining."""
    target, drafter = pair
    chained = _generate(
        target, drafter, "static", temperature, draft_ahead=draft_ahead, chain_verify=True, policy=policy
    )
    assert chained == _generate(target, drafter, "static", temperature, policy=policy)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("policy", ["dspark", "full", "dspark-async"])
def test_drafting_behind_chained_rounds_equals_unchained(pair, temperature: float, policy: str) -> None:
    """Chained rounds that also queue the next round's draft step behind their verify step (the context
    append and the anchors taken on the device): greedy == target greedy, as without chaining, while requests
    join, finish (their drafted rows dropped) and run out of room for a block (then the commit decides the
    next round's drafting); sampled rounds are not chained, so nothing is drafted behind them."""
    target, drafter = pair
    behind = _generate(
        target, drafter, "static", temperature, draft_ahead=True, chain_verify=True, policy=policy, chain_draft=True
    )
    assert behind == _generate(target, drafter, "static", temperature, policy=policy)


@pytest.mark.parametrize("chained", [False, True])
def test_drafting_ahead_survives_aborts_and_close(pair, chained: bool) -> None:
    """A request aborted while its next block is drafted ahead (``chained``: drafted behind the chained
    verify step), a request joining meanwhile, and the engine closed with drafts in flight: the others still
    decode the target's greedy output, a round after the close drafts afresh, and every slot comes back."""
    target, drafter = pair
    verify = VerifyEngine(target, 4, 96, graphs="static", max_drafts=drafter.block_size, graph_buckets=BUCKETS)
    draft = DraftEngine(drafter, 4, 96, graphs="static", graph_buckets=BUCKETS)
    engine = SpeculativeEngine(
        verify,
        draft,
        make_policy("full", _sps(), drafter.block_size),
        draft_ahead=True,
        chain_verify=chained,
        chain_draft=chained,
    )
    behind = _count_launches(draft, "propose_behind", "launched")
    prompts = [[3, 5, 7, 9], [11, 2, 4], [6, 6, 1, 8, 2], [9, 1]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in prompts[:3]]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(3):
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    assert engine._ahead is not None and engine._ahead.pending is not None  # drafts in flight
    assert engine.abort(ids[1])
    ids.append(engine.add_request(prompts[3], greedy))
    outputs[ids[-1]] = []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    expected = target.generate([prompts[0], prompts[2], prompts[3]], max_new_tokens=24)
    assert [outputs[ids[0]], outputs[ids[2]], outputs[ids[3]]] == expected
    late = engine.add_request(prompts[1], greedy)
    outputs[late] = []
    for _ in range(3):
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    assert engine._ahead is not None
    engine.close()  # drafts launched ahead are waited for and dropped: the next round drafts afresh
    assert engine._ahead is None
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    assert outputs[late] == target.generate([prompts[1]], max_new_tokens=24)[0]
    assert verify.num_free_slots == 4 and draft.num_free_slots == 4
    assert (behind["launched"] > 0) == chained and not behind["refused"], behind


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_prefills_in_the_ragged_step_equals_eager(pair, temperature: float) -> None:
    """Joining prompts chunked into the same ragged step as the verify chunks (up to 40 prompt rows a step):
    greedy == target greedy == eager, sampled == eager (same random numbers)."""
    target, drafter = pair
    assert _generate(target, drafter, "static", temperature, 40) == _generate(target, drafter, "off", temperature)


@pytest.mark.skipif(
    not interpreting(),
    reason="CPU tensors through the Triton kernels need the interpreter (conftest sets it where CUDA is absent); "
    "on a GPU test_cuda_graphs_equal_eager runs the same fused skinny drafter on CUDA",
)
def test_engine_with_the_fused_skinny_drafter_equals_target_greedy(tmp_path: Path) -> None:
    """The drafter on its fused path with the skinny GEMMs (the default on a Hopper GPU; Triton through the
    interpreter on CPU): buckets of 1 and 2 requests (5 and 10 block rows) run its layers and LM head on the skinny
    GEMMs, larger ones on torch's matmuls; the speculative greedy output of the bucketed steps is still the
    target's (``_generate`` checks it)."""
    spec = PairSpec(vocab=128, hidden=32, block_size=5, markov_rank=8, target_layer_ids=(-1, 1, 2), seed=5)
    target_dir, draft_dir = write_pair(tmp_path, spec)
    drafter = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=drafter.config.target_layer_ids)
    drafter.attention_backend, drafter.fused = "reference", True
    assert drafter.skinny_gemm
    _generate(target, drafter, "static", 0.0)
    counters = drafter.fused_drafter()._skinny_counters
    assert counters is not None and int(counters.abs().sum()) == 0


def test_row_buckets_and_bucket_choice(pair) -> None:
    from verify_service.graphs import row_buckets

    assert row_buckets(2, 9) == [2, 3, 4, 6, 8, 9]
    assert row_buckets(129, 1025) == [192, 256, 384, 512, 768, 1024, 1025]
    target, _ = pair
    engine = VerifyEngine(target, 8, 64, graphs="static", max_drafts=5, graph_buckets=BUCKETS, graph_prefill_rows=24)
    runner = engine.graphs
    assert runner is not None and runner.width == 6 and runner.max_rows == 8 * 6 + 1 + 24
    assert runner.chunk_sizes == (1, 2, 4, 8, 16)
    # 3 chunks of 10 rows: bucket 4 chunks, >= 10 + 1 padding row + 1 sink row.
    assert runner.bucket(3, 10) == (4, 12)
    assert runner.bucket(1, 1) == (1, 2)
    assert runner.bucket(8, 48) == (8, 49)
    assert runner.bucket(16, 74) is None
    # A prefill of 14 tokens: chunks of 6 + 6 + 1 (discarded) and the last token (sampled).
    assert runner.chunk_count(14, True) == 4 and runner.chunk_count(1, True) == 1 and runner.chunk_count(6, False) == 1
    assert runner.fits([(14, True), (6, False)], 4)
    assert not runner.fits([(7, False)], 4)  # wider than a verify chunk
    assert not runner.fits([(3, False)], 17)  # a draft distribution wider than draft_top_k (16)
    # The verify-only check from the draft counts alone says what ``fits`` says of the same items.
    rng = np.random.default_rng(7)
    for _ in range(200):
        num_drafts = rng.integers(0, 8, size=int(rng.integers(0, 18)))
        width = int(rng.choice([0, 4, 16, 17]))
        items = [(1 + int(n), False) for n in num_drafts]
        assert runner.fits_verify(num_drafts, width) == runner.fits(items, width)


def test_every_bucket_runs_on_its_padding(pair) -> None:
    """What capture does on a GPU (warm-up and recording run every bucket's step on all-padding buffers of its
    own shape): each step is a valid sampler call (offsets match its draft count) and writes only the dummy slot."""
    target, _ = pair
    engine = VerifyEngine(target, 4, 32, graphs="static", max_drafts=5, graph_buckets=BUCKETS, graph_prefill_rows=12)
    runner = engine.graphs
    assert runner is not None
    before = engine.cache.k.clone()
    for key, step in runner.steps.items():
        runner.pad_for(key)
        packed, features = step.fn()
        assert packed.shape == (key[0], 1 + runner.width) and features.shape[0] == key[1]
        assert bool((packed[:, 0] == 0).all())  # padding chunks have no drafts
    changed = (engine.cache.k != before).flatten(2).any(-1)  # [layers, slots]
    assert not bool(changed[:, : runner.dummy_slot].any()) and not bool(changed[:, runner.dummy_slot + 1 :].any())


def test_ragged_step_with_prefills_equals_eager(pair) -> None:
    """One step mixing two prefills (one longer than a chunk, one re-prefill with a known anchor) and verifies
    (greedy and sampled): same tokens, KV, features and lengths as the eager step."""
    target, _ = pair
    seq = 48
    rng = np.random.default_rng(3)
    engines = {
        mode: VerifyEngine(
            target, 6, seq, graphs=mode, max_drafts=5, draft_top_k=4, graph_buckets=BUCKETS, graph_prefill_rows=40
        )
        for mode in ("off", "static")
    }
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=21)]
    prompts = [rng.integers(0, 127, size=n).tolist() for n in (5, 11)]
    joining = rng.integers(0, 127, size=17).tolist()
    gen = torch.Generator().manual_seed(4)
    results = {}
    for mode, engine in engines.items():
        anchors = [
            r.tokens[0] for r in engine.step([PrefillItem(f"v{i}", p, params[i]) for i, p in enumerate(prompts)])
        ]
        drafts = [[7, 8, 9], [10, 11, 12, 13, 14]]
        ids = torch.stack([torch.randperm(128, generator=torch.Generator().manual_seed(j))[:4] for j in range(5)])
        ids[:, 0] = torch.tensor(drafts[1])
        probs = torch.softmax(torch.randn(5, 4, generator=gen.manual_seed(9)), dim=-1)
        verifies = [VerifyItem("v0", anchors[0], drafts[0]), VerifyItem("v1", anchors[1], drafts[1], ids, probs)]
        joins = [
            PrefillItem("p0", joining, SamplingParams(temperature=1.0, seed=5)),
            PrefillItem("p1", [3, 4, 5, 6, 7, 8, 9], SamplingParams(temperature=0.0), anchor=42),
        ]
        if mode == "static":
            counts = _count_graph_steps(engine)
        results[mode] = engine.step(joins, verifies)
    assert counts == {"verify": 0, "prefill": 1}
    for a, b in zip(results["off"], results["static"], strict=True):
        assert (a.req_id, a.tokens, a.num_drafts, a.num_accepted, a.feature_start) == (
            b.req_id,
            b.tokens,
            b.num_drafts,
            b.num_accepted,
            b.feature_start,
        )
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=1e-5)
        off, static = engines["off"], engines["static"]
        slot_a, slot_b = off._requests[a.req_id].slot, static._requests[b.req_id].slot
        length = off.cache.length(slot_a)
        assert static.cache.length(slot_b) == length
        torch.testing.assert_close(
            off.cache.k[:, slot_a, :length], static.cache.k[:, slot_b, :length], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            off.cache.v[:, slot_a, :length], static.cache.v[:, slot_b, :length], atol=1e-5, rtol=1e-5
        )
    assert results["static"][1].tokens == [] and results["static"][0].features.shape[0] == 17


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32])
def test_cuda_graphs_equal_eager(tmp_path: Path, dtype: torch.dtype) -> None:
    """On CUDA: captured graphs == eager (Triton attention, Triton sampler) == target greedy; sampled
    requests give the same tokens from the captured graphs as from the same bucketed step run eagerly; the
    same with the next round drafted ahead, and greedy with chained rounds, also drafting behind them."""
    spec = PairSpec(vocab=128, hidden=32, block_size=5, markov_rank=8, target_layer_ids=(-1, 1, 2), seed=5)
    target_dir, draft_dir = write_pair(tmp_path, spec)
    drafter = load_draft_model(draft_dir, target_dir=target_dir, dtype=dtype, device="cuda")
    target = TargetModel.from_pretrained(
        target_dir, feature_layer_ids=drafter.config.target_layer_ids, dtype=dtype, device="cuda"
    )
    assert target.attention_backend == "triton" and drafter.attention_backend == "triton"
    assert drafter.use_fused and drafter.skinny_gemm  # the fused drafter, its skinny GEMMs on a Hopper GPU
    greedy = {mode: _generate(target, drafter, mode, 0.0) for mode in ("off", "static", "capture")}
    assert greedy["capture"] == greedy["off"] == greedy["static"]
    assert _generate(target, drafter, "capture", 1.0) == _generate(target, drafter, "static", 1.0)
    assert _generate(target, drafter, "capture", 0.0, 40) == greedy["off"]
    assert _generate(target, drafter, "capture", 1.0, 40) == _generate(target, drafter, "static", 1.0, 40)
    # Drafting ahead: the launched step's result copy waited for by an event, the commit in between.
    assert _generate(target, drafter, "capture", 0.0, draft_ahead=True) == greedy["off"]
    assert _generate(target, drafter, "capture", 1.0, draft_ahead=True) == _generate(target, drafter, "static", 1.0)
    # Chained rounds: the verify graph queued behind the draft graph, reading the drafts from its output.
    assert _generate(target, drafter, "capture", 0.0, chain_verify=True) == greedy["off"]
    assert _generate(target, drafter, "capture", 0.0, draft_ahead=True, chain_verify=True) == greedy["off"]
    assert _generate(target, drafter, "capture", 0.0, chain_verify=True, policy="full") == greedy["off"]
    # Drafting behind: the next draft graph queued behind the verify graph, its inputs taken from its outputs.
    for policy in ("dspark", "full"):
        behind = _generate(
            target, drafter, "capture", 0.0, draft_ahead=True, chain_verify=True, policy=policy, chain_draft=True
        )
        assert behind == greedy["off"]


def _batch_and_items(anchors, positions, drafts, num_drafts):
    from verify_service.engine import VerifyBatch

    batch = VerifyBatch(
        [f"r{i}" for i in range(len(anchors))],
        np.array(anchors, dtype=np.int64),
        np.array(positions, dtype=np.int64),
        np.array(drafts, dtype=np.int64),
        np.array(num_drafts, dtype=np.int64),
    )
    items = [
        VerifyItem(f"r{i}", a, d[:n], None, None, p)
        for i, (a, p, d, n) in enumerate(zip(anchors, positions, drafts, num_drafts, strict=True))
    ]
    return batch, items


def test_verify_batch_equals_its_items(pair) -> None:
    """A VerifyBatch (the round driver's arrays) gives a verifier exactly what the list of its items gives:
    the same results, and for a bad batch the same error (stale position, token outside the vocabulary, no
    room in the slot), raised before anything changes."""
    target, _ = pair
    seq = 24
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 127, size=n).tolist() for n in (3, 9, seq - 6)]
    params = [SamplingParams(temperature=0.0)] * 3
    on_batch, anchors = _prefilled(target, "static", prompts, params, seq)
    on_items, _ = _prefilled(target, "static", prompts, params, seq)
    positions = [len(p) for p in prompts]
    drafts = rng.integers(0, 127, size=(3, 5)).tolist()
    batch, items = _batch_and_items(anchors, positions, drafts, [5, 2, 0])
    assert list(batch) == items and batch[1] == items[1] and len(batch) == 3
    got_batch, got_items = on_batch.step([], batch), on_items.step([], items)
    assert [(r.req_id, r.tokens, r.num_accepted, r.feature_start) for r in got_batch] == [
        (r.req_id, r.tokens, r.num_accepted, r.feature_start) for r in got_items
    ]
    torch.testing.assert_close(got_batch.features, got_items.features)
    positions = [p + 1 + r.num_accepted for p, r in zip(positions, got_batch, strict=True)]
    anchors = [r.tokens[-1] for r in got_batch]
    bad = [
        (anchors, [positions[0] - 1, *positions[1:]], drafts, [1, 1, 1]),  # a stale round
        (anchors, positions, [[*drafts[0][:4], 128], *drafts[1:]], [5, 0, 0]),  # outside the vocabulary
        (anchors, positions, drafts, [0, 0, 5]),  # request 2 has no room for 5 drafts
    ]
    for case in bad:
        batch, items = _batch_and_items(*case)
        errors = []
        for engine, verifies in ((on_batch, batch), (on_items, items)):
            with pytest.raises(Exception) as info:
                engine.step([], verifies)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]
    assert [on_batch.context_length(f"r{i}") for i in range(3)] == positions


def test_rounds_with_late_requests_take_the_drafts_launched_ahead(pair) -> None:
    """Every request is behind its TPOT target (1 ns) in every round, so every round is weighted by lateness:
    such rounds are plain rounds, which take the drafts launched ahead for them (they are the drafts an eager
    step would make; only the lengths differ) instead of dropping them and drafting again in the round. Greedy
    output stays the target's own."""
    target, drafter = pair
    verify = VerifyEngine(target, 12, 96, graphs="static", max_drafts=drafter.block_size, graph_buckets=BUCKETS)
    draft = DraftEngine(drafter, 12, 96, graphs="static", graph_buckets=BUCKETS)
    engine = SpeculativeEngine(
        verify, draft, make_policy("dspark", _sps(), drafter.block_size), draft_ahead=True,
        service_levels=ServiceLevels(),
    )  # fmt: skip
    calls = _count_proposals(draft)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 127, size=int(rng.integers(2, 20))).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, tpot_slo_ms=1e-6)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == target.generate(prompts, max_new_tokens=24)
    assert engine.snapshot().rounds > 2 * calls["in_round"] and calls["ahead"] > 0, calls


def test_late_requests_verify_whole_blocks_in_chained_rounds(pair) -> None:
    """Requests behind their TPOT targets (every request, every round: the target is 1 ns) in rounds whose
    lengths are planned before the drafts exist (``fixed-1`` plans one draft each) verify every draft their
    caps allow, and those rounds still chain (the verify step queued behind the draft step on the device):
    lateness no longer costs the round pipeline its overlap. Greedy output stays the target's own."""
    target, drafter = pair
    verify = VerifyEngine(target, 12, 96, graphs="static", max_drafts=drafter.block_size, graph_buckets=BUCKETS)
    draft = DraftEngine(drafter, 12, 96, graphs="static", graph_buckets=BUCKETS)
    planned: list[np.ndarray] = []
    start = verify.start_chained

    def recorded(req_ids, anchors, positions, num_drafts, drafts):
        planned.append(num_drafts.copy())
        return start(req_ids, anchors, positions, num_drafts, drafts)

    verify.start_chained = recorded
    engine = SpeculativeEngine(
        verify, draft, make_policy("fixed-1", _sps(), drafter.block_size), draft_ahead=True, chain_verify=True,
        chain_draft=True, service_levels=ServiceLevels(),
    )  # fmt: skip
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 127, size=int(rng.integers(2, 20))).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, tpot_slo_ms=1e-6)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == target.generate(prompts, max_new_tokens=40)
    snap = engine.snapshot()
    assert snap.planned_rounds >= 2 and planned
    wall_s = snap.round_draft_time_s + snap.round_verify_time_s + snap.schedule_time_s + snap.host_time_s
    assert 0 < snap.planned_round_time_s < wall_s  # the other rounds: the first ones, where prompts joined
    assert int(planned[0].min()) == drafter.block_size, planned  # the whole block, not fixed-1's one draft


def _chained_engine(pair, policy: str, levels: ServiceLevels) -> tuple[SpeculativeEngine, TargetModel]:
    """An engine on the chained pipeline (drafts ahead and behind, verify chained behind the drafts), static
    steps on CPU."""
    target, drafter = pair
    verify = VerifyEngine(target, 12, 96, graphs="static", max_drafts=drafter.block_size, graph_buckets=BUCKETS)
    draft = DraftEngine(drafter, 12, 96, graphs="static", graph_buckets=BUCKETS)
    engine = SpeculativeEngine(
        verify, draft, make_policy(policy, _sps(), drafter.block_size), draft_ahead=True, chain_verify=True,
        chain_draft=True, service_levels=levels,
    )  # fmt: skip
    return engine, target


def test_lower_tiers_sitting_out_chained_rounds_keep_greedy_output(pair) -> None:
    """``pause_lower_tiers`` on the chained pipeline: the late high-tier requests' rounds are plain rounds over a
    subset of the running requests (drafted ahead and behind for that subset, planned whole blocks for the late
    ones), the paused lower-tier requests rejoin later at their committed anchors; every output is still the
    target's greedy output."""
    engine, target = _chained_engine(pair, "fixed-2", ServiceLevels(pause_lower_tiers=True))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 127, size=int(rng.integers(2, 20))).tolist() for _ in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, priority=-1, tpot_slo_ms=1e-6) if i % 3 == 0
        else SamplingParams(temperature=0.0, max_tokens=30, priority=1)
        for i in range(len(prompts))
    ]  # fmt: skip
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == target.generate(prompts, max_new_tokens=30)
    snap = engine.snapshot()
    assert snap.paused_request_rounds > 0 and snap.planned_rounds > 0


def _joins(engine: SpeculativeEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[dict, dict]:
    """Run ``prompts[0]`` alone for one round, then queue the others and step to the end: returns each request's
    tokens and the round each first emitted in."""
    ids = [engine.add_request(prompts[0], params[0])]
    tokens: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    round_index = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.new_token_ids:
                first.setdefault(out.req_id, round_index)
        if round_index == 0:
            ids += [engine.add_request(p, q) for p, q in zip(prompts[1:], params[1:], strict=True)]
        round_index += 1
    return {i: tokens[i] for i in ids}, first


def test_prompts_wait_to_join_together_while_a_target_runs(pair) -> None:
    """``join_hold_ms``: while a request with a TPOT target runs on the chained pipeline, prompts that arrive
    wait (here the hold outlasts the run: they join once no target runs), the rounds between stay chained, and
    every output is still the target's greedy output; with no hold they join at the next round."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 127, size=int(rng.integers(2, 20))).tolist() for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, tpot_slo_ms=1e6)] + [
        SamplingParams(temperature=0.0, max_tokens=12)
    ] * 3
    held, target = _chained_engine(pair, "fixed-2", ServiceLevels(join_hold_ms=1e9))
    tokens, first = _joins(held, prompts, params)
    assert list(tokens.values()) == [
        target.generate([p], max_new_tokens=n.max_tokens)[0] for p, n in zip(prompts, params, strict=True)
    ]
    ids = list(tokens)
    assert all(first[i] > first[ids[0]] + 1 for i in ids[1:]), first  # none joined beside the target's request
    assert len({first[i] for i in ids[1:]}) == 1, first  # they joined together
    assert held.snapshot().planned_rounds > 0
    at_once, _ = _chained_engine(pair, "fixed-2", ServiceLevels())
    tokens_at_once, first_at_once = _joins(at_once, prompts, params)
    assert tokens_at_once == dict(zip(tokens_at_once, tokens.values(), strict=True))
    assert all(first_at_once[i] == 1 for i in list(tokens_at_once)[1:]), first_at_once
