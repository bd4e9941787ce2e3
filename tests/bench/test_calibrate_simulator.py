"""bench/calibrate_simulator.py on the shipped serving matrices: the derived costs follow their rule, every measured
cell is simulated in both fits, the bench's aggregate of the autoregressive cells (round model only, no acceptance
trace involved), counted as the bench counts it, comes within the 10 % goal when fitted on all levels, Ray's
autoregressive runs are simulated with the decode steps they served with, and a matrix holding the server's split
of TTFT gets the simulator's beside it (one without is calibrated as before)."""

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
    served_split,
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


def test_the_simulated_split_is_counted_over_the_window() -> None:
    """The simulator's counterpart of the server's split: the requests whose first token came in the window
    (arrival to admission, admission to the prefill round's end) and the rounds that ended in it."""
    costs = load_costs(ROOT / "docs" / "simulator" / "costs_h200.json")
    users, count = 4, 40
    workload = Workload(np.zeros(count), np.full(count, 50), np.full(count, 16))
    spec = ClusterSpec(placement="colocated", policy="autoregressive", verifier_slots=users)
    result = simulate(workload, costs, None, spec, closed_loop=ClosedLoop(users, 0.002), log_rounds=True)
    t0 = float(np.max(result.finish_s[:users]))
    window = 2.5 * (float(result.finish_s[users]) - t0)
    split = _window_stats(result, t0, window, 0.002).split
    firsts = (result.first_token_s >= t0) & (result.first_token_s <= t0 + window)
    assert firsts.sum() >= users
    assert split.queue_s == pytest.approx(np.mean((result.admit_s - result.arrival_s)[firsts]))
    assert split.admission_s == pytest.approx(np.mean((result.first_token_s - result.admit_s)[firsts]))
    assert split.queue_s >= 0 and split.admission_s > 0
    rounds = (result.round_end_s > t0) & (result.round_end_s <= t0 + window)
    # A wave's prefill round verifies no request; a first token comes at the end of the round the request joined.
    assert split.requests_per_round == pytest.approx(result.round_requests[rounds].mean())
    assert 0 < split.requests_per_round < users
    assert split.joins_per_round * rounds.sum() == pytest.approx(firsts.sum())


def test_a_matrix_with_the_served_split_is_compared_with_the_simulated_one(tmp_path: Path) -> None:
    """Levels whose server counted its TTFT split carry it and the simulated one (``served_split``); the others
    are the rows they were."""
    matrix = json.loads(COLUMNS.read_text())
    level = matrix["runs"][0]["levels"][1]
    assert served_split(level["speculative"]) is None  # recorded before the server counted it
    level["speculative"].update(first_tokens=40, ttft_split_ms={"queue": 3.0, "admission_to_first_token": 7.0},
                                requests_per_round=7.5, joins_per_round=0.25)
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(matrix))
    out = tmp_path / "calibration.json"
    assert main(["--matrix", str(path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["cells"]
    with_split = [r for r in rows if "served_split" in r]
    users = int(level["load"]["value"])
    assert {(r["fit"], r["layout"], r["policy"], r["users"]) for r in with_split} == {
        (fit, matrix["runs"][0]["layout"], matrix["runs"][0]["policy"], users) for fit in ("all", "held-out")
    }
    for row in with_split:
        measured, predicted = row["served_split"]["measured"], row["served_split"]["predicted"]
        assert measured == pytest.approx({"queue_ms": 3.0, "admission_to_first_token_ms": 7.0,
                                          "requests_per_round": 7.5, "joins_per_round": 0.25})
        assert predicted["queue_ms"] >= 0 and predicted["admission_to_first_token_ms"] > 0
        assert 0 < predicted["requests_per_round"] <= users and predicted["joins_per_round"] > 0
