"""What outlives a process that dies without cleaning up: a reaper per run folder.

A process that is SIGKILLed (by a user, a supervisor, the OOM killer) runs no ``finally``: the
processes it started die with it (each has a parent-death signal, :func:`~.proc.die_with_parent`),
but its folders would stay. So a process that owns a run's folder first starts a
:class:`Reaper`: a small interpreter (no torch, milliseconds to start) that waits on a pipe
from its owner. When the owner ends the run normally it says ``done`` and the reaper exits doing
nothing; when the pipe closes without that (the owner died), the reaper SIGKILLs the process
groups it was told about (``pid N``: the run's ranks, in case one has no parent-death signal to
follow) and removes the folders, then exits. It survives its owner by design: it is the one
process of a run that does.

``python reaper.py PATH...`` (this file, run as a script) is the reaper; its protocol on stdin, one
line each: ``pid N`` (a process group to kill), ``path P`` (one more folder), ``done``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

_GONE_S = 5.0  # how long the reaper waits for the killed processes to go before it removes


class Reaper:
    """Removes ``paths`` (and kills the process groups given to :meth:`watch`) if this process
    dies before :meth:`close`; :meth:`close` ends it without touching anything."""

    def __init__(self, paths: Iterable[str | Path]) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            # run as a script: importing the runtime's package would import torch (seconds)
            [sys.executable, "-I", __file__, *map(str, paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is its owner's to handle
        )

    def _say(self, line: str) -> None:
        with self._lock:
            proc = self._proc
            if proc is None or proc.stdin is None:
                return
            with contextlib.suppress(OSError):
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.flush()

    def watch(self, pid: int) -> None:
        """Kill process group ``pid`` too if this process dies first."""
        self._say(f"pid {pid}")

    def add(self, path: str | Path) -> None:
        """Remove ``path`` too if this process dies first."""
        self._say(f"path {path}")

    def close(self) -> None:
        """The run ended and its owner cleaned up: the reaper exits, touching nothing."""
        self._say("done")
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(paths: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only its owner's end matters
    parent = os.getppid()
    pids: list[int] = []
    folders = list(paths)
    pending = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            word, _, arg = raw.decode(errors="replace").partition(" ")
            if word == "done":
                return 0
            if word == "pid" and arg.isdigit():
                pids.append(int(arg))
            elif word == "path" and arg:
                folders.append(arg)
        if not chunk or os.getppid() != parent:
            break
    # the owner died without saying "done"
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + _GONE_S
    while time.monotonic() < deadline and any(_exists(p) for p in pids):
        time.sleep(0.05)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _exists(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
