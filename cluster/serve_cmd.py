"""``dspark serve``: start an embedded local Ray cluster (or join one) and deploy the application.

With no ``--config`` it serves the shipped demo pair on CPU on 127.0.0.1:8000. ``--config FILE`` takes a Ray Serve
config file (the same file ``serve deploy`` takes and the KubeRay manifest embeds): the application whose
``import_path`` is ``cluster.app:build_app`` gets its ``args``, and each entry under ``deployments`` overrides that
deployment's options (replicas, autoscaling, resources).

On an embedded cluster whose ingress runs one replica, that replica answers HTTP on the port itself (Ray Serve's
direct ingress, :func:`direct_ingress_environment`): a request and its streamed chunks skip Serve's HTTP proxy, a
process and a Ray streaming call each way. Serve's proxy still runs, on a free port of the same host (Serve needs
one), and is logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

IMPORT_PATH = "cluster.app:build_app"
APP_NAME = "dspark"
#: How long a stop waits for the application's deletion before the embedded cluster is shut down regardless
#: (a SIGTERM must end the process well within the grace period of Kubernetes, 30 s by default).
STOP_BUDGET_S = 8.0
#: How long start-up waits for the pool replicas to register before it lists the gRPC addresses.
ENDPOINTS_WAIT_S = 30.0
#: The environment variable that carries the embedded cluster's generated data-plane token to every replica.
EMBEDDED_TOKEN_ENV = "DSPARK_EMBEDDED_GRPC_TOKEN"
logger = logging.getLogger(__name__)


def load_serve_config(path: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """Read a Serve config file; returns (app args, per-deployment overrides, http options).

    The file is validated with Ray Serve's own schema first, so a broken file fails with Serve's message.
    """
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(Path(path).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    apps = [a for a in schema.applications if a.import_path == IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"{path}: expected exactly one application with import_path {IMPORT_PATH!r}")
    app = apps[0]
    overrides = {
        d.name: d.model_dump(exclude_unset=True, exclude={"name"}) for d in (app.deployments or [])
    }
    http = schema.http_options.model_dump(exclude_unset=True) if schema.http_options else {}
    return dict(app.args or {}), overrides, http


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the Ray mode on top of the model / engine options shared with ``--no-ray``."""
    parser.add_argument("--config", help="Ray Serve config YAML, the same file the KubeRay manifest embeds "
                        "(default: none, the flags describe the deployment)")
    parser.add_argument("--address", help="join the existing Ray cluster at this address (default: none, start "
                        "an embedded local cluster of this process's own)")
    parser.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray node "
                        "(default: the machine's cores, at least 4)")
    from cluster.serve_local import non_negative

    parser.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=None,
                        help="the ingress replica answers HTTP on --port itself, without Serve's HTTP proxy in between "
                        "(default: on for an embedded cluster whose ingress has one replica, else off)")
    parser.add_argument("--spare-workers", type=non_negative(int), default=None, help="idle Ray workers the "
                        "scheduler keeps on every node, so that a replica that dies restarts in one of them (the "
                        "config's spare_workers); on an embedded cluster every worker imports torch, Serve's replica "
                        "and this application when it starts; 0: none (default: the config's, else 1 on an embedded "
                        "cluster and 0 on a joined one)")


def direct_ingress_environment(port: int) -> dict[str, str]:
    """The Ray Serve settings that make the one ingress replica of an embedded cluster serve HTTP on ``port``.

    Serve allocates direct-ingress ports from a range: here exactly ``port`` (the range's end is exclusive), given
    back at once when the replica dies (no quarantine, which exists for load balancers in front of many nodes),
    so its replacement listens on the same port; no minimum draining period either (nothing in front of it needs
    time to notice), so a stop deletes the application within its budget. The variables must be in the
    environment of every Ray process before the cluster starts: the embedded cluster's processes inherit it."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def single_ingress(overrides: dict[str, dict[str, Any]]) -> bool:
    """Whether the application runs one ingress replica (the default): direct ingress serves one per port, and
    several need Serve's proxy to spread requests over them."""
    ingress = overrides.get("Ingress", {})
    return ingress.get("num_replicas", 1) == 1 and not ingress.get("autoscaling_config")


