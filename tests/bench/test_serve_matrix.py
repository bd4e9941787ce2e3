"""bench/serve_matrix.py on CPU with the demo pair: one cell started cold and warm on its own cache folder, both
start-up times recorded from the process start, the first wave of every level in the results and the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serve_matrix import main, parse_args, serve_command


@pytest.mark.slow
def test_a_cell_starts_cold_then_warm_on_its_cache_folder(tmp_path: Path) -> None:
    out, cache = tmp_path / "out", tmp_path / "cache"
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in
                                                 ("def add(a, b):\n", "class Stack:\n", "import os\n")))
    stale = cache / "no-ray-dspark" / "sps" / "stale.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")  # emptied before the cold start
    assert main(["--layouts", "no-ray", "--policies", "dspark", "--concurrency", "1", "2", "--duration", "1",
                 "--output-len", "8", "--max-seq-len", "512",
                 "--prompts-dir", str(tmp_path), "--prompt-sets", "code", "--repeat-start", "--cache-dir", str(cache),
                 "--scratch", str(tmp_path / "scratch"), "--port", "8391", "--out-dir", str(out)]) == 0
    run = json.loads((out / "serve_matrix.json").read_text())["runs"][0]
    cold, warm = run["starts"]
    assert (cold["caches"], warm["caches"]) == ("cold", "warm")
    for start in (cold, warm):
        assert 0 < start["health_s"] <= start["completion_s"]
    assert run["startup_s"] == cold["completion_s"]
    assert not stale.exists() and len(list((cache / "no-ray-dspark" / "sps").glob("*.json"))) == 1
    assert (cache / "no-ray-dspark" / "triton").is_dir()
    assert [lv["first_wave"]["requests"] for lv in run["levels"]] == [1, 2]
    md = (out / "serve_matrix.md").read_text()
    assert "| no-ray dspark | cold |" in md and "| no-ray dspark | warm |" in md and "first wave" in md


def test_ray_cells_take_the_ray_serve_flags(tmp_path: Path) -> None:
    args = parse_args(["--scratch", str(tmp_path), "--out-dir", str(tmp_path), "--ray-serve-flags",
                       "--no-direct-ingress --spare-workers 0"])
    ray = serve_command(args, "ray-colocated", "dspark", Path("t"), Path("d"), "cpu", "float32", 2, 8391, None)
    assert ray[-6:-3] == ["serve", "--config", str(tmp_path / "serve-colocated-dspark.yaml")]
    assert ray[-3:] == ["--no-direct-ingress", "--spare-workers", "0"]
    local = serve_command(args, "no-ray", "dspark", Path("t"), Path("d"), "cpu", "float32", 2, 8391, None)
    assert "--no-direct-ingress" not in local  # a flag of the Ray mode only
