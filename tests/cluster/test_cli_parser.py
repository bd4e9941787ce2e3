"""The ``dspark`` parser as operators meet it: fast to build (no heavy import), every option explained."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def _options(command: str) -> dict[str, str]:
    """``--flag`` -> help text of one subcommand's parser."""
    from cluster.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    return {a.option_strings[-1]: a.help or "" for a in parser._actions if a.option_strings and a.dest != "help"}


@pytest.mark.parametrize("command", ["serve", "draft-server", "verify-server", "scheduler"])
def test_every_option_states_its_default(command: str) -> None:
    for flag, text in _options(command).items():
        assert "(default: " in text or "(required)" in text, (command, flag, text)


def test_serve_help_states_both_modes_where_they_differ() -> None:
    options = _options("serve")
    for flag in ("--device", "--dtype", "--served-model-name"):
        assert "--no-ray: " in options[flag], (flag, options[flag])
    # One AppConfig for every placement: the engine shape and the SPS source are the same either way.
    for flag in ("--max-requests", "--max-seq-len", "--draft-top-k", "--sps"):
        assert "--no-ray" not in options[flag], (flag, options[flag])


def test_standalone_servers_offer_only_options_they_use() -> None:
    http = {"--host", "--port", "--api-key", "--served-model-name"}
    draft, verify, scheduler = (set(_options(c)) for c in ("draft-server", "verify-server", "scheduler"))
    assert not (draft | verify) & (http | {"--draft-cost", "--tokenizer"})
    assert not draft & {"--sps", "--feature-dtype", "--no-draft-ahead"}
    assert {"--sps", "--feature-dtype", "--no-draft-ahead", "--context-projection"} <= verify
    assert not scheduler & {"--sps", "--max-requests", "--graphs", "--device", "--grpc-port", "--feature-dtype"}
