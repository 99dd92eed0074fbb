"""The connections between CPU ranks: one authenticated TCP connection per pair of ranks.

Set up once when a rank's transport is created: each rank listens on its node's address
(loopback when the run stays on one machine), the addresses are exchanged with
``all_gather_object`` over the default process group, each rank connects to every lower rank (a
``connect`` completes in the kernel's backlog, so nobody waits for an ``accept``) and then
accepts the higher ranks. Every connection starts with the run's mutual challenge
(:mod:`.control`): a process without the run's secret is dropped, and a rank cannot pose as
another. The native wire (:mod:`.native`) then owns them.

Waiting. A rank with a core of its own busy-polls its connections for up to a second of every
wait before it blocks, as a GPU rank's device never sleeps between kernels. A rank that blocks
lets its virtual CPU halt, and its next operators ran slower: measured on the two-core VM this
was built on, over four paired runs of a tiny Qwen3-Next, the AFD plan's ranks spent 1.15x and
1.15x their profiled operator time when they blocked and 0.99x and 0.89x when they spun, CAD's
1.13x and 1.45x against 0.98x and 1.26x, and the plans' TPOT fell from 32.3 to 24.7 ms (AFD)
and from 37.2 to 29.9 ms (CAD). Ranks that share cores must not spin (each would burn the time
slice another one needs), so they block at once (:meth:`~.options.RunOptions.spin_s`;
``opweave run --wait spin|block`` overrides the choice).

A peer that exits closes its connection: the wait fails at once with :class:`PeerError` naming
it; one that hangs fails the wait after ``timeout_s``.
"""

from __future__ import annotations

import socket
import time

from ..errors import OpWeaveRuntimeError
from .control import AuthError, ChannelClosed, client_handshake, server_handshake

MAX_MESSAGE_BYTES = 1 << 36  # activations of one microbatch: far above any real prefill


class PeerError(OpWeaveRuntimeError):
    """A message to or from ``peer`` failed or timed out: the peer died, hung, or disconnected.
    ``peer`` None: one of ``suspects`` did (a collective of a group, which cannot say whom it
    waited on)."""

    def __init__(self, peer: int | None, message: str, suspects: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.peer = peer
        self.suspects = suspects


def group_blame(others: tuple[int, ...]) -> tuple[int | None, tuple[int, ...]]:
    """Whom a failed collective of a group waited on, as (``peer``, ``suspects``): the other
    rank of a pair; in a larger group none in particular, since the collective relays through
    members (a tree in gloo, a ring in NCCL): the driver names the silent one of ``others``."""
    return (others[0] if len(others) == 1 else None), others


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
