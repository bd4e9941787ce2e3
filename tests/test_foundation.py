"""The project installs, every package imports, and the CLI behaves (help, version, bad subcommand)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["cluster", "draft_service", "verify_service", "scheduler", "kernels"]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports_with_role_docstring(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__ and len(module.__doc__.split()) >= 20, f"{name} needs a docstring stating its role"


def test_layout_is_the_fixed_one() -> None:
    for entry in [*PACKAGES, "deploy", "tests", "pyproject.toml", "README.md", ".ci/run"]:
        assert (ROOT / entry).exists(), entry


def test_help_lists_subcommands() -> None:
    result = _run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "usage: dspark" in result.stdout
    assert "version" in result.stdout


def test_installed_console_script_runs() -> None:
    script = Path(sys.executable).parent / "dspark"
    if not script.exists():
        pytest.skip("project not installed into this interpreter's environment (no console script)")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: dspark" in result.stdout


def test_version_prints_package_version() -> None:
    result = _run_cli("version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("dspark-serve ")


def test_unknown_subcommand_prints_usage_and_exits_2() -> None:
    result = _run_cli("frobnicate")
    assert result.returncode == 2
    assert "usage: dspark" in result.stderr
    assert "invalid choice" in result.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    assert "make test" in readme and "exec make test" in ci


def test_readme_example_answers_what_the_readme_says() -> None:
    """The README's curl request, greedy, gives the continuation the README shows (the server is lossless, so the
    target's own greedy decoding is what any deployment answers)."""
    from transformers import AutoTokenizer

    from verify_service.target import TargetModel

    readme = (ROOT / "README.md").read_text()
    request = json.loads(re.search(r"-d '(\{.*\})'", readme).group(1))
    shown = json.loads(re.search(r'answers `"text": ("[^`]*")`', readme).group(1))
    target_dir = ROOT / "models" / "demo" / "target"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = tokenizer.encode(request["prompt"], add_special_tokens=True)
    assert request["temperature"] == 0
    out = TargetModel.from_pretrained(target_dir).generate([ids], max_new_tokens=request["max_tokens"])[0]
    assert tokenizer.decode(out, skip_special_tokens=True) == shown
