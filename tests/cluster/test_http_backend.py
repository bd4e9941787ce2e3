"""LocalBackend on its own (no HTTP): the loop thread, per-request queues, rejection on the first delta, abort on
close of the iterator, shutdown. A tiny random target/drafter pair keeps it fast."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path

import pytest
from http_harness import free_slots
from model_factory import PairSpec, write_pair

from cluster.backend import BackendUnavailableError, GenerateBackend, GenerateDelta, LocalBackend
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel

SLOTS = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    spec = PairSpec(vocab=128, hidden=32, block_size=4, target_layer_ids=(-1, 1, 2), seed=11)
    return write_pair(tmp_path_factory.mktemp("backend_pair"), spec)


def _backend(pair: tuple[Path, Path], max_seq_len: int = 96) -> tuple[LocalBackend, TargetModel]:
    target_dir, draft_dir = pair
    draft_model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=draft_model.config.target_layer_ids)
    engine = SpeculativeEngine(
        VerifyEngine(target, max_requests=SLOTS, max_seq_len=max_seq_len),
        DraftEngine(draft_model, max_requests=SLOTS, max_seq_len=max_seq_len),
        make_policy("dspark", SPSTable([1, 16], [1.0, 1.0]), draft_model.block_size),
    )
    return LocalBackend(engine, "tiny"), target


async def _collect(
    backend: LocalBackend, req_id: str, prompt: list[int], params: SamplingParams
) -> list[GenerateDelta]:
    return [d async for d in backend.generate(req_id, prompt, params)]


def test_concurrent_generates_equal_target_greedy(pair: tuple[Path, Path]) -> None:
    backend, target = _backend(pair)
    assert isinstance(backend, GenerateBackend)
    prompts = [[3, 5, 7], [11, 13], [17, 19, 23, 29], [31], [37, 41, 43], [47, 53]]  # more requests than slots
    max_tokens = [20, 7, 33, 12, 25, 1]

    async def main() -> list[list[GenerateDelta]]:
        return await asyncio.gather(
            *(
                _collect(backend, f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n))
                for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
            )
        )

    try:
        results = asyncio.run(main())
        expected = target.generate(prompts, max_new_tokens=max(max_tokens))
        for deltas, prompt, n, want in zip(results, prompts, max_tokens, expected, strict=True):
            assert [t for d in deltas for t in d.token_ids] == want[:n]
            assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
            assert deltas[-1].finish_reason == "length"
            assert deltas[-1].num_prompt_tokens == len(prompt) and deltas[-1].num_output_tokens == n
        assert free_slots(backend) == (SLOTS, SLOTS, False)
        snap = asyncio.run(backend.metrics())
        assert snap.num_drafts > 0 and snap.running == snap.waiting == 0
    finally:
        backend.close()


def test_queue_time_counts_the_wait_for_the_round_in_flight(pair: tuple[Path, Path]) -> None:
    """A request handed to the backend while a round runs waits for that round to end before the engine sees it:
    the TTFT split counts that wait as queueing (from the hand-over), not from the engine's add_request. The
    round in flight (the first request's second round: it was admitted in the first) is held until the second
    request was handed over, and then 0.2 s longer."""
    backend, _ = _backend(pair)
    engine = backend.engine
    step = engine.step
    in_round, handed_over = threading.Event(), threading.Event()
    rounds = itertools.count()

    def held_step() -> list:
        if next(rounds) == 1:  # the second round only
            in_round.set()
            assert handed_over.wait(60)
            time.sleep(0.2)
        return step()

    engine.step = held_step  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)

    async def main() -> None:
        first = asyncio.create_task(_collect(backend, "a", [3, 5, 7], greedy))
        assert await asyncio.to_thread(in_round.wait, 60)
        second = asyncio.create_task(_collect(backend, "b", [11, 13], greedy))
        await asyncio.sleep(0)  # the task hands "b" over (its generator's first step) ...
        handed_over.set()  # ... before the held round may end
        await asyncio.gather(first, second)

    try:
        asyncio.run(main())
        snap = asyncio.run(backend.metrics())
        assert snap.first_tokens == 2
        assert snap.queue_time_s >= 0.2
    finally:
        backend.close()


def test_rejections_come_from_the_first_delta(pair: tuple[Path, Path]) -> None:
    backend, _ = _backend(pair, max_seq_len=40)

    async def first(prompt: list[int], max_tokens: int, req_id: str = "x") -> None:
        stream = backend.generate(req_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        await anext(stream)

    try:
        with pytest.raises(ValueError, match="maximum context length is 40"):
            asyncio.run(first([1] * 30, 20))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            asyncio.run(first([1, 500], 2))
        with pytest.raises(ValueError, match="empty"):
            asyncio.run(first([], 2))
        with pytest.raises(ValueError, match="accepts at most"):  # the engine's own limit (room for a block)
            asyncio.run(first([1] * 36, 1))

        async def duplicate() -> None:
            running = backend.generate("same", [1, 2], SamplingParams(temperature=0.0, max_tokens=30))
            await anext(running)
            try:
                await first([3, 4], 2, req_id="same")
            finally:
                await running.aclose()

        with pytest.raises(ValueError, match="already in use"):
            asyncio.run(duplicate())
        assert free_slots(backend) == (SLOTS, SLOTS, False)
        assert asyncio.run(_collect(backend, "ok", [1, 2], SamplingParams(temperature=0.0, max_tokens=3)))[-1].finished
    finally:
        backend.close()


def test_closing_the_iterator_or_abort_frees_the_caches(pair: tuple[Path, Path]) -> None:
    backend, _ = _backend(pair)

    async def main() -> None:
        params = SamplingParams(temperature=0.7, seed=5, max_tokens=60)
        closed = backend.generate("closed", [1, 2, 3], params)
        aborted = backend.generate("aborted", [4, 5, 6], params)
        await anext(closed)
        await anext(aborted)
        assert free_slots(backend)[:2] == (SLOTS - 2, SLOTS - 2)
        await closed.aclose()  # a consumer that stops reading
        await backend.abort("aborted")  # the HTTP layer's explicit abort; returns once the engine let go
        assert free_slots(backend) == (SLOTS, SLOTS, False)
        await aborted.aclose()
        await backend.abort("never-existed")  # idempotent, unknown ids are fine

    try:
        asyncio.run(main())
        assert free_slots(backend) == (SLOTS, SLOTS, False)
    finally:
        backend.close()


def test_shutdown_fails_running_and_queued_requests(pair: tuple[Path, Path]) -> None:
    """close() while one request runs and another is still queued: both fail with BackendUnavailableError."""
    backend, _ = _backend(pair, max_seq_len=512)
    asyncio.run(backend.health())
    gate = threading.Event()

    async def main() -> None:
        running = backend.generate("running", [1, 2], SamplingParams(temperature=0.0, max_tokens=480))
        await anext(running)
        blocker = backend.call(lambda _engine: gate.wait(60))  # holds the loop thread between two rounds
        queued = asyncio.ensure_future(
            _collect(backend, "queued", [3, 4], SamplingParams(temperature=0.0, max_tokens=8))
        )
        # One pass of the event loop runs the new task up to its first await, after it enqueued its submit
        # behind the blocker (ordering, not timing: the loop runs ready tasks in order).
        await asyncio.sleep(0)
        closer = threading.Thread(target=backend.close)
        closer.start()
        while True:  # health turns unavailable as soon as close() has begun
            try:
                await backend.health()
            except BackendUnavailableError:
                break
            await asyncio.sleep(0.01)
        gate.set()
        with pytest.raises(BackendUnavailableError):
            async for _ in running:
                pass
        with pytest.raises(BackendUnavailableError):
            await queued
        await asyncio.wrap_future(blocker)
        closer.join(60)

    asyncio.run(main())
    with pytest.raises(BackendUnavailableError):
        asyncio.run(_collect(backend, "late", [1], SamplingParams(temperature=0.0, max_tokens=2)))
