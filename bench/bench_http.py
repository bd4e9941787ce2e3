"""Load test of the OpenAI-compatible HTTP endpoint: N concurrent streaming clients for a bounded time.

Every client loops: send a streaming /v1/completions request (usage included), read it to the end, or, with
probability ``--disconnect``, drop the connection after a few chunks (the server must abort the request and free
its caches). Reported: requests/s, output tokens/s (aggregate and per user), time to first token and latency
percentiles, errors by kind (goal: 0), and the server's state before and after (resident memory of the server
process when this script started it, running/waiting requests, spec-decode counters from /metrics).

By default the script starts ``dspark serve --no-ray`` itself (loopback only); ``--grpc`` starts the disaggregated
services instead (``dspark draft-server``, ``verify-server`` and ``scheduler`` as three processes talking gRPC, no
Ray); ``--url`` points it at a server that is already running (e.g. the Ray deployment).

    python bench/bench_http.py --small                                        # quick CPU check (~20 s)
    python bench/bench_http.py --concurrency 32 --duration 60 --out http.json # issue 8: 32 streams
    python bench/bench_http.py --concurrency 200 --duration 60 --disconnect 0.1 --max-requests 64  # issue 10
    python bench/bench_http.py --device cuda --draft models/demo/dspark --concurrency 32 --duration 60
    python bench/bench_http.py --grpc --draft models/demo/draft_dspark --concurrency 32 --duration 60  # issue 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\nclass ",
    "    for key, value in sorted(",
    '"""Utilities for parsing ',
    "if __name__ == '__main__':\n",
    "try:\n    import _thread\nexcept ImportError:\n",
    "def __repr__(self):\n        return ",
    "    raise ValueError(",
    "class Queue:\n    def __init__(self, maxsize=0):\n",
    "    def close(self):\n        ",
]


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    per_user_tps: list[float] = field(default_factory=list)
    completed: int = 0
    disconnected: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random, stats: Stats) -> None:
    body = {
        "model": args.model,
        "prompt": rng.choice(PROMPTS),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    drop_after = rng.randint(1, 5) if rng.random() < args.disconnect else None
    start = time.perf_counter()
    first: float | None = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                stats.error(f"http {resp.status_code}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    stats.error(f"stream error: {event['error'].get('type')}")
                    return
                if event.get("choices") and first is None:
                    first = time.perf_counter()
                if event.get("usage"):
                    usage = event["usage"]
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    stats.disconnected += 1
                    return  # leaving the context closes the connection mid-stream
    except (httpx.TransportError, json.JSONDecodeError) as error:
        stats.error(type(error).__name__)
        return
    end = time.perf_counter()
    if usage is None or first is None:
        stats.error("incomplete stream")
        return
    stats.completed += 1
    stats.ttft.append(first - start)
    stats.latency.append(end - start)
    stats.tokens.append(usage["completion_tokens"])
    if usage["completion_tokens"] > 1 and end > first:
        stats.per_user_tps.append((usage["completion_tokens"] - 1) / (end - first))


async def run_load(args: argparse.Namespace, base_url: str) -> tuple[Stats, float]:
    stats = Stats()
    deadline = time.perf_counter() + args.duration
    budget = [args.requests]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            await one_request(client, args, rng, stats)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    return stats, elapsed


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            key = sample.name + ("" if "position" not in sample.labels else f"[{sample.labels['position']}]")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model_flags(args: argparse.Namespace, server: str | None = None) -> list[str]:
    """The ``dspark serve`` flags of this run; for a standalone ``server``, only those it takes."""
    from cluster.standalone import SERVE_OPTIONS_TAKEN

    pairs = [("--policy", args.policy), ("--max-requests", args.max_requests), ("--target", args.target),
             ("--max-seq-len", args.max_seq_len), ("--served-model-name", args.model), ("--log-level", "warning"),
             ("--draft", args.draft), ("--device", args.device), ("--sps", args.sps)]
    taken = None if server is None else SERVE_OPTIONS_TAKEN[server]
    return [part for flag, value in pairs if value and (taken is None or flag in taken) for part in (flag, str(value))]


def wait_healthy(procs: list[subprocess.Popen], url: str, timeout_s: float = 300.0) -> None:
    """Poll ``url``/health until 200; fails at once when a server process exits, and after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"a server process exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    for proc in procs:
        proc.kill()
    raise SystemExit(f"server did not come up within {timeout_s:.0f} s")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    command = [sys.executable, "-m", "cluster.cli", "serve", "--no-ray", "--port", str(port), *_model_flags(args)]
    if args.api_key:
        command += ["--api-key", args.api_key]
    proc = subprocess.Popen(command, cwd=ROOT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([proc], url)
    return proc, url


def start_grpc_servers(args: argparse.Namespace) -> tuple[list[subprocess.Popen[str]], str]:
    """Drafter and verifier gRPC servers, then the scheduler with the HTTP API over them (the last process)."""
    procs: list[subprocess.Popen[str]] = []
    addresses = []
    # The servers share a token made for this run (in the environment, never on a command line).
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               DSPARK_GRPC_TOKEN=secrets.token_urlsafe(32))
    for kind in (["draft-server"] if args.draft else []) + ["verify-server"]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", kind, *_model_flags(args, kind)],
            cwd=ROOT, text=True, stdout=subprocess.PIPE, env=env,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            raise SystemExit(f"{kind} did not start: {line!r}")
        addresses.append(line.split()[-1])
    port = _free_port()
    command = [sys.executable, "-m", "cluster.cli", "scheduler", "--port", str(port), *_model_flags(args, "scheduler")]
    if args.draft:
        command += ["--drafter", addresses[0]]
    command += ["--verifier", addresses[-1]]
    if args.api_key:
        command += ["--api-key", args.api_key]
    procs.append(subprocess.Popen(command, cwd=ROOT, text=True, env=env))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(procs, url)
    return procs, url


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def load_summary(stats: Stats, elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
    """The client-side results of a load run (machine, settings, counts, rates, latency percentiles)."""
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "elapsed_s": elapsed,
        "completed": stats.completed,
        "disconnected": stats.disconnected,
        "errors": stats.errors,
        "requests_per_s": stats.completed / elapsed,
        "output_tokens_per_s": sum(stats.tokens) / elapsed,
        "per_user_tokens_per_s": percentiles(stats.per_user_tps),
        "ttft_s": percentiles(stats.ttft),
        "latency_s": percentiles(stats.latency),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="server to load (default: start dspark serve --no-ray)")
    parser.add_argument("--model", default="dspark-demo")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which new requests start")
    parser.add_argument("--requests", type=int, default=100_000, help="upper bound on requests sent")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--disconnect", type=float, default=0.0, help="fraction of clients that drop mid-stream")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    parser.add_argument("--small", action="store_true", help="quick check: 8 clients, 10 s, 32 tokens")
    # server options (when the script starts the server)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "demo" / "target")
    parser.add_argument("--draft", type=Path, default=None, help="drafter folder (default: none)")
    parser.add_argument("--policy", default=None, help="default: dspark with --draft, else autoregressive")
    parser.add_argument("--max-requests", type=int, default=32, help="server slots")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--device", default=None)
    parser.add_argument("--sps", type=Path, default=None, help="SPS table JSON for the server(s)")
    parser.add_argument("--grpc", action="store_true", help="start drafter, verifier and scheduler processes (gRPC)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.small:
        args.concurrency, args.duration, args.max_tokens = 8, 10.0, 32
    if args.policy is None:
        args.policy = "dspark" if args.draft else "autoregressive"

    procs: list[subprocess.Popen[str]] = []
    url = args.url
    if url is None and args.grpc:
        procs, url = start_grpc_servers(args)
    elif url is None:
        proc, url = start_server(args)
        procs = [proc]
    pid = procs[-1].pid if procs else None  # the process serving HTTP
    try:
        asyncio.run(one_request(httpx.AsyncClient(base_url=url), args, random.Random(0), Stats()))  # warm-up
        before, rss_before = scrape(url), rss_mib(pid)
        stats, elapsed = asyncio.run(run_load(args, url))
        time.sleep(1.0)  # let aborts of the last disconnects land
        after, rss_after = scrape(url), rss_mib(pid)
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGINT)
            proc.wait(60)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    result: dict[str, Any] = {
        **load_summary(stats, elapsed, args),
        "server": {
            "rss_mib_before": rss_before,
            "rss_mib_after": rss_after,
            "running_after": after.get("vllm:num_requests_running"),
            "waiting_after": after.get("vllm:num_requests_waiting"),
            "aborted": delta("dspark_requests_aborted_total"),
            "tau": (delta("vllm:spec_decode_num_accepted_tokens_total") + drafts) / drafts if drafts else None,
            "verify_budget": delta("vllm:spec_decode_num_draft_tokens_total") / drafts if drafts else None,
        },
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if stats.errors else 0


if __name__ == "__main__":
    sys.exit(main())
