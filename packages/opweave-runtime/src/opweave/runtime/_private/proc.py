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


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the thread that started it exits."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def watch_parent(parent: int) -> None:
    """Exit as soon as this process is re-parented (its starter is gone)."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=loop, name="opweave-parent", daemon=True).start()


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
