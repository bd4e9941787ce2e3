"""``bench/plot_fault_inject.py`` on the committed fault-injection results: every role's runs are read and a PNG
is written."""

from __future__ import annotations

from pathlib import Path

from bench.plot_fault_inject import ROLES, faults, main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def test_the_spare_worker_runs_plot(tmp_path: Path) -> None:
    spares = sorted(RESULTS.glob("fault_inject_cpu_spares_*.json"))
    none = sorted(RESULTS.glob("fault_inject_cpu_no_spares_*.json"))
    assert spares and none
    assert {f["role"] for f in faults(spares)} == set(ROLES)
    out = tmp_path / "plot.png"
    assert main(["--a", *map(str, spares), "--b", *map(str, none), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
