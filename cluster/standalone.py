"""The services as standalone processes, without Ray: ``dspark draft-server``, ``verify-server``, ``scheduler``.

The GPU benchmark machines have no Ray, and a two-GPU run pins one process per GPU; these commands run exactly the
objects the Ray deployments wrap (:class:`DrafterService`, :class:`VerifierService`, :class:`SchedulerHub` plus the
OpenAI HTTP app), wired by addresses given on the command line instead of heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from cluster.config import AppConfig

logger = logging.getLogger(__name__)


_ENGINE_OPTIONS = ("--target", "--draft", "--policy", "--max-requests", "--max-seq-len", "--draft-top-k", "--graphs",
                   "--device", "--dtype", "--log-level")
#: The options of ``dspark serve`` (:func:`~cluster.serve_local.add_local_arguments`) each server takes: the ones
#: it uses, so that none is offered and then ignored. Scripts that start servers filter their flags with it.
SERVE_OPTIONS_TAKEN: dict[str, tuple[str, ...]] = {
    "draft-server": _ENGINE_OPTIONS,
    "verify-server": (*_ENGINE_OPTIONS, "--sps", "--cache-dir"),
    "scheduler": ("--target", "--tokenizer", "--policy", "--draft-cost", "--served-model-name", "--host", "--port",
                  "--api-key", "--log-level"),
}


def _add_grpc_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grpc-host", default="127.0.0.1", help="gRPC bind address (default: 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=0,
                   help="gRPC port; 0 = any free port, printed at start (default: 0)")


def _add_grpc_token(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grpc-token", default=None,
                   help="shared secret required on every gRPC call (default: none, calls are not authenticated)")


def _add_feature_path(p: argparse.ArgumentParser) -> None:
    """Options both ends of the context-feature path must agree on."""
    p.add_argument(
        "--context-projection",
        choices=("verifier", "drafter"),
        default="verifier",
        help="who applies the drafter's context projection; verifier: 1/m of the feature bytes on the wire "
        "(default: verifier)",
    )
    p.add_argument(
        "--feature-transport",
        choices=("grpc", "collective"),
        default="grpc",
        help="how context features travel: grpc (bytes in the push) or collective (torch.distributed p2p links: "
        "gloo for CPU, NCCL for CUDA tensors; only metadata over gRPC) (default: grpc)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    from cluster.serve_local import add_local_arguments

    p = sub.add_parser("draft-server", help="run a drafter gRPC server (no Ray)")
    add_local_arguments(p, services=SERVE_OPTIONS_TAKEN["draft-server"])
    _add_grpc_server(p)
    _add_grpc_token(p)
    _add_feature_path(p)
    p.set_defaults(handler=run_draft_server)
    p = sub.add_parser(
        "verify-server", help="run a verifier gRPC server (no Ray); its SPS table from the cache or profiled at start"
    )
    add_local_arguments(p, services=SERVE_OPTIONS_TAKEN["verify-server"])
    _add_grpc_server(p)
    _add_grpc_token(p)
    _add_feature_path(p)
    p.add_argument(
        "--feature-dtype",
        choices=("model", "bfloat16", "float16"),
        default="model",
        help="dtype context features travel in; model: exact, narrower ones may change drafts, never outputs "
        "(default: model)",
    )
    p.add_argument(
        "--no-draft-ahead",
        dest="draft_ahead",
        action="store_false",
        help="drafters wait for the scheduler's Propose instead of drafting as soon as the context arrives "
        "(default: off, they draft ahead)",
    )
    p.set_defaults(handler=run_verify_server)
    p = sub.add_parser("scheduler", help="run the scheduler over given drafter / verifier servers, with the HTTP API")
    add_local_arguments(p, services=SERVE_OPTIONS_TAKEN["scheduler"])
    _add_grpc_token(p)
    p.add_argument("--drafter", action="append", default=[],
                   help="drafter gRPC address, repeatable (default: none; needed unless --policy autoregressive)")
    p.add_argument("--verifier", action="append", default=[], required=True,
                   help="verifier gRPC address, repeatable (required)")
    p.set_defaults(handler=run_scheduler)


def _config(args: argparse.Namespace) -> AppConfig:
    from cluster.serve_cmd import app_args_from_flags

    app_args = app_args_from_flags(args)
    app_args["network"]["grpc_token"] = args.grpc_token
    given = vars(args)  # each server has only the options it uses; AppConfig's defaults fill in the rest
    engine_options = ("context_projection", "feature_dtype", "draft_ahead", "feature_transport")
    app_args["engine"].update({name: given[name] for name in engine_options if name in given})
    return AppConfig.from_args(app_args)


async def _serve_forever(
    services: list[Any], args: argparse.Namespace, health: Any = None, close: Any = None
) -> None:
    from cluster.rpc import RpcServer

    server = RpcServer(services, host=args.grpc_host, port=args.grpc_port, token=args.grpc_token, health=health)
    await server.start()
    print(f"listening on {server.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    if close is not None:  # the verifier's feature links close with it
        await close()


def run_draft_server(args: argparse.Namespace) -> int:
    from cluster.loading import build_drafter_service

    logging.basicConfig(level=args.log_level.upper())
    service = build_drafter_service(_config(args), args.grpc_host)
    try:
        asyncio.run(_serve_forever([service.service()], args, service.health))
    finally:
        service.close()
    return 0


def run_verify_server(args: argparse.Namespace) -> int:
    from cluster.loading import build_verifier_service

    logging.basicConfig(level=args.log_level.upper())
    service = build_verifier_service(_config(args))
    asyncio.run(_serve_forever([service.service()], args, service.health, service.close))
    return 0


def run_scheduler(args: argparse.Namespace) -> int:
    import uvicorn
    from transformers import AutoTokenizer

    from cluster.http_app import build_app
    from cluster.rpc import SyncRpcClient
    from scheduler.hub import SchedulerHub

    logging.basicConfig(level=args.log_level.upper())
    config = _config(args)
    tokenizer = AutoTokenizer.from_pretrained(config.models.tokenizer_path, local_files_only=True)
    engine_tokenizer = AutoTokenizer.from_pretrained(config.models.tokenizer_path, local_files_only=True)
    hub = SchedulerHub(
        model_name=config.model_name,
        policy=config.scheduler.policy,
        draft_cost=config.scheduler.draft_cost,
        request_groups=config.scheduler.request_groups,
        decode=lambda ids: engine_tokenizer.decode(ids, skip_special_tokens=True),
        token=args.grpc_token,
        timeout_s=config.network.grpc_timeout_s,
        readiness_timeout_s=config.network.readiness_timeout_s,
    )
    for i, address in enumerate(args.drafter):
        hub.register_drafter(f"drafter-{i}", address)
    for i, address in enumerate(args.verifier):
        client = SyncRpcClient(address, token=args.grpc_token, timeout_s=30)
        info = client.call("dspark.Verifier", "Info", {})
        client.close()
        hub.register_verifier(f"verifier-{i}", address, info["sps"])
    app = build_app(hub, tokenizer, api_key=config.network.api_key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        hub.close()
    return 0