def free_port(host: str) -> int:
    """A port that ``host`` has free now (for Serve's proxy when the ingress replica takes the advertised one)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def app_args_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The AppConfig ``args`` equivalent of the command-line model / engine options.

    Options the parser does not have (a standalone server offers only those it uses) or left unset keep
    AppConfig's defaults.
    """
    given = {name: value for name, value in vars(args).items() if value is not None}

    def pick(*names: str) -> dict[str, Any]:
        return {name: given[name] for name in names if name in given}

    named = pick("target", "draft", "tokenizer", "sps")
    models: dict[str, str | None] = {name: str(value) for name, value in named.items()}
    models.update(pick("device", "dtype"))
    if given.get("policy") == "autoregressive":
        models["draft"] = None
    out: dict[str, Any] = {
        "models": models,
        "engine": pick("max_requests", "max_seq_len", "draft_top_k", "graphs"),
        "scheduler": pick("policy", "draft_cost", "chain_tolerance"),
        "network": pick("api_key"),
    }
    levels = pick("slo_admission", "slo_attainment", "join_hold_ms")
    if levels.get("slo_attainment") == "off":
        levels["slo_attainment"] = None
    if levels:
        out["scheduler"]["service_levels"] = levels
    if given.get("served_model_name"):
        out["model_name"] = given["served_model_name"]
    out.update(pick("cache_dir"))
    return out


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``dspark serve``: deploy, log where everything listens, serve until SIGINT or SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.no_ray:
        if args.config:
            print("dspark serve: --config describes a Ray deployment; use the flags with --no-ray", file=sys.stderr)
            return 2
        from cluster.serve_local import run_local

        return run_local(args)
    overrides: dict[str, dict[str, Any]] = {}
    if args.config:
        app_args, overrides, http = load_serve_config(args.config)
        args.host = http.get("host", args.host)
        args.port = http.get("port", args.port)
    else:
        app_args = app_args_from_flags(args)
    if args.address:
        from cluster.config import AppConfig

        try:  # an embedded cluster gets a generated token; a joined one must be given one
            AppConfig.from_args(app_args).require_grpc_auth()
        except ValueError as error:
            logger.error("cannot join %s: %s", args.address, error)
            return 2
    busy = port_in_use(args.host, args.port)
    if busy is not None:
        logger.error("cannot start: %s:%d is in use (%s); is another dspark serve still running or stopping?",
                     args.host, args.port, busy)
        return 2
    import ray
    from ray import serve

    from cluster.app import assemble_app
    from cluster.spare_workers import preload_system_config

    if args.spare_workers is not None:
        app_args["spare_workers"] = args.spare_workers
    elif not args.address:
        app_args.setdefault("spare_workers", 1)
    spare_count = app_args.get("spare_workers", 0)
    direct = args.direct_ingress
    if direct is None:
        direct = not args.address and single_ingress(overrides)
    elif direct and (args.address or not single_ingress(overrides)):
        logger.error("cannot start: --direct-ingress needs an embedded cluster and one Ingress replica")
        return 2
    proxy_port = free_port(args.host) if direct else args.port
    install_stop_signals()
    try:
        if args.address:
            ray.init(address=args.address)
        else:
            # Embedded mode: everything is on this machine, so the gRPC data plane stays on loopback unless the
            # config says otherwise (Ray may register the node under a routable address).
            network = app_args.setdefault("network", {})
            if not network.get("grpc_host"):
                network["grpc_host"] = "127.0.0.1"
            secure_embedded_cluster(network)
            if direct:
                os.environ.update(direct_ingress_environment(args.port))
            ray.init(
                # A fresh head of our own, always: without "local" Ray joins the cluster it finds (RAY_ADDRESS, the
                # last cluster started on this machine), e.g. a killed dspark serve's cluster that is still dying.
                address="local",
                _node_ip_address="127.0.0.1",
                # Logical CPUs are Ray's accounting, not cores: four deployments of one CPU each must fit a laptop.
                num_cpus=args.num_cpus or max(4, os.cpu_count() or 1),
                resources={"draft_pool": 1, "verify_pool": 1},
                object_store_memory=256 * 1024 * 1024,
                include_dashboard=False,
                _system_config=preload_system_config() if spare_count else {},
            )
        install_stop_signals()  # Ray's core worker installed a SIGTERM handler of its own (a stack dump)
        serve.start(http_options={"host": args.host, "port": proxy_port})
        serve.run(assemble_app(app_args, overrides), name=APP_NAME, route_prefix="/")
        _log_endpoints(serve.get_deployment_handle("Scheduler", app_name=APP_NAME), args, proxy_port)
        threading.Event().wait()  # until SIGINT / SIGTERM raise KeyboardInterrupt here
    except KeyboardInterrupt:
        logger.info("stopping: deleting the application (at most %.0f s)", STOP_BUDGET_S)
    finally:
        _stop(serve, ray, joined=bool(args.address))
    return 0


