"""The product's shape on one machine: Ray Serve with the drafter pool and the verifier pool on separate devices
(issue 12), driven over HTTP with streaming completions.

For every ``--policies`` x ``--groups`` setting the script writes a Serve config derived from
``deploy/serve_config.gpu.yaml`` (one drafter and one verifier replica, pinned by the ``draft_pool`` /
``verify_pool`` resources of the embedded node; one GPU each on a GPU machine, none on the CPU), starts ``dspark
serve --config`` on it, waits for ``/health``, then for every concurrency level runs the streaming load of
``bench/bench_http.py`` for ``--duration`` seconds and reads the server's ``/metrics`` before and after (tau, rounds,
verified drafts). On a GPU machine ``nvidia-smi`` samples every GPU's utilisation during each load, which gives
each pool's busy fraction. Raw results: ``serve_pools.json``; a short table last.

With ``--shape`` the demo pair is inflated first (``dspark inflate``, docs/COST_REALISTIC.md) into a scratch folder.

Two GPUs (nvidia-h200-x2): Ray Serve and the prometheus_client wheel travel in ``.gpu-ray`` (see
docs/benchmarks/data_plane.md for the exact carry):
    bash -c 'mkdir -p /tmp/site && tar xJf .gpu-ray/ray-serve-*.tar.xz -C /tmp/site && python3 -m pip install -q \\
      --no-index --no-deps --target /tmp/site .gpu-ray/*.whl && export PYTHONPATH=/tmp/site:. \\
      PATH=/tmp/site/bin:$PATH && python3 bench/bench_serve_pools.py --shape qwen3-4b --device cuda --out-dir $OUT'
CPU smoke (Ray from the project's environment, demo pair, about two minutes):
    PYTHONPATH=. python bench/bench_serve_pools.py --device cpu --concurrency 1 4 --duration 5 --out-dir /tmp/pools
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import load_summary, run_load, scrape, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
DEMO_DRAFT = ROOT / "models" / "demo" / "draft_dspark"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--shape", default="none", help="inflate the demo pair to this Qwen3 shape (none: as it is)")
    p.add_argument("--policies", nargs="+", default=["autoregressive", "dspark"])
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2], help="scheduler.request_groups settings")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--feature-transport", choices=("grpc", "collective"), default="grpc",
                   help="context features as gRPC bytes, or over torch.distributed links (NCCL on GPUs)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out-dir", type=Path, required=True)
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_config(target: Path, draft: Path, device: str, policy: str, groups: int, port: int,
                 slots: int, transport: str = "grpc") -> dict[str, Any]:
    """deploy/serve_config.gpu.yaml with these models, one replica per pool, no secrets, test-sized limits."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.gpu.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    args = app["args"]
    args["model_name"] = "dspark-demo"
    gpu = device == "cuda"
    args["models"].update(target=str(target), draft=str(draft), device=device,
                          dtype="bfloat16" if gpu else "float32")
    for pool in ("draft_pool", "verify_pool"):
        args[pool].update(num_gpus=1 if gpu else 0, num_cpus=1)
    args["engine"].update(max_requests=slots, max_seq_len=1024, feature_transport=transport)
    args["scheduler"].update(policy=policy, request_groups=groups)
    args["network"] = {"grpc_timeout_s": 60}
    app["deployments"] = [{"name": name, "num_replicas": 1} for name in ("Verifier", "Drafter")
                          if policy != "autoregressive" or name == "Verifier"]
    return config


class GpuSampler:
    """``nvidia-smi`` utilisation samples of every GPU while a load runs (nothing on a machine without it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=self.path.open("w"), stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    def mean_utilisation(self) -> dict[str, float]:
        samples: dict[str, list[float]] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                index, _, value = line.partition(",")
                if value.strip().isdigit():
                    samples.setdefault(index.strip(), []).append(float(value))
        return {f"gpu{i}": sum(v) / len(v) for i, v in samples.items()}


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def run_setting(args: argparse.Namespace, target: Path, draft: Path, policy: str, groups: int,
                scratch: Path) -> list[dict[str, Any]]:
    port = _free_port()
    path = scratch / f"serve_{policy}_{groups}.yaml"
    path.write_text(yaml.safe_dump(serve_config(target, draft, args.device, policy, groups, port,
                                                max(args.concurrency), args.feature_transport)))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    log = (args.out_dir / f"serve_{policy}_{groups}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--config", str(path)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        started = time.monotonic()
        wait_healthy([proc], base, args.startup_timeout)
        print(f"{policy} groups={groups}: healthy after {time.monotonic() - started:.0f} s", flush=True)
        for concurrency in args.concurrency:
            load = argparse.Namespace(model="dspark-demo", api_key=None, concurrency=concurrency,
                                      duration=args.duration, requests=1 << 30, max_tokens=args.max_tokens,
                                      temperature=0.0, disconnect=0.0, timeout=300.0)
            before = scrape(base)
            sampler = GpuSampler(args.out_dir / f"gpu_{policy}_{groups}_c{concurrency}.csv")
            with sampler:
                stats, elapsed = asyncio.run(run_load(load, base))
            after = scrape(base)
            drafts = _delta(before, after, "vllm:spec_decode_num_drafts_total")
            accepted = _delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")
            row = {
                "policy": policy, "groups": groups, "concurrency": concurrency,
                **load_summary(stats, elapsed, load),
                "tau": 1 + accepted / drafts if drafts else 1.0,
                "gpu_utilisation": sampler.mean_utilisation(),
            }
            row.pop("settings")
            rows.append(row)
            print(_line(row), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
    return rows


def _line(r: dict[str, Any]) -> str:
    util = " ".join(f"{k} {v:.0f}%" for k, v in sorted(r["gpu_utilisation"].items()))
    return (f"{r['policy']:<15}{r['groups']:>4}{r['concurrency']:>6}{r['per_user_tokens_per_s']['p50']:>10.1f}"
            f"{r['output_tokens_per_s']:>10.1f}{r['tau']:>6.2f}{r['completed']:>7}{sum(r['errors'].values()):>5}"
            f"  {util}")


HEADER = f"{'policy':<15}{'grp':>4}{'conc':>6}{'tok/s/u':>10}{'agg tok/s':>10}{'tau':>6}{'done':>7}{'err':>5}  busy"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        target, draft = DEMO_TARGET, DEMO_DRAFT
        if args.shape != "none":
            subprocess.run([sys.executable, "-m", "cluster.cli", "inflate", "--target", str(DEMO_TARGET), "--draft",
                            str(DEMO_DRAFT), "--shape", args.shape, "--out", str(scratch / "pair")], check=True)
            target, draft = scratch / "pair" / "target", scratch / "pair" / "draft"
            if (DEMO_DRAFT / "sts.json").exists():
                shutil.copy(DEMO_DRAFT / "sts.json", draft / "sts.json")
        for policy in args.policies:
            for groups in args.groups if policy != "autoregressive" else [1]:
                results["rows"] += run_setting(args, target, draft, policy, groups, scratch)
                (args.out_dir / "serve_pools.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + HEADER)
    for row in results["rows"]:
        print(_line(row))
    return 0 if all(not r["errors"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
