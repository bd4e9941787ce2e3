"""The compile cache follows the deployment's ``cache_dir``: the ``--no-ray`` backend and the Ray replicas'
engine builders point Triton's cache at ``<cache_dir>/triton`` before their warm-up, unless the user set
``$TRITON_CACHE_DIR``. Real engines over a tiny random pair on CPU; Triton's own cache manager then writes
there."""

from __future__ import annotations

from pathlib import Path

import pytest
from model_factory import PairSpec, write_pair
from triton import knobs
from triton.runtime.cache import get_cache_manager

from cluster.compile_cache import TRITON_ENV, use_compile_cache
from cluster.config import AppConfig
from cluster.loading import build_draft_engine, build_local_backend, build_verify_engine


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("compile-cache"), PairSpec(vocab=96, block_size=3, seed=4))


def _triton_writes_to(folder: Path) -> None:
    """Triton's cache manager (what a kernel compilation stores through) puts its files under ``folder``."""
    path = Path(get_cache_manager("a" * 32).put(b"kernel", "probe.bin"))
    assert path.is_relative_to(folder) and path.read_bytes() == b"kernel"


def test_no_ray_backend_puts_the_triton_cache_under_cache_dir(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRITON_ENV, raising=False)
    target, draft = pair
    config = AppConfig.from_args({"models": {"target": str(target), "draft": str(draft)},
                                  "engine": {"max_requests": 2, "max_seq_len": 64},
                                  "scheduler": {"policy": "full"}, "cache_dir": str(tmp_path / "cache")})
    build_local_backend(config).close()  # what `dspark serve --no-ray` serves with
    folder = tmp_path / "cache" / "triton"
    assert folder.is_dir() and knobs.cache.dir == str(folder)
    _triton_writes_to(folder)


def test_replica_builders_use_cache_dir_and_a_users_setting_wins(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = pair
    config = AppConfig.from_args({"models": {"target": str(target), "draft": str(draft)},
                                  "engine": {"max_requests": 2, "max_seq_len": 64}, "cache_dir": str(tmp_path / "c")})
    monkeypatch.delenv(TRITON_ENV, raising=False)
    build_draft_engine(config)  # a drafter replica
    assert knobs.cache.dir == str(tmp_path / "c" / "triton")
    monkeypatch.delenv(TRITON_ENV, raising=False)
    build_verify_engine(config)  # a verifier replica
    assert knobs.cache.dir == str(tmp_path / "c" / "triton")
    _triton_writes_to(tmp_path / "c" / "triton")

    own = tmp_path / "users-own"
    monkeypatch.setenv(TRITON_ENV, str(own))
    build_verify_engine(config)
    assert knobs.cache.dir == str(own)
    assert use_compile_cache(tmp_path / "d") == own and not (tmp_path / "d").exists()
