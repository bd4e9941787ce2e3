"""The Triton kernels compile for the serving GPUs (sm_90) on a machine without a GPU.

The CPU tests run the kernels through Triton's interpreter, which accepts programs the real compiler rejects;
this runs the real compiler (front end, LLVM, ptxas from the Triton wheel) in a subprocess with the
interpreter switched off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from kernels.compile_check import _CONFIGS, _SKINNY_CONFIGS


@pytest.mark.slow
def test_every_kernel_configuration_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--arch", "90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if ": ok in " in line]
    assert len(lines) == len(_CONFIGS) + len(_SKINNY_CONFIGS), done.stdout
