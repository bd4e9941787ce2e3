"""Round-trip latency and bytes of the gRPC + msgpack data plane between two processes on loopback.

Two workloads, both over a real grpc.aio server in a child process and the grpc.aio client the services use:

* tensor payloads of 1 KiB .. 16 MiB (bfloat16, like context features), echoed back: the cost of moving bulk;
* one per-round control message, 256 requests x 8 draft tokens with sparse top-8 draft probabilities, answered
  with a verify result (accepted tokens per request), in two layouts: one map per request, and flat ragged
  tensors for the whole batch (``num_draft`` counts + concatenated rows). It shows what a round costs in
  bytes and milliseconds, and which layout the services should use.

Each row also reports the in-process codec time (encode + decode, and schema validation for the control
message) so transport and serialisation costs can be told apart.

    python bench/bench_wire.py                          # full run (~15 s on a 2-core VM)
    python bench/bench_wire.py --small                  # quick check
    python bench/bench_wire.py --device cuda:0 --server-device cuda:1 --out wire.json --plot wire.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from cluster.messages import Float, Int, List, Message, Str, Tensor, validate  # noqa: E402
from cluster.rpc import RpcClient, Service, start_server  # noqa: E402
from cluster.wire import WIRE_DTYPES, decode, encode  # noqa: E402

SERVICE = "bench.Wire"
KIB = 1024
SIZES = [KIB * 4**i for i in range(8)]  # 1 KiB .. 16 MiB
SMALL_SIZES = [KIB, 16 * KIB, 256 * KIB, 1024 * KIB]
NUM_REQUESTS, GAMMA, TOP_K, VOCAB = 256, 8, 8, 151_936

ECHO = Message("Echo", {"payload": Tensor(sorted(WIRE_DTYPES))})
TOKEN = Int(min=0, max=VOCAB - 1)
BLOCK = Message(
    "DraftBlock",
    {
        "request_id": Str(min_len=1, max_len=128),
        "anchor": TOKEN,
        "draft_tokens": List(TOKEN, max_len=64),
        "confidences": List(Float(min=0.0, max=1.0), max_len=64),
        "draft_ids": Tensor("int32", rank=2),
        "draft_probs": Tensor("float32", rank=2),
    },
)
ROUND_PER_REQUEST = Message("DraftRound", {"round": Int(min=0), "requests": List(BLOCK, max_len=8192)})


def _flat_consistent(m: dict[str, Any]) -> str | None:
    """The ragged layout is only as good as its bookkeeping: counts must match every row count."""
    r, n = len(m["request_ids"]), int(m["num_draft"].sum())
    if m["anchors"].shape[0] != r or m["num_draft"].shape[0] != r:
        return f"anchors/num_draft must have one entry per request ({r})"
    if int(m["num_draft"].min()) < 0 or m["draft_tokens"].shape[0] != n or m["confidences"].shape[0] != n:
        return f"draft_tokens and confidences must have sum(num_draft) = {n} rows"
    if m["draft_ids"].shape[0] != n or m["draft_probs"].shape != m["draft_ids"].shape:
        return "draft_ids and draft_probs must both be [sum(num_draft), K]"
    return None


ROUND_FLAT = Message(
    "DraftRoundFlat",
    {
        "round": Int(min=0),
        "request_ids": List(Str(min_len=1, max_len=128), max_len=8192),
        "anchors": Tensor("int32", rank=1),
        "num_draft": Tensor("int32", rank=1),
        "draft_tokens": Tensor("int32", rank=1),
        "confidences": Tensor("float32", rank=1),
        "draft_ids": Tensor("int32", rank=2),
        "draft_probs": Tensor("float32", rank=2),
    },
    checks=[_flat_consistent],
)


def control_messages(seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """One round in both layouts: ids, anchors, drafts, confidences and top-K renormalised draft probs."""
    g = torch.Generator().manual_seed(seed)
    r, n = NUM_REQUESTS, NUM_REQUESTS * GAMMA
    draft_ids = torch.randint(0, VOCAB, (n, TOP_K), generator=g, dtype=torch.int32)
    probs = torch.rand(n, TOP_K, generator=g).sort(dim=1, descending=True).values
    probs = probs / probs.sum(dim=1, keepdim=True)
    choice = torch.multinomial(probs, 1, generator=g).squeeze(1)
    tokens = draft_ids.gather(1, choice[:, None]).squeeze(1)
    confidences = torch.rand(n, generator=g)
    anchors = torch.randint(0, VOCAB, (r,), generator=g, dtype=torch.int32)
    ids = [f"req-{i:06d}" for i in range(r)]
    flat = {
        "round": 1,
        "request_ids": ids,
        "anchors": anchors,
        "num_draft": torch.full((r,), GAMMA, dtype=torch.int32),
        "draft_tokens": tokens,
        "confidences": confidences,
        "draft_ids": draft_ids,
        "draft_probs": probs,
    }
    rows = [slice(i * GAMMA, (i + 1) * GAMMA) for i in range(r)]
    per_request = {
        "round": 1,
        "requests": [
            {
                "request_id": ids[i],
                "anchor": int(anchors[i]),
                "draft_tokens": tokens[s].tolist(),
                "confidences": confidences[s].tolist(),
                "draft_ids": draft_ids[s],
                "draft_probs": probs[s],
            }
            for i, s in enumerate(rows)
        ],
    }
    return per_request, flat


# ---------------------------------------------------------------------------------------------- server side


def _verify_result(request_ids: list[str], drafts: list[list[int]]) -> dict[str, Any]:
    """A plausible answer: a deterministic share of each block accepted plus one bonus token."""
    return {
        "round": 1,
        "results": [
            {"request_id": rid, "tokens": [*d[: (len(rid) + i) % (len(d) + 1)], 7]}
            for i, (rid, d) in enumerate(zip(request_ids, drafts, strict=True))
        ],
    }


async def _serve(device: str) -> None:
    async def echo(request: dict[str, Any]) -> dict[str, Any]:
        payload = request["payload"]
        if device != "cpu":
            payload = payload.to(device)  # what a replica does with received features; encode copies it back
        return {"payload": payload}

    async def round_per_request(request: dict[str, Any]) -> dict[str, Any]:
        blocks = request["requests"]
        return _verify_result([b["request_id"] for b in blocks], [b["draft_tokens"] for b in blocks])

    async def round_flat(request: dict[str, Any]) -> dict[str, Any]:
        tokens = request["draft_tokens"].split(request["num_draft"].tolist())
        return _verify_result(request["request_ids"], [t.tolist() for t in tokens])

    service = Service(
        SERVICE,
        {
            "Echo": (echo, ECHO),
            "RoundPerRequest": (round_per_request, ROUND_PER_REQUEST),
            "RoundFlat": (round_flat, ROUND_FLAT),
        },
    )
    server = await start_server([service], host="127.0.0.1", port=0)
    print(server.port, flush=True)
    # Serve until the parent closes our stdin (it exits, or is killed): no orphaned server.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace_s=None)


# ---------------------------------------------------------------------------------------------- client side


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"p50_ms": statistics.median(ms), "p99_ms": p99, "mean_ms": statistics.fmean(ms)}


def _codec_time(message: dict[str, Any], schema: Message | None, iters: int) -> float:
    """Median in-process encode + decode (+ validate) time in ms: the serialisation share of a round trip."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        value = decode(encode(message))
        if schema is not None:
            validate(schema, value)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


