"""A clean interpreter that imports torch once and forks a node's ranks from it.

A process that runs vLLM's engine has threads (ZMQ, asyncio, OpenMP) a fork would copy
mid-flight, so its ranks must start from a fresh interpreter; importing torch takes seconds per
process, so instead of spawning every rank the driver spawns this launcher, which imports the
runtime once and forks one child per rank (it is single-threaded, so forking it is safe).

Protocol on its pipes, one line each: the driver writes a tag (its number for the rank, unique
over the launcher's life) and a rank spec file's path; the launcher answers ``started TAG PID``
and, when it reaps that rank, ``exited TAG CODE`` (negative: killed by that signal). At end of
input (the driver is gone) it kills its ranks and exits. One launcher serves every run its
driver starts, so each rank takes its driver's environment of the moment after the fork.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from pathlib import Path


def main() -> int:
    from .join import run_rank
    from .proc import die_with_parent, watch_parent
    from .spec import read_spec

    die_with_parent()
    watch_parent(os.getppid())
    import torch  # noqa: F401 -- imported once here, inherited by every rank

    children: dict[int, int] = {}  # pid -> tag
    stdin = sys.stdin.fileno()
    pending = b""
    open_input = True
    while open_input or children:
        ready, _, _ = select.select([stdin] if open_input else [], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                open_input = False
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                tag, name = line.decode().split(" ", 1)
                spec = read_spec(Path(name))  # and removed: it holds the run's key
                pid = _fork(spec, run_rank)
                children[pid] = int(tag)
                _say(f"started {tag} {pid}")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            tag = children.pop(pid, None)
            if tag is not None:
                _say(f"exited {tag} {os.waitstatus_to_exitcode(status)}")
    return 0


def _fork(spec, run_rank) -> int:
    log = Path(spec.log) if getattr(spec, "log", None) else None
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        from .proc import die_with_parent

        die_with_parent()  # with the launcher
        if spec.env is not None:  # the driver's, as a rank it forked itself would have
            os.environ.clear()
            os.environ.update(spec.env)
        if log is not None:
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        code = run_rank(spec)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
