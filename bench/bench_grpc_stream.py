"""Per-message latency of grpcio's call shapes on loopback: unary calls against messages on an open stream.

The server runs in a child process (as a replica does); the client sends a payload of ``--sizes`` bytes and waits
for the same number of bytes back, one message at a time, and reports p50 / p99 per message. Variants:

* ``tcp``: raw TCP echo (a floor: two syscalls and a wake-up per side);
* ``sync-unary`` / ``aio-unary``: one unary call per message (grpc sync client, grpc.aio client);
* ``sync-stream``: one bidirectional stream opened once, sync client (a request iterator fed from a queue; grpc
  reads it on its own thread and delivers replies through its channel thread);
* ``aio-stream-own-loop``: one grpc.aio bidirectional stream whose event loop the calling thread runs itself
  for each message (``loop.run_until_complete``): how a synchronous round loop can drive an aio stream without
  handing the message to another thread;
* ``aio-stream-loop-thread``: the same stream on an event loop in a background thread, the caller submitting
  each message with ``run_coroutine_threadsafe`` (one more hand-off each way);
* ``dspark-unary`` / ``dspark-stream``: the project's own clients (:class:`cluster.rpc.SyncRpcClient` and
  :class:`cluster.rpc.StreamLane`) against its :class:`cluster.rpc.RpcServer`, msgpack and schema validation
  included: what a round pays per replica on the data plane.

The grpc servers are grpc.aio servers (as every replica's) unless ``--sync-server``. Variants run interleaved
``--repeats`` times so that the load of a shared machine hits all alike; medians over the repeats are reported.

    PYTHONPATH=. python bench/bench_grpc_stream.py --messages 1000 --repeats 3 \\
        --out docs/benchmarks/grpc_stream_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from cluster.messages import Bytes, Message  # noqa: E402
from cluster.rpc import RpcServer, Service, StreamLane, SyncRpcClient  # noqa: E402

SERVICE = "bench.Echo"
UNARY = f"/{SERVICE}/Echo"
STREAM = f"/{SERVICE}/EchoStream"
KIB = 1024
ECHO = Message("Echo", {"payload": Bytes(max_len=1 << 24)})
VARIANTS = (
    "tcp",
    "sync-unary",
    "aio-unary",
    "sync-stream",
    "aio-stream-own-loop",
    "aio-stream-loop-thread",
    "dspark-unary",
    "dspark-stream",
)


# ------------------------------------------------------------------------------------------------- the server
def _serve(sync_server: bool) -> None:
    """Child process: a TCP echo server, a raw grpc echo server and a dspark RpcServer; prints their ports."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()

    def tcp_echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            header = _recv_exact(conn, 4)
            if not header:
                return
            body = _recv_exact(conn, int.from_bytes(header, "little"))
            conn.sendall(header + body)

    def tcp_accept() -> None:
        while True:
            threading.Thread(target=tcp_echo, args=(tcp.accept()[0],), daemon=True).start()

    threading.Thread(target=tcp_accept, daemon=True).start()

    async def dspark_echo(request: dict[str, Any]) -> dict[str, Any]:
        return {"payload": request["payload"]}

    async def main() -> None:
        dspark = RpcServer([Service("bench.Dspark", {"Echo": (dspark_echo, ECHO)})])
        await dspark.start()
        if sync_server:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_OPTIONS)
            unary = grpc.unary_unary_rpc_method_handler(lambda raw, _ctx: raw)
            stream = grpc.stream_stream_rpc_method_handler(lambda it, _ctx: (raw for raw in it))
        else:
            server = grpc.aio.server(options=_OPTIONS)

            async def echo_unary(raw: bytes, _ctx: grpc.aio.ServicerContext) -> bytes:
                return raw

            async def echo_stream(it: Any, _ctx: grpc.aio.ServicerContext) -> Any:
                async for raw in it:
                    yield raw

            unary = grpc.unary_unary_rpc_method_handler(echo_unary)
            stream = grpc.stream_stream_rpc_method_handler(echo_stream)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {"Echo": unary, "EchoStream": stream})]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        start = server.start()
        if start is not None:
            await start
        print(json.dumps({"tcp": tcp.getsockname()[1], "grpc": port, "dspark": dspark.port}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
        await dspark.stop(None)
        stop = server.stop(None)
        if stop is not None:
            await stop

    asyncio.run(main())


_OPTIONS = [("grpc.max_receive_message_length", 1 << 26), ("grpc.max_send_message_length", 1 << 26)]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(left)
        if not chunk:
            return b""
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------------------------------------- clients
Echo = Callable[[bytes], bytes]


class _Client:
    """One variant: ``echo(payload) -> reply`` plus ``close()``."""

    def __init__(self, variant: str, ports: dict[str, int]) -> None:
        self.variant = variant
        target = f"127.0.0.1:{ports['grpc']}"
        self._close: list[Callable[[], None]] = []
        if variant == "tcp":
            conn = socket.create_connection(("127.0.0.1", ports["tcp"]))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._close.append(conn.close)

            def tcp(payload: bytes) -> bytes:
                conn.sendall(len(payload).to_bytes(4, "little") + payload)
                header = _recv_exact(conn, 4)
                return _recv_exact(conn, int.from_bytes(header, "little"))

            self.echo: Echo = tcp
        elif variant == "sync-unary":
            channel = grpc.insecure_channel(target, options=_OPTIONS)
            self._close.append(channel.close)
            self.echo = channel.unary_unary(UNARY)
        elif variant == "sync-stream":
            channel = grpc.insecure_channel(target, options=_OPTIONS)
            requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

            def feed() -> Iterator[bytes]:
                while (item := requests.get()) is not None:
                    yield item

            replies = channel.stream_stream(STREAM)(feed())

            def sync_stream(payload: bytes) -> bytes:
                requests.put(payload)
                return next(replies)

            self._close += [lambda: requests.put(None), replies.cancel, channel.close]
            self.echo = sync_stream
        elif variant in ("aio-unary", "aio-stream-own-loop", "aio-stream-loop-thread"):
            loop = asyncio.new_event_loop()
            thread = None
            if variant == "aio-stream-loop-thread":
                thread = threading.Thread(target=loop.run_forever, daemon=True)
                thread.start()

            def run(coro: Any) -> Any:
                if thread is None:
                    return loop.run_until_complete(coro)
                return asyncio.run_coroutine_threadsafe(coro, loop).result()

            async def open_() -> tuple[grpc.aio.Channel, Any]:
                channel = grpc.aio.insecure_channel(target, options=_OPTIONS)
                if variant == "aio-unary":
                    return channel, channel.unary_unary(UNARY)
                return channel, channel.stream_stream(STREAM)()

            channel, call = run(open_())

            async def aio_unary(payload: bytes) -> bytes:
                return await call(payload)

            async def aio_stream(payload: bytes) -> bytes:
                await call.write(payload)
                return await call.read()

            once = aio_unary if variant == "aio-unary" else aio_stream
            self.echo = lambda payload: run(once(payload))

            async def close_channel() -> None:
                if variant != "aio-unary":
                    call.cancel()
                await channel.close()
                await asyncio.sleep(0.01)  # let the cancelled call's own tasks end before the loop closes

            def close() -> None:
                run(close_channel())
                if thread is not None:
                    loop.call_soon_threadsafe(loop.stop)
                    thread.join()
                loop.close()

            self._close.append(close)
        elif variant == "dspark-unary":
            client = SyncRpcClient(f"127.0.0.1:{ports['dspark']}")
            self._close.append(client.close)
            self.echo = lambda payload: client.call("bench.Dspark", "Echo", {"payload": payload})["payload"]
        elif variant == "dspark-stream":
            lane = StreamLane()
            stream = lane.stream(f"127.0.0.1:{ports['dspark']}", "bench.Dspark", "Echo")
            self._close.append(lane.close)
            self.echo = lambda payload: stream.call({"payload": payload})["payload"]
        else:
            raise ValueError(variant)

    def close(self) -> None:
        for close in self._close:
            close()


def _measure(client: _Client, payload: bytes, messages: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        assert len(client.echo(payload)) == len(payload)
    samples = []
    for _ in range(messages):
        t0 = time.perf_counter()
        reply = client.echo(payload)
        samples.append(time.perf_counter() - t0)
        assert len(reply) == len(payload)
    return samples


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[KIB, 64 * KIB])
    parser.add_argument("--messages", type=int, default=2000, help="timed messages per variant, size and repeat")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--sync-server", action="store_true", help="raw grpc variants against a sync grpc server")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.sync_server)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, __file__, "--serve", *(["--sync-server"] if args.sync_server else [])]
    server = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        ports = json.loads(server.stdout.readline())
        samples: dict[tuple[str, int], list[list[float]]] = {}
        loads = []
        for rep in range(args.repeats):
            order = args.variants if rep % 2 == 0 else list(reversed(args.variants))
            for variant in order:
                client = _Client(variant, ports)
                try:
                    for size in args.sizes:
                        run = _measure(client, os.urandom(size), args.messages, args.warmup)
                        samples.setdefault((variant, size), []).append(run)
                finally:
                    client.close()
            loads.append(os.getloadavg()[0])
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
    rows = []
    for (variant, size), runs in samples.items():
        rows.append({
            "variant": variant,
            "bytes": size,
            "p50_us": round(1e6 * statistics.median(_quantile(r, 0.5) for r in runs), 1),
            "p99_us": round(1e6 * statistics.median(_quantile(r, 0.99) for r in runs), 1),
            "p50_us_runs": [round(1e6 * _quantile(r, 0.5), 1) for r in runs],
        })
    rows.sort(key=lambda r: (r["bytes"], VARIANTS.index(r["variant"])))
    result = {
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join(["python", *sys.argv]),
        "grpcio": grpc.__version__,
        "python": platform.python_version(),
        "server": "sync grpc server (4 threads)" if args.sync_server else "grpc.aio server",
        "messages": args.messages,
        "repeats": args.repeats,
        "load_average_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "rows": rows,
    }
    print(f"{'variant':<24}{'bytes':>8}{'p50 us':>10}{'p99 us':>10}")
    for row in rows:
        print(f"{row['variant']:<24}{row['bytes']:>8}{row['p50_us']:>10}{row['p99_us']:>10}")
    print(f"load average {result['load_average_1min']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
