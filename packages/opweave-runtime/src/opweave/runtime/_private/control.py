"""The control channel between the driver and the ranks, and how both sides authenticate.

Every rank holds one TCP connection to the driver (the process that owns the requests: the
offline generator or vLLM's engine through the executor). Control messages travel on it --
work for a microbatch (admit + prefill, decode, free), shutdown; from the ranks: ready, results,
statistics, an error report -- while activations go rank to rank over the transport. Because every
rank keeps this one connection open, its closing tells the driver at once that a rank died, on
any node, and tells a rank that the driver is gone.

Messages: the typed classes of :mod:`.messages`, framed by their length (checked against
:data:`~.messages.MAX_FRAME_BYTES` before anything is allocated).

Authentication: ranks of a run trust only each other. A run has a secret (random for a run on one
node, handed to its processes; ``OPWEAVE_RUN_SECRET`` on every node of a run that spans several).
Every connection of a run -- control and the wire between ranks -- starts with a mutual
challenge: each side sends a random nonce and proves knowledge of the secret with an HMAC-SHA256
over both nonces (and, from a rank, its rank id), so a process without the secret is refused
before it can send or receive a single message, and a rank cannot claim another's id.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from ..errors import OpWeaveRuntimeError
from .messages import FrameReader, ToRank, encode

SECRET_ENV = "OPWEAVE_RUN_SECRET"
HANDSHAKE_TIMEOUT_S = 10.0
_MAGIC = b"OPWEAVE1"
_NONCE = 32


class AuthError(OpWeaveRuntimeError):
    """A peer did not prove it holds the run's secret."""


class ChannelClosed(OpWeaveRuntimeError):
    """The other end closed the connection (it exited or died)."""


def run_secret(multi_process_origin: bool) -> bytes:
    """The run's key: from ``OPWEAVE_RUN_SECRET`` where set (required when the run's processes
    do not all descend from this one: several nodes, torchrun), else fresh random bytes."""
    text = os.environ.get(SECRET_ENV, "")
    if text:
        return hashlib.sha256(text.encode()).digest()
    if multi_process_origin:
        raise OpWeaveRuntimeError(
            f"a run whose processes start on several nodes (or under torchrun) needs a shared "
            f"secret: set {SECRET_ENV} to the same value on every node, e.g. "
            f'{SECRET_ENV}="$(openssl rand -hex 32)"'
        )
    return secrets.token_bytes(32)


def store_namespace(key: bytes) -> str:
    """The prefix of every key a run writes to a TCP rendezvous store (the driver's control
    address, gloo's and NCCL's rendezvous): derived from the run's secret, so a process that
    reaches the store without the secret cannot find, read or overwrite the run's keys (torch's
    store protocol has no way to list them)."""
    return "opweave-" + _mac(key, b"rendezvous namespace").hex()[:32]  # PrefixStore adds "/"


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelClosed("the peer closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


def server_handshake(sock: socket.socket, key: bytes) -> int:
    """Authenticate the connecting side; returns the id it claimed (a rank)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + nonce)
    got = _recv_exactly(sock, _NONCE + 8 + 32)
    theirs, ident, proof = got[:_NONCE], got[_NONCE : _NONCE + 8], got[_NONCE + 8 :]
    if not hmac.compare_digest(proof, _mac(key, b"client", nonce, theirs, ident)):
        raise AuthError("a connection did not prove it holds the run's secret")
    sock.sendall(_mac(key, b"server", theirs, nonce))
    sock.settimeout(None)
    return struct.unpack("<q", ident)[0]


def client_handshake(sock: socket.socket, key: bytes, ident: int) -> None:
    """Authenticate to a server of the run as ``ident`` (and check the server knows the key)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    got = _recv_exactly(sock, len(_MAGIC) + _NONCE)
    if got[: len(_MAGIC)] != _MAGIC:
        raise AuthError("the peer is not an OpWeave rank or driver")
    theirs = got[len(_MAGIC) :]
    nonce = secrets.token_bytes(_NONCE)
    packed = struct.pack("<q", ident)
    sock.sendall(nonce + packed + _mac(key, b"client", theirs, nonce, packed))
    proof = _recv_exactly(sock, 32)
    if not hmac.compare_digest(proof, _mac(key, b"server", nonce, theirs)):
        raise AuthError("the peer does not hold the run's secret")
    sock.settimeout(None)


class ControlClient:
    """A rank's end of its control connection (blocking sends; reads as frames arrive)."""

    def __init__(self, host: str, port: int, key: bytes, rank: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ChannelClosed(
                        f"cannot reach the driver at {host}:{port}: {exc}"
                    ) from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(sock, key, rank)
        self._attach(sock)

    def _attach(self, sock: socket.socket) -> None:
        """Read and write messages on ``sock`` (connected and authenticated; blocking)."""
        self.sock = sock
        self._reader = FrameReader(ToRank)
        self._inbox: list[Any] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        self.send_all([message])

    def send_all(self, messages: Sequence[Any]) -> None:
        """Several messages in one write."""
        try:
            self.sock.sendall(b"".join(map(encode, messages)))
        except OSError as exc:
            raise ChannelClosed(f"the driver is gone ({exc})") from None

    def poll(self) -> bool:
        """Whether a whole message is waiting (reads what has arrived, never blocks)."""
        while not self._inbox and self._read(socket.MSG_DONTWAIT):
            pass
        return bool(self._inbox)

    def recv(self) -> Any:
        """The next message (blocks until one arrives)."""
        while not self._inbox:
            self._read(0)
        return self._inbox.pop(0)

    def _read(self, flags: int) -> bool:
        """One read of the socket into the inbox; False if nothing was waiting (with
        ``MSG_DONTWAIT``). The socket stays blocking: a non-blocking read is a flag of its own."""
        try:
            messages = self._reader.read(self.sock, flags)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise ChannelClosed(f"the driver's connection failed ({exc})") from None
        if messages is None:
            raise ChannelClosed("the driver closed the control connection")
        self._inbox += messages
        return True

    def close(self) -> None:
        self.sock.close()
