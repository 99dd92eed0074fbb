"""Point-to-point byte streams between CPU ranks, progressed by the ranks' own threads.

Why not gloo's ``isend``/``irecv`` on CPU. Gloo completes messages on its own I/O threads. In a
pipeline every rank's compute thread is busy most of the time, so when a message arrives the
receiver's I/O thread has to wait for a core, and a rank that blocked in ``wait`` has to be woken
by another thread (on a VM, its virtual CPU too). Measured on a two-core VM with two ranks
passing two microbatches around a ring (about 0.5 ms of GEMMs per hop): gloo adds about 2 ms per
hop, a socket read and written by the compute threads themselves about 0.1-0.25 ms.

The protocol. Every pair of ranks shares one TCP connection, set up once when the transport is
created: each rank listens on its node's address (loopback when the run stays on one machine),
the addresses are exchanged with ``all_gather_object`` over the default process group, each rank
connects to every lower rank (a ``connect`` completes in the kernel's backlog, so nobody waits
for an ``accept``) and then accepts the higher ranks. Every connection starts with the run's
mutual challenge (:mod:`.control`): a process without the run's secret is dropped, and a rank
cannot pose as another. A message is a 16-byte header (payload length, tag) and the payload;
lengths beyond :data:`MAX_MESSAGE_BYTES` and negative ones are refused before anything is
allocated. Sends never block: the bytes
go into the socket as far as it takes them and the rest waits in a per-peer queue. Whenever a
rank waits (for a message, or for its queued sends), it progresses everything: it writes queued
bytes to every peer that can take them and reads every peer that has data into per-peer
message queues. Since no rank can block while another one waits for it to read, there is no
deadlock whatever the message sizes, and messages between two ranks arrive in the order they
were sent (which the compiled schedule relies on; the tag is checked against it).

Waiting. A rank with a core of its own busy-polls its sockets (``select`` with a zero timeout) for
up to ``SPIN_S`` of every wait before it blocks in ``select``, as a GPU rank's device never
sleeps between kernels. A rank that blocks lets its virtual CPU halt, and its next operators ran
slower: measured on the two-core VM this was built on, over four paired runs of a tiny
Qwen3-Next, the AFD plan's ranks spent 1.15x and 1.15x their profiled operator time when they
blocked and 0.99x and 0.89x when they spun, CAD's 1.13x and 1.45x against 0.98x and 1.26x, and
the plans' TPOT fell from 32.3 to 24.7 ms (AFD) and from 37.2 to 29.9 ms (CAD). Ranks that share
cores must not spin (each would burn the time slice another one needs), so they block at once
(:meth:`~.options.RunOptions.spin_s`; ``OPWEAVE_WAIT=spin|block`` overrides the choice).

A peer that exits closes its connection: the wait fails at once with :class:`PeerError` naming
it; one that hangs fails the wait after ``timeout_s``.
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import deque
from typing import Any

import torch

from ..errors import OpWeaveRuntimeError
from .control import AuthError, ChannelClosed, client_handshake, server_handshake

_HEADER = struct.Struct("<qq")  # payload length, tag
MAX_MESSAGE_BYTES = 1 << 36  # activations of one microbatch: far above any real prefill
_CHUNK = 1 << 20


class PeerError(OpWeaveRuntimeError):
    """A message to or from ``peer`` failed or timed out: the peer died, hung, or disconnected."""

    def __init__(self, peer: int | None, message: str) -> None:
        super().__init__(message)
        self.peer = peer


class _Peer:
    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.out: deque[memoryview] = deque()  # bytes not yet written
        self.inbox: deque[tuple[int, torch.Tensor]] = deque()  # complete (tag, payload)
        self.header = bytearray()
        self.body: bytearray | None = None
        self.body_tag = 0
        self.filled = 0
        self.closed = False


class SocketWire:
    """This rank's connections to every other rank of the default process group."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        host: str,
        key: bytes,
        *,
        spin_s: float = 0.0,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self.peers: dict[int, _Peer] = {}
        for peer, sock in connect_pairs(rank, world_size, timeout_s, host, key).items():
            sock.setblocking(False)
            self.peers[peer] = _Peer(peer, sock)
        self.selector = selectors.DefaultSelector()
        for p in self.peers.values():
            self.selector.register(p.sock, selectors.EVENT_READ, p)

    # -- the interface the Transport uses -------------------------------------------------------
    def post(self, peer: int, tag: int, *parts: torch.Tensor) -> None:
        """Queue one message for ``peer``: the bytes of ``parts`` (contiguous uint8 CPU
        tensors) one after the other; write what fits now. What does not fit stays queued as
        a view of the tensors, not a copy: the caller leaves them unchanged until the next
        :meth:`drain`."""
        p = self.peers[peer]
        views = []
        for t in parts:
            if t.numel():
                array: Any = t.numpy()
                views.append(memoryview(array).cast("B"))
        p.out.append(memoryview(_HEADER.pack(sum(len(v) for v in views), tag)))
        p.out.extend(views)
        self._write(p)

    def take(self, peer: int, tag: int, what: str) -> torch.Tensor:
        """The next message from ``peer`` (blocking, bounded); it must carry ``tag``."""
        p = self.peers[peer]
        now = time.monotonic()
        deadline, spin_until = now + self.timeout_s, now + self.spin_s
        while not p.inbox:
            if p.closed:
                raise PeerError(peer, f"lost rank {peer} while {what}: it closed its connection")
            self._progress(deadline, f"{what} (rank {peer})", peer, spin_until)
        got, payload = p.inbox.popleft()
        if got != tag:
            raise PeerError(
                peer, f"rank {peer} sent tag {got} while {what} expected {tag}: schedules differ"
            )
        return payload

    def wait_readable(self, fileno: int) -> None:
        """Block until ``fileno`` (the control connection) is readable, progressing queued
        sends and incoming messages meanwhile, so waiting for the driver never stalls a peer."""
        key = self.selector.register(fileno, selectors.EVENT_READ, None)
        try:
            while True:
                for p in self.peers.values():
                    if not p.closed:
                        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if p.out else 0)
                        self.selector.modify(p.sock, events, p)
                for k, mask in self.selector.select(timeout=1.0):
                    if k.data is None:
                        return
                    if mask & selectors.EVENT_WRITE:
                        self._write(k.data)
                    if mask & selectors.EVENT_READ:
                        self._read(k.data)
        finally:
            self.selector.unregister(key.fileobj)

    def pending(self) -> bool:
        return any(p.out for p in self.peers.values())

    def drain(self, what: str) -> None:
        """Wait until every queued byte is written (reading meanwhile, so peers never stall)."""
        now = time.monotonic()
        deadline, spin_until = now + self.timeout_s, now + self.spin_s
        while self.pending():
            self._progress(deadline, what, None, spin_until)

    def close(self) -> None:
        self.selector.close()
        for p in self.peers.values():
            p.sock.close()

    # -- progress ---------------------------------------------------------------------------
    def _progress(
        self, deadline: float, what: str, peer: int | None, spin_until: float = 0.0
    ) -> None:
        for p in self.peers.values():
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if p.out else 0)
            if not p.closed:
                self.selector.modify(p.sock, events, p)
        left = deadline - time.monotonic()
        if left <= 0:
            who = (
                peer
                if peer is not None
                else next((p.rank for p in self.peers.values() if p.out), -1)
            )
            raise PeerError(who, f"timed out after {self.timeout_s:g} s {what}")
        timeout = 0.0 if time.monotonic() < spin_until else min(left, 1.0)
        for key, mask in self.selector.select(timeout=timeout):
            p = key.data
            if mask & selectors.EVENT_WRITE:
                self._write(p)
            if mask & selectors.EVENT_READ:
                self._read(p)

    def _write(self, p: _Peer) -> None:
        while p.out:
            head = p.out[0]
            try:
                sent = p.sock.send(head[:_CHUNK])
            except BlockingIOError:
                return
            except OSError as exc:
                raise PeerError(p.rank, f"sending to rank {p.rank} failed: {exc}") from None
            if sent == len(head):
                p.out.popleft()
            else:
                p.out[0] = head[sent:]
                return

    def _read(self, p: _Peer) -> None:
        while True:
            try:
                if p.body is None:
                    chunk = p.sock.recv(_HEADER.size - len(p.header))
                    if not chunk:
                        return self._closed(p)
                    p.header += chunk
                    if len(p.header) < _HEADER.size:
                        continue
                    size, tag = _HEADER.unpack(bytes(p.header))
                    p.header.clear()
                    if not 0 <= size <= MAX_MESSAGE_BYTES:
                        raise PeerError(
                            p.rank, f"rank {p.rank} sent a malformed message ({size} bytes)"
                        )
                    if size == 0:
                        p.inbox.append((tag, torch.empty(0, dtype=torch.uint8)))
                        continue
                    p.body, p.body_tag, p.filled = bytearray(size), tag, 0
                view = memoryview(p.body)[p.filled :]
                got = p.sock.recv_into(view, min(len(view), _CHUNK))
                if not got:
                    return self._closed(p)
                p.filled += got
                if p.filled == len(p.body):
                    p.inbox.append((p.body_tag, torch.frombuffer(p.body, dtype=torch.uint8)))
                    p.body = None
            except BlockingIOError:
                return
            except OSError:
                return self._closed(p)

    def _closed(self, p: _Peer) -> None:
        if not p.closed:
            p.closed = True
            self.selector.unregister(p.sock)


