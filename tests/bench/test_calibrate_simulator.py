"""bench/calibrate_simulator.py on the shipped serving matrix: the derived costs follow their rule, every measured
cell is simulated in both fits, and the engine's generation rate of the autoregressive cells (round model only,
no acceptance trace involved) comes within the 10 % goal when fitted on all levels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.calibrate_simulator import ROOT, _host_of, layout_base, main, measured_levels, served_sps
from cluster.simulator.costs import load_costs

MATRIX = ROOT / "docs" / "simulator" / "serve_matrix_calibration.json"


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
            assert abs(row["error"]["generated"]) <= 0.10, row
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
