"""The serving matrix: `dspark serve` in every layout and policy, measured through HTTP with `dspark bench serve`.

For each layout (``no-ray``: everything in one process; ``ray``: the Ray Serve application in the ``disaggregated``
placement, drafter and verifier deployments sharing the one GPU; ``ray-colocated``: the Ray Serve application in the
``colocated`` placement, one engine replica with the whole GPU) and each policy, the script starts ``dspark serve``
as a user would, waits until ``/health`` reports ready and a completion succeeds (both times from the process start
are recorded: start-up as users see it), sweeps the closed-loop concurrency levels with the project's benchmark
client (each level's first wave, the first request of every user, is reported against its steady state), stops the
server and moves on. With ``--repeat-start`` every cell starts twice on the same cache folder (``--cache-dir``: SPS
tables and Triton kernels, emptied before the first start), so start-up is measured cold and warm. Every cell goes
into one results file, lined up side by side, with the ratios the serving goals are stated in (Ray against
``--no-ray``, and each policy against autoregressive decoding in the same layout), and plots. Results are rewritten
after every cell, so a run cut short keeps what it measured; ``--time-limit-s`` skips the cells that would not fit.

With ``--inflate SHAPE`` the trained demo pair is first inflated (``dspark inflate``, function-preserving) to a real
Qwen3 shape, so that every step costs what that model costs:

    PYTHONUNBUFFERED=1 python3 bench/serve_matrix.py --inflate qwen3-4b --prompts-dir .data/prompts \\
        --layouts no-ray ray ray-colocated --policies autoregressive fixed-1 full dspark dspark-async --out-dir $OUT
    python3 bench/serve_matrix.py --layouts no-ray --policies autoregressive dspark --concurrency 1 4 \\
        --duration 3 --output-len 32 --out-dir /tmp/matrix    # the demo pair on CPU, a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.bench_serve import report  # noqa: E402
from cluster.bench_serve.client import RequestOptions  # noqa: E402
from cluster.bench_serve.load import LoadLevel, Window  # noqa: E402
from cluster.bench_serve.runner import BenchConfig, BenchError, run  # noqa: E402
from cluster.bench_serve.workload import prompt_set_requests  # noqa: E402

DEMO = ROOT / "models" / "demo"
MODEL_NAME = "matrix"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=DEMO / "target")
    p.add_argument("--draft", type=Path, default=DEMO / "draft_dspark")
    p.add_argument("--inflate", default=None, help="inflate the pair to this Qwen3 shape first (e.g. qwen3-4b)")
    p.add_argument("--scratch", type=Path, default=Path("/tmp/dspark-matrix"), help="inflated models and configs")
    p.add_argument("--layouts", nargs="+", choices=("no-ray", "ray", "ray-colocated"),
                   default=["no-ray", "ray", "ray-colocated"])
    p.add_argument("--policies", nargs="+", default=["autoregressive", "fixed-1", "full", "dspark", "dspark-async"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--prompts-dir", type=Path, default=ROOT.parent / "shared" / "data" / "prompts")
    p.add_argument("--prompt-sets", nargs="+", default=["humaneval", "mbpp"])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per level")
    p.add_argument("--warmup-requests", type=int, default=1, help="requests each user finishes before measuring")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-requests", type=int, default=None, help="slots (default: the largest concurrency)")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--sps", type=Path, default=None, help="SPS table file given to every server")
    p.add_argument("--extra-serve-args", nargs=argparse.REMAINDER, default=[],
                   help="appended to every `dspark serve --no-ray` command line")
    p.add_argument("--ray-serve-flags", default="", metavar="FLAGS",
                   help="appended to every Ray `dspark serve --config` command line (one string, split like a shell "
                        "does), e.g. \"--no-direct-ingress\"")
    p.add_argument("--ray-engine", nargs="+", default=[], metavar="KEY=VALUE",
                   help="set in the Ray configs' engine section (VALUE read as YAML), e.g. relay_drafts=false")
    p.add_argument("--ray-scheduler", nargs="+", default=[], metavar="KEY=VALUE",
                   help="set in the Ray configs' scheduler section (VALUE read as YAML), e.g. decode_steps=1")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="every server's cache_dir is <this>/<layout>-<policy> (SPS tables, Triton kernels); default: "
                        "the servers' own, or <scratch>/cache with --repeat-start")
    p.add_argument("--repeat-start", action="store_true",
                   help="empty each cell's cache folder, and after its sweep start it once more on the filled "
                        "folder: start-up cold and warm")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--time-limit-s", type=float, default=None, help="skip cells that would start after this")
    p.add_argument("--out-dir", type=Path, required=True)
    return p.parse_args(argv)


def inflate(args: argparse.Namespace, device: str, dtype: str) -> tuple[Path, Path]:
    out = args.scratch / f"inflated-{args.inflate}"
    if not (out / "target" / "config.json").exists():
        cmd = [sys.executable, "-m", "cluster.cli", "inflate", "--target", str(args.target), "--draft",
               str(args.draft), "--shape", args.inflate, "--out", str(out), "--dtype", dtype, "--device", device]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return out / "target", out / "draft"


def section_settings(pairs: list[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs of ``flag`` (``--ray-engine``, ``--ray-scheduler``) as a mapping (values parsed as
    YAML: ``false``, ``2``, ...)."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} takes KEY=VALUE, got {pair!r}")
        settings[key] = yaml.safe_load(value)
    return settings


def ray_config(args: argparse.Namespace, target: Path, draft: Path, policy: str, device: str, dtype: str,
               slots: int, port: int, placement: str, cache: Path | None) -> Path:
    """A Serve config for one machine, one replica of every deployment: ``disaggregated``, both pools on its GPU
    (half each); ``colocated``, one engine replica with the whole GPU. ``cache``: the application's cache_dir."""
    colocated = placement == "colocated"
    gpu = (1.0 if colocated else 0.5) if device.startswith("cuda") else 0.0
    models: dict[str, Any] = {"target": str(target), "draft": None if policy == "autoregressive" else str(draft),
                              "device": device, "dtype": dtype}
    if args.sps is not None:
        models["sps"] = str(args.sps.resolve())
    doc = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": "dspark",
            "import_path": "cluster.app:build_app",
            "route_prefix": "/",
            "args": {
                "model_name": MODEL_NAME,
                **({} if cache is None else {"cache_dir": str(cache)}),
                "placement": placement,
                "models": models,
                "draft_pool": {"resource": "draft_pool", "num_gpus": gpu, "num_cpus": 1},
                "verify_pool": {"resource": "verify_pool", "num_gpus": gpu, "num_cpus": 1},
                "engine": {"max_requests": slots, "max_seq_len": args.max_seq_len,
                           **section_settings(args.ray_engine, "--ray-engine")},
                "scheduler": {"policy": policy, **section_settings(args.ray_scheduler, "--ray-scheduler")},
            },
            "deployments": [{"name": "Verifier", "num_replicas": 1}, {"name": "Drafter", "num_replicas": 1}],
        }],
    }
    if colocated:
        doc["applications"][0]["deployments"] = [{"name": "Engine", "num_replicas": 1}]
    elif policy == "autoregressive":
        doc["applications"][0]["deployments"] = [{"name": "Verifier", "num_replicas": 1}]
    path = args.scratch / f"serve-{placement}-{policy}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def serve_command(args: argparse.Namespace, layout: str, policy: str, target: Path, draft: Path, device: str,
                  dtype: str, slots: int, port: int, cache: Path | None) -> list[str]:
    base = [sys.executable, "-m", "cluster.cli", "serve"]
    if layout.startswith("ray"):
        placement = "colocated" if layout == "ray-colocated" else "disaggregated"
        config = ray_config(args, target, draft, policy, device, dtype, slots, port, placement, cache)
        return [*base, "--config", str(config), *shlex.split(args.ray_serve_flags)]
    cmd = [*base, "--no-ray", "--target", str(target), "--draft", str(draft), "--policy", policy,
           "--device", device, "--dtype", dtype, "--max-requests", str(slots), "--max-seq-len",
           str(args.max_seq_len), "--served-model-name", MODEL_NAME, "--port", str(port)]
    if args.sps is not None:
        cmd += ["--sps", str(args.sps)]
    if cache is not None:
        cmd += ["--cache-dir", str(cache)]
    return cmd + list(args.extra_serve_args)


