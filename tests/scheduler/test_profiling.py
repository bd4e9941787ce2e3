"""SPS profiling on CPU: the graph-path verify step (mode ``static``: the code a CUDA graph records, eagerly), the
eager target pass, and the clock each is timed by."""

from __future__ import annotations

import pytest
import torch
from model_factory import PairSpec, write_pair

from scheduler.profiling import host_step_timer, profile_graph_sps, profile_graph_sps_by_requests, profile_target_sps
from scheduler.sps import RequestSPS, SPSTable, thread_cpu_timer, wall_clock_timer
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel

BLOCK = 3
SPEC = PairSpec(vocab=64, hidden=16, target_layers=2, block_size=BLOCK, target_layer_ids=(-1, 0), seed=3)
pytestmark = pytest.mark.filterwarnings("ignore::scheduler.sps.SPSMonotonicityWarning")  # CPU timing noise


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> VerifyEngine:
    target_dir, _ = write_pair(tmp_path_factory.mktemp("profiling"), SPEC)
    torch.manual_seed(0)
    target = TargetModel.from_pretrained(target_dir)
    return VerifyEngine(target, 6, 32, graphs="static", max_drafts=BLOCK, graph_buckets=(1, 2, 4, 8))


def test_token_table_of_the_graph_step(engine: VerifyEngine) -> None:
    free = engine.num_free_slots
    table, device_times = profile_graph_sps(engine, chunk=BLOCK + 1, batch_sizes=[1, 4, 9], context=8, repeats=2)
    assert isinstance(table, SPSTable) and table.batch_sizes.tolist() == [1, 4, 9]
    assert len(device_times) == 3 and all(t > 0 for t in device_times)
    assert engine.num_free_slots == free  # the scratch requests are released


def test_tables_by_request_count_of_the_graph_step(engine: VerifyEngine) -> None:
    free = engine.num_free_slots
    by_requests, device_times = profile_graph_sps_by_requests(
        engine, chunk=BLOCK + 1, request_counts=[5, 2, 2], context=8, warmup=1, repeats=2
    )
    assert isinstance(by_requests, RequestSPS) and by_requests.request_counts == (2, 5)
    for r in (2, 5):  # R requests verifying the anchor and 0 .. block drafts each
        assert by_requests.tables[r].batch_sizes.tolist() == [r * rows for rows in range(1, BLOCK + 2)]
        assert len(device_times[r]) == BLOCK + 1 and all(t > 0 for t in device_times[r])
    assert by_requests.table_for(3) is by_requests.tables[5]
    assert engine.num_free_slots == free
    assert RequestSPS.from_dict(by_requests.to_dict()).request_counts == (2, 5)


def test_profilers_need_the_graph_path(tmp_path) -> None:
    target_dir, _ = write_pair(tmp_path, SPEC)
    eager = VerifyEngine(TargetModel.from_pretrained(target_dir), 2, 32)
    with pytest.raises(ValueError, match="graphs on"):
        profile_graph_sps(eager, chunk=BLOCK + 1, batch_sizes=[1])
    with pytest.raises(ValueError, match="graphs on"):
        profile_graph_sps_by_requests(eager, chunk=BLOCK + 1, request_counts=[1])


def test_host_steps_are_timed_by_thread_cpu_time_only_on_one_cpu_thread() -> None:
    """One intra-op thread on a CPU: the step runs on the calling thread, whose CPU time leaves out the time
    co-tenants hold the core. Several threads, or a GPU: the wall clock (the calling thread sees part of it)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert host_step_timer(torch.device("cpu")) is thread_cpu_timer
        assert host_step_timer(torch.device("cuda")) is wall_clock_timer  # only the device type is read
        torch.set_num_threads(2)
        assert host_step_timer(torch.device("cpu")) is wall_clock_timer
    finally:
        torch.set_num_threads(threads)


def test_token_table_of_eager_target_passes(tmp_path) -> None:
    target_dir, _ = write_pair(tmp_path, SPEC)
    target = TargetModel.from_pretrained(target_dir)
    table = profile_target_sps(target, chunk=BLOCK + 1, max_batch_tokens=12, context=8, warmup=1, repeats=3,
                               progress=False)
    assert table.batch_sizes.tolist() == [1, 2, 3, 4, 6, 8, 12]
    assert (table.device, table.dtype) == ("cpu", "float32")
    assert all(rate > 0 for rate in table.measured_steps_per_s)
