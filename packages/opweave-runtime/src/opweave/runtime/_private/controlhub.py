"""The driver's end of every rank's control connection, served by one IO thread.

Ranks connect to the driver's listening socket and prove the run's secret off the IO thread (a
silent peer must not stall it); the IO thread then reads every connection's messages and
writes what the driver queued for it, never blocking: a frame a rank's socket does not take at
once waits in that connection's buffer. What the messages mean, and what a lost connection
means, is the :class:`~.cluster.Cluster`'s (:meth:`ControlHub._handle`,
:meth:`ControlHub._watch`, :meth:`ControlHub._signal`).
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import OpWeaveRuntimeError
from .control import AuthError, ChannelClosed, server_handshake
from .messages import Error, FrameReader, Ready, ToDriver, encode

_POLL_S = 0.05
# connections proving the secret at once, at most: a local process that floods the port must
# not start a thread (and hold a descriptor) per connection; beyond it a connection is dropped
_HANDSHAKES = 32


@dataclass
class Conn:
    """One rank's control connection, as the driver's IO thread sees it."""

    sock: socket.socket
    rank: int
    reader: FrameReader = field(default_factory=lambda: FrameReader(ToDriver))
    out: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = "joined"  # joined -> ready -> closed
    last_seen: float = field(default_factory=time.monotonic)
    host: str = ""
    pid: int | None = None
    ready: Ready | None = None
    report: Error | None = None
    stats: dict[str, Any] | None = None
    warmed: bool = False  # compiled its decode steps (warm_up)


class ControlHub:
    """The control connections of a run's ranks and the IO thread that serves them."""

    world: int
    _key: bytes
    _listener: socket.socket
    _conns: dict[int, Conn]
    _claimed: set[int]
    _new_conns: queue.SimpleQueue[Conn]
    _lock: threading.Lock
    _closing: bool
    _stopping: bool
    _stop_listening: bool = False

    def _start_io(self) -> None:
        self._handshakes = threading.BoundedSemaphore(_HANDSHAKES)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._io = threading.Thread(target=self._loop, name="opweave-driver-io", daemon=True)
        self._io.start()

    # -- sending ------------------------------------------------------------------------------
    def _send(self, rank: int, message: Any) -> None:
        self._send_frame(rank, encode(message))

    def _send_frame(self, rank: int, frame: bytes) -> None:
        conn = self._conns.get(rank)
        if conn is None or conn.state == "closed":
            return  # its loss is being (or was) reported
        with conn.lock:
            if not conn.out:
                try:
                    sent = conn.sock.send(frame)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    return  # the IO thread sees the closed connection
                frame = frame[sent:]
            conn.out += frame
        if conn.out:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"w")

    # -- the IO thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closing:
            try:
                if self._stop_listening:
                    self._close_listener()
                self._register_writes()
                for key, mask in self._selector.select(timeout=_POLL_S):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError, OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn: Conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                self._watch()
            except Exception as exc:  # the IO thread must never die silently
                self._signal(f"the driver's control loop failed: {type(exc).__name__}: {exc}")
                self._finish_failure(force=True)
                return

    def _close_listener(self) -> None:
        """Every rank joined: close the control port, so no other process can connect."""
        self._stop_listening = False
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        with contextlib.suppress(OSError):
            self._listener.close()

    def _register_writes(self) -> None:
        for conn in list(self._conns.values()):
            if conn.state == "closed":
                continue
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(conn.sock, events, conn)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError:  # out of descriptors, or the listener was closed: drop this one
            return
        if not self._handshakes.acquire(blocking=False):
            sock.close()  # too many at once: a flood, not the run's ranks
            return
        threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        """Authenticate a new connection off the IO thread (a silent peer must not stall it)."""
        try:
            rank = server_handshake(sock, self._key)
        except (AuthError, ChannelClosed, OSError):
            sock.close()  # not a rank of this run
            return
        finally:
            self._handshakes.release()
        with self._lock:
            if not 0 <= rank < self.world or rank in self._claimed or self._closing:
                sock.close()
                return
            self._claimed.add(rank)
            everyone = len(self._claimed) == self.world
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._new_conns.put(Conn(sock, rank))  # registered by the IO thread
        if everyone:
            self._stop_listening = True  # nobody else may join: the IO thread closes the port
        with contextlib.suppress(OSError):
            self._wake_w.send(b"c")

    def _flush(self, conn: Conn) -> None:
        with conn.lock:
            while conn.out:
                try:
                    sent = conn.sock.send(conn.out)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    conn.out.clear()
                    return
                del conn.out[:sent]

    def _read(self, conn: Conn) -> None:
        while True:
            try:
                messages = conn.reader.read(conn.sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                messages = None
            except OpWeaveRuntimeError as exc:
                conn.report = Error("error", f"sent a malformed message: {exc}")
                self._lost(conn)
                return
            if messages is None:
                self._lost(conn)
                return
            conn.last_seen = time.monotonic()
            for msg in messages:
                self._handle(conn, msg)

    def _lost(self, conn: Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        was = conn.state
        conn.state = "closed"
        if self._stopping and conn.stats is not None:
            return  # a clean exit after shutdown
        if was != "closed":
            self._signal(f"rank {conn.rank} closed its control connection")

    # -- what the cluster decides ---------------------------------------------------------------
    def _handle(self, conn: Conn, msg: Any) -> None:
        raise NotImplementedError

    def _watch(self) -> None:
        raise NotImplementedError

    def _signal(self, why: str) -> None:
        raise NotImplementedError

    def _finish_failure(self, *, force: bool = False) -> None:
        raise NotImplementedError