def wait_until_serving(url: str, proc: subprocess.Popen[bytes], started: float, timeout_s: float) -> dict[str, float]:
    """Seconds from ``started`` (the process start, ``perf_counter``) until ``/health`` answered 200
    (``health_s``) and then until a completion succeeded (``completion_s``); raises when the server died or the
    time ran out. Polled every 0.25 s, so each time is late by at most that."""
    body = {"model": MODEL_NAME, "prompt": "def main():\n", "max_tokens": 4, "temperature": 0}
    times: dict[str, float] = {}
    with httpx.Client(timeout=60.0) as client:
        while time.perf_counter() - started < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before serving")
            try:
                if "health_s" not in times:
                    if client.get(url + "/health").status_code == 200:
                        times["health_s"] = time.perf_counter() - started
                        continue
                elif client.post(url + "/v1/completions", json=body).status_code == 200:
                    times["completion_s"] = time.perf_counter() - started
                    return times
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    waited = "/health" if "health_s" not in times else "a completion"
    raise RuntimeError(f"{waited} did not succeed within {timeout_s:.0f} s of the start")


def start_server(cmd: list[str], log_path: Path, cache: Path | None) -> tuple[subprocess.Popen[bytes], float]:
    """``cmd`` in its own process group, output appended to ``log_path``; returns it and its start time. With a
    cache folder, ``$DSPARK_CACHE_DIR`` and ``$TRITON_CACHE_DIR`` are left to it (a caller's own would win)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    if cache is not None:
        env.pop("TRITON_CACHE_DIR", None)
        env["DSPARK_CACHE_DIR"] = str(cache)
    with log_path.open("ab") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
    return proc, started


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (graceful), then SIGKILL of the whole process group; leaves no Ray processes of it behind."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=45)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def wait_port_free(port: int, timeout_s: float = 60.0) -> None:
    """Until nothing listens on ``port`` (a stopped server's socket may linger a moment), at most ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while not port_free(port) and time.perf_counter() < deadline:
        time.sleep(1.0)


def ratios(runs: list[dict[str, Any]]) -> str:
    """Markdown: each policy against autoregressive in its layout, and Ray against --no-ray per policy."""
    cells = {(r["layout"], r["policy"]): {lv["load"]["label"]: lv for lv in r["levels"]} for r in runs}
    loads = sorted({load for c in cells.values() for load in c}, key=lambda s: int(s.split("=")[1]))

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, pick: Any) -> str:
        if not a or not b or not pick(a) or not pick(b):
            return "-"
        return f"{pick(a) / pick(b):.2f}x"

    def user(lv: dict[str, Any]) -> Any:
        return lv["tokens_per_s_per_user"]["median"]

    def agg(lv: dict[str, Any]) -> Any:
        return lv["output_throughput"]

    head = "| cell | " + " | ".join(f"{load} per user | {load} aggregate" for load in loads) + " |"
    out = ["Against autoregressive decoding in the same layout:", "", head, "| --- " + "| ---: " * 2 * len(loads) + "|"]
    for (layout, policy), by in cells.items():
        base = cells.get((layout, "autoregressive"))
        if policy == "autoregressive" or base is None:
            continue
        row = [f"{ratio(by.get(x), base.get(x), f)}" for x in loads for f in (user, agg)]
        out.append(f"| {layout} {policy} | " + " | ".join(row) + " |")
    out += ["", "Ray against --no-ray, same policy:", "", head, "| --- " + "| ---: " * 2 * len(loads) + "|"]
    for (layout, policy), by in cells.items():
        base = cells.get(("no-ray", policy))
        if not layout.startswith("ray") or base is None:
            continue
        row = [f"{ratio(by.get(x), base.get(x), f)}" for x in loads for f in (user, agg)]
        out.append(f"| {layout} {policy} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def write_all(args: argparse.Namespace, runs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    if not runs:
        return
    paths = report.write(runs, args.out_dir, "serve_matrix")
    doc = json.loads(paths[0].read_text())
    doc = doc if "runs" in doc else {"runs": [doc]}
    doc["matrix"] = meta
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    startup = "| cell | caches | /health ready (s) | first completion (s) |\n| --- | --- | ---: | ---: |\n" + "".join(
        f"| {r['label']} | {start['caches']} | {start['health_s']:.1f} | {start['completion_s']:.1f} |\n"
        for r in runs for start in r["starts"])
    cells = "\n".join(f"## {r['label']}\n\n{report.level_table(r)}\n" for r in runs)
    (args.out_dir / "serve_matrix.md").write_text(
        "\n".join([report.side_by_side(runs), ratios(runs), startup, cells])
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    target, draft = (args.target, args.draft) if args.inflate is None else inflate(args, device, dtype)
    files = [args.prompts_dir / f"{name}.jsonl" for name in args.prompt_sets]
    requests = prompt_set_requests(files, args.output_len)
    slots = args.max_requests or max(args.concurrency)
    meta = {"command": sys.argv, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "dtype": dtype, "inflate": args.inflate, "slots": slots, "max_seq_len": args.max_seq_len,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "skipped": []}
    cache_root = args.cache_dir or (args.scratch / "cache" if args.repeat_start else None)
    meta["cache_dir"] = None if cache_root is None else str(cache_root)
    runs: list[dict[str, Any]] = []
    # Policy by policy, each in every layout: a run cut short by its time limit still pairs the layouts it measured.
    cells = [(layout, policy) for policy in args.policies for layout in args.layouts]
    for i, (layout, policy) in enumerate(cells):
        elapsed = time.perf_counter() - began
        if args.time_limit_s is not None and i and elapsed + elapsed / i > args.time_limit_s:
            meta["skipped"].append(f"{layout} {policy}")
            print(f"--- skip {layout} {policy}: {elapsed:.0f} s used of {args.time_limit_s:.0f}", flush=True)
            continue
        port = args.port + i
        log_path = args.scratch / f"server-{layout}-{policy}.log"
        log_path.write_bytes(b"")
        cache = None if cache_root is None else cache_root / f"{layout}-{policy}"
        if cache is not None and args.repeat_start:
            shutil.rmtree(cache, ignore_errors=True)  # the first start is cold
        cmd = serve_command(args, layout, policy, target, draft, device, dtype, slots, port, cache)
        print(f"--- {layout} {policy}: $ {' '.join(cmd)}", flush=True)
        url = f"http://127.0.0.1:{port}"
        starts: list[dict[str, Any]] = []
        try:
            proc, started = start_server(cmd, log_path, cache)
            try:
                starts.append({"caches": "cold" if args.repeat_start else "as found",
                               **wait_until_serving(url, proc, started, args.startup_timeout_s)})
                print(f"    /health ready {starts[0]['health_s']:.1f} s, first completion "
                      f"{starts[0]['completion_s']:.1f} s after start", flush=True)
                config = BenchConfig(
                    base_url=url,
                    options=RequestOptions(model=MODEL_NAME, ignore_eos=True),
                    requests=requests,
                    levels=[LoadLevel("closed", c) for c in args.concurrency],
                    window=Window(duration_s=args.duration, warmup_requests=args.warmup_requests),
                    workload={"source": "prompts", "files": [str(f) for f in files], "output_len": args.output_len},
                    label=f"{layout} {policy}",
                    progress=False,
                )
                result = run(config)
            finally:
                stop(proc)
            if args.repeat_start:
                wait_port_free(port)
                proc, started = start_server(cmd, log_path, cache)
                try:
                    starts.append({"caches": "warm", **wait_until_serving(url, proc, started,
                                                                          args.startup_timeout_s)})
                finally:
                    stop(proc)
                print(f"    warm start: /health ready {starts[1]['health_s']:.1f} s, first completion "
                      f"{starts[1]['completion_s']:.1f} s", flush=True)
            result.update(layout=layout, policy=policy, startup_s=starts[0]["completion_s"], starts=starts)
            runs.append(result)
            print(report.level_table(result), flush=True)
        except (RuntimeError, BenchError) as error:
            print(f"    FAILED: {error}; server log {log_path}:", flush=True)
            print(log_path.read_text(errors="replace")[-3000:], flush=True)
            meta["skipped"].append(f"{layout} {policy} (failed: {error})")
        wait_port_free(port)
        write_all(args, runs, meta)
    write_all(args, runs, meta)
    if runs:
        print((args.out_dir / "serve_matrix.md").read_text().split("## ")[0], flush=True)
    print(f"matrix done in {time.perf_counter() - began:.0f} s; skipped: {meta['skipped'] or 'none'}", flush=True)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