def install_stop_signals() -> None:
    """SIGTERM (docker stop, Kubernetes, kill) and SIGINT (Ctrl-C, ``kill -INT``) both raise KeyboardInterrupt in
    the main thread, during start-up too, so either stops the server the one graceful way.

    SIGINT is set explicitly: a process started in the background by a non-interactive shell (``dspark serve &``
    in a script) begins with SIGINT ignored, and Python then leaves it ignored, so ``kill -INT`` did nothing.
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def secure_embedded_cluster(network: dict[str, Any]) -> None:
    """Authentication of an embedded cluster that its config does not set up: random per-cluster tokens.

    Everything of an embedded cluster is a child process of this one, so the tokens travel in the environment
    that every Ray process inherits, never in an argument: Serve's stored deployment config and the command
    lines hold no secret. The data plane's token goes by name (``network.grpc_token_env``: the config's variable
    when it names one that is unset here, else a variable of our own) unless the config gives a token inline,
    a variable that is set, or ``grpc_insecure``. Ray's own ports: Ray 2.60 listens on every interface whatever the node
    address says (GCS, raylet, workers, object manager), so they keep Ray's token authentication, which Ray
    turns on for a new local cluster unless ``RAY_AUTH_MODE`` says otherwise (the operator's explicit choice
    wins); the token is ``RAY_AUTH_TOKEN`` (a fresh one unless the environment has one), so Ray writes no
    token file to the home folder.
    """
    variable = network.get("grpc_token_env")
    if not (network.get("grpc_token") or network.get("grpc_insecure") or (variable and os.environ.get(variable))):
        variable = network["grpc_token_env"] = variable or EMBEDDED_TOKEN_ENV
        os.environ[variable] = secrets.token_urlsafe(32)
        logger.info("the gRPC data plane requires a token generated for this cluster ($%s)", variable)
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (None when it can): checked before Ray starts, so a port still held
    by a stopping server is a one-line error instead of a Serve proxy failing minutes into start-up."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            return error.strerror or str(error)
    return None


def _log_endpoints(scheduler: Any, args: argparse.Namespace, proxy_port: int) -> None:
    """Log the HTTP URL and every gRPC address, once the pool replicas have registered (bounded wait: a replica
    that registers later is served all the same, only not listed here), and Serve's proxy where the ingress
    replica answers on the port itself."""
    deadline = time.monotonic() + ENDPOINTS_WAIT_S
    while True:
        endpoints = scheduler.endpoints.remote().result(timeout_s=30)
        if endpoints["verifiers"] or endpoints["engines"] or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    logger.info("scheduler gRPC on %s", endpoints["scheduler"])
    for kind in ("verifiers", "drafters", "engines"):
        for replica_id, address in sorted(endpoints[kind].items()):
            logger.info("%s %s gRPC on %s", kind[:-1], replica_id, address)
    if proxy_port != args.port:
        logger.info("Serve's HTTP proxy on http://%s:%d (the ingress replica answers on port %d itself)",
                    args.host, proxy_port, args.port)
    logger.info("serving on http://%s:%d/v1 (Ctrl-C to stop)", args.host, args.port)


def _stop(serve: Any, ray: Any, *, joined: bool) -> None:
    """Delete the application (its replicas drain and close their servers), bounded by STOP_BUDGET_S, then leave.

    ``serve.shutdown`` is not used for the embedded cluster: its proxy keeps draining for tens of seconds, and
    ``ray.shutdown`` ends the whole embedded cluster anyway. On a joined cluster only this application goes;
    Serve and the cluster stay for their other users. A second Ctrl-C skips the wait.
    """
    deadline = time.monotonic() + STOP_BUDGET_S
    try:
        if ray.is_initialized():
            serve.delete(APP_NAME, _blocking=False)
            while APP_NAME in serve.status().applications and time.monotonic() < deadline:
                time.sleep(0.5)
            if APP_NAME in serve.status().applications:
                logger.warning("the application was not deleted within %.0f s; its replicas are killed",
                               STOP_BUDGET_S)
            else:
                logger.info("application deleted")
    except KeyboardInterrupt:
        logger.warning("interrupted again: not waiting for the application's deletion")
    except Exception as error:  # e.g. Serve never started: nothing to delete
        logger.warning("deleting the application: %r", error)
    finally:
        ray.shutdown()
