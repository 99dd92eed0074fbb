"""The TCP sockets processes hold, and what a local process without a run's secret can do to
their listening ports: flood them with connect-and-close attempts, or hold silent connections.

Used by the device check's scripts beside this file and by the tests (``tests.helpers``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

LISTEN, ESTABLISHED, CLOSE_WAIT = "0A", "01", "08"  # the state column of /proc/net/tcp


def descriptors(pid: int) -> int:
    """File descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process ``pid`` has open (none if it is gone)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def tcp_sockets(pids: list[int]) -> list[tuple[str, str, int, int]]:
    """``(state, local address, port, pid)`` of every TCP socket one of ``pids`` holds (IPv6
    addresses shown raw)."""
    owner = {inode: pid for pid in pids for inode in socket_inodes(pid)}
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode not in owner:
                continue
            addr_hex, port_hex = local.split(":")
            assert len(addr_hex) == width
            addr = addr_hex
            if width == 8:
                addr = ".".join(str(int(addr_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
            out.append((state, addr, int(port_hex, 16), owner[inode]))
    return out


def listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """``(local address, port, pid)`` of every TCP socket in LISTEN state one of ``pids`` holds."""
    return [(addr, port, pid) for state, addr, port, pid in tcp_sockets(pids) if state == LISTEN]


Target = tuple[str, int]  # (IPv4 address, port), as listening() gives them


def _address(target: Target) -> Target:
    """``target`` as a connect() address; a listener this module cannot reach is an error (a
    flood that connected nowhere would read as a port that refuses)."""
    addr, port = target
    try:
        socket.inet_aton(addr)
    except OSError:
        raise ValueError(f"not an IPv4 address: {addr!r} (port {port})") from None
    return addr, port


def flood(targets: list[Target], seconds: float) -> list[dict[str, object]]:
    """Connect to each ``(address, port)`` and close, over and over for ``seconds`` (a try waits
    20 ms at most); per target the attempts and the connections made."""
    out: list[dict[str, object]] = []
    for target in targets:
        address = _address(target)
        attempts = made = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            attempts += 1
            sock = socket.socket()
            sock.settimeout(0.02)
            try:
                sock.connect(address)
                made += 1
            except OSError:
                pass
            finally:
                sock.close()
        out.append({"address": address[0], "port": address[1], "attempts": attempts, "made": made})
    return out


def hold(targets: list[Target], count: int) -> list[socket.socket]:
    """``count`` silent connections to each ``(address, port)``, left open (non-blocking)."""
    held = []
    for target in targets:
        address = _address(target)
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.connect_ex(address)
            held.append(sock)
    return held