def connect_pairs(
    rank: int, world_size: int, timeout_s: float, host: str, key: bytes
) -> dict[int, socket.socket]:
    """One authenticated TCP connection (``TCP_NODELAY``, blocking) to every other rank of the
    default process group, by peer. Every rank must call it at once (the listening addresses
    travel by ``all_gather_object``): each connects to the lower ranks and accepts the higher
    ones, after the run's mutual challenge."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(max(world_size, 8))
    addresses: list[tuple[str, int] | None] = [None] * world_size
    dist.all_gather_object(addresses, (host, listener.getsockname()[1]))
    peers: dict[int, socket.socket] = {}
    try:
        for peer in range(rank):
            address = addresses[peer]
            assert address is not None
            sock = socket.create_connection(address, timeout=timeout_s)
            try:
                client_handshake(sock, key, rank)
            except (AuthError, ChannelClosed, OSError) as exc:
                raise PeerError(peer, f"rank {peer} refused the connection: {exc}") from None
            peers[peer] = sock
        expected = set(range(rank + 1, world_size))
        deadline = time.monotonic() + timeout_s
        while expected:
            listener.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                raise PeerError(
                    min(expected), f"timed out waiting for ranks {sorted(expected)} to connect"
                ) from None
            try:
                peer = server_handshake(sock, key)
            except (AuthError, ChannelClosed, OSError):
                sock.close()  # not a rank of this run
                continue
            if peer not in expected:
                sock.close()
                continue
            expected.discard(peer)
            peers[peer] = sock
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    finally:
        listener.close()
    for sock in peers.values():
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return peers


def node_address(master: str) -> str:
    """This host's address as the run's other nodes reach it: loopback for a run on this machine,
    else the address of the interface on the route to the master (node 0)."""
    if master in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master, 9))
            return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())
