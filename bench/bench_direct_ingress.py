"""The time to first token through Serve's HTTP proxy against the ingress replica answering HTTP itself.

Starts one ``dspark serve`` (an embedded cluster, direct ingress on: the ingress replica listens on ``--port`` and
Serve's proxy on a port of its own, which the server logs), then sends the same streaming requests one at a time
through both, alternating, so both ways see the same server, caches and machine load. Per way: TTFT (request sent
to the first chunk with text) and end-to-end latency percentiles. Extra ``dspark serve`` options go after ``--``.

    python bench/bench_direct_ingress.py --requests 60 --out docs/benchmarks/direct_ingress_cpu.json
    python bench/bench_direct_ingress.py --max-tokens 32 -- --config deploy/serve_config.gpu.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("    def keys(self):\n        return list(self._data.", "import os\nimport sys\n\ndef main():\n",
           "    for key, value in sorted(")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--port", type=int, default=8450)
    p.add_argument("--requests", type=int, default=60, help="measured requests per way (after 3 unmeasured each)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more dspark serve options")
    return p.parse_args(argv)


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server; returns it and its proxy's URL once it serves."""
    extra = [a for a in args.serve_args if a != "--"]
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(args.port), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + args.startup_timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        proxy = re.search(r"Serve's HTTP proxy on (http://\S+)", text)
        if proxy and "serving on http://" in text:
            return proc, proxy.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"dspark serve exited ({proc.returncode}):\n{text[-3000:]}")
        time.sleep(1)
    raise RuntimeError(f"dspark serve did not serve within {args.startup_timeout_s:.0f} s")


def one(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """Seconds to the first chunk with text and to the end of one streaming completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    began, first = time.perf_counter(), None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data:") and '"text"' in line:
                first = time.perf_counter() - began
    if first is None:
        raise RuntimeError(f"no text streamed from {url}")
    return first, time.perf_counter() - began


def summary(values: list[float]) -> dict[str, float]:
    deciles = statistics.quantiles(values, n=10)
    return {"p10_ms": 1e3 * deciles[0], "p50_ms": 1e3 * statistics.median(values), "p90_ms": 1e3 * deciles[-1]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = Path(f"/tmp/bench-direct-ingress-{args.port}.log")
    proc, proxy = start(args, log)
    direct = f"http://127.0.0.1:{args.port}"
    ways = {"serve_proxy": proxy, "direct_ingress": direct}
    samples: dict[str, dict[str, list[float]]] = {w: {"ttft": [], "e2e": []} for w in ways}
    try:
        with httpx.Client(timeout=120) as client:
            model = client.get(f"{direct}/v1/models").json()["data"][0]["id"]
            for i in range(args.requests + 3):
                for way, url in ways.items():
                    ttft, e2e = one(client, url, model, PROMPTS[i % len(PROMPTS)], args.max_tokens)
                    if i >= 3:
                        samples[way]["ttft"].append(ttft)
                        samples[way]["e2e"].append(e2e)
    finally:
        proc.send_signal(signal.SIGTERM)  # as an operator stops it: the server ends its own cluster
        proc.wait(120)
    results = {way: {kind: summary(values) for kind, values in s.items()} for way, s in samples.items()}
    record = {"tool": "bench/bench_direct_ingress.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}",
              "requests_per_way": args.requests, "max_tokens": args.max_tokens,
              "serve_args": [a for a in args.serve_args if a != "--"], "results": results}
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("| way | TTFT p10 / p50 / p90 ms | end to end p50 ms |\n| --- | --- | ---: |")
    for way, r in results.items():
        t = r["ttft"]
        print(f"| {way} | {t['p10_ms']:.1f} / {t['p50_ms']:.1f} / {t['p90_ms']:.1f} | {r['e2e']['p50_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
