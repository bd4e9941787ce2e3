"""Per-round cost of the gRPC data plane vs the in-process engine, on the same models and prompts (issue 8).

Runs the same greedy workload twice with the same round driver (:class:`SpeculativeEngine`, policy ``dspark``, the
same SPS table): once over in-process engines, once over ``dspark draft-server`` and ``dspark verify-server``
processes on loopback (the verifier pushes context features straight to the drafter). Checks that both produce
identical tokens, then reports the mean round time of each, their ratio (goal <= 1.15 at 8 concurrent requests) and
the bytes on the wire per emitted token (scheduler <-> replicas, plus verifier -> drafter features).

    PYTHONPATH=. python bench/bench_grpc_overhead.py --concurrency 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.engine_setup import (
    DEMO_TARGET,
    build_engine,
    code_prompts,
    demo_drafter,
    load_calibration,
    load_pair,
    tokenizer_for,
)
from cluster.rpc import SyncRpcClient
from cluster.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.remote import DrafterPool, RemoteVerifier
from verify_service.profiling import profile_target_sps


def _run(engine: SpeculativeEngine, prompts: list[list[int]], max_tokens: int, desc: str) -> tuple[list, float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    rounds = 0
    with tqdm(total=len(prompts) * max_tokens, desc=desc, unit="tok") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.req_id].extend(out.new_token_ids)
                bar.update(len(out.new_token_ids))
            rounds += 1
    return [outputs[i] for i in ids], time.perf_counter() - start, rounds


def _start_server(kind: str, port: int, drafter: Path, sps_path: Path, max_requests: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=".", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "cluster.cli", kind, "--grpc-port", str(port), "--draft", str(drafter),
           "--sps", str(sps_path), "--max-requests", str(max_requests), "--max-seq-len", "512", "--device", "cpu",
           "--dtype", "float32", "--log-level", "warning"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_listening(proc: subprocess.Popen, what: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("listening on "):
            return line.split()[-1]
    raise RuntimeError(f"{what} exited before listening (code {proc.wait()})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/grpc_overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    drafter_dir = demo_drafter()
    if drafter_dir is None:
        raise SystemExit("needs the trained demo drafter (models/demo/draft_dspark)")
    target, drafter = load_pair(DEMO_TARGET, drafter_dir, "cpu", torch.float32)
    tokenizer = tokenizer_for(DEMO_TARGET)
    prompts = code_prompts(tokenizer, args.concurrency, args.prompt_tokens)
    sps = profile_target_sps(target, chunk=drafter.block_size + 1, max_batch_tokens=args.concurrency * 8)

    local = build_engine(target, drafter, policy="dspark", sps=sps, max_requests=args.concurrency, max_seq_len=512,
                         calibration=load_calibration(drafter_dir))
    _run(local, prompts[:1], 8, "warm-up")
    local_out, local_s, local_rounds = _run(local, prompts, args.max_tokens, "in-process")

    with tempfile.TemporaryDirectory() as tmp:
        sps_path = sps.save(Path(tmp) / "sps.json")
        draft_proc = _start_server("draft-server", 0, drafter_dir, sps_path, args.concurrency)
        verify_proc = _start_server("verify-server", 0, drafter_dir, sps_path, args.concurrency)
        try:
            draft_addr = _wait_listening(draft_proc, "draft-server")
            verify_addr = _wait_listening(verify_proc, "verify-server")
            pool = DrafterPool([draft_addr])
            remote_verify = RemoteVerifier(verify_addr, pool.route_of)
            remote = SpeculativeEngine(remote_verify, pool, make_policy("dspark", sps, pool.block_size),
                                       eos_token_ids=target.eos_token_ids)
            _run(remote, prompts[:1], 8, "warm-up (gRPC)")
            before = _wire_bytes(pool, remote_verify, verify_addr)
            remote_out, remote_s, remote_rounds = _run(remote, prompts, args.max_tokens, "gRPC")
            wire = _wire_bytes(pool, remote_verify, verify_addr) - before
            pool.close()
            remote_verify.close()
        finally:
            for proc in (draft_proc, verify_proc):
                proc.terminate()
                proc.wait(30)
    if remote_out != local_out:
        print("MISMATCH: gRPC and in-process outputs differ", file=sys.stderr)
        return 1
    tokens = sum(len(o) for o in local_out)
    result = {
        "machine": "2-core CPU VM (shared), torch CPU, 1 thread per process",
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "tokens": tokens,
        "in_process": {"seconds": local_s, "rounds": local_rounds, "ms_per_round": 1e3 * local_s / local_rounds},
        "grpc": {"seconds": remote_s, "rounds": remote_rounds, "ms_per_round": 1e3 * remote_s / remote_rounds},
        "ratio": (remote_s / remote_rounds) / (local_s / local_rounds),
        "wire_bytes": wire,
        "wire_bytes_per_token": wire / tokens,
        "identical_outputs": True,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{'path':<12}{'rounds':>8}{'ms/round':>10}{'tok/s':>8}")
    for name in ("in_process", "grpc"):
        r = result[name]
        print(f"{name:<12}{r['rounds']:>8}{r['ms_per_round']:>10.2f}{tokens / r['seconds']:>8.1f}")
    print(f"gRPC / in-process per round: {result['ratio']:.3f} (goal <= 1.15); "
          f"{result['wire_bytes_per_token']:.0f} bytes on the wire per emitted token")
    return 0


def _wire_bytes(pool: DrafterPool, verify: RemoteVerifier, verify_addr: str) -> int:
    """Scheduler-side bytes both ways plus the verifier's feature pushes to the drafter."""
    scheduler_side = sum(c.bytes_sent + c.bytes_received for c in pool._clients.values())
    scheduler_side += verify._client.bytes_sent + verify._client.bytes_received
    probe = SyncRpcClient(verify_addr, timeout_s=10)
    features = probe.call("dspark.Verifier", "Info", {})["feature_bytes_sent"]
    probe.close()
    return scheduler_side + features


if __name__ == "__main__":
    sys.exit(main())
