"""A rank process's ties to the machine: its name, its parent, its core."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time

import torch


def name_process(name: str) -> None:
    """Linux: the name ``ps``/``top`` show for this process (15 characters at most)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME


def die_with_parent(parent: int | None = None) -> None:
    """Linux: the kernel kills this process when the thread that started it exits. With
    ``parent`` (its pid), a process whose parent died before the call exits at once."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def watch_parent(parent: int) -> None:
    """Exit as soon as this process is re-parented (its starter is gone)."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=loop, name="opweave-parent", daemon=True).start()


_SO_ATTACH_FILTER = 26  # Linux <asm-generic/socket.h>
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def listening_sockets() -> list[int]:
    """File descriptors of this process's TCP sockets that listen (Linux; [] elsewhere)."""
    inodes: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = int(name)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == _TCP_LISTEN and fields[9] in inodes:
                    found.append(inodes[fields[9]])
    return sorted(found)


def refuse_new_connections() -> int:
    """Linux: every TCP port this process listens on drops new connections from now on (a
    socket filter that accepts no packet: a connecting SYN is dropped before the kernel
    queues it); connections already made are untouched. Returns how many ports it closed.

    Why: gloo's listening ports keep every connection they accept until it proves it is a
    peer, which a flood never does; measured on a 2-core VM, about 20,000 connect-and-close
    attempts in 35 s exhausted a rank's descriptors and gloo aborted the rank. A rank's
    process groups are all connected once it has joined, so nothing needs those ports after.
    """
    import socket
    import struct

    drop_all = struct.pack("HBBI", 0x06, 0, 0, 0)  # BPF_RET | BPF_K, 0: keep no byte
    program = ctypes.create_string_buffer(drop_all)
    fprog = struct.pack("HL", 1, ctypes.addressof(program))  # struct sock_fprog
    closed = 0
    for fd in listening_sockets():
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
                closed += 1
            finally:
                sock.close()
    return closed


def pin_to_core(local_rank: int, local_ranks: int) -> bool:
    """Bind a single-threaded CPU rank to one core of those this process may use, as a GPU
    rank is bound to its device: the scheduler then never migrates it (its caches stay warm)
    and two ranks never share a core while another one idles. More ranks than cores share
    them round-robin, from the last core down: the first cores are left to the OS's
    housekeeping and the unpinned front end (server, scheduler, clients). Measured on a 2-core
    VM, one rank serving 4 streaming clients, its core alternated six times: 99.8-143.0
    (median 126) output tok/s on the last core, 90.3-126.6 (median 114) on the first. Returns
    whether the rank has a core of its own (then it may spin while it waits, see
    :mod:`.native`)."""
    if not hasattr(os, "sched_setaffinity") or torch.get_num_threads() != 1:
        return False
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[-1 - local_rank % len(cores)]})
    return local_ranks <= len(cores)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """The rank's device: its local GPU, or the CPU."""
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class RunQueueClock:
    """The calling thread's time spent runnable but not running (waiting for a CPU another
    process or thread held), from the scheduler's statistics (Linux ``schedstat``; 0 where
    there are none). Read in about 2 us."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
