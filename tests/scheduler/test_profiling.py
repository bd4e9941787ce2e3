"""SPS profiling of the graph-path verify step on CPU (mode ``static``: the code a CUDA graph records, eagerly)."""

from __future__ import annotations

import pytest
import torch
from model_factory import PairSpec, write_pair

from scheduler.profiling import profile_graph_sps, profile_graph_sps_by_requests
from scheduler.sps import RequestSPS, SPSTable
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
