"""The ``dspark`` parser as operators meet it: fast to build (no heavy import), every option explained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Libraries that take seconds to import; building the parser (``dspark --help``) must import none of them.
HEAVY = ("torch", "transformers", "ray", "grpc", "uvicorn", "fastapi")


def test_building_the_parser_imports_no_heavy_library() -> None:
    code = (
        "import json, sys\n"
        "from cluster.cli import build_parser\n"
        "build_parser().format_help()\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
