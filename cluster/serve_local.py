"""``dspark serve --no-ray``: the whole system in one process (target, drafter, scheduler policy, HTTP API).

The in-process placement of the one round pipeline: the command-line flags become the same
:class:`~cluster.config.AppConfig` a Ray deployment reads, :func:`cluster.loading.build_local_backend` builds
the engines and the round driver exactly as a ``colocated`` Serve replica does, and the same OpenAI-compatible
app serves them. Heavy imports (torch, transformers, uvicorn) happen in the functions so that ``dspark --help``
stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.config import AppConfig

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = ROOT / "models" / "demo" / "target"
DEFAULT_DRAFT = ROOT / "models" / "demo" / "draft_dspark"
DEFAULT_MODEL_NAME = "dspark-demo"
DTYPES = ("float32", "bfloat16", "float16")


def non_negative(kind: type[int] | type[float]) -> Any:
    """An argparse type: a number of ``kind`` that is >= 0 (a usage error otherwise)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if not value >= 0:  # also NaN
            raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
        return value

    return parse


def _attainment(text: str) -> str | float:
    """``--slo-attainment``: a share in (0, 1), or ``off``."""
    if text == "off":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1) or off, got {text!r}")
    return value


def _share(text: str) -> float:
    """``--chain-tolerance``: a share in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return value


def add_local_arguments(parser: argparse.ArgumentParser, *, services: Collection[str] | None = None) -> None:
    """The model, engine and HTTP options of ``dspark serve`` (both modes), one definition each.

    Every help text states the default that applies, per mode where the modes differ: the Ray mode (and the
    standalone servers, which build the same :class:`~cluster.config.AppConfig`) and ``--no-ray``.
    ``services``: for a standalone server, the option names (``--target``, ...) it uses, each with its
    AppConfig default only; options it would ignore are not offered.
    """

    def add(flag: str, what: str, shown: str, *, local: str | None = None, **kwargs: Any) -> None:
        """``shown``: the Ray / standalone default in words; ``local``: the ``--no-ray`` one where it differs."""
        if services is not None and flag not in services:
            return
        if local is not None and services is None:
            shown = f"{shown}; --no-ray: {local}"
        parser.add_argument(flag, help=f"{what} (default: {shown})", **kwargs)

    add("--target", "target model folder, HF Qwen3", str(DEFAULT_TARGET.relative_to(ROOT)), type=Path,
        default=DEFAULT_TARGET)
    add("--draft", "DSpark drafter folder, DeepSpec layout; unused with --policy autoregressive",
        str(DEFAULT_DRAFT.relative_to(ROOT)), type=Path, default=DEFAULT_DRAFT)
    add("--tokenizer", "tokenizer folder", "the target's", type=Path, default=None)
    add("--policy", "verification policy: dspark, dspark-async, fixed-N, full, autoregressive (no drafter)",
        "dspark", default="dspark")
    add("--draft-cost", "dspark policies: charge no draft time, or the draft time measured while serving (and "
        "skip drafting when a plain round is faster)", "none", choices=("none", "measured"), default="none")
    add("--chain-tolerance", "dspark: share of Algorithm 1's objective a length planned before the drafts exist "
        "may give up, so that the round chains (in process) or is relayed (disaggregated); 0 to 1",
        "0.05", type=_share, default=None)
    add("--sps", "SPS JSON: a token table or tables by request count", "the SPS cache's table for this model and "
        "engine, profiled at start when missing", type=Path, default=None)
    add("--cache-dir", "cache folder of profiled SPS tables", "$DSPARK_CACHE_DIR, else ~/.cache/dspark",
        default=None)
    add("--slo-admission", "a request whose tpot_slo_ms cannot be met at the current load: refused (429 + "
        "Retry-After) or queued until it can be", "refuse", choices=("refuse", "queue"), default=None)
    add("--slo-attainment", "share of each tier's requests with a tpot_slo_ms meant to meet it, which the "
        "scheduler paces the tier for; off paces every request at its target itself", "0.95",
        type=_attainment, default=None)
    add("--join-hold-ms", "while a request with a tpot_slo_ms runs, how long a prompt may wait so that prompts "
        "join rounds together and the rounds between them are chained", "0 (join at once)",
        type=non_negative(float),
        default=None)
    add("--max-requests", "KV / context slots, i.e. concurrent requests, per replica", "64", type=int,
        default=None)
    add("--max-seq-len", "slot length = max prompt + completion tokens", "1024", type=int, default=None)
    add("--draft-top-k", "draft distribution support sent to the verifier", "16", type=int, default=None)
    add("--graphs", "verify / draft steps: CUDA graphs of bucketed steps (capture), the same steps eagerly "
        "(static), eager (off), or auto = capture on CUDA, off on CPU", "auto",
        choices=("auto", "capture", "static", "off"), default="auto")
    add("--device", "cpu or cuda[:i]", "cpu", local="cuda if available, else cpu", default=None)
    add("--dtype", "model dtype", "float32", local="float32 on CPU, bfloat16 on GPU", choices=DTYPES, default=None)
    add("--served-model-name", "model id of the API", DEFAULT_MODEL_NAME,
        local=f"{DEFAULT_MODEL_NAME} for the demo target, else the target folder's name", default=None)
    add("--host", "HTTP bind address", "127.0.0.1", default="127.0.0.1")
    add("--port", "HTTP port", "8000", type=int, default=8000)
    add("--api-key", "require this bearer key on /v1/*", "$DSPARK_API_KEY; unset = open",
        default=os.environ.get("DSPARK_API_KEY"))
    add("--log-level", "log level of this process", "info", default="info",
        choices=("debug", "info", "warning", "error"))


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``dspark serve``: Ray Serve deployment by default, everything in this process with ``--no-ray``."""
    from cluster.serve_cmd import add_ray_arguments, run_serve

    p = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API (demo pair on CPU by default)",
        description="Serve the OpenAI-compatible API: a Ray Serve application on an embedded local Ray cluster "
        "(default), an existing cluster (--address), or everything in this process (--no-ray). With --config "
        "FILE the file's args decide models, engine and scheduler and the flags for them are ignored (--host "
        "and --port apply when the file has no http_options).",
    )
    p.add_argument("--no-ray", action="store_true", help="run target, drafter and scheduler in this process "
                   "(default: off, a Ray Serve application)")
    add_local_arguments(p)
    add_ray_arguments(p)
    p.set_defaults(handler=run_serve)


