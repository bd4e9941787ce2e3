"""kernels.uninitialised: torch modules' initialisers skipped on the building thread only, no torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch
from conftest import ROOT

from kernels.uninitialised import uninitialised


def test_init_is_skipped_on_this_thread_only() -> None:
    mine, theirs = torch.zeros(3, 3), torch.zeros(3, 3)
    with uninitialised():
        for init in (torch.nn.init.kaiming_uniform_, torch.nn.init.uniform_, torch.nn.init.normal_):
            assert init(mine) is mine
        assert torch.nn.init.constant_(tensor=mine, val=2.0) is mine
        other = threading.Thread(target=torch.nn.init.constant_, args=(theirs, 1.0))
        other.start()
        other.join()
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))  # other torch calls run as usual
    assert torch.equal(mine, torch.zeros(3, 3)) and torch.equal(theirs, torch.ones(3, 3))
    torch.nn.init.constant_(mine, 1.0)
    assert torch.equal(mine, torch.ones(3, 3))


def test_building_modules_imports_no_dynamo() -> None:
    """What building on the meta device did (torch.nn.init on meta tensors imports torch._dynamo: 1.2-1.6 s)."""
    code = ("import sys, torch; from kernels.uninitialised import uninitialised\n"
            "with uninitialised(): torch.nn.Linear(64, 64); torch.nn.Embedding(10, 4, padding_idx=0)\n"
            "print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "False"
