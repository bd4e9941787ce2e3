"""The SPS cache: a profiled table is reused by the next start with the same fingerprint, a changed fingerprint
profiles again (and says what changed), an explicit file wins, and ``dspark profile`` fills the cache that
``dspark serve --no-ray`` then reads. Real engines over a tiny random pair on CPU; nothing is mocked."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest
from model_factory import PairSpec, write_pair

from cluster.cli import main
from cluster.config import AppConfig
from cluster.loading import (
    build_local_backend,
    build_verify_engine,
    draft_layer_ids,
    drafter_block_size,
    engine_shape,
    load_or_profile_sps,
)
from cluster.sps_cache import SPSCache, sps_fingerprint
from scheduler.profiling import PROFILER_VERSION
from scheduler.sps import SPSTable, load_sps_file


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("sps-cache"), PairSpec(vocab=96, block_size=3, seed=2))


def _config(target: Path, draft: Path, cache: Path, **engine: object) -> AppConfig:
    return AppConfig.from_args({
        "models": {"target": str(target), "draft": str(draft)},
        "engine": {"max_requests": 2, "max_seq_len": 64, **engine},
        "cache_dir": str(cache),
    })


def _load(config: AppConfig):
    return load_or_profile_sps(config, build_verify_engine(config), drafter_block_size(config))


def test_cached_table_is_reused_and_a_changed_fingerprint_profiles_again(
    pair: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target, draft = pair
    cache = tmp_path / "cache"
    first = _load(_config(target, draft, cache))
    assert first.origin["source"] == "profiled"
    assert Path(first.origin["path"]).is_file() and Path(first.origin["path"]).parent == cache / "sps"
    again = _load(_config(target, draft, cache))
    assert again.origin == {**first.origin, "source": "cache"}
    assert again.sps.to_dict() == first.sps.to_dict()  # the measured numbers, not a re-profile

    with caplog.at_level(logging.INFO, logger="cluster.sps_cache"):
        other_shape = _load(_config(target, draft, cache, max_requests=3))
    assert other_shape.origin["source"] == "profiled" and other_shape.origin["path"] != first.origin["path"]
    assert "changed: engine.max_requests" in caplog.text

    # The model changes (a copy of the target whose config differs): profiled anew, the change named.
    changed = tmp_path / "models" / target.name
    shutil.copytree(target, changed)
    config_json = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config_json, "rope_theta": 12345.0}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cluster.sps_cache"):
        assert _load(_config(changed, draft, cache)).origin["source"] == "profiled"
    assert "model_config" in caplog.text

    # An explicit file wins over the cache.
    table = tmp_path / "table.json"
    table.write_text(json.dumps(first.sps.to_dict()))
    explicit = AppConfig.from_args({"models": {"target": str(target), "draft": str(draft), "sps": str(table)},
                                    "engine": {"max_requests": 2, "max_seq_len": 64}, "cache_dir": str(cache)})
    assert _load(explicit).origin == {"source": "file", "path": str(table)}


def test_a_table_of_an_earlier_profiler_version_is_profiled_again(
    pair: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A change of how steps are timed (PROFILER_VERSION) makes every cached table stale, whatever else matches."""
    target, draft = pair
    config = _config(target, draft, tmp_path / "cache")
    verify = build_verify_engine(config)
    block_size = drafter_block_size(config)
    current = sps_fingerprint(target, draft_layer_ids(config), config.models.dtype, verify.target.device,
                              engine_shape(config, block_size), PROFILER_VERSION)
    stale = SPSTable([1, 2], [1000.0, 900.0])
    SPSCache(tmp_path / "cache" / "sps").store(target.name, {**current, "profiler_version": PROFILER_VERSION - 1},
                                               stale)
    with caplog.at_level(logging.INFO, logger="cluster.sps_cache"):
        loaded = load_or_profile_sps(config, verify, block_size)
    assert loaded.origin["source"] == "profiled" and loaded.sps.to_dict() != stale.to_dict()
    assert "changed: profiler_version" in caplog.text


def test_dspark_profile_fills_the_cache_that_serve_no_ray_reads(pair: tuple[Path, Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    cache, output = tmp_path / "cache", tmp_path / "sps.json"
    flags = ["--target", str(target), "--draft", str(draft), "--max-requests", "2", "--max-seq-len", "64",
             "--device", "cpu", "--cache-dir", str(cache)]
    assert main(["profile", *flags, "--output", str(output)]) == 0
    origin = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert origin["source"] == "profiled" and Path(origin["path"]).is_file()
    cached = json.loads(Path(origin["path"]).read_text())["sps"]
    assert load_sps_file(output).to_dict() == cached  # the same table as a plain file for --sps
    config = AppConfig.from_args({"models": {"target": str(target), "draft": str(draft)}, "cache_dir": str(cache),
                                  "engine": {"max_requests": 2, "max_seq_len": 64}})
    backend = build_local_backend(config)
    try:
        info = asyncio.run(backend.model_info())
    finally:
        backend.close()
    assert info["sps"]["local"]["origin"] == {**origin, "source": "cache"}


def test_a_table_keeps_its_file_name(tmp_path: Path) -> None:
    """Tables written by earlier versions are found only while names and digests stay the same: pinned for a fixed
    fingerprint (the folder name made file-safe, the first 16 hex digits of the canonical JSON's SHA-256)."""
    fingerprint = {"format": "x/1", "files": [{"name": "tokenizer.json", "size": 3}], "b": None, "a": 1.5}
    cache = SPSCache(tmp_path)
    assert cache.path_for("Qwen/Qwen3 8B!", fingerprint) == tmp_path / "Qwen_Qwen3_8B-ef0a004a4332926b.json"
    assert cache.path_for("..", fingerprint) == tmp_path / "model-ef0a004a4332926b.json"
