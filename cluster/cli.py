"""The ``dspark`` command line.

One entry point for every way the system runs (serving, standalone services, evaluation, profiling). Each
subcommand is a small function registered in :data:`COMMANDS`; heavy imports (torch, Ray) happen inside the
handlers so that ``dspark --help`` stays fast and works on a machine that has only the base install.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cluster import __version__

Handler = Callable[[argparse.Namespace], int]
ROOT = Path(__file__).resolve().parents[1]


def _cmd_version(args: argparse.Namespace) -> int:
    """Print the package version and the versions of the libraries that decide numerics and transport."""
    print(f"dspark-serve {__version__}")
    if args.verbose:
        for name in ("torch", "triton", "transformers", "ray", "grpc", "msgpack"):
            try:
                module = __import__(name)
                print(f"  {name} {getattr(module, '__version__', '?')}")
            except ImportError:
                print(f"  {name} (not installed)")
        print(f"  python {platform.python_version()} on {platform.machine()}")
    return 0


def _add_version(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print the version (and library versions with -v)")
    p.add_argument("-v", "--verbose", action="store_true", help="also print library versions")
    p.set_defaults(handler=_cmd_version)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """``train-tokenizer``, ``demo-corpus``, ``train-target``: rebuild the shipped demo models."""
    from verify_service.demo.cli import register

    register(sub)


def _add_inflate(sub: argparse._SubParsersAction) -> None:
    """``inflate``: embed the demo pair into a real Qwen3 shape (cost-realistic benchmarks)."""
    from draft_service.inflate_cli import register

    register(sub)


def _add_drafter_training(sub: argparse._SubParsersAction) -> None:
    """``gen-responses``, ``train-drafter``, ``calibrate-drafter``: rebuild the shipped demo drafters."""
    from draft_service.training.cli import register

    register(sub)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """``eval``: offline accepted length, acceptance, threshold sweep and calibration of drafters."""
    from scheduler.evaluation.report import register

    register(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    """``serve``: the OpenAI-compatible server on Ray Serve (``--no-ray``: everything in this process)."""
    from cluster.serve_local import register

    register(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """``bench serve``, ``bench report``: the HTTP serving benchmark of any OpenAI-compatible server."""
    from cluster.bench_serve.cli import register

    register(sub)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    """``profile``: the verify engine's SPS table into the SPS cache (servers then load it instead)."""
    from cluster.profile_cmd import register

    register(sub)


def _add_standalone(sub: argparse._SubParsersAction) -> None:
    """``draft-server``, ``verify-server``, ``scheduler``: the services as plain processes, without Ray."""
    from cluster.standalone import register

    register(sub)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    """``simulate``: the trace-driven cluster simulator (``run``) and pool planner (``plan``)."""
    from cluster.simulator.cli import register

    register(sub)


class _HelpFormatter(argparse.HelpFormatter):
    """States each option's default after its help, unless the help says it already (``(default: ...)`` in words,
    per mode where the modes differ) or there is none to state (no value, a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default in ("", [], {})
        ):
            return text
        if isinstance(default, Path):
            default = _relative(default)
        shown = str(default).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def _relative(path: Path) -> str:
    """A path inside the repository as the repository-relative path it was written as."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: :class:`_HelpFormatter` unless a command picks a formatter of its own.
    ``add_subparsers`` makes sub-parsers of the parent's class, so nested commands (``bench serve``) get it too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


#: Subcommand registrars, in the order ``dspark --help`` lists them.
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_version,
    _add_serve,
    _add_profile,
    _add_standalone,
    _add_bench,
    _add_eval,
    _add_demo,
    _add_drafter_training,
    _add_inflate,
    _add_simulate,
]


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand."""
    parser = _Parser(
        prog="dspark",
        description="dspark-serve: lossless DSpark speculative decoding on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"dspark-serve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; exit code 2 on usage errors (argparse's convention)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
