"""Fault injection against a running ``dspark serve``: hostile gRPC input, slot exhaustion, and each role killed
mid-stream, with what an OpenAI client sees.

The script starts ``dspark serve`` (Ray mode, embedded cluster, the demo pair on CPU) itself, drives streaming
completions with the official ``openai`` client from ``--clients`` threads, and then, one after the other:

1. hostile gRPC input on every gRPC port the server prints (scheduler, verifier, drafter): random bytes to every
   method, schema-valid but unauthenticated ``Scheduler/Generate`` (the HTTP API key bypass) and
   ``Verifier/Step`` prefills (slot exhaustion: ``--exhaust`` of them); recorded: the gRPC status of each, and
   whether HTTP clients are still served afterwards;
2. SIGKILL of the scheduler, of the verifier and of the drafter replica process, mid-stream. Their PIDs come from
   the Ray workers' process titles (``ray::ServeReplica:dspark:<Deployment>``) among the server's descendants:
   Ray's state API needs the dashboard, which ``dspark serve`` leaves off. Recorded per fault: streams cut (in
   flight at the kill and ended with an error) and the ones that completed, whether every completion ended with the
   same text as those before the fault (one greedy request: nothing sent twice or lost across a continued stream),
   the time until the first completion started after the kill succeeded and until the first token of a request
   sent after the kill (back to serving: a new request is answered), the longest stall of streams that
   survived the kill, the errors as the client saw them (exception class, HTTP status, error code), how long
   ``/health`` took to answer, when it first said something else than 200 and when 200 again, whether every
   Prometheus counter served by the ingress stayed monotonic, and how many rounds
   ``dspark_rounds_without_draft_total`` added. Where the time went comes from the server's log (Ray's timestamps,
   seconds after the kill): when Serve's controller saw the replica dead (its next health check),
   when it started the replacement, and for a pool replica when the replacement made its first call to the
   scheduler (its first heartbeat: constructor done, model loaded and warmed up). The Ray session's own logs and
   ``/proc`` add the replacement's phases: its process started (a Ray worker), its constructor started (Ray's
   worker, Serve's replica actor and the deployment's module imports done) and returned, and Serve's controller
   saw it running.

The openai client runs with ``max_retries=0`` so that every status is seen (by default it retries 503 twice,
honouring ``Retry-After``, and 408/409/429/5xx too).

    python bench/fault_inject.py --out docs/benchmarks/fault_inject_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from load_test import replica_processes  # noqa: E402
from timing import cpu_name  # noqa: E402

PROMPT = "def fibonacci(n):\n"
METHODS = {
    "scheduler": ("dspark.Scheduler", ("Generate", "Abort", "Metrics", "Info", "ModelInfo")),
    "verifier": ("dspark.Verifier", ("Info", "Step", "Release")),
    "drafter": ("dspark.Drafter", ("Info", "AddRequests", "AppendContext", "Propose", "Release")),
}
ROLES = {"scheduler": "Scheduler", "verifier": "Verifier", "drafter": "Drafter"}
NO_DRAFT = 'dspark_rounds_without_draft_total{model_name="dspark-demo"}'


@dataclass
class Outcome:
    """One streamed completion as the client saw it."""

    start: float
    chunks: list[float] = field(default_factory=list)
    first_token: float | None = None  # the first chunk with text
    end: float = 0.0
    error: str | None = None  # None: completed
    text: str = ""


class Load:
    """``clients`` threads streaming completions back to back until stopped."""

    def __init__(self, base_url: str, clients: int, max_tokens: int) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            outcome = Outcome(time.monotonic())
            try:
                stream = self.client.completions.create(model="dspark-demo", prompt=PROMPT, stream=True,
                                                        max_tokens=self.max_tokens, temperature=0)
                for chunk in stream:
                    outcome.chunks.append(time.monotonic())
                    text = "".join(choice.text for choice in chunk.choices)
                    if text and outcome.first_token is None:
                        outcome.first_token = outcome.chunks[-1]
                    outcome.text += text
            except openai.APIStatusError as error:
                outcome.error = f"{type(error).__name__} status={error.status_code} code={_code(error.body)}"
            except openai.APIError as error:  # an error event on a started stream: no HTTP status
                outcome.error = f"{type(error).__name__} status=None code={_code(error.body)}"
            except Exception as error:  # connection refused, reset: what the client raised
                outcome.error = f"{type(error).__name__}"
            outcome.end = time.monotonic()
            self.outcomes.append(outcome)
            if outcome.error is not None:
                time.sleep(0.2)  # a client backing off, not a busy loop against a down server

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)


def _code(body: Any) -> Any:
    if isinstance(body, dict):
        error = body.get("error", body)
        return error.get("code") if isinstance(error, dict) else None
    return None


def _counters(base_url: str) -> dict[str, float] | None:
    try:
        response = httpx.get(f"{base_url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    out = {}
    for line in response.text.splitlines():
        if not line.startswith("#") and "_total" in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _health(base_url: str) -> tuple[int | None, float]:
    started = time.monotonic()
    try:
        status: int | None = httpx.get(f"{base_url}/health", timeout=30).status_code
    except httpx.HTTPError:
        status = None
    return status, time.monotonic() - started


def hostile(addresses: dict[str, str], base_url: str, exhaust: int) -> dict[str, Any]:
    """Random bytes to every method, then schema-valid unauthenticated calls; the gRPC status of each."""
    rng = random.Random(0)
    codes: dict[str, dict[str, int]] = {}
    for role, (service, methods) in METHODS.items():
        with grpc.insecure_channel(addresses[role]) as channel:
            for method in methods:
                path = f"/{service}/{method}"
                for _ in range(20):
                    payload = rng.randbytes(rng.randint(0, 256))
                    code = _call(channel, path, payload, stream=method == "Generate")
                    codes.setdefault(f"{role} {method} (random bytes)", {}).setdefault(code, 0)
                    codes[f"{role} {method} (random bytes)"][code] += 1
    from cluster.wire import encode

    generate = encode({"req_id": "stranger", "prompt_ids": [1, 2, 3], "params": {"max_tokens": 4}})
    step = encode({"prefill_req_ids": ["stranger-0"], "prefill_params": [{"max_tokens": 4}], "prefill_counts": [3],
                   "prefill_tokens": torch.tensor([1, 2, 3]), "prefill_anchors": [-1], "verify_req_ids": [],
                   "verify_anchors": [], "verify_counts": [], "verify_tokens": torch.zeros(0, dtype=torch.int64)})
    with grpc.insecure_channel(addresses["scheduler"]) as channel:
        codes["scheduler Generate (schema-valid, no token)"] = {
            _call(channel, "/dspark.Scheduler/Generate", generate, stream=True): 1}
    exhausted: dict[str, int] = {}
    with grpc.insecure_channel(addresses["verifier"]) as channel:
        for _ in range(exhaust):
            code = _call(channel, "/dspark.Verifier/Step", step, stream=False)
            exhausted[code] = exhausted.get(code, 0) + 1
    codes[f"verifier Step prefill x{exhaust} (schema-valid, no token)"] = exhausted
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    served = client.completions.create(model="dspark-demo", prompt=PROMPT, max_tokens=8, temperature=0)
    return {"grpc_status": codes, "http_after": served.choices[0].finish_reason}


def _call(channel: grpc.Channel, path: str, payload: bytes, *, stream: bool) -> str:
    try:
        if stream:
            list(channel.unary_stream(path)(payload, timeout=30))
        else:
            channel.unary_unary(path)(payload, timeout=30)
    except grpc.RpcError as error:
        return error.code().name
    return "OK"


_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def _stamp_s(line: str, killed_at: float) -> float | None:
    """Seconds from ``killed_at`` (wall clock) to the Ray / Serve log timestamp of ``line`` (None: no stamp)."""
    stamp = _STAMP.search(line)
    if stamp is None:
        return None
    return datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - killed_at  # local time


def _process_started_at(pid: int) -> float | None:
    """Wall-clock start of process ``pid`` from ``/proc`` (clock-tick resolution), None when it is gone."""
    try:  # start in clock ticks after boot; /proc/uptime (not btime, whole seconds) places boot on the wall clock
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime_s + ticks / os.sysconf("SC_CLK_TCK")


def session_dir(server_pid: int) -> Path | None:
    """The Ray session folder of the cluster ``dspark serve`` (``server_pid``) started: Ray names it after the
    process that started the head."""
    root = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    found = sorted(root.glob(f"session_*_{server_pid}"))
    return found[-1] if found else None


def replacement_phases(session: Path | None, role: str, pid: int | None, killed_at: float) -> dict[str, float | None]:
    """Seconds from the kill to the replacement's phases, from the Ray session's Serve logs and ``/proc``: its
    process started (``pid``), its constructor started (Serve's replica log: the Ray worker, Serve's replica
    actor and the deployment's module imports are done by then) and returned, and the controller saw it
    running."""
    out: dict[str, float | None] = dict.fromkeys(("replacement_process_started_s", "replacement_constructor_started_s",
                                                  "replacement_constructor_done_s", "replacement_running_s"))
    started = None if pid is None else _process_started_at(pid)
    if started is not None:
        out["replacement_process_started_s"] = round(started - killed_at, 2)
    if session is None:
        return out
    name = ROLES[role]
    replica_id = None
    for log in sorted((session / "logs" / "serve").glob(f"replica_dspark_{name}_*.log")):
        lines = log.read_text(errors="replace").splitlines()
        begun = next((line for line in lines if "Started initializing replica" in line), None)
        at = None if begun is None else _stamp_s(begun, killed_at)
        if at is None or at < 0:
            continue  # the replica that was killed (or an earlier one)
        replica_id = log.stem.rsplit("_", 1)[1]
        out["replacement_constructor_started_s"] = round(at, 2)
        done = next((line for line in lines if "Finished initializing replica" in line), None)
        if done is not None and (done_at := _stamp_s(done, killed_at)) is not None:
            out["replacement_constructor_done_s"] = round(done_at, 2)
        break
    if replica_id is not None:
        for log in (session / "logs" / "serve").glob("controller_*.log"):
            for line in log.read_text(errors="replace").splitlines():
                if f"Replica(id='{replica_id}'" in line and "started successfully" in line:
                    out["replacement_running_s"] = _round(_stamp_s(line, killed_at))
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def timeline(log_path: Path, role: str, killed_at: float) -> dict[str, float | None]:
    """Seconds from the kill (``killed_at``: wall clock) to the restart's steps as the server's log shows them."""
    name = ROLES[role]
    marks: dict[str, tuple[str, ...]] = {
        "controller_saw_it_dead_s": (f"deployment='{name}'", "crashed"),
        "replacement_started_s": (f"Adding 1 replica to Deployment(name='{name}'",),
    }
    if role != "scheduler":
        marks["replacement_first_call_to_scheduler_s"] = (f"ServeReplica:dspark:{name} pid=",
                                                          "SharedRouterLongPollClient")
    out: dict[str, float | None] = dict.fromkeys(marks)
    for line in log_path.read_text(errors="replace").splitlines():
        at = _stamp_s(line, killed_at)
        if at is None or at < 0:
            continue
        for key, needles in marks.items():
            if out[key] is None and all(n in line for n in needles):
                out[key] = round(at, 2)
    return out


def inject(role: str, server: subprocess.Popen[str], base_url: str, load: Load, recover_s: float,
           log_path: Path) -> dict[str, Any]:
    """SIGKILL ``role``'s replica process mid-stream and watch the service come back."""
    title = f"ServeReplica:dspark:{ROLES[role]}"
    pids = [pid for pid, name in replica_processes(server.pid, []).items() if name == title]
    if not pids:
        return {"role": role, "error": f"no process titled {title}"}
    before = _counters(base_url)
    killed, killed_wall = time.monotonic(), time.time()
    os.kill(pids[0], signal.SIGKILL)
    health: list[tuple[float, int | None, float]] = []
    down_at = healthy_at = None  # /health's first non-200 after the kill, and its first 200 after that
    while time.monotonic() - killed < recover_s:
        status, took = _health(base_url)
        at = time.monotonic() - killed
        health.append((at, status, took))
        if status != 200 and down_at is None:
            down_at = at
        if status == 200 and down_at is not None and healthy_at is None:
            healthy_at = at
        recovered = any(o.error is None and o.start >= killed for o in list(load.outcomes))
        if recovered and (down_at is None or healthy_at is not None):
            break
        time.sleep(0.5)
    time.sleep(5)  # streams in flight at the kill end; the service settles
    after = _counters(base_url)
    outcomes = [o for o in list(load.outcomes) if o.end >= killed]
    in_flight = [o for o in outcomes if o.start < killed]
    later_ok = [o.end - killed for o in outcomes if o.start >= killed and o.error is None]
    later_first = [o.first_token - killed for o in outcomes if o.start >= killed and o.first_token is not None]
    survivors = [o for o in in_flight if o.error is None]
    # Every completion is of the same greedy request: one completed before the fault has the text all must have.
    reference = next((o.text for o in load.outcomes if o.error is None and o.end < killed), None)
    stalls = [max((b - a for a, b in zip([o.start, *o.chunks], o.chunks, strict=False) if b >= killed),
                  default=0.0) for o in survivors]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None:
            errors[o.error] = errors.get(o.error, 0) + 1
    decreased = sorted(k for k, v in (before or {}).items() if after is not None and after.get(k, 0.0) < v)
    replacement = [pid for pid, name in replica_processes(server.pid, []).items() if name == title and pid != pids[0]]
    return {
        "role": role,
        "pid": pids[0],
        "streams_in_flight": len(in_flight),
        "streams_cut": sum(o.error is not None for o in in_flight),
        "streams_continued": len(survivors),
        "completed_with_other_text": None if reference is None else sum(o.text != reference for o in outcomes
                                                                           if o.error is None),
        "first_success_after_kill_s": min(later_ok) if later_ok else None,
        "first_token_after_kill_s": min(later_first) if later_first else None,
        "max_stall_of_surviving_streams_s": max(stalls) if stalls else None,
        "client_errors": errors,
        "health_not_200_at_s": down_at,
        "health_200_again_at_s": healthy_at,
        "rounds_without_draft_added": None if before is None or after is None else after.get(NO_DRAFT, 0.0)
        - before.get(NO_DRAFT, 0.0),
        "max_health_answer_s": max(took for _, _, took in health) if health else None,
        "metrics_monotonic": None if before is None or after is None else not decreased,
        "counters_decreased": decreased,
        "timeline": {**timeline(log_path, role, killed_wall),
                     **replacement_phases(session_dir(server.pid), role, replacement[0] if replacement else None,
                                          killed_wall)},
    }


def _replicas_config(port: int, verifiers: int) -> Path:
    """deploy/serve_config.yaml with ``verifiers`` fixed verifier replicas, one drafter, the engines of the flags'
    deployment (16 slots x 256 tokens) and the HTTP port; written next to the server's log."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"]["engine"].update(max_requests=16, max_seq_len=256)
    for deployment in app["deployments"]:
        if deployment["name"] in ("Verifier", "Drafter"):
            deployment.pop("autoscaling_config", None)
            deployment["num_replicas"] = verifiers if deployment["name"] == "Verifier" else 1
    path = Path(f"/tmp/fault_inject_{port}.yaml")
    path.write_text(yaml.safe_dump(config))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8125, help="HTTP port of the server (default: 8125)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default: 64)")
    parser.add_argument("--exhaust", type=int, default=64, help="unauthenticated prefills sent (default: 64)")
    parser.add_argument("--steady-s", type=float, default=10.0, help="load before each fault (default: 10)")
    parser.add_argument("--recover-s", type=float, default=120.0, help="longest wait for recovery (default: 120)")
    parser.add_argument("--verifiers", type=int, default=1,
                        help="verifier replicas; more than 1 serves deploy/serve_config.yaml with that many and one "
                        "drafter, engines as with 1 (default: 1: the flags' demo deployment, one replica each)")
    parser.add_argument("--spare-workers", type=int, default=None,
                        help="the server's --spare-workers (default: the server's own, 1 on its embedded cluster)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (default: none)")
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_AUTH_MODE", None)  # the product's default: dspark serve secures its embedded cluster itself
    command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(args.port)]
    if args.verifiers > 1:
        command += ["--config", str(_replicas_config(args.port, args.verifiers))]
    else:
        command += ["--max-requests", "16", "--max-seq-len", "256"]
    if args.spare_workers is not None:
        command += ["--spare-workers", str(args.spare_workers)]
    log_path = Path(f"/tmp/fault_inject_{args.port}.log")
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{args.port}"
    results: dict[str, Any] = {"faults": []}
    load = None
    try:
        deadline = time.monotonic() + 600
        while "serving on http://" not in log_path.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dspark serve did not start; see {log_path}")
            time.sleep(1)
        started = log_path.read_text()
        addresses = {"scheduler": re.search(r"scheduler gRPC on (\S+)", started).group(1),  # type: ignore[union-attr]
                     "verifier": re.search(r"verifier \S+ gRPC on (\S+)", started).group(1),  # type: ignore[union-attr]
                     "drafter": re.search(r"drafter \S+ gRPC on (\S+)", started).group(1)}  # type: ignore[union-attr]
        results["hostile"] = hostile(addresses, base_url, args.exhaust)
        print(json.dumps(results["hostile"], indent=1), flush=True)
        load = Load(base_url, args.clients, args.max_tokens)
        for role in ("scheduler", "verifier", "drafter"):
            time.sleep(args.steady_s)
            results["faults"].append(inject(role, server, base_url, load, args.recover_s, log_path))
            print(json.dumps(results["faults"][-1], indent=1), flush=True)
    finally:
        if load is not None:
            load.finish()
            results["completions"] = sum(o.error is None for o in load.outcomes)
            results["failed"] = sum(o.error is not None for o in load.outcomes)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    results.update({
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "server": " ".join(command[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "clients": args.clients,
        "max_tokens": args.max_tokens,
    })
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
