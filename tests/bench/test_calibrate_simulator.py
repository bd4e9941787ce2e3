"""bench/calibrate_simulator.py on the shipped serving matrices: the derived costs follow their rule, every measured
cell is simulated in both fits, the bench's aggregate of the autoregressive cells (round model only, no acceptance
trace involved), counted as the bench counts it, comes within the 10 % goal when fitted on all levels, and Ray's
autoregressive runs are simulated with the decode steps they served with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.calibrate_simulator import (
    ROOT,
    _host_of,
    _window_stats,
    layout_base,
    main,
    matrices_of,
    measured_levels,
    run_decode_steps,
    served_sps,
)
from cluster.config import GPU_DECODE_STEPS
from cluster.simulator.costs import load_costs
from cluster.simulator.simulation import ClosedLoop, ClusterSpec, simulate
from cluster.simulator.workload import Workload

MATRIX = ROOT / "docs" / "simulator" / "serve_matrix_calibration.json"
DECODE_STEPS = ROOT / "docs" / "benchmarks" / "serve_matrix_decode_steps.json"
COLUMNS = ROOT / "docs" / "benchmarks" / "serve_matrix_columns.json"


def test_levels_and_the_host_rule() -> None:
    levels = measured_levels(json.loads(MATRIX.read_text()))
    assert {(lv.layout, lv.policy) for lv in levels} >= {("no-ray", "dspark"), ("ray", "autoregressive")}
    base = load_costs(ROOT / "docs" / "simulator" / "costs_h200.json")
    level = next(lv for lv in levels if (lv.layout, lv.policy, lv.users) == ("no-ray", "autoregressive", 1))
    assert level.round_s == pytest.approx(5.0 / 1450)  # the window over the server's rounds
    verify = base.verify_s(1, 1)
    prefill = level.joins_per_round * base.prefill_s(round(level.mean_prompt))
    assert _host_of(level, base) == pytest.approx(level.round_s - verify - prefill - level.draft_s)


def test_every_cell_is_predicted_and_the_plain_rounds_compose(tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    assert main(["--json", str(out), "--costs-out", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    cells = {(r["fit"], r["layout"], r["policy"], r["users"]) for r in doc["cells"]}
    assert len(cells) == len(doc["cells"]) == 2 * len(measured_levels(json.loads(MATRIX.read_text())))
    for row in doc["cells"]:
        if row["fit"] == "all" and row["policy"] == "autoregressive":
            assert abs(row["error"]["aggregate"]) <= 0.10, row
    for layout in ("no-ray", "ray"):
        costs = load_costs(tmp_path / f"costs_served_{layout}.json")  # loads as a cost file the simulator takes
        assert costs.calibrated and costs.hop_s("colocated") == 0.0


def test_the_served_table_wins_when_the_results_hold_it() -> None:
    base_doc = json.loads((ROOT / "docs" / "simulator" / "costs_h200.json").read_text())
    table = base_doc["prefill"]["sps"]  # a real token table, standing in for what a server reported
    card = {"id": "m", "dspark": {"sps": {"local": {**table, "origin": {"source": "cache"}}}}}
    matrix = {"runs": [{"layout": "ray", "server": {"cards": [{"id": "m", "dspark": {}}]}},
                       {"layout": "no-ray", "server": {"cards": [card]}}]}
    assert served_sps(matrix["runs"][1]) == table and served_sps(matrix["runs"][0]) is None
    doc, costs = layout_base(base_doc, matrix, "no-ray")
    assert doc["verify"]["sps"] == table and costs.verify_s(1, 1) == costs.prefill_sps.dense_step_time(1)[1]
    assert layout_base(base_doc, matrix, "ray")[0] is base_doc  # nothing recorded: the profiled tables


def test_ray_autoregressive_runs_are_read_with_their_decode_steps() -> None:
    """The decode steps come from the matrix's ``--ray-scheduler`` settings, for Ray's autoregressive runs only; a
    level's rounds then hold a pass per step, which the host rule and the measured generation rate count."""
    matrices = matrices_of(json.loads(DECODE_STEPS.read_text()))
    assert len(matrices) == 2
    steps = {(m["matrix"]["date"], run["layout"]): run_decode_steps(m, run) for m in matrices for run in m["runs"]}
    assert sorted(steps.values()) == [1, 4, 8]
    columns = json.loads(COLUMNS.read_text())
    assert {run_decode_steps(columns, run) for run in columns["runs"]} == {1}  # no Ray autoregressive run
    auto = {"matrix": {"command": ["--ray-scheduler", "decode_steps=auto", "--out-dir", "x"], "device": "NVIDIA H200"}}
    ray = {"layout": "ray", "policy": "autoregressive"}
    assert run_decode_steps(auto, ray) == GPU_DECODE_STEPS
    assert run_decode_steps({"matrix": {"command": [], "device": "NVIDIA H200"}}, ray) == 1  # not set: one step
    base = load_costs(ROOT / "docs" / "simulator" / "costs_h200.json")
    level = next(lv for m in matrices for lv in measured_levels(m) if lv.decode_steps == 8 and lv.users == 8)
    assert level.passes_per_round == 127 / 16  # 128 tokens: the prefill's, 15 rounds of 8 and one of 7
    run = next(run for run in matrices[1]["runs"] if run["layout"] == "ray")
    measured = next(lv for lv in run["levels"] if lv["load"]["value"] == 8)
    drafts = measured["speculative"]["drafts"]
    assert level.generated == pytest.approx((drafts * 127 / 16 + measured["completed"]) / measured["window_s"])
    verify = base.verify_s(8, 8) * 127 / 16
    prefill = level.joins_per_round * base.prefill_s(round(level.mean_prompt))
    assert _host_of(level, base) == pytest.approx(level.round_s - verify - prefill - level.draft_s)


def test_the_window_opens_after_the_last_warm_up_request_as_the_bench_counts() -> None:
    """Users with equal requests end in waves; the bench's window opens once every user ended its first request,
    so the wave that ended then is not counted, and the window counts the waves that end in it."""
    costs = load_costs(ROOT / "docs" / "simulator" / "costs_h200.json")
    users, count = 4, 40
    workload = Workload(np.zeros(count), np.full(count, 50), np.full(count, 16))
    spec = ClusterSpec(placement="colocated", policy="autoregressive", verifier_slots=users)
    result = simulate(workload, costs, None, spec, closed_loop=ClosedLoop(users, 0.002))
    t0 = float(np.max(result.finish_s[:users]))
    assert (result.finish_s[:users] == t0).all()  # the first wave ends together
    period = float(result.finish_s[users]) - t0  # the next wave's end
    assert (result.finish_s[users : 2 * users] == t0 + period).all()
    window = 2.5 * period  # two more waves end in it
    predicted = _window_stats(result, t0, window, 0.002)
    assert predicted.aggregate * window == pytest.approx(2 * users * 16)


def test_the_matrices_with_decode_steps_are_calibrated(tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    assert main(["--matrix", str(COLUMNS), str(DECODE_STEPS), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["cells"]
    plain = [r for r in rows if r["policy"] == "autoregressive"]
    ray = {(r["decode_steps"], r["users"]) for r in plain if r["layout"] == "ray"}
    assert ray == {(4, 1), (4, 8), (4, 32), (8, 1), (8, 8), (8, 32), (8, 128)}
    for row in plain:  # a token per target pass, as the server counts it, however many passes a round runs
        assert row["predicted"]["tau"] == pytest.approx(1.0) == row["measured"]["tau"]
