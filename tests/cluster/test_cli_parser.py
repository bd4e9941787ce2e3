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


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its command line (``dspark bench serve``, ...)."""
    from cluster.cli import build_parser

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in dict.fromkeys(action.choices.values()):  # aliases share a parser
                    walk(child)

    walk(build_parser())
    return found


def test_every_option_of_every_command_has_help_and_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--help`` explains every option and shows the value it takes when not given (never a secret: a key
    taken from the environment is named, not printed)."""
    monkeypatch.setenv("DSPARK_API_KEY", "s3kr1t")
    monkeypatch.setenv("OPENAI_API_KEY", "s3kr1t")
    parsers = _parsers()
    assert {"dspark serve", "dspark bench serve", "dspark simulate run", "dspark train-drafter"} <= set(parsers)
    for prog, parser in parsers.items():
        text = parser.format_help()
        assert "s3kr1t" not in text, prog
        for action in parser._actions:
            if not action.option_strings or action.dest == "help" or action.help == argparse.SUPPRESS:
                continue
            assert action.help, (prog, action.option_strings)
            valued = action.default not in (None, "", [], {}, argparse.SUPPRESS)
            if valued and not isinstance(action.default, bool):
                assert "default" in parser._get_formatter()._expand_help(action), (prog, action.option_strings)


def test_chain_tolerance_reaches_the_config_and_the_policy() -> None:
    """``--chain-tolerance`` sets ``scheduler.chain_tolerance`` (0.05 unset), which the dspark policy's chain
    planner takes; the config refuses a value outside [0, 1]."""
    from cluster.cli import build_parser
    from cluster.config import AppConfig
    from cluster.serve_cmd import app_args_from_flags
    from scheduler.policy import DSparkScheduled, make_policy
    from scheduler.sps import SPSTable

    def tolerance(*flags: str) -> float:
        args = build_parser().parse_args(["serve", *flags])
        return AppConfig.from_args(app_args_from_flags(args)).scheduler.chain_tolerance

    assert tolerance() == 0.05
    assert tolerance("--chain-tolerance", "0.2") == 0.2
    assert tolerance("--no-ray", "--chain-tolerance", "0") == 0.0
    policy = make_policy("dspark", SPSTable([1, 64], [100.0, 90.0]), 7, chain_tolerance=0.2)
    assert isinstance(policy, DSparkScheduled) and policy.chain_tolerance == 0.2
    with pytest.raises(ValueError, match="chain_tolerance"):
        AppConfig.from_args({"scheduler": {"chain_tolerance": 2}})


def test_service_level_flags_reach_the_config() -> None:
    """``--slo-admission``, ``--slo-attainment`` (a share, or ``off`` for pacing at the target itself) and
    ``--join-hold-ms`` set the scheduler's service levels in both modes; an out-of-range value is a usage error
    (so is a negative ``--spare-workers``)."""
    from cluster.cli import build_parser
    from cluster.config import AppConfig
    from cluster.serve_cmd import app_args_from_flags

    def levels(*flags: str) -> tuple[str, float | None, float]:
        args = build_parser().parse_args(["serve", *flags])
        config = AppConfig.from_args(app_args_from_flags(args)).scheduler.service_levels
        return config.slo_admission, config.slo_attainment, config.join_hold_ms

    assert levels() == ("refuse", 0.95, 0.0)
    assert levels("--slo-admission", "queue", "--slo-attainment", "off") == ("queue", None, 0.0)
    assert levels("--slo-attainment", "0.9", "--join-hold-ms", "20") == ("refuse", 0.9, 20.0)
    for flag, bad in (("--slo-attainment", "1"), ("--slo-attainment", "0"), ("--slo-attainment", "most"),
                      ("--join-hold-ms", "-1"), ("--spare-workers", "-1"), ("--spare-workers", "two"),
                      ("--chain-tolerance", "1.5"), ("--chain-tolerance", "-0.1"), ("--chain-tolerance", "nan")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, bad])
