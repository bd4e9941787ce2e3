"""``dspark profile``: profile the SPS table of a deployment's verify engine into the SPS cache, ahead of serving.

The table is what :func:`cluster.loading.load_or_profile_sps` would profile at a server's start, for the same
model, dtype, device and engine shape, written where that function looks first: servers started afterwards
(``dspark serve``, with or without Ray, ``dspark verify-server``) with the same settings and cache folder load it
instead of profiling. Run it once per GPU type (and again after changing the model, the engine shape or the
torch / triton versions: the fingerprint then differs). ``--output FILE`` also writes a plain table file for
``models.sps`` / ``--sps``.

    dspark profile --config deploy/serve_config.gpu.yaml       # exactly what that deployment's verifiers use
    dspark profile --target DIR --draft DIR --device cuda      # the serve flags
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from cluster.serve_local import add_local_arguments

    p = sub.add_parser("profile", help="profile the verify engine's SPS table into the SPS cache")
    p.add_argument("--config", help="Ray Serve config YAML: profile the engine its verifiers build")
    add_local_arguments(p)
    p.add_argument("--refresh", action="store_true", help="profile even when the cache holds a table already")
    p.add_argument("--output", type=Path, default=None, help="also write the table to this SPS JSON file")
    p.set_defaults(handler=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    import torch
    from pydantic import ValidationError

    from cluster.config import AppConfig
    from cluster.loading import build_verify_engine, drafter_block_size, load_or_profile_sps
    from cluster.serve_cmd import app_args_from_flags, load_serve_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.config:
            app_args = load_serve_config(args.config)[0]
            if args.cache_dir:
                app_args["cache_dir"] = args.cache_dir
        else:
            args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
            app_args = app_args_from_flags(args)
        config = AppConfig.from_args(app_args)
        loaded = load_or_profile_sps(
            config, build_verify_engine(config), drafter_block_size(config), refresh=args.refresh
        )
    except (OSError, ValueError, ValidationError) as error:
        print(f"dspark profile: {error}", file=sys.stderr)
        return 2
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(loaded.sps.to_dict(), indent=2) + "\n")
    print(json.dumps(loaded.origin))
    return 0