async def _time_calls(
    client: RpcClient, method: str, request: dict[str, Any], iters: int, device: str
) -> list[float]:
    """Round-trip times in seconds after a short warm-up; an echoed tensor is moved back to ``device``."""
    stub = client.unary(SERVICE, method)
    samples = []
    for i in range(iters + 3):
        start = time.perf_counter()
        response = await stub(request, timeout_s=120)
        if device != "cpu" and "payload" in response:
            response["payload"].to(device)
            torch.cuda.synchronize(device)
        if i >= 3:
            samples.append(time.perf_counter() - start)
    return samples


async def _run_client(port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    sizes = SMALL_SIZES if args.small else SIZES
    async with RpcClient(f"127.0.0.1:{port}", timeout_s=120) as client:
        await client.wait_ready(timeout_s=60)
        per_request, flat = control_messages()
        cases: list[tuple[str, str, dict[str, Any], Message | None]] = [
            (
                f"tensor {_human(size)}",
                "Echo",
                {"payload": torch.zeros(size // 2, dtype=torch.bfloat16)},
                None,
            )
            for size in sizes
        ]
        cases += [
            ("round, map per request", "RoundPerRequest", per_request, ROUND_PER_REQUEST),
            ("round, flat tensors", "RoundFlat", flat, ROUND_FLAT),
        ]
        for name, method, request, schema in tqdm(cases, desc="wire bench", unit="case"):
            payload_bytes = len(encode(request))
            iters = max(
                10 if args.small else 20, min(args.iters, (256 * 1024 * 1024) // max(payload_bytes, 1))
            )
            codec_ms = _codec_time(request, schema, max(3, iters // 4))
            if args.device != "cpu" and method == "Echo":
                request = {"payload": request["payload"].to(args.device)}
            samples = await _time_calls(client, method, request, iters, args.device)
            response = await client.call(SERVICE, method, request)
            rows.append(
                {
                    "case": name,
                    "request_bytes": payload_bytes,
                    "response_bytes": len(encode(response)),
                    "iters": iters,
                    "codec_ms": codec_ms,
                    **_percentiles(samples),
                }
            )
    return rows


def _human(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 else f"{n // 1024} KiB"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | request bytes | response bytes | p50 ms | p99 ms | codec ms in-process | MB/s at p50 | n |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mbps = (r["request_bytes"] + r["response_bytes"]) / (r["p50_ms"] / 1e3) / 1e6
        lines.append(
            f"| {r['case']} | {r['request_bytes']:,} | {r['response_bytes']:,} | {r['p50_ms']:.3f} | "
            f"{r['p99_ms']:.3f} | {r['codec_ms']:.3f} | {mbps:,.0f} | {r['iters']} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensor_rows = [r for r in rows if r["case"].startswith("tensor")]
    sizes = [r["request_bytes"] for r in tensor_rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(sizes, [r["p50_ms"] for r in tensor_rows], "o-", label="round trip p50")
    ax.loglog(sizes, [r["p99_ms"] for r in tensor_rows], "s--", label="round trip p99")
    ax.loglog(sizes, [r["codec_ms"] for r in tensor_rows], "^:", label="codec: encode + decode, in-process")
    for r in rows:
        if r["case"].startswith("round"):
            ax.plot(r["request_bytes"], r["p50_ms"], "*", markersize=12, label=f"{r['case']} p50")
    ax.set_xlabel("request bytes (echoed back)")
    ax.set_ylabel("ms")
    ax.set_title("gRPC + msgpack round trip, two processes on loopback")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="sizes up to 1 MiB and fewer iterations")
    parser.add_argument("--iters", type=int, default=400, help="iterations per case for small payloads")
    parser.add_argument("--device", default="cpu", help="client-side device of the tensor payloads")
    parser.add_argument("--server-device", default=None, help="server-side device (default: --device)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, help="write a latency-vs-size plot (PNG) here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.serve:
        asyncio.run(_serve(args.server_device or args.device))
        return 0

    server_device = args.server_device or args.device
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--server-device", server_device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        rows = asyncio.run(_run_client(port, args))
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=30)

    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    print(f"\nmachine: {machine}; client device {args.device}, server device {server_device}\n")
    print(_table(rows))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "device": args.device, "rows": rows}, indent=2))
    if args.plot:
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
