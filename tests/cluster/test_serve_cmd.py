"""`dspark serve` (Ray mode) as operators run it: a real process on an embedded local Ray cluster, on CPU."""

from __future__ import annotations

import importlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import ray  # noqa: F401  (puts its vendored psutil on the path)
import torch

from cluster.rpc import SyncRpcClient

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's output, line by line, read on a thread (a full pipe would block the server)."""
    out: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=read, daemon=True).start()
    return out


def _until(lines: queue.Queue[str], seen: list[str], marker: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(marker in line for line in seen):
        try:
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
        except queue.Empty:
            raise AssertionError(f"no {marker!r} within {timeout_s:.0f} s; output:\n{''.join(seen)}") from None


def test_serve_starts_its_own_cluster_lists_its_ports_and_stops_on_sigterm() -> None:
    port = _free_port()
    # RAY_ADDRESS names a cluster that does not exist: plain ray.init() would try to join it (as it joins a killed
    # server's dying cluster); dspark serve must start its own and ignore it.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": "127.0.0.1:1"}
    env.pop("RAY_AUTH_MODE", None)  # the default: dspark serve secures its embedded cluster's Ray ports itself
    env.pop("DSPARK_GRPC_TOKEN", None)
    command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--max-requests", "2",
               "--max-seq-len", "128", "--num-cpus", "4"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, seen = _lines(proc), []
    try:
        _until(lines, seen, "serving on http://", 240)
        started = "".join(seen)
        for kind in ("scheduler", "verifier", "drafter"):
            assert f"{kind} " in started and "gRPC on 127.0.0.1:" in started, started
        _assert_strangers_are_refused(proc.pid, started)
        body = {"model": "dspark-demo", "prompt": "import os\n", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).status_code == 200
        proxy = _assert_the_ingress_replica_listens(proc.pid, port, started)
        assert httpx.post(f"{proxy}/v1/completions", json=body, timeout=120).status_code == 200  # Serve's way too
        time.sleep(5)  # steady state: heartbeats run every 2 s and must not print a line each
        while not lines.empty():
            seen.append(lines.get())
        steady = "".join(seen)[len(started):]
        assert "register_" not in steady, steady
        _assert_a_preloaded_spare_waits(proc.pid)
        stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        stopped_after = time.monotonic() - stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen)
    assert proc.returncode == 0, output
    assert "application deleted" in output and "Traceback" not in output, output
    assert stopped_after < 15, output


def _descendants(pid: int) -> list[Any]:
    psutil = importlib.import_module("psutil")  # Ray's vendored copy: on the path once ray is imported
    return psutil.Process(pid).children(recursive=True)


def _assert_the_ingress_replica_listens(pid: int, port: int, started: str) -> str:
    """Direct ingress (the default of an embedded cluster): the process listening on the advertised port is the
    Ingress replica itself, not Serve's proxy, whose own port is logged; returns the proxy's URL."""
    listeners = [p for p in _descendants(pid)
                 if any(c.status == "LISTEN" and c.laddr.port == port for c in p.net_connections(kind="tcp"))]
    assert len(listeners) == 1 and "ServeReplica:dspark:Ingress" in " ".join(listeners[0].cmdline()), listeners
    return re.search(r"Serve's HTTP proxy on (http://\S+)", started).group(1)  # type: ignore[union-attr]


def _assert_a_preloaded_spare_waits(pid: int, timeout_s: float = 120) -> None:
    """An idle Ray worker of the embedded cluster (``ray::IDLE``) has torch loaded already: the spare that a
    replica which dies restarts in (``--spare-workers``, 1 by default)."""
    def loads_torch(process: Any) -> bool:
        try:
            return (" ".join(process.cmdline()).startswith("ray::IDLE")
                    and "libtorch" in Path(f"/proc/{process.pid}/maps").read_text())
        except Exception:  # the process ended meanwhile
            return False

    deadline = time.monotonic() + timeout_s
    while not any(loads_torch(process) for process in _descendants(pid)):
        assert time.monotonic() < deadline, "no idle worker with torch loaded"
        time.sleep(1)


def _assert_strangers_are_refused(pid: int, started: str) -> None:
    """The embedded cluster's gRPC data plane and Ray's own ports refuse callers without its generated tokens:
    a schema-valid ``Generate`` (the HTTP API key bypass) and a prefill ``Step`` (slot exhaustion) are
    UNAUTHENTICATED, and the same calls with the token that the replicas got through their environment work."""
    scheduler = re.search(r"scheduler gRPC on (\S+)", started).group(1)  # type: ignore[union-attr]
    verifier = re.search(r"verifier \S+ gRPC on (\S+)", started).group(1)  # type: ignore[union-attr]
    generate = {"req_id": "stranger", "prompt_ids": [1, 2, 3], "params": {"max_tokens": 2, "temperature": 0.0}}
    step = {"prefill_req_ids": ["stranger"], "prefill_params": [{"max_tokens": 2}], "prefill_counts": [3],
            "prefill_tokens": torch.tensor([1, 2, 3]), "prefill_anchors": [-1], "verify_req_ids": [],
            "verify_anchors": [], "verify_counts": [], "verify_tokens": torch.zeros(0, dtype=torch.int64)}
    replicas = [p for p in _descendants(pid) if "ServeReplica" in " ".join(p.cmdline())]
    tokens = {p.environ().get("DSPARK_EMBEDDED_GRPC_TOKEN") for p in replicas}
    assert len(tokens) == 1 and None not in tokens, "every replica has the one generated token"
    token = tokens.pop()
    assert token not in started  # never logged
    for address, call in ((scheduler, lambda c: list(c.stream("dspark.Scheduler", "Generate", generate))),
                          (verifier, lambda c: c.call("dspark.Verifier", "Step", step))):
        with SyncRpcClient(address, timeout_s=30) as client, pytest.raises(grpc.RpcError) as error:
            call(client)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, address
        with SyncRpcClient(address, token=token, timeout_s=60) as client:
            assert call(client)  # schema-valid: with the token it runs
    with SyncRpcClient(verifier, token=token, timeout_s=60) as client:
        client.call("dspark.Verifier", "Release", {"req_ids": ["stranger"]})
    gcs = next(p for p in _descendants(pid) if p.name() == "gcs_server")
    port = next(c.laddr.port for c in gcs.net_connections(kind="tcp") if c.status == "LISTEN")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as error:
        channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo")(b"", timeout=30)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED  # Ray's token authentication is on
