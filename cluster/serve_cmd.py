"""``dspark serve``: start an embedded local Ray cluster (or join one) and deploy the application.

With no ``--config`` it serves the shipped demo pair on CPU on 127.0.0.1:8000. ``--config FILE`` takes a Ray Serve
config file (the same file ``serve deploy`` takes and the KubeRay manifest embeds): the application whose
``import_path`` is ``cluster.app:build_app`` gets its ``args``, and each entry under ``deployments`` overrides that
deployment's options (replicas, autoscaling, resources).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

IMPORT_PATH = "cluster.app:build_app"
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


def app_args_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The AppConfig ``args`` equivalent of the command-line model / engine options.

    Options the parser does not have (a standalone server offers only those it uses) or left unset keep
    AppConfig's defaults.
    """
    given = {name: value for name, value in vars(args).items() if value is not None}

    def pick(*names: str) -> dict[str, Any]:
        return {name: given[name] for name in names if name in given}

    models = {name: str(value) for name, value in pick("target", "draft", "tokenizer", "sps").items()}
    models.update(pick("device", "dtype"))
    if given.get("policy") == "autoregressive":
        models["draft"] = None
    out: dict[str, Any] = {
        "models": models,
        "engine": pick("max_requests", "max_seq_len", "draft_top_k", "graphs"),
        "scheduler": pick("policy", "draft_cost"),
        "network": pick("api_key"),
    }
    if given.get("served_model_name"):
        out["model_name"] = given["served_model_name"]
    return out


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    import ray
    from ray import serve

    from cluster.app import assemble_app

    if args.address:
        ray.init(address=args.address)
    else:
        # Embedded mode: everything is on this machine, so the gRPC data plane stays on loopback unless the
        # config says otherwise (Ray may register the node under a routable address).
        network = app_args.setdefault("network", {})
        if not network.get("grpc_host"):
            network["grpc_host"] = "127.0.0.1"
        # An embedded single-node cluster on loopback; the node carries both pools.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            _node_ip_address="127.0.0.1",
            # Logical CPUs are Ray's accounting, not cores: four deployments of one CPU each must fit on a laptop.
            num_cpus=args.num_cpus or max(4, os.cpu_count() or 1),
            resources={"draft_pool": 1, "verify_pool": 1},
            object_store_memory=256 * 1024 * 1024,
            include_dashboard=False,
        )
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(assemble_app(app_args, overrides), name="dspark", route_prefix="/")
    logger.info("serving on http://%s:%d/v1 (Ctrl-C to stop)", args.host, args.port)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
