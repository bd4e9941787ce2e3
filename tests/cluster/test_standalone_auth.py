"""The standalone servers are secure by default: with no flag a `dspark draft-server` creates a private token file
and refuses callers without its token; `--grpc-insecure` is the explicit way to serve open; a scheduler with
another token stops with a one-line error naming the fix. Plus the token file's own contract."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from model_factory import PairSpec, write_pair

from cluster.rpc import SyncRpcClient
from cluster.token_file import load_or_create_token

REPO = Path(__file__).resolve().parents[2]
DEMO_TARGET = REPO / "models" / "demo" / "target"


def test_token_file_is_created_private_once_and_then_read(tmp_path: Path) -> None:
    path = tmp_path / "config" / "dspark" / "grpc-token"
    token, created = load_or_create_token(path)
    assert created and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_token(path) == (token, False)
    assert [p.name for p in path.parent.iterdir()] == ["grpc-token"]  # no temporary file left behind


def test_concurrent_creators_agree_on_one_token(tmp_path: Path) -> None:
    path = tmp_path / "grpc-token"
    results: list[tuple[str, bool]] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        results.append(load_or_create_token(path))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({token for token, _ in results}) == 1 and sum(created for _, created in results) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["grpc-token"]


def test_a_token_file_others_can_read_or_an_empty_one_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.write_text("secret\n")
    shared.chmod(0o644)
    with pytest.raises(ValueError, match=r"accessible by other users .*chmod 600"):
        load_or_create_token(shared)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        load_or_create_token(empty)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("pair"), PairSpec(vocab=64, block_size=3, seed=2))


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HOME=str(home))
    env.pop("DSPARK_GRPC_TOKEN", None)
    return env


@pytest.fixture
def drafter_server(
    pair: tuple[Path, Path], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[str, str]]:
    """A `dspark draft-server` with the extra flags of the test's parameter; yields (address, its output)."""
    target_dir, draft_dir = pair
    cmd = [sys.executable, "-m", "cluster.cli", "draft-server", "--grpc-port", "0", "--target", str(target_dir),
           "--draft", str(draft_dir), "--max-requests", "4", "--max-seq-len", "64", "--device", "cpu",
           "--dtype", "float32", "--log-level", "warning", *request.param]
    proc = subprocess.Popen(cmd, env=_env(tmp_path), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("listening on "):
                break
        else:
            raise AssertionError(f"draft-server exited (code {proc.wait()}): {''.join(output)}")
        yield output[-1].split()[-1], "".join(output)
    finally:
        proc.terminate()
        proc.wait(60)


def _info(address: str, token: str | None) -> dict:
    with SyncRpcClient(address, token=token, timeout_s=30) as client:
        return client.call("dspark.Drafter", "Info", {})


@pytest.mark.parametrize("drafter_server", [[]], indirect=True)
def test_a_server_without_flags_creates_a_token_file_and_refuses_callers_without_it(
    drafter_server: tuple[str, str], tmp_path: Path, pair: tuple[Path, Path]
) -> None:
    address, output = drafter_server
    token_file = tmp_path / ".config" / "dspark" / "grpc-token"
    assert f"gRPC token created in {token_file}" in output
    token = token_file.read_text().strip()
    assert token not in output  # where it is, never what it is
    for wrong in (None, "not-the-token"):
        with pytest.raises(grpc.RpcError) as error:
            _info(address, wrong)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _info(address, token)["max_requests"] == 4

    # A scheduler with another token stops at once with what to do (not a traceback, not serving open).
    other = tmp_path / "other-token"
    scheduler = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "scheduler", "--target", str(DEMO_TARGET), "--drafter", address,
         "--verifier", "127.0.0.1:1", "--grpc-token-file", str(other), "--log-level", "warning"],
        env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert scheduler.returncode != 0
    assert "refused this scheduler's gRPC token" in scheduler.stderr and "--grpc-token-file" in scheduler.stderr
    assert "Traceback" not in scheduler.stderr


@pytest.mark.parametrize("drafter_server", [["--grpc-insecure"]], indirect=True)
def test_grpc_insecure_is_the_explicit_way_to_serve_open(drafter_server: tuple[str, str], tmp_path: Path) -> None:
    address, output = drafter_server
    assert "WITHOUT authentication" in output
    assert not (tmp_path / ".config").exists()
    assert _info(address, None)["max_requests"] == 4
