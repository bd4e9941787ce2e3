"""`dspark serve --no-ray` as users run it: a real process serving the shipped demo target over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_serve_no_ray_process_answers_openai_requests() -> None:
    port = _free_port()
    command = [
        sys.executable, "-m", "cluster.cli", "serve", "--no-ray", "--policy", "autoregressive", "--port", str(port),
        "--max-requests", "2", "--max-seq-len", "128", "--api-key", "k", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # bounded wait for startup (a hang fails, nothing is timed)
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["dspark-demo"]
        resp = client.chat.completions.create(
            model="dspark-demo", messages=[{"role": "user", "content": "import os\n"}], max_tokens=6, temperature=0
        )
        assert resp.usage.completion_tokens >= 1 and resp.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_serve_refuses_clearly(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    assert main(["serve", "--no-ray", "--config", "deploy/serve_config.yaml"]) == 2
    assert "--config describes a Ray deployment" in capsys.readouterr().err
    assert main(["serve", "--no-ray", "--draft", "/nonexistent/drafter"]) == 2
    assert "drafter folder /nonexistent/drafter not found" in caplog.text
    assert main(["serve", "--no-ray", "--policy", "fixed-0"]) == 2
    assert "fixed-N" in caplog.text
