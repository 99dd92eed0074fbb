"""Starting a node's rank processes: one :class:`RankSpec` per rank, one :class:`Starter`.

Every rank of a run gets the same description of the run -- the plan, the model folder, the
run's :class:`~.options.RunOptions`, its secret and where to rendezvous -- plus its own place
in it (:func:`rank_specs` makes them all, for the driver's node, another node, or a torchrun
worker). How the process starts is a :class:`Starter`:

- :class:`ForkStarter`: forked from this process (CPU, while it has started no thread since it
  imported the runtime: a fork copies only the calling thread, so a lock another one holds
  would stay locked forever in the child);
- :class:`LauncherStarter`: forked from a clean interpreter this process keeps for all its runs
  (:mod:`.launcher`; what a process running vLLM's engine must use, and CUDA's default);
- :class:`SpawnStarter`: a fresh interpreter per rank.

Every rank starts in a session of its own (a terminal's Ctrl-C reaches the driver only) and
dies with the process that started it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from opweave.costmodel import Plan

from ..errors import OpWeaveRuntimeError
from .nccl_env import NCCL_DEFAULTS
from .options import RunOptions
from .placement import total_ranks
from .spec import RankSpec

STOP_S = 10.0  # after shutdown, how long ranks get to send their statistics and exit
MAX_RANKS_PER_NODE = 1024  # far beyond any node's GPUs; more processes would exhaust the host


def rank_specs(
    plan: Plan,
    model_dir: str | Path,
    options: RunOptions,
    ranks: Sequence[int],
    *,
    key: bytes,
    host: str,
    store: dict[str, Any],
    control: tuple[str, int] | None = None,
    local_ranks: Sequence[int] | None = None,
    local_world_size: int | None = None,
) -> list[RankSpec]:
    """The specs of ``ranks`` (global ranks started by one node, in local order): local rank
    ``i`` is ``ranks[i]`` unless ``local_ranks`` says otherwise (torchrun's)."""
    world = total_ranks(plan)
    doc = plan.model_dump(mode="json")
    local = list(local_ranks) if local_ranks is not None else list(range(len(ranks)))
    return [
        RankSpec(
            plan=doc,
            model_dir=str(model_dir),
            rank=rank,
            world_size=world,
            local_rank=lr,
            local_world_size=local_world_size or len(ranks),
            key=key.hex(),
            host=host,
            store=store,
            options=options,
            control=control,
        )
        for rank, lr in zip(ranks, local, strict=True)
    ]


def node_layout(
    world: int, nnodes: int, nodes: Sequence[Sequence[int]] | None = None
) -> list[tuple[int, ...]]:
    """Global ranks of each node: ``nodes`` as given (e.g. from a deployment's ``nodes.json``),
    or ``world`` split into ``nnodes`` equal contiguous ranges."""
    if nodes is not None:
        layout = [tuple(int(r) for r in n) for n in nodes]
        flat = sorted(r for n in layout for r in n)
        if flat != list(range(world)):
            raise OpWeaveRuntimeError(
                f"the node layout must place each of the plan's {world} ranks exactly once"
            )
        if nnodes != len(layout):
            raise OpWeaveRuntimeError(f"--nnodes {nnodes} but the node layout has {len(layout)}")
        _check_node_sizes(layout)
        return layout
    if nnodes < 1 or world % nnodes:
        raise OpWeaveRuntimeError(
            f"the plan's {world} ranks do not split evenly over {nnodes} nodes; "
            "give the node layout (opweave deploy writes nodes.json)"
        )
    per = world // nnodes
    layout = [tuple(range(n * per, (n + 1) * per)) for n in range(nnodes)]
    _check_node_sizes(layout)
    return layout


def _check_node_sizes(layout: Sequence[Sequence[int]]) -> None:
    for n, ranks in enumerate(layout):
        if len(ranks) > MAX_RANKS_PER_NODE:
            raise OpWeaveRuntimeError(
                f"node {n} would start {len(ranks)} ranks (at most {MAX_RANKS_PER_NODE}); "
                "spread the plan over more nodes (--nnodes)"
            )


def rank_env(host: str, threads: int) -> dict[str, str]:
    """Extra environment of every rank: one OpenMP team per rank, and gloo's and NCCL's
    sockets on the interface of ``host`` (the rank's address: loopback for a run that stays on
    this machine), not on whatever interface the host name resolves to (gloo) or every one but
    loopback (NCCL's bootstrap). NCCL connects every algorithm of a communicator when it is made
    (a rank makes every connection before its ports close: :mod:`.connect`), and its RAS service
    (a port any local process may query) is off; a variable already set is left as it is."""
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    env.update({k: v for k, v in NCCL_DEFAULTS.items() if k not in os.environ})
    name = "lo" if host == "127.0.0.1" else interface_of(host)
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name is not None and key not in os.environ:
            env[key] = name
    return env


def interface_of(address: str) -> str | None:
    """Linux: the name of the network interface holding IPv4 ``address``, or ``None``."""
    import fcntl

    siocgifaddr = 0x8915
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def _threads() -> int:
    """Threads of this process, native ones (OpenMP's, oneDNN's, an engine's) included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: Python's own threads are all that can be seen
        return threading.active_count()


_THREADS_AT_IMPORT = _threads()  # torch (imported by the runtime) keeps one idle helper thread


def fork_is_safe() -> bool:
    """Whether this process has started no thread since it imported the runtime: only then is
    a fork safe, as no other thread can hold a lock the child would then wait on forever."""
    return threading.active_count() == 1 and _threads() <= _THREADS_AT_IMPORT


@dataclass
class RankProcess:
    """A rank process this node started (directly, or through the launcher)."""

    rank: int
    pid: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    launcher: _Launcher | None = None
    tag: int = -1  # the launcher's name for it
    status: int | None = None  # exit code; negative = killed by that signal

    def poll(self) -> int | None:
        if self.status is not None:
            return self.status
        if self.launcher is not None:
            self.status = self.launcher.status.get(self.tag)
            return self.status
        if self.popen is not None:
            self.status = self.popen.poll()
            return self.status
        with contextlib.suppress(ChildProcessError):
            pid, raw = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(raw)
        return self.status

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.wait(None if self.launcher is None else STOP_S)

    def wait(self, timeout_s: float | None = None) -> int | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            if self.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(0.05)
            else:
                time.sleep(0.02)
        return self.status

    def ended(self) -> str | None:
        code = self.poll()
        if code is None or code == 0:
            return None
        launcher = self.launcher
        if launcher is not None and self.tag in launcher.orphaned:
            return (
                f"was stopped with the rank launcher (process {launcher.proc.pid}), which "
                f"{_ended(launcher.proc.returncode)}"
            )
        return _ended(code)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1].strip()[:300]
        return ""


def _ended(code: int) -> str:
    """How a process with exit code ``code`` ended (negative: killed by that signal)."""
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


class Starter(Protocol):
    """How a node starts one rank process."""

    name: str

    def start(self, spec: RankSpec, run_dir: Path) -> RankProcess: ...


def log_path(spec: RankSpec, run_dir: Path) -> Path:
    """Where a rank writes its output: the run's ``log_dir`` (kept), else its folder."""
    folder = Path(spec.options.log_dir) if spec.options.log_dir is not None else run_dir
    return folder / f"rank{spec.rank}.log"


def _write_spec(spec: RankSpec, path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the key
    with os.fdopen(fd, "w") as f:
        f.write(spec.model_dump_json())


class ForkStarter:
    """Forks this process (``close_fds``: the driver's sockets the rank must not keep)."""

    name = "fork"

    def __init__(self, close_fds: Sequence[int] = ()) -> None:
        self.close_fds = list(close_fds)

    def start(self, spec: RankSpec, run_dir: Path) -> RankProcess:
        log = log_path(spec, run_dir)
        env = rank_env(spec.host, spec.options.threads)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child: never returns into the caller's stack
            code = 1
            try:
                os.setsid()
                for fd in self.close_fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                from .proc import die_with_parent

                die_with_parent()
                out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(out, 1)
                os.dup2(out, 2)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.environ.update(env)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                from .join import run_rank

                code = run_rank(spec)
            except BaseException:
                import traceback

                traceback.print_exc(file=sys.__stderr__)
            finally:
                os._exit(code)
        return RankProcess(spec.rank, pid, log)


class SpawnStarter:
    """A fresh interpreter per rank (``python -m opweave.runtime._private.join SPEC``)."""

    name = "spawn"

    def start(self, spec: RankSpec, run_dir: Path) -> RankProcess:
        log = log_path(spec, run_dir)
        path = run_dir / f"rank{spec.rank}.json"
        _write_spec(spec, path)
        env = {**os.environ, **rank_env(spec.host, spec.options.threads)}
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "opweave.runtime._private.join", str(path)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return RankProcess(spec.rank, popen.pid, log, popen)


class LauncherStarter:
    """Forked by this process's clean launcher interpreter (:class:`_Launcher`)."""

    name = "launcher"

    def __init__(self) -> None:
        self.launcher = _Launcher.shared()

    def start(self, spec: RankSpec, run_dir: Path) -> RankProcess:
        log = log_path(spec, run_dir)
        env = {**os.environ, **rank_env(spec.host, spec.options.threads)}
        spec = spec.model_copy(update={"log": str(log), "env": env})
        return self.launcher.start(spec, run_dir)


def starter(method: str, *, device: str, close_fds: Sequence[int] = ()) -> Starter:
    """The starter named ``method`` (``fork``, ``launcher``, ``spawn``); ``auto``: a fork
    (milliseconds: torch is imported here) where it is safe on CPU, else the launcher."""
    if method == "auto":
        method = "fork" if device == "cpu" and fork_is_safe() else "launcher"
    if method == "fork":
        return ForkStarter(close_fds)
    if method == "launcher":
        return LauncherStarter()
    if method == "spawn":
        return SpawnStarter()
    raise OpWeaveRuntimeError(f"start method must be fork, launcher or spawn, got {method!r}")


class _Launcher:
    """The clean interpreter this process's ranks are forked from (:mod:`.launcher`), for a
    driver that must not fork itself: one torch import per process instead of one per rank.

    One launcher serves every run this process starts (:meth:`shared`); each rank it starts is
    known by a tag of its own, since two runs both have a rank 0.
    """

    _shared: _Launcher | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> _Launcher:
        """This process's launcher, started on first use (again if the last one died)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared.dead:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "opweave.runtime._private.launcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.pids: dict[int, int] = {}  # tag -> pid
        self.status: dict[int, int] = {}  # tag -> exit code (negative: killed by that signal)
        self.orphaned: set[int] = set()  # ranks whose exit the launcher did not report: it died
        self.dead = False
        self._tags = itertools.count()
        self._write = threading.Lock()
        self._started = threading.Condition()
        threading.Thread(target=self._read, name="opweave-launcher", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            words = raw.decode(errors="replace").split()
            if len(words) == 3 and words[0] in ("started", "exited"):
                with self._started:
                    if words[0] == "started":
                        self.pids[int(words[1])] = int(words[2])
                    else:
                        self.status[int(words[1])] = int(words[2])
                    self._started.notify_all()
        self.proc.wait()
        with self._started:
            for tag in self.pids:  # the launcher is gone, and its ranks with it
                if tag not in self.status:
                    self.orphaned.add(tag)
                    self.status[tag] = -signal.SIGKILL
            self.dead = True
            self._started.notify_all()

    def start(self, spec: RankSpec, run_dir: Path) -> RankProcess:
        path = run_dir / f"rank{spec.rank}.json"
        _write_spec(spec, path)
        assert self.proc.stdin is not None
        with self._write:
            tag = next(self._tags)
            try:
                self.proc.stdin.write(f"{tag} {path}\n".encode())
                self.proc.stdin.flush()
            except OSError as exc:
                raise OpWeaveRuntimeError(f"the rank launcher is gone ({exc})") from None
        with self._started:
            if not self._started.wait_for(lambda: tag in self.pids or self.dead, timeout=120) or (
                tag not in self.pids
            ):
                raise OpWeaveRuntimeError("the rank launcher did not start (see its output)")
            pid = self.pids[tag]
        return RankProcess(spec.rank, pid, Path(spec.log or os.devnull), launcher=self, tag=tag)