def local_config(args: argparse.Namespace) -> AppConfig:
    """The :class:`AppConfig` of ``dspark serve --no-ray`` with these flags: the flags as the Ray mode reads
    them (:func:`cluster.serve_cmd.app_args_from_flags`), with this mode's own defaults for what it detects:
    the device (CUDA when there is one), the dtype (bfloat16 on a GPU) and the model name."""
    import torch

    from cluster.config import AppConfig
    from cluster.serve_cmd import app_args_from_flags

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.served_model_name = args.served_model_name or (
        DEFAULT_MODEL_NAME if Path(args.target).resolve() == DEFAULT_TARGET else Path(args.target).name
    )
    return AppConfig.from_args(app_args_from_flags(args))


def run_local(args: argparse.Namespace) -> int:
    """Entry point of ``dspark serve --no-ray``: load everything, serve until interrupted."""
    import uvicorn
    from pydantic import ValidationError
    from transformers import AutoTokenizer

    from cluster.http_app import build_app
    from cluster.loading import build_local_backend

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = local_config(args)
        tokenizer_dir = config.models.tokenizer_path
        backend = build_local_backend(config, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir))
    except (OSError, ValueError, ValidationError) as error:
        logger.error("cannot start: %s", error)
        return 2
    app = build_app(backend, AutoTokenizer.from_pretrained(tokenizer_dir), api_key=config.network.api_key)
    logger.info(
        "serving %s (policy %s, %d slots x %d tokens, %s %s) on http://%s:%d%s",
        config.model_name,
        config.scheduler.policy,
        config.engine.max_requests,
        backend.max_context,
        config.models.device,
        config.models.dtype,
        args.host,
        args.port,
        " with an API key" if config.network.api_key else "",
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        backend.close()
    return 0
