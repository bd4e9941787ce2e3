"""The services as standalone processes, without Ray: ``dspark draft-server``, ``verify-server``, ``scheduler``.

The GPU benchmark machines have no Ray, and a two-GPU run pins one process per GPU; these commands run exactly the
objects the Ray deployments wrap (:class:`DrafterService`, :class:`VerifierService`, :class:`SchedulerHub` plus the
OpenAI HTTP app), wired by addresses given on the command line instead of heartbeats.

Secure by default, as the Ray deployment: every server requires the data plane's token unless started with
``--grpc-insecure``. The token comes from ``--grpc-token-file``, else ``$DSPARK_GRPC_TOKEN``, else the default
token file (:data:`~cluster.token_file.DEFAULT_TOKEN_FILE`), which the first server on a machine creates: servers
of one user on one machine then share it with no flag at all; on other machines, copy the file or set the
variable. Never on the command line, where every local user can read it (``/proc/<pid>/cmdline``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from cluster.config import AppConfig
from cluster.token_file import DEFAULT_TOKEN_FILE, load_or_create_token

logger = logging.getLogger(__name__)


_ENGINE_OPTIONS = ("--target", "--draft", "--policy", "--max-requests", "--max-seq-len", "--draft-top-k", "--graphs",
                   "--device", "--dtype", "--log-level")
#: The options of ``dspark serve`` (:func:`~cluster.serve_local.add_local_arguments`) each server takes: the ones
#: it uses, so that none is offered and then ignored. Scripts that start servers filter their flags with it.
SERVE_OPTIONS_TAKEN: dict[str, tuple[str, ...]] = {
    "draft-server": _ENGINE_OPTIONS,
    "verify-server": (*_ENGINE_OPTIONS, "--sps", "--cache-dir"),
    "scheduler": ("--target", "--tokenizer", "--policy", "--draft-cost", "--chain-tolerance",
                  "--served-model-name", "--host", "--port",
                  "--api-key", "--log-level"),
}


def _add_grpc_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grpc-host", default="127.0.0.1", help="gRPC bind address (default: 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=0,
                   help="gRPC port; 0 = any free port, printed at start (default: 0)")


#: The variable a token can be given in (scripts that start servers and call them themselves).
TOKEN_ENV = "DSPARK_GRPC_TOKEN"


def _add_grpc_token(p: argparse.ArgumentParser) -> None:
    auth = p.add_mutually_exclusive_group()
    auth.add_argument(
        "--grpc-token-file", type=Path, default=None,
        help="file holding the shared secret every gRPC call needs (mode 0600), created with a random token "
        f"when missing (default: ${TOKEN_ENV} if set, else {DEFAULT_TOKEN_FILE})",
    )
    auth.add_argument(
        "--grpc-insecure", action="store_true",
        help="serve and call the data plane without a token: anyone who reaches the port can use it "
        "(only on a trusted single-user machine) (default: off)",
    )


def grpc_token(args: argparse.Namespace) -> str | None:
    """The data plane's token for this server (None with ``--grpc-insecure``); says on stderr where it came from
    (never the token itself; stdout is for the ``listening on`` line that scripts read)."""
    if args.grpc_insecure:
        print("gRPC data plane WITHOUT authentication (--grpc-insecure)", file=sys.stderr, flush=True)
        return None
    if args.grpc_token_file is None and os.environ.get(TOKEN_ENV):
        print(f"gRPC token from ${TOKEN_ENV}", file=sys.stderr, flush=True)
        return os.environ[TOKEN_ENV]
    path = (args.grpc_token_file or DEFAULT_TOKEN_FILE).expanduser()
    try:
        token, created = load_or_create_token(path)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"gRPC token {'created in' if created else 'from'} {path}", file=sys.stderr, flush=True)
    return token


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
    """The servers' config from their flags; the data plane's token resolved (see :func:`grpc_token`)."""
    from cluster.serve_cmd import app_args_from_flags

    app_args = app_args_from_flags(args)
    token = grpc_token(args)
    app_args["network"].update(grpc_token=token, grpc_insecure=token is None)
    given = vars(args)  # each server has only the options it uses; AppConfig's defaults fill in the rest
    engine_options = ("context_projection", "feature_dtype", "draft_ahead", "feature_transport")
    app_args["engine"].update({name: given[name] for name in engine_options if name in given})
    return AppConfig.from_args(app_args)


async def _serve_forever(
    services: list[Any], args: argparse.Namespace, token: str | None, health: Any = None, close: Any = None
) -> None:
    from cluster.rpc import RpcServer

    server = RpcServer(services, host=args.grpc_host, port=args.grpc_port, token=token, health=health)
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
    config = _config(args)
    service = build_drafter_service(config, args.grpc_host)
    try:
        asyncio.run(_serve_forever([service.service()], args, config.network.grpc_token, service.health))
    finally:
        service.close()
    return 0


def run_verify_server(args: argparse.Namespace) -> int:
    from cluster.loading import build_verifier_service

    logging.basicConfig(level=args.log_level.upper())
    config = _config(args)
    service = build_verifier_service(config)
    asyncio.run(_serve_forever([service.service()], args, config.network.grpc_token, service.health, service.close))
    return 0


def run_scheduler(args: argparse.Namespace) -> int:
    import grpc
    import uvicorn
    from transformers import AutoTokenizer

    from cluster import contract
    from cluster.http_app import build_app
    from cluster.rpc import SyncRpcClient
    from scheduler.hub import SchedulerHub
    from scheduler.stopping import tokenizer_decode

    logging.basicConfig(level=args.log_level.upper())
    config = _config(args)
    tokenizer = AutoTokenizer.from_pretrained(config.models.tokenizer_path, local_files_only=True)
    engine_tokenizer = AutoTokenizer.from_pretrained(config.models.tokenizer_path, local_files_only=True)
    hub = SchedulerHub(
        model_name=config.model_name,
        policy=config.scheduler.policy,
        draft_cost=config.scheduler.draft_cost,
        chain_tolerance=config.scheduler.chain_tolerance,
        request_groups=config.scheduler.request_groups,
        decode=tokenizer_decode(engine_tokenizer),
        token=config.network.grpc_token,
        timeout_s=config.network.grpc_timeout_s,
        readiness_timeout_s=config.network.readiness_timeout_s,
        relay_drafts=config.engine.relay_drafts and config.engine.draft_ahead,
        decode_steps=config.scheduler.decode_steps_on(config.models.device),
    )
    try:
        for i, address in enumerate(args.drafter):
            hub.register_drafter(f"drafter-{i}", address)
        for i, address in enumerate(args.verifier):
            with SyncRpcClient(address, token=config.network.grpc_token, timeout_s=30) as client:
                info = contract.VERIFIER_INFO.call(client, {})
            hub.register_verifier(f"verifier-{i}", address, info["sps"])
    except grpc.RpcError as error:
        hub.close()
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise SystemExit(f"error: a server refused this scheduler's gRPC token ({error.details()}): start "
                             f"every server with the same token (--grpc-token-file or ${TOKEN_ENV})") from None
        raise
    app = build_app(hub, tokenizer, api_key=config.network.api_key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        hub.close()
    return 0
