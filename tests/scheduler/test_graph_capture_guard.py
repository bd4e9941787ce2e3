"""The step bodies the engines record as CUDA graphs contain nothing a graph capture refuses, checked on CPU.

:class:`capture_guard.CaptureGuard` watches every aten op of a region. The verify step, the draft step and the
context append run under it on the ``meta`` device (every host tensor, host read and cross-device copy shows)
for every bucket and every head type, and on CPU with the Triton kernels through the interpreter (the exact
code the GPU captures) while an engine runs real rounds. The guard itself is checked first: it must flag
each pattern that failed or would fail a capture, and pass the capture-safe forms used instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from capture_guard import CaptureGuard
from model_factory import PairSpec, write_pair

from draft_service.checkpoint import load_draft_model
from draft_service.config import REAL_VOCAB_KEY
from draft_service.engine import ContextItem, DraftEngine
from draft_service.graphs import DraftGraphRunner
from draft_service.model import DSparkDraftModel
from kernels.rejection import rejection_sample_reference
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from verify_service.engine import VerifyEngine
from verify_service.graphs import VerifyGraphRunner
from verify_service.target import TargetModel

BUCKETS = (1, 2, 4)
Region = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

# (name, region over a [5] float, a [3, 4] float and a [2] int64 tensor on the device under test)
REFUSED: list[tuple[str, Region]] = [
    ("python scalar into one element", lambda a, b, i: a.__setitem__(2, 3)),
    ("python scalar into one 2-d element", lambda a, b, i: b.__setitem__((1, 2), 3.0)),
    ("item", lambda a, b, i: a.sum().item()),
    ("bool of a tensor", lambda a, b, i: bool(a.any())),
    ("int of a tensor", lambda a, b, i: int(a.sum())),
    ("tolist", lambda a, b, i: a.tolist()),
    ("nonzero", lambda a, b, i: a.nonzero()),
    ("boolean index", lambda a, b, i: a[a > 0]),
    ("boolean index write", lambda a, b, i: a.__setitem__(a > 0, 1.0)),
    ("repeat_interleave without output_size", lambda a, b, i: torch.repeat_interleave(i, i)),
    ("torch RNG", lambda a, b, i: torch.rand(3, device=a.device)),
]
REFUSED_ON_CPU: list[tuple[str, Region]] = [
    ("torch.tensor from a list", lambda a, b, i: a + torch.tensor([1.0, 2, 3, 4, 5], device=a.device)),
]
REFUSED_ON_META: list[tuple[str, Region]] = [
    ("factory without device=", lambda a, b, i: a + torch.arange(5)),
    ("device -> host copy", lambda a, b, i: a.cpu()),
    ("host -> device copy", lambda a, b, i: a + torch.ones(5).to(a.device)),
]
ALLOWED: list[tuple[str, Region]] = [
    ("python scalar into a slice", lambda a, b, i: a.__setitem__(slice(1, 3), 3)),
    ("python scalar into a 2-d slice", lambda a, b, i: b.__setitem__((slice(None), slice(2, None)), float("-inf"))),
    ("fill_ of a one-element slice", lambda a, b, i: a[4:].fill_(7)),
    ("where with a python scalar", lambda a, b, i: torch.where(a > 0, a, 1.0)),
    ("factories on the device", lambda a, b, i: torch.cat([a, torch.full((1,), 2.0, device=a.device)])),
    ("integer index and write", lambda a, b, i: a.__setitem__(i, b[0, :2])),
    ("repeat_interleave with output_size", lambda a, b, i: torch.repeat_interleave(i, i, output_size=2)),
    ("searchsorted", lambda a, b, i: torch.searchsorted(b.cumsum(-1), b[:, :1].contiguous(), right=True)),
]


def _violations(device: str, region: Region) -> list[str]:
    guard = CaptureGuard(device)
    a = torch.zeros(5, device=device)
    b = torch.zeros(3, 4, device=device)
    i = torch.arange(2, device=device)
    try:
        with guard.active():
            region(a, b, i)
    except (RuntimeError, NotImplementedError):
        pass  # meta tensors refuse host reads themselves; the guard has recorded the op before that
    return guard.violations


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_guard_flags_what_capture_refuses(device: str) -> None:
    refused = REFUSED + (REFUSED_ON_CPU if device == "cpu" else REFUSED_ON_META)
    missed = [name for name, region in refused if not _violations(device, region)]
    assert not missed, f"the guard missed: {missed}"
    flagged = {name: _violations(device, region) for name, region in ALLOWED}
    assert not any(flagged.values()), f"the guard refused capture-safe code: {flagged}"


# ------------------------------------------------------------------------------------------ on the meta device
SPECS = [
    PairSpec(vocab=64, block_size=5, target_layer_ids=(-1, 1, 2)),
    PairSpec(vocab=64, block_size=4, markov_head_type="gated", confidence_with_markov=False, heads=4, kv_heads=4),
    PairSpec(vocab=64, block_size=3, markov_head_type="rnn", confidence=False, target_layer_ids=(2,)),
    PairSpec(vocab=64, block_size=4, markov_rank=0, confidence=False, heads=4, kv_heads=1),
]
# (spec, real vocabulary of an inflated pair or None): every head type, and the padded-vocabulary masking
META_CASES = [(SPECS[0], None), (SPECS[0], 60), (SPECS[1], None), (SPECS[2], None), (SPECS[3], 60)]


def _meta_pair(root: Path, spec: PairSpec, real_vocab: int | None) -> tuple[TargetModel, DSparkDraftModel]:
    """A target and drafter of ``spec`` loaded by the engines' own loaders onto the meta device (a buffer a
    loader leaves on the host would show up as a host tensor inside the steps)."""
    target_dir, draft_dir = write_pair(root, spec)
    if real_vocab is not None:  # an inflated pair: ids from real_vocab on are padding
        for config_file, extra in (
            (target_dir / "config.json", {REAL_VOCAB_KEY: real_vocab}),
            (draft_dir / "config.json", {REAL_VOCAB_KEY: real_vocab, "mask_token_id": real_vocab - 1}),
        ):
            config_file.write_text(json.dumps(json.loads(config_file.read_text()) | extra))
    drafter = load_draft_model(draft_dir, target_dir=target_dir, device="meta")
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=drafter.config.target_layer_ids, device="meta")
    assert target.vocab_size == drafter.config.real_vocab_size == real_vocab or real_vocab is None
    return target, drafter


def _guarded(fn: Callable[[], object], device: str, host: list[torch.Tensor]) -> object:
    guard = CaptureGuard(device, host_tensors=host)
    try:
        with guard.active():
            out = fn()
    except (RuntimeError, NotImplementedError) as error:  # meta tensors refuse host reads and mixed devices
        if guard.violations:
            raise AssertionError("not capturable:\n" + guard.report()) from error
        raise
    assert guard.ops, "the region ran no op"
    assert not guard.violations, "not capturable:\n" + guard.report()
    return out


@pytest.mark.parametrize(
    ("spec", "real_vocab"), META_CASES, ids=[f"{s.name}-{'padded' if v else 'vocab'}" for s, v in META_CASES]
)
def test_step_bodies_on_the_meta_device(tmp_path: Path, spec: PairSpec, real_vocab: int | None) -> None:
    """Every bucket's verify step (reference slot attention, reference sampler), draft step and context append
    touch only device tensors, read nothing on the host and write no Python scalar into a device element."""
    target, drafter = _meta_pair(tmp_path, spec, real_vocab)
    bs, top_k, width = spec.block_size, 4, spec.block_size + 1
    verify_cache = target.new_kv_cache(5, 48)
    verify = VerifyGraphRunner(
        target,
        verify_cache,
        dummy_slot=verify_cache.reserve_last(),
        max_drafts=bs,
        draft_top_k=top_k,
        max_requests=4,
        mode="static",
        sampler=rejection_sample_reference,
        buckets=BUCKETS,
        prefill_rows=8,
    )
    draft_cache = drafter.new_context_cache(5, 48)
    draft = DraftGraphRunner(
        drafter,
        draft_cache,
        dummy_slot=draft_cache.reserve_last(),
        draft_top_k=top_k,
        max_requests=4,
        mode="static",
        buckets=BUCKETS,
    )
    assert verify.backend == draft.backend == "reference"
    host = [verify._host_int, verify._host_float, draft._host_int, draft._host_temp, draft._host_where]
    host.append(draft_cache.lengths)
    smallest, largest = min(verify.steps), max(verify.steps)
    for chunks, rows in (smallest, largest):  # the bodies differ in shapes only (meta ops run in Python: slow)
        packed, features = _guarded(verify.steps[(chunks, rows)].fn, "meta", host)
        assert packed.device.type == "meta" and packed.shape == (chunks, 1 + width)
        assert features is not None and features.shape == (rows, target.feature_dim)
    for size in (BUCKETS[0], BUCKETS[-1]):
        packed, ids, probs = _guarded(draft.steps[size].fn, "meta", host)
        assert packed.shape == (size, 2 * bs) and ids.shape == probs.shape == (size, bs, top_k)
        assert all(t.device.type == "meta" for t in (packed, ids, probs))
        _guarded(draft.append_steps[size].fn, "meta", host)
    # The append step of a drafter fed rows the verifier already projected.
    projected_cache = drafter.new_context_cache(5, 48)
    projected = DraftGraphRunner(
        drafter,
        projected_cache,
        dummy_slot=projected_cache.reserve_last(),
        draft_top_k=top_k,
        max_requests=4,
        mode="static",
        buckets=BUCKETS,
        projected=True,
    )
    assert projected.context_rows.shape[1] == drafter.config.hidden_size
    projected_host = [*host, projected._host_int, projected._host_temp, projected._host_where, projected_cache.lengths]
    _guarded(projected.append_steps[BUCKETS[-1]].fn, "meta", projected_host)
    _guarded(projected.steps[BUCKETS[-1]].fn, "meta", projected_host)  # its staged append takes projected rows


# ------------------------------------------------------------------------- on CPU, Triton through the interpreter
@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[TargetModel, DSparkDraftModel]:
    spec = PairSpec(vocab=128, hidden=32, block_size=5, markov_rank=8, target_layer_ids=(-1, 1, 2), seed=5)
    target_dir, draft_dir = write_pair(tmp_path_factory.mktemp("guard"), spec)
    drafter = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=drafter.config.target_layer_ids)
    return target, drafter


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs compiled on CUDA: the capture itself checks")
def test_triton_step_bodies_in_real_rounds(pair: tuple[TargetModel, DSparkDraftModel]) -> None:
    """The bodies exactly as captured on a GPU (Triton slot attention and Triton rejection sampler, here through
    the interpreter), while an engine runs real rounds of greedy and sampled requests with top-k / top-p: no
    host read, no syncing op, no tensor from Python data, no host staging buffer touched."""
    target, drafter = pair
    verify = VerifyEngine(
        target, 4, 64, use_triton=True, graphs="static", max_drafts=drafter.block_size, graph_buckets=BUCKETS
    )
    draft = DraftEngine(drafter, 4, 64, graphs="static", graph_buckets=BUCKETS)
    assert verify.graphs is not None and draft.graphs is not None
    verify.graphs.backend = draft.graphs.backend = "triton"
    host = [verify.graphs._host_int, verify.graphs._host_float, draft.graphs._host_int, draft.graphs._host_temp]
    host += [draft.graphs._host_where, draft.cache.lengths]
    guarded: list[str] = []
    steps = {"verify": verify.graphs.steps, "draft": draft.graphs.steps, "append": draft.graphs.append_steps}
    for kind, by_size in steps.items():
        for size, step in by_size.items():
            body = step.fn

            def checked(body=body, name=f"{kind}[{size}]"):
                guarded.append(name)
                return _guarded(body, "cpu", host)

            step.fn = checked
    engine = SpeculativeEngine(verify, draft, make_policy("full", None, drafter.block_size))
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=1.0, top_k=7, max_tokens=12, seed=1),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=2),
    ]
    ids = [engine.add_request([3 + i, 9, 27, 81], sp) for i, sp in enumerate(params)]
    for _ in range(3):
        engine.step()
    # The rounds' context appends are done inside the draft steps; a row block longer than a draft step
    # takes per request runs the append step itself.
    assert {name.split("[")[0] for name in guarded} == {"verify", "draft"}, guarded
    rows = torch.randn(drafter.block_size + 2, drafter.config.context_feature_size)
    draft.append_context([ContextItem(ids[0], draft.context_length(ids[0]), rows)])
    assert {name.split("[")[0] for name in guarded} == {"verify", "draft", "append"}, guarded
    for rid in ids:
        engine.abort(rid)
