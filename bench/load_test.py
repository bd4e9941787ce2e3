"""Sustained load on a running deployment: N concurrent streaming clients for a bounded time, some of them hanging
up mid-stream, with the resident memory of every replica process before and after.

What it checks (issue 10): errors (goal 0), latency (TTFT and end to end, p50/p99), output tokens/s, and that
memory returns to its baseline once the load is over (disconnects must free their caches): the RSS of each
process of the deployment is read from ``/proc/<pid>/status`` after a warm-up request and again ``--settle``
seconds after the last request, and the server's running/waiting gauges must be back to 0.

Processes: the Ray workers of the deployment are found by their process titles (``ray::ServeReplica:<app>:<name>``,
``ray::ServeController``, ``ray::ProxyActor``) among the descendants of ``--server-pid`` (the ``dspark serve``
process that started the embedded cluster), so other Ray clusters on the machine are not counted; ``--pids`` names
processes explicitly instead. Loopback only: the URL must point at this machine.

    dspark serve --port 8000 --max-requests 64 --max-seq-len 256 &          # the Ray deployment, demo pair, CPU
    python bench/load_test.py --url http://127.0.0.1:8000 --server-pid $!   # 200 clients, 60 s, 10 % hang up
    python bench/load_test.py --url http://127.0.0.1:8000 --small            # 16 clients, 10 s

The client loop is the one of bench/bench_http.py (same prompts, same accounting).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import Stats, load_summary, one_request, run_load, scrape

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TITLES = ("ray::ServeReplica:", "ray::ServeController", "ray::ProxyActor")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the (comm) that may hold spaces


def _descends_from(pid: int, root: int) -> bool:
    seen = 0
    while pid and seen < 64:
        if pid == root:
            return True
        parent = _parent(pid)
        if parent is None:
            return False
        pid, seen = parent, seen + 1
    return False


def replica_processes(server_pid: int | None, pids: list[int]) -> dict[int, str]:
    """PID -> a readable name for every process of the deployment."""
    if pids:
        return {pid: _cmdline(pid).split(" ")[0] or str(pid) for pid in pids}
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        title = _cmdline(pid)
        if not title.startswith(TITLES):
            continue
        if server_pid is not None and not _descends_from(pid, server_pid):
            continue
        found[pid] = title.split(" ")[0].removeprefix("ray::").split(".")[0]  # the title names the current method
    if server_pid is not None:
        found[server_pid] = "driver (dspark serve)"
    return found


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None  # the process is gone (a replica restarted): reported as missing
    return None


def replica_slots(app: str) -> dict[str, dict[str, Any]]:
    """Free/total slots of every drafter and verifier replica reachable through the Serve handles (joins the
    running Ray cluster as a driver; the handle spreads calls over replicas, so a few calls find them all)."""
    import ray
    from ray import serve

    from cluster.rpc import SyncRpcClient

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    out: dict[str, dict[str, Any]] = {}
    for name, service in (("Drafter", "dspark.Drafter"), ("Verifier", "dspark.Verifier")):
        handle = serve.get_deployment_handle(name, app_name=app)
        for address in {handle.address.remote().result(timeout_s=30) for _ in range(12)}:
            with SyncRpcClient(address, timeout_s=10) as client:
                info = client.call(service, "Info", {})
            out[f"{name} {address}"] = {"free": info["free_slots"], "total": info["max_requests"],
                                        "running": len(info["running"])}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the running deployment (loopback only)")
    parser.add_argument("--server-pid", type=int, default=None, help="PID of the dspark serve process")
    parser.add_argument("--pids", type=int, nargs="*", default=[], help="processes to watch (instead of discovery)")
    parser.add_argument("--model", default="dspark-demo")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=200, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which new requests start")
    parser.add_argument("--requests", type=int, default=20_000, help="upper bound on requests sent")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--disconnect", type=float, default=0.1, help="fraction of requests dropped mid-stream")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait before the 'after' reading")
    parser.add_argument(
        "--warmup", type=float, default=10.0,
        help="seconds of the same load before the 'before' reading (allocator pools and batch shapes warmed up)",
    )
    parser.add_argument("--small", action="store_true", help="quick check: 16 clients for 10 s")
    parser.add_argument("--check-slots", metavar="APP", default=None,
                        help="after the run, read every replica's free slots through Ray Serve app APP (e.g. dspark)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.small:
        args.concurrency, args.duration = 16, 10.0
    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        parser.error(f"--url must be a loopback address (127.0.0.1, localhost, ::1), got {host!r}")
    if not 1 <= args.concurrency <= 1000 or not 0 < args.duration <= 600:
        parser.error("--concurrency must be in [1, 1000] and --duration in (0, 600] s: the test is bounded")

    processes = replica_processes(args.server_pid, args.pids)
    if not processes:
        print("warning: no deployment process found (pass --server-pid or --pids); memory is not reported",
              file=sys.stderr)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def warm_up() -> None:
        async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as client:
            await one_request(client, args, random.Random(0), Stats())

    asyncio.run(warm_up())
    if args.warmup > 0:
        warm = argparse.Namespace(**{**vars(args), "duration": args.warmup})
        warm_stats, _ = asyncio.run(run_load(warm, args.url))
        if warm_stats.errors:
            print(f"warm-up errors: {warm_stats.errors}", file=sys.stderr)
        time.sleep(args.settle)
    before_metrics = scrape(args.url)
    rss_before = {pid: rss_mib(pid) for pid in processes}
    stats, elapsed = asyncio.run(run_load(args, args.url))
    time.sleep(args.settle)  # aborts of the last disconnects land, allocator settles
    after_metrics = scrape(args.url)
    rss_after = {pid: rss_mib(pid) for pid in processes}

    memory = []
    for pid, name in sorted(processes.items(), key=lambda item: item[1]):
        before, after = rss_before[pid], rss_after[pid]
        memory.append({"pid": pid, "process": name, "rss_mib_before": before, "rss_mib_after": after,
                       "delta_mib": None if before is None or after is None else after - before})
    result: dict[str, Any] = {
        **load_summary(stats, elapsed, args),
        "running_after": after_metrics.get("vllm:num_requests_running"),
        "waiting_after": after_metrics.get("vllm:num_requests_waiting"),
        "aborted": after_metrics.get("dspark_requests_aborted_total", 0.0)
        - before_metrics.get("dspark_requests_aborted_total", 0.0),
        "memory": memory,
        "replica_slots_after": replica_slots(args.check_slots) if args.check_slots else None,
    }
    print(json.dumps(result, indent=2))
    print(f"\n{stats.completed} completed, {stats.disconnected} dropped by the client, errors {stats.errors or 0}; "
          f"{result['output_tokens_per_s']:.0f} tok/s; latency p50 {result['latency_s']['p50']:.2f} s, "
          f"p99 {result['latency_s']['p99']:.2f} s; running/waiting after: {result['running_after']}/"
          f"{result['waiting_after']}")
    for row in memory:
        print(f"  {row['process']:<32} pid {row['pid']:>7}  RSS {row['rss_mib_before'] or float('nan'):7.1f} -> "
              f"{row['rss_mib_after'] or float('nan'):7.1f} MiB")
    for replica, slots in (result["replica_slots_after"] or {}).items():
        print(f"  {replica:<40} free slots {slots['free']}/{slots['total']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if stats.errors else 0


if __name__ == "__main__":
    sys.exit(main())
