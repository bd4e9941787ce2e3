"""``dspark serve`` stops on SIGINT and SIGTERM however it was started (fast: no Ray, only the signal set-up)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What run_serve does around its wait: install the handlers, then wait until a signal raises KeyboardInterrupt.
SERVER = """
import threading
from cluster.serve_cmd import install_stop_signals
install_stop_signals()
try:
    print("ready", flush=True)  # inside the try: the signal may land right after the line is out
    threading.Event().wait()
except KeyboardInterrupt:
    print("stopping gracefully", flush=True)
"""


def _ignore_sigint() -> None:
    """What a non-interactive shell's ``&`` does to a background job: SIGINT (and SIGQUIT) ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stop_signals_raise_keyboard_interrupt_even_when_started_with_sigint_ignored(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "stopping gracefully" in out, out
