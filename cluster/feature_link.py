"""The direct feature path (issue 12): context features moved verifier -> drafter by torch.distributed p2p.

With ``engine.feature_transport: collective`` the verifier's ``AppendContext`` carries only metadata (link id,
sequence number, shape, dtype and the usual request fields) and the rows themselves go over a c10d process group of
size 2 per (verifier, drafter) pair: rank 0 the verifier (sender), rank 1 the drafter (receiver); gloo for CPU
tensors, NCCL for CUDA ones. The groups are built directly from a store, without ``init_process_group``, so
replicas join and leave freely (autoscaling): there is no world, only pairs.

The protocol:

* every drafter hosts a ``TCPStore`` (master) on its gRPC host and a free port (:class:`LinkHost`);
* a verifier opens a link on its first push to a drafter: ``OpenLink {link_id, backend, peer_host}``; the drafter
  answers with its store address at once and builds rank 1 on the link's own thread, while the verifier connects to
  the store and builds rank 0 (:class:`LinkSender`); a push waits at most ``LINK_OPEN_WAIT_S`` for the link and
  otherwise goes as bytes over gRPC, so opening a link never fails a round;
* per push the verifier numbers the link's sends (``seq`` 0, 1, ...), issues the ``send`` (keeping the tensor
  referenced until its work completes) and then sends the metadata over gRPC; the drafter receives strictly in
  ``seq`` order per link (NCCL ignores tags: metadata overtaking an earlier one waits for its turn), into a buffer
  on its device;
* any failure on a link (it cannot be built, a send or receive fails or times out, the drafter no longer knows it)
  ends the link on both sides; the verifier then sends that drafter bytes over gRPC, as with ``grpc``, starting
  with the push that failed.

Every blocking c10d call (store connect, group rendezvous, ``wait``) has the link's timeout, so a lost peer costs at
most that long, never a hang; a push lost that way fails its requests' next ``Propose`` and failover re-prefills
them, the same path as a lost gRPC push. Nothing here pickles: only raw tensors cross the groups.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from cluster import contract
from cluster.rpc import RpcClient
from cluster.wire import WIRE_DTYPES

log = logging.getLogger(__name__)

#: Longest a link waits for its peer in any one step (rendezvous, a send or a receive, its turn in sequence).
DEFAULT_LINK_TIMEOUT_S = 30.0
#: How long a push waits for its link to open before it goes as bytes over gRPC instead: well below the drafter's
#: Propose wait for context rows (10 s), so a slow rendezvous (NCCL's takes seconds) never fails a round.
LINK_OPEN_WAIT_S = 2.0
#: Links one drafter holds at most (one per verifier replica that pushes to it; each holds a thread).
MAX_LINKS = 256
_SENDER, _RECEIVER = 0, 1
_WILDCARDS = ("", "0.0.0.0", "::")


class PairGroup(Protocol):
    """The c10d calls a link makes on its group of two: a ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` backend
    object (built directly, so not a ``dist.ProcessGroup``). Each send or receive returns a work handle to wait on."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int, /) -> dist.Work: ...

    def abort(self) -> None: ...

    def shutdown(self) -> None: ...


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors, gloo CPU ones; both ends of a link must use the same."""
    return "nccl" if device.type == "cuda" else "gloo"


def split_host(address: str) -> str:
    """The host of a ``host:port`` gRPC address (brackets of an IPv6 literal removed)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def local_address_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (what the peer can reach us at); sends nothing."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def build_group(
    store: dist.Store, link_id: str, rank: int, backend: str, local_host: str, device: torch.device, timeout_s: float
) -> PairGroup:
    """One end of a link's process group of size 2; blocks until the other end joins (or ``timeout_s``).

    Both ends then exchange one element: NCCL creates its communicator on the first point-to-point call, which
    blocks until the peer makes its own; here both ends are building, whereas the first push's send would wait for
    a receive that the drafter only posts once the push's metadata has arrived."""
    prefixed = dist.PrefixStore(f"feature-link/{link_id}/", store)
    timeout = timedelta(seconds=timeout_s)
    # torch's stubs leave send and recv off the c10d Backend class (the pybind classes have them), hence the casts
    group: PairGroup
    if backend == "gloo":
        # _Options (the pybind options with _devices and _timeout) is missing from torch's stubs
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        options._timeout = timeout
        group = cast(PairGroup, dist.ProcessGroupGloo(prefixed, rank, 2, options))
    elif backend == "nccl":  # not run on a GPU yet (docs/ROUND_PIPELINE.md, "The direct feature path")
        if device.index is not None:
            torch.cuda.set_device(device)
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        group = cast(PairGroup, dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_options))
    else:
        raise ValueError(f"unknown feature link backend {backend!r}")
    probe = torch.zeros(1, device=device if backend == "nccl" else "cpu")
    work = group.send([probe], _RECEIVER, 0) if rank == _SENDER else group.recv([probe], _SENDER, 0)
    work.wait(timeout)
    return group


class _Link:
    """One end of a link: its group and the one thread that runs its c10d calls in submission (= seq) order."""

    def __init__(self, link_id: str, device: torch.device, timeout_s: float) -> None:
        self.link_id = link_id
        self.device = device
        self.timeout_s = timeout_s
        self.group: PairGroup | None = None
        self.next_seq = 0
        self.closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"link-{link_id[:8]}")

    def submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def wait(self, work: Any) -> None:
        work.wait(timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        self.closed = True
        group, self.group = self.group, None
        if group is not None:
            try:
                if backend_name(group) == "nccl":
                    group.abort()
                else:
                    group.shutdown()
            except Exception as exc:  # closing a broken link: nothing left to save
                log.debug("closing feature link %s: %s", self.link_id, exc)
        self._executor.shutdown(wait=False, cancel_futures=True)


def backend_name(group: PairGroup) -> str:
    return "nccl" if type(group).__name__ == "ProcessGroupNCCL" else "gloo"


class LinkHost:
    """The drafter's end: hosts the store every link rendezvous through, and receives in sequence order."""

    def __init__(
        self, host: str, device: torch.device, timeout_s: float = DEFAULT_LINK_TIMEOUT_S, advertise: str | None = None
    ) -> None:
        self.host = host
        self._advertise = advertise  # where verifiers reach this drafter when not at ``host`` (NAT, several NICs)
        self.device = device
        self.backend = backend_for(device)
        self.timeout_s = timeout_s
        self._store = dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        self.port = int(self._store.port)
        self._links: dict[str, _Link] = {}
        self._turns: dict[str, asyncio.Condition] = {}
        self._wakes: set[asyncio.Task[None]] = set()

    @property
    def advertised_host(self) -> str:
        """Where verifiers reach the store and this end: ``advertise``, else ``host``; empty for a wildcard host
        (the verifier then uses the host of the drafter's gRPC address)."""
        if self._advertise is not None:
            return self._advertise
        return "" if self.host in _WILDCARDS else self.host

    def open(self, link_id: str, backend: str, peer_host: str) -> int:
        """Start building rank 1 of a new link on its thread; returns the store port for the verifier."""
        if backend != self.backend:
            raise ValueError(f"OpenLink: this drafter's features live on {self.device} ({self.backend}), not {backend}")
        if link_id in self._links:
            raise ValueError(f"OpenLink: link {link_id} is already open")
        if len(self._links) >= MAX_LINKS:
            raise ValueError(f"OpenLink: this drafter holds {MAX_LINKS} links already")
        local = self.advertised_host or local_address_toward(peer_host)
        link = self._links[link_id] = _Link(link_id, self.device, self.timeout_s)
        self._turns[link_id] = asyncio.Condition()

        def build() -> None:
            link.group = build_group(self._store, link_id, _RECEIVER, self.backend, local, self.device, self.timeout_s)

        future = link.submit(build)
        future.add_done_callback(lambda f: self._built(link, f))
        return self.port

    def _built(self, link: _Link, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("feature link %s could not be built: %s", link.link_id, future.exception())
            self.close_link(link.link_id)

    async def receive(self, link_id: str, seq: int, shape: list[int], dtype: str) -> torch.Tensor:
        """The rows of push ``seq`` of ``link_id``, once every earlier push of the link has been received."""
        link, turn = self._links.get(link_id), self._turns.get(link_id)
        if link is None or turn is None:
            raise ValueError(f"AppendContext: unknown feature link {link_id} (closed, failed or never opened)")
        buffer = torch.empty(shape, dtype=WIRE_DTYPES[dtype], device=self.device)
        async with turn:
            try:
                await asyncio.wait_for(turn.wait_for(lambda: link.next_seq >= seq or link.closed), self.timeout_s)
            except TimeoutError:
                self.close_link(link_id)
                raise RuntimeError(f"feature link {link_id}: push {link.next_seq} never came before {seq}") from None
            if link.closed:
                raise ValueError(f"AppendContext: feature link {link_id} closed")
            if link.next_seq != seq:
                raise ValueError(f"AppendContext: push {seq} of feature link {link_id} was received already")
            future = link.submit(self._recv, link, buffer)  # queued behind the build and every earlier receive
            link.next_seq += 1
            turn.notify_all()
        try:
            return await future
        except Exception:
            self.close_link(link_id)
            raise

    @staticmethod
    def _recv(link: _Link, buffer: torch.Tensor) -> torch.Tensor:
        if link.group is None:
            raise RuntimeError(f"feature link {link.link_id} is not built")
        link.wait(link.group.recv([buffer], _SENDER, 0))
        return buffer

    def close_link(self, link_id: str, wake: bool = True) -> None:
        """End a link (on the server's event loop; ``wake``: pushes waiting for their turn fail at once)."""
        link = self._links.pop(link_id, None)
        turn = self._turns.pop(link_id, None)
        if link is not None:
            link.close()
        if turn is not None and wake:

            async def notify() -> None:
                async with turn:
                    turn.notify_all()

            self._wakes.add(task := asyncio.get_running_loop().create_task(notify()))
            task.add_done_callback(self._wakes.discard)

    @property
    def num_links(self) -> int:
        return len(self._links)

    @property
    def link_ids(self) -> list[str]:
        return list(self._links)

    def close(self) -> None:
        """At shutdown (the server stopped: nobody waits for a turn any more)."""
        for link_id in list(self._links):
            self.close_link(link_id, wake=False)


class LinkSender:
    """The verifier's ends: one link per drafter address, opened lazily; ``None`` where bytes go over gRPC."""

    def __init__(
        self, device: torch.device, timeout_s: float = DEFAULT_LINK_TIMEOUT_S, open_wait_s: float = LINK_OPEN_WAIT_S
    ) -> None:
        self.device = device
        self.backend = backend_for(device)
        self.timeout_s = timeout_s
        self.open_wait_s = open_wait_s
        self.bytes_sent = 0  # tensor bytes moved over links (the gRPC metadata counts in the clients)
        self._links: dict[str, _Link] = {}
        self._opening: dict[str, asyncio.Task[_Link | None]] = {}
        self._grpc_only: set[str] = set()  # drafters whose link failed: bytes over gRPC from now on

    async def link_for(self, address: str, client: RpcClient) -> _Link | None:
        """The open link to ``address`` (opened now if there is none yet); None: send bytes over gRPC."""
        if address in self._grpc_only:
            return None
        link = self._links.get(address)
        if link is not None:
            return link
        task = self._opening.get(address)
        if task is None:
            task = self._opening[address] = asyncio.ensure_future(self._open(address, client))
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.open_wait_s)
        except TimeoutError:  # this push goes as bytes (its drafter's Propose waits for it); the link keeps opening
            return None

    async def _open(self, address: str, client: RpcClient) -> _Link | None:
        link_id = uuid.uuid4().hex
        link = _Link(link_id, self.device, self.timeout_s)
        try:
            local = await asyncio.to_thread(local_address_toward, split_host(address))  # may resolve a name
            reply = await contract.OPEN_LINK.acall(
                client, {"link_id": link_id, "backend": self.backend, "peer_host": local}
            )
            host, port = reply["store_host"] or split_host(address), int(reply["store_port"])
            def build() -> None:
                nonlocal local
                if host != split_host(address):
                    local = local_address_toward(host)
                store = dist.TCPStore(host, port, None, False, timedelta(seconds=self.timeout_s))
                link.group = build_group(store, link_id, _SENDER, self.backend, local, self.device, self.timeout_s)

            await link.submit(build)
        except Exception as exc:
            link.close()
            self._grpc_only.add(address)
            log.warning("no feature link to drafter %s (%s): its features go over gRPC", address, exc)
            await _close_remote(client, link_id)
            return None
        finally:
            self._opening.pop(address, None)
        self._links[address] = link
        return link

    def send(self, link: _Link, tensor: torch.Tensor) -> tuple[int, asyncio.Future[Any]]:
        """Number the next push of ``link`` and issue its send; the future gives the send's work."""
        group = link.group
        if group is None or link.closed:
            raise RuntimeError(f"feature link {link.link_id} is closed")
        seq = link.next_seq
        link.next_seq += 1
        return seq, link.submit(lambda: group.send([tensor], _RECEIVER, 0))

    async def complete(self, link: _Link, work: Any, tensor: torch.Tensor) -> None:
        """Wait (off the event loop) until the send is done; ``tensor`` stays referenced until then."""
        await asyncio.to_thread(link.wait, work)
        self.bytes_sent += tensor.numel() * tensor.element_size()

    async def fail(self, address: str, link: _Link, reason: object, client: RpcClient) -> None:
        """End a link after any failure on it, on both sides: that drafter gets bytes over gRPC from now on."""
        if self._links.get(address) is link:
            del self._links[address]
            self._grpc_only.add(address)
            log.warning("feature link to drafter %s failed (%s): its features go over gRPC from now on",
                        address, reason)
        link.close()
        await _close_remote(client, link.link_id)

    @property
    def num_links(self) -> int:
        return len(self._links)

    async def close(self, clients: dict[str, RpcClient]) -> None:
        """Close every link, telling each drafter (best effort: a drafter gone has nothing to close)."""
        for task in list(self._opening.values()):
            await asyncio.shield(task)
        for address, link in list(self._links.items()):
            client = clients.get(address)
            if client is not None:
                await _close_remote(client, link.link_id)
            link.close()
        self._links.clear()


async def _close_remote(client: RpcClient, link_id: str) -> None:
    """Tell the drafter to drop its end of a link (best effort: a drafter gone has nothing to close)."""
    try:
        await contract.CLOSE_LINK.acall(client, {"link_id": link_id}, timeout_s=5.0)
    except Exception as exc:
        log.debug("CloseLink %s to %s: %s", link_id, client.target, exc)
