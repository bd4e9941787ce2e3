"""``dspark serve --no-ray``: the whole system in one process (target, drafter, scheduler policy, HTTP API).

What the GPU benchmarks run on machines without Ray, and the quickest way to try the demo: the engines and the
round loop of :class:`~scheduler.engine.SpeculativeEngine` behind :class:`~cluster.backend.LocalBackend`, served
by the same OpenAI-compatible app as the Ray deployment. Heavy imports (torch, transformers, uvicorn) happen in
the functions so that ``dspark --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.backend import LocalBackend

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = ROOT / "models" / "demo" / "target"
DEFAULT_DRAFT = ROOT / "models" / "demo" / "draft_dspark"
DEFAULT_MODEL_NAME = "dspark-demo"
DTYPES = ("float32", "bfloat16", "float16")


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
    add("--sps", "SPS JSON: a token table or tables by request count", "the SPS cache's table for this model and "
        "engine, profiled at start when missing", type=Path, default=None)
    add("--cache-dir", "cache folder of profiled SPS tables", "$DSPARK_CACHE_DIR, else ~/.cache/dspark",
        default=None)
    add("--max-requests", "KV / context slots, i.e. concurrent requests, per replica", "16", type=int, default=16)
    add("--max-seq-len", "slot length = max prompt + completion tokens", "1024, serving 1023",
        local="the target's context, at most 2048", type=int, default=None)
    add("--draft-top-k", "draft distribution support sent to the verifier", "16", type=int, default=16)
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


def load_local_backend(
    target: Path,
    draft: Path | None,
    *,
    policy: str = "dspark",
    draft_cost: str = "none",
    sps: Path | None = None,
    cache_dir: str | None = None,
    max_requests: int = 16,
    max_seq_len: int | None = None,
    draft_top_k: int = 16,
    device: str = "cpu",
    dtype: str = "float32",
    model_name: str = DEFAULT_MODEL_NAME,
    tokenizer: Any = None,
    graphs: str = "auto",
) -> LocalBackend:
    """Load the models, build and warm up the engines, load or profile the SPS table and start a
    :class:`LocalBackend` (its loop thread runs from here).

    ``sps``: an SPS JSON file; else the table comes from the SPS cache under ``cache_dir``, or is profiled now
    and cached, by the same :func:`cluster.loading.serving_sps` a Ray verifier uses.

    ``tokenizer`` is used for detokenisation and stop strings inside the engine; pass a tokenizer object that
    no other thread uses (the HTTP app tokenises on its own instance).
    """
    import torch

    from cluster.backend import LocalBackend
    from cluster.compile_cache import use_compile_cache
    from cluster.config import AppConfig
    from cluster.graphs import resolve_graph_mode
    from cluster.loading import serving_sps
    from draft_service.checkpoint import load_draft_model
    from draft_service.engine import DraftEngine
    from draft_service.warmup import warm_up_draft
    from scheduler.engine import SpeculativeEngine
    from scheduler.policy import make_policy, uses_sps
    from verify_service.engine import VerifyEngine
    from verify_service.target import TargetModel
    from verify_service.warmup import warm_up_verify

    torch_dtype = getattr(torch, dtype)
    draft_model = None
    # The scheduled policies draft; the others are checked (and asked) without a table.
    if uses_sps(policy) or make_policy(policy, None, 1).uses_drafter:
        if draft is None or not draft.is_dir():
            raise ValueError(
                f"drafter folder {draft} not found: pass --draft DIR, or serve without speculation with "
                "--policy autoregressive"
            )
        draft_model = load_draft_model(draft, target_dir=target, dtype=torch_dtype, device=device)
    feature_ids = draft_model.config.target_layer_ids if draft_model is not None else ()
    target_model = TargetModel.from_pretrained(target, feature_ids, dtype=torch_dtype, device=device)
    if max_seq_len is None:
        max_seq_len = min(target_model.max_context_len, 2048)
    graphs = resolve_graph_mode(graphs, device)
    block_size = 1 if draft_model is None else draft_model.config.block_size
    # This deployment as an AppConfig: the engine shape of a Ray deployment with these settings (one shape for
    # every placement), and what the SPS lookup fingerprints.
    config = AppConfig.from_args({
        "models": {"target": str(target), "draft": None if draft_model is None else str(draft),
                   "sps": None if sps is None else str(sps), "dtype": dtype, "device": device},
        "engine": {"max_requests": max_requests, "max_seq_len": max_seq_len, "draft_top_k": draft_top_k,
                   "graphs": graphs},
        "scheduler": {"policy": policy, "draft_cost": draft_cost},
        "cache_dir": cache_dir,
    })
    use_compile_cache(config.cache_path)  # before the warm-up compiles the kernels
    bucketed = {} if graphs == "off" else {"graphs": graphs, "max_drafts": block_size, "draft_top_k": draft_top_k,
                                           "graph_prefill_rows": config.engine.graph_prefill_rows}
    verify = VerifyEngine(target_model, max_requests=max_requests, max_seq_len=max_seq_len, **bucketed)
    warm_up_verify(verify, block_size)
    drafter = None
    if draft_model is not None:
        from scheduler.sts import STSCalibration

        sts_path = Path(draft) / "sts.json"  # type: ignore[arg-type]
        calibration = STSCalibration.load(sts_path) if sts_path.exists() else None
        drafter = DraftEngine(draft_model, max_requests=max_requests, max_seq_len=max_seq_len,
                              draft_top_k=draft_top_k, calibration=calibration, graphs=graphs)
        warm_up_draft(drafter, projected=False)
    loaded = serving_sps(config, verify, block_size)
    engine = SpeculativeEngine(
        verify,
        drafter,
        make_policy(policy, None if loaded is None else loaded.sps, block_size, draft_cost),
        decode=(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None,
        eos_token_ids=target_model.eos_token_ids,
        draft_ahead=graphs == "capture",  # the host commits a round while the device drafts the next
        chain_verify=graphs == "capture",  # rounds of known lengths: the verify step queued behind the drafter
        chain_draft=graphs == "capture",  # and the next round's draft step behind that verify step
    )
    return LocalBackend(engine, model_name, info={"sps": {} if loaded is None else {"local": loaded.to_dict()}})


def run_local(args: argparse.Namespace) -> int:
    """Entry point of ``dspark serve --no-ray``: load everything, serve until interrupted."""
    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from cluster.http_app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    tokenizer_dir = args.tokenizer or args.target
    model_name = args.served_model_name or (
        DEFAULT_MODEL_NAME if Path(args.target).resolve() == DEFAULT_TARGET else Path(args.target).name
    )
    try:
        backend = load_local_backend(
            args.target,
            args.draft,
            policy=args.policy,
            draft_cost=args.draft_cost,
            sps=args.sps,
            cache_dir=args.cache_dir,
            max_requests=args.max_requests,
            max_seq_len=args.max_seq_len,
            draft_top_k=args.draft_top_k,
            graphs=args.graphs,
            device=device,
            dtype=dtype,
            model_name=model_name,
            tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        )
    except (OSError, ValueError) as error:
        logger.error("cannot start: %s", error)
        return 2
    app = build_app(backend, AutoTokenizer.from_pretrained(tokenizer_dir), api_key=args.api_key)
    logger.info(
        "serving %s (policy %s, %d slots x %d tokens, %s %s) on http://%s:%d%s",
        model_name,
        args.policy,
        args.max_requests,
        backend.max_context,
        device,
        dtype,
        args.host,
        args.port,
        " with an API key" if args.api_key else "",
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        backend.close()
    return 0
