"""The driver's side of a run: install a plan on rank processes, talk to them, watch them.

:class:`Cluster` is what both drivers -- offline generation (:mod:`.driver`) and vLLM's engine
(:mod:`opweave.runtime.vllm`) -- stand on. It starts this node's ranks (forked from a clean
process on CPU, which has torch imported already; spawned as fresh interpreters otherwise),
hosts the rendezvous (a file store for a run on one node; a TCP store on ``master_addr`` for
several nodes, whose other nodes start their ranks with :func:`run_node`), accepts every rank's
authenticated control connection, and then carries the control messages: :meth:`submit` sends a
microbatch's :class:`~.work.Work` to the ranks that serve it, :meth:`result` returns the sampled
tokens the last segment's leaders send back.

Faults. A rank that dies closes its control connection (on any node), one that fails reports
why before it exits, one that hangs is named by the peers that time out waiting for it (or, as a
backstop, by a step that yields no result within the timeout): the cluster then waits a moment
for the other reports, blames one rank -- a crash over an error over the peer others waited on
-- kills this node's ranks, closes every connection (so the other nodes' ranks exit too), and
raises :class:`~opweave.runtime.RunFailedError` from every call, naming the rank, its owner and
stages. Nothing of a run outlives it: processes are reaped and the run's folder removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import os
import queue
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from opweave.costmodel import ModelSpec, Plan

from ..errors import OpWeaveRuntimeError, RunFailedError
from . import native
from .control import (
    AuthError,
    ChannelClosed,
    FrameReader,
    encode,
    run_secret,
    server_handshake,
)
from .decode import DECODE_STEPS
from .placement import Placement, check_plan, total_ranks
from .rank import CONTROL_KEY, RankSpec, in_namespace, rank_programs, run_rank
from .results import RankStats
from .schedule import compile_schedule
from .weights import Checkpoint
from .wire import node_address, spin_budget
from .work import Work

_GRACE_S = 2.0  # after a first failure, how long the other ranks get to report
_POLL_S = 0.05
_STOP_S = 10.0  # after shutdown, how long ranks get to send their statistics and exit


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


MAX_RANKS_PER_NODE = 1024  # far beyond any node's GPUs; more processes would exhaust the host


def _check_node_sizes(layout: Sequence[Sequence[int]]) -> None:
    for n, ranks in enumerate(layout):
        if len(ranks) > MAX_RANKS_PER_NODE:
            raise OpWeaveRuntimeError(
                f"node {n} would start {len(ranks)} ranks (at most {MAX_RANKS_PER_NODE}); "
                "spread the plan over more nodes (--nnodes)"
            )


def check_weights(model_dir: str | Path, model: ModelSpec) -> None:
    """Refuse a checkpoint whose tensors do not have the shapes its config implies, before
    any rank starts (reads the safetensors headers only)."""
    checkpoint = Checkpoint(model_dir)
    try:
        checkpoint.check_shapes(model.arch)
    finally:
        checkpoint.close()


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
        with self._started:
            for tag in self.pids:  # the launcher is gone, and its ranks with it
                self.status.setdefault(tag, -signal.SIGKILL)
            self.dead = True
            self._started.notify_all()

    def start(self, spec: RankSpec, run_dir: Path) -> _Child:
        path = run_dir / f"rank{spec.rank}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the key
        with os.fdopen(fd, "w") as f:
            f.write(spec.to_json())
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
        return _Child(spec.rank, pid, Path(spec.log or os.devnull), launcher=self, tag=tag)


def _threads() -> int:
    """Threads of this process, native ones (OpenMP's, oneDNN's, an engine's) included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: Python's own threads are all that can be seen
        return threading.active_count()


_THREADS_AT_IMPORT = _threads()  # torch (imported above) keeps one idle helper thread


def _fork_is_safe() -> bool:
    """Whether this process has started no thread since it imported the runtime: only then is
    a fork safe, as no other thread can hold a lock the child would then wait on forever."""
    return threading.active_count() == 1 and _threads() <= _THREADS_AT_IMPORT


@dataclass
class _Child:
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
        self.wait(None if self.launcher is None else _STOP_S)

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
        if code < 0:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"exited with status {code}"

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1].strip()[:300]
        return ""


@dataclass
class _Conn:
    """One rank's control connection, as the driver's IO thread sees it."""

    sock: socket.socket
    rank: int
    reader: FrameReader = field(default_factory=FrameReader)
    out: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = "joined"  # joined -> ready -> closed
    last_seen: float = field(default_factory=time.monotonic)
    host: str = ""
    pid: int | None = None
    ready: dict[str, Any] | None = None
    report: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    warmed: bool = False  # compiled its decode steps (Cluster.warm_up)


def rank_env(host: str, threads: int) -> dict[str, str]:
    """Extra environment of every rank: one OpenMP team per rank, and gloo's and NCCL's
    sockets on the interface of ``host`` (the rank's address: loopback for a run that stays on
    this machine), not on whatever interface the host name resolves to (gloo) or every one but
    loopback (NCCL's bootstrap)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
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


def start_rank(
    spec: RankSpec,
    run_dir: Path,
    method: str,
    close_fds: Sequence[int],
    launcher: _Launcher | None = None,
) -> _Child:
    """Start one rank: forked here (``close_fds`` are the driver's sockets it must not keep),
    forked by the ``launcher``, or spawned; always in a session of its own (a terminal's Ctrl-C
    reaches the driver only)."""
    log = run_dir / f"rank{spec.rank}.log"
    env = rank_env(spec.host, spec.threads)
    if method == "launcher":
        assert launcher is not None
        spec = dataclasses.replace(spec, log=str(log), env={**os.environ, **env})
        return launcher.start(spec, run_dir)
    if method == "spawn":
        path = run_dir / f"rank{spec.rank}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the key
        with os.fdopen(fd, "w") as f:
            f.write(spec.to_json())
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "opweave.runtime._private.rank", str(path)],
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return _Child(spec.rank, popen.pid, log, popen)
    if method != "fork":
        raise OpWeaveRuntimeError(f"start method must be fork, launcher or spawn, got {method!r}")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: never returns into the caller's stack
        code = 1
        try:
            os.setsid()
            for fd in close_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            from .rank import die_with_parent

            die_with_parent()
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.environ.update(env)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            import torch

            torch.set_num_threads(spec.threads)
            code = run_rank(spec)
        except BaseException:
            import traceback

            traceback.print_exc(file=sys.__stderr__)
        finally:
            os._exit(code)
    return _Child(spec.rank, pid, log)


class Cluster:
    """A plan installed on rank processes, with this process as their driver (node 0)."""

    def __init__(
        self,
        plan: Plan,
        model: ModelSpec,
        model_dir: str | Path,
        *,
        nnodes: int = 1,
        nodes: Sequence[Sequence[int]] | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        device: str = "cpu",
        timeout_s: float = 60.0,
        join_timeout_s: float = 600.0,
        start_method: str = "auto",
        dtype: str | None = None,
        kernels: str = "opweave",
        decode_step: str = "per-request",
        threads: int = 1,
        torchrun: bool = False,
    ) -> None:
        """``start_method``: ``fork`` (CPU default while this process has started no thread
        since it imported the runtime, so no lock can be held across the fork), ``launcher``
        (otherwise, CUDA's default and what a process running vLLM's engine must use: ranks
        forked from one fresh interpreter that this process keeps for all its runs), ``spawn``
        (a fresh interpreter each) or ``auto``. ``torchrun``: this is the process torchrun made
        rank 0; it starts rank 0 and drives the others, which torchrun started
        (:func:`run_torchrun_rank`), through torchrun's rendezvous (``MASTER_ADDR`` and
        ``MASTER_PORT``)."""
        check_plan(plan, model)
        check_weights(model_dir, model)
        spin_budget(own_core=False)  # a malformed OPWEAVE_WAIT fails here, before any rank starts
        if rank_programs(device, decode_step):
            native.load()  # built once here (cached), not by every rank at once
        self.plan = plan
        self.placement = Placement(plan, model)
        self.world = total_ranks(plan)
        if torchrun:  # every rank is a "node" of its own to this driver
            nnodes, nodes = self.world, None
            master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.layout = node_layout(self.world, nnodes, nodes)
        if nnodes > 1 and master_port is None:
            raise OpWeaveRuntimeError("a run over several nodes needs --master-port")
        self.timeout_s = float(timeout_s)
        self.join_timeout_s = float(join_timeout_s)
        self.on_failure: list[Callable[[], None]] = []
        self.failed: RunFailedError | None = None
        self._results: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._conns: dict[int, _Conn] = {}  # touched by the IO thread only, once registered
        self._claimed: set[int] = set()
        self._new_conns: queue.SimpleQueue[_Conn] = queue.SimpleQueue()
        self._hang: tuple[list[int], float] | None = None
        self._lock = threading.Lock()
        self._failing_since: float | None = None
        self._first_signal: str | None = None
        self._closing = False
        self._stopping = False
        self._started = time.monotonic()
        self._expected: dict[tuple[int, int], set[int]] = {}
        self._receivers = self._who_gets_work()
        key = run_secret(multi_process_origin=nnodes > 1)
        self._key = key
        self.run_dir = Path(tempfile.mkdtemp(prefix="opweave-run-"))
        self.children: list[_Child] = []
        self._store: Any = None
        multi = nnodes > 1
        host = node_address(master_addr) if multi else "127.0.0.1"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(max(self.world, 8))
            control = (host, self._listener.getsockname()[1])
            store = (
                {"host": master_addr, "port": master_port}
                if multi
                else {"file": str(self.run_dir / "store")}
            )
            if start_method == "auto":  # a fork starts in milliseconds: torch is imported here
                fork = device == "cpu" and _fork_is_safe()
                start_method = "fork" if fork else "launcher"
            local = self.layout[0]
            self.start_method = start_method
            self._launcher = _Launcher.shared() if start_method == "launcher" else None
            for lr, rank in enumerate(local):
                spec = RankSpec(
                    plan=plan.model_dump(mode="json"),
                    model_dir=str(model_dir),
                    rank=rank,
                    world_size=self.world,
                    local_rank=lr,
                    local_world_size=len(local),
                    device=device,
                    timeout_s=self.timeout_s,
                    key=key.hex(),
                    host=host,
                    store=store,
                    control=control,
                    dtype=dtype,
                    kernels=kernels,
                    decode_step=decode_step,
                    join_timeout_s=self.join_timeout_s,
                    threads=threads,
                )
                self.children.append(
                    start_rank(
                        spec,
                        self.run_dir,
                        start_method,
                        [self._listener.fileno()],
                        self._launcher,
                    )
                )
            if multi:  # hosted after every fork, so no rank inherits the store's thread
                agent_store = torchrun and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                self._store = in_namespace(
                    _host_store(master_addr, master_port, self.join_timeout_s, client=agent_store),
                    key,
                )
                self._store.set(CONTROL_KEY, f"{control[0]}:{control[1]}")
            self._wake_r, self._wake_w = socket.socketpair()
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._listener, selectors.EVENT_READ, "listener")
            self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._io = threading.Thread(target=self._loop, name="opweave-driver-io", daemon=True)
            self._io.start()
            self._wait_ready()
            self.first_iteration = 0  # the drivers' first iteration (1 after a warm-up)
            # whether decode steps are static (built at the warm-up): a driver may then keep
            # the sampled tokens on the ranks (Work.forward, Work.carried)
            self.static_decode = decode_step in DECODE_STEPS and decode_step != "per-request"
            if self.static_decode:
                self.warm_up()
        except BaseException:
            self.close()
            raise

    # -- what the drivers use -----------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    @property
    def microbatches(self) -> int:
        return self.plan.microbatches

    @property
    def pids(self) -> list[int]:
        """Process ids of this node's ranks."""
        return [c.pid for c in self.children]

    def result_parts(self, microbatch: int) -> int:
        """How many result messages one iteration of ``microbatch`` yields (one per replica of
        the last segment's owner that serves it)."""
        return len(self._result_ranks[microbatch])

    def warm_up(self) -> None:
        """Build every rank's static decode steps before any traffic (every ``--decode-step``
        but ``per-request``): compiling a step (``compiled``, ``traced``) takes from seconds to
        minutes, longer than a rank waits for its peers, and would otherwise fall on the first
        requests; and the rows a decode step receives into are laid out from what it saw here.

        Iteration 0 prefills two tokens for a warm-up request in every slot, so each rank sees
        the inputs of each of its actions; then every rank builds each action's static decode
        step, runs it once on padding rows (compiling it), allocates its input rows, frees the
        warm-up's requests and says so, within ``join_timeout_s``. The drivers start at
        :attr:`first_iteration`.
        """
        m = self.microbatches
        everyone: list[str] = []
        for k in range(m):
            slots = tuple(self.placement.microbatch_slots(k))
            rids = tuple(f"opweave-warm-up-{s}" for s in slots)
            everyone += rids
            n = len(slots)
            self.submit(
                Work(
                    iteration=0,
                    microbatch=k,
                    request_ids=rids,
                    slots=slots,
                    context_lens=(0,) * n,
                    query_lens=(2,) * n,
                    sample=(True,) * n,
                    token_ids=(0,) * (2 * n),
                )
            )
        for _ in range(sum(self.result_parts(k) for k in range(m))):
            self.result()
        deadline = time.monotonic() + self.join_timeout_s
        for rank in range(self.world):
            self._send(rank, {"t": "warm", "r": everyone})
        self._await_ranks(
            lambda c: c.warmed,
            deadline,
            f"did not compile its decode steps within {self.join_timeout_s:g} s "
            "(see its log with OPWEAVE_DEBUG=1)",
        )
        self.first_iteration = 1

    def submit(self, work: Work) -> None:
        """Send ``work`` to every rank serving its microbatch; its result is then expected
        from the last segment's leaders."""
        self.check()
        k = work.microbatch
        with self._lock:
            self._expected[(work.iteration, k)] = set(self._result_ranks[k])
        for rank, (tokens, params) in self._receivers[k].items():
            self._send(rank, work.to_message(tokens=tokens, params=params))

    def result(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next result message (``{"i", "k", "r": request ids, "x": tokens}``); raises
        :class:`RunFailedError` once the run failed, or if nothing arrives within the timeout."""
        wait = self.timeout_s + 5.0 if timeout_s is None else timeout_s
        try:
            msg = self._results.get(timeout=wait)
        except queue.Empty:
            self._signal_hang(wait)
            msg = self._results.get()
        if msg is None:
            self._results.put(None)  # every later call fails too
            assert self.failed is not None
            raise self.failed
        return msg

    def check(self) -> None:
        """Raise :class:`RunFailedError` if the run has failed."""
        if self.failed is not None:
            raise self.failed

    def shutdown(self) -> list[RankStats]:
        """Stop every rank after the work submitted so far; their statistics, in rank order."""
        self.check()
        self._stopping = True
        for rank in range(self.world):
            self._send(rank, {"t": "shutdown"})
        deadline = time.monotonic() + max(self.timeout_s, _STOP_S)
        while time.monotonic() < deadline and self.failed is None:
            conns = list(self._conns.values())
            if all(c.stats is not None or c.state == "closed" for c in conns):
                break
            time.sleep(_POLL_S)
        self.check()
        for child in self.children:
            if child.wait(_STOP_S) is None:
                child.kill()
        missing = [r for r in range(self.world) if self._conns[r].stats is None]
        if missing:
            raise RunFailedError(
                f"{self.describe(missing[0])} exited without its statistics after the shutdown"
            )
        return [RankStats.model_validate(self._conns[r].stats) for r in range(self.world)]

    def close(self) -> None:
        """Kill whatever still runs, close every connection, remove the run's folder."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for child in self.children:
            child.kill()
        with contextlib.suppress(AttributeError, OSError):
            self._wake_w.send(b"x")
        io = getattr(self, "_io", None)
        if io is not None:
            io.join(timeout=5)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.sock.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        for name in ("_wake_r", "_wake_w"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        self._store = None
        if self.failed is not None and os.environ.get("OPWEAVE_DEBUG") == "1":
            print(f"opweave: the ranks' logs are kept in {self.run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def describe(self, rank: int) -> str:
        node = next(n for n, ranks in enumerate(self.layout) if rank in ranks)
        where = f" on node {node}" if len(self.layout) > 1 else ""
        return f"rank {rank}{where} ({self.placement.describe(rank)})"

    # -- setup --------------------------------------------------------------------------------
    def _who_gets_work(self) -> dict[int, dict[int, tuple[bool, bool]]]:
        """Per microbatch: each rank serving it, and whether it needs the token ids (it runs
        the first segment) and sampling parameters (the last)."""
        out: dict[int, dict[int, tuple[bool, bool]]] = {
            k: {} for k in range(self.placement.microbatches)
        }
        results: dict[int, list[int]] = {k: [] for k in out}
        for rank in range(self.world):
            info = self.placement.ranks[rank]
            for a in compile_schedule(self.placement, rank):
                tokens, params = out[a.microbatch].get(rank, (False, False))
                out[a.microbatch][rank] = (tokens or a.first, params or a.last)
                if a.last and info.is_leader:
                    results[a.microbatch].append(rank)
        self._result_ranks = results
        return out

    def _wait_ready(self) -> None:
        """Until every rank has loaded its weights and said so; at most ``join_timeout_s``."""
        self._await_ranks(
            lambda c: c.state == "ready",
            self._started + self.join_timeout_s,
            f"was not ready {self.join_timeout_s:g} s after the start (stuck loading or "
            "starting; see its log with OPWEAVE_DEBUG=1)",
        )

    def _await_ranks(self, done: Callable[[_Conn], bool], deadline: float, late: str) -> None:
        """Until ``done`` holds for every rank's connection; past ``deadline`` (monotonic), a
        :class:`RunFailedError` naming the first rank it does not hold for, then ``late``."""
        while True:
            self.check()
            finished = {c.rank for c in list(self._conns.values()) if done(c)}
            waiting = set(range(self.world)) - finished
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RunFailedError(f"{self.describe(min(waiting))} {late}")
            time.sleep(_POLL_S)

    # -- sending ------------------------------------------------------------------------------
    def _send(self, rank: int, message: dict[str, Any]) -> None:
        conn = self._conns.get(rank)
        if conn is None or conn.state == "closed":
            return  # its loss is being (or was) reported
        frame = encode(message)
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
                self._register_writes()
                for key, mask in self._selector.select(timeout=_POLL_S):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError, OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                self._watch()
            except Exception as exc:  # the IO thread must never die silently
                self._signal(f"the driver's control loop failed: {type(exc).__name__}: {exc}")
                self._finish_failure(force=True)
                return

    def _register_writes(self) -> None:
        for conn in list(self._conns.values()):
            if conn.state == "closed":
                continue
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(conn.sock, events, conn)

    def _accept(self) -> None:
        sock, _ = self._listener.accept()
        threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        """Authenticate a new connection off the IO thread (a silent peer must not stall it)."""
        try:
            rank = server_handshake(sock, self._key)
        except (AuthError, ChannelClosed, OSError):
            sock.close()  # not a rank of this run
            return
        with self._lock:
            if not 0 <= rank < self.world or rank in self._claimed or self._closing:
                sock.close()
                return
            self._claimed.add(rank)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._new_conns.put(_Conn(sock, rank))  # registered by the IO thread
        with contextlib.suppress(OSError):
            self._wake_w.send(b"c")

    def _flush(self, conn: _Conn) -> None:
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

    def _read(self, conn: _Conn) -> None:
        while True:
            try:
                messages = conn.reader.read(conn.sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                messages = None
            except OpWeaveRuntimeError as exc:
                conn.report = {"kind": "error", "message": f"sent a malformed message: {exc}"}
                self._lost(conn)
                return
            if messages is None:
                self._lost(conn)
                return
            conn.last_seen = time.monotonic()
            for msg in messages:
                self._handle(conn, msg)

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "hello":
            conn.pid, conn.host = msg.get("pid"), str(msg.get("host", ""))
        elif kind == "ready":
            conn.state, conn.ready = "ready", msg
        elif kind == "result":
            with self._lock:
                key = (int(msg["i"]), int(msg["k"]))
                waiting = self._expected.get(key)
                if waiting is not None:
                    waiting.discard(conn.rank)
                    if not waiting:
                        del self._expected[key]
            self._results.put(msg)
        elif kind == "warmed":
            conn.warmed = True
        elif kind == "stats":
            conn.stats = msg["stats"]
        elif kind == "error":
            conn.report = msg
            self._signal(f"rank {conn.rank} reported an error")
        # "loading" only refreshes last_seen

    def _lost(self, conn: _Conn) -> None:
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

    def _watch(self) -> None:
        """Local exits, join and load deadlines; and, once failing, the end of the grace."""
        now = time.monotonic()
        while not self._new_conns.empty():
            conn = self._new_conns.get()
            self._conns[conn.rank] = conn
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        for child in self.children:
            code = child.poll()
            if code not in (None, 0) or (code == 0 and not self._stopping):
                self._signal(f"rank {child.rank} exited")
        if self._failing_since is None:
            if len(self._conns) < self.world and now - self._started > self.join_timeout_s:
                missing = sorted(set(range(self.world)) - set(self._conns))
                self._signal(f"ranks {missing} did not join within {self.join_timeout_s:g} s")
            for conn in list(self._conns.values()):
                if conn.state == "joined" and now - conn.last_seen > self.timeout_s + 5:
                    self._signal(f"rank {conn.rank} stopped responding while loading")
        self._finish_failure()

    # -- failure ------------------------------------------------------------------------------
    def _signal(self, why: str) -> None:
        if self.failed is not None or self._closing:
            return
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            self._first_signal = why

    def _signal_hang(self, waited_s: float) -> None:
        """Called by a driver whose step produced nothing within the timeout."""
        with self._lock:
            owing = sorted({r for ranks in self._expected.values() for r in ranks})
        self._hang = (owing, waited_s)
        self._signal("a step yielded no result")

    def _finish_failure(self, *, force: bool = False) -> None:
        if self._failing_since is None or self.failed is not None:
            return
        children = {c.rank: c for c in self.children}

        def settled_conn(c: _Conn) -> bool:
            if c.report is not None:
                return True
            # a local rank that went silent: wait for its exit status too (a crash is named)
            child = children.get(c.rank)
            return c.state == "closed" and (child is None or child.poll() is not None)

        settled = len(self._conns) == self.world and all(
            settled_conn(c) for c in self._conns.values()
        )
        if not force and not settled and time.monotonic() - self._failing_since < _GRACE_S:
            return
        message = self._diagnose()
        self.failed = RunFailedError(message)
        for child in self.children:
            child.kill()
        for conn in list(self._conns.values()):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
            with contextlib.suppress(OSError):
                conn.sock.close()
            conn.state = "closed"
        self._store = None
        self._results.put(None)
        for callback in self.on_failure:
            with contextlib.suppress(Exception):
                callback()

    def _diagnose(self) -> str:
        """Blame one rank: a crash beats an own error beats the peer others waited on."""
        children = {c.rank: c for c in self.children}
        who = self.describe
        reports = {r: c.report for r, c in self._conns.items() if c.report is not None}
        for rank, child in sorted(children.items()):
            how = child.ended()
            if how is not None and rank not in reports:
                tail = child.log_tail()
                detail = f" (its last words: {tail})" if tail and "Error" in tail else ""
                return f"{who(rank)} {how}{detail}; the run was stopped"
        for rank, conn in sorted(self._conns.items()):
            if conn.state == "closed" and rank not in reports and rank not in children:
                return (
                    f"{who(rank)} lost its connection to the driver (its process or node died); "
                    "the run was stopped"
                )
        for rank, rep in sorted(reports.items()):
            if rep.get("kind") == "error":
                return f"{who(rank)} failed: {rep['message']}"
        silent = [r for r, c in self._conns.items() if c.report is None and c.state != "closed"]
        for rank, rep in sorted(reports.items()):
            peer = rep.get("peer")
            if peer is not None and peer not in reports:
                return f"{who(peer)} stopped responding: {who(rank)} reported: {rep['message']}"
        hang = self._hang
        if hang is not None:
            owing, waited = hang
            culprits = [r for r in owing if r in silent] or owing or silent
            if culprits:
                return (
                    f"{who(culprits[0])} stopped responding: no result within {waited:g} s; "
                    "the run was stopped"
                )
        if reports:
            rank, rep = next(iter(sorted(reports.items())))
            if silent:
                return (
                    f"{who(silent[0])} stopped responding: {who(rank)} reported: {rep['message']}"
                )
            return f"{who(rank)} failed: {rep['message']}"
        missing = sorted(set(range(self.world)) - set(self._conns))
        if missing:
            child = children.get(missing[0])
            tail = child.log_tail() if child is not None else ""
            return f"{who(missing[0])} did not join the run" + (f": {tail}" if tail else "")
        return f"the run failed: {self._first_signal}"


def _host_store(addr: str, port: int | None, timeout_s: float, *, client: bool = False) -> Any:
    """The run's TCP store on ``addr:port`` (``client``: torchrun's agent hosts it already).

    torch's store server would listen on every interface of the host; it is handed a socket
    bound to ``addr`` (the master address, one of this node's) instead, so only the network the
    other nodes reach node 0 on can reach it. torch's store protocol has no authentication,
    so the run keeps its keys under a prefix derived from its secret
    (:func:`~.control.store_namespace`; see the README's "Network exposure"); the run's own
    control and rank-to-rank connections prove the secret.
    """
    import torch.distributed as dist

    listener: socket.socket | None = None
    try:
        if not client:
            listener = _store_listener(addr, port or 0)
            port = listener.getsockname()[1]
        return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            addr,
            port or 0,
            None,
            is_master=not client,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=None if listener is None else listener.detach(),
        )
    except (RuntimeError, OSError) as exc:
        if listener is not None:
            listener.close()
        raise OpWeaveRuntimeError(
            f"cannot host the rendezvous store on {addr}:{port}: {exc}"
        ) from None


def _store_listener(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr:port``: the master address when it is this node's, else
    this node's address on the route to it (behind NAT, the master address is another's)."""
    host = socket.gethostbyname(addr)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            sock.bind((node_address(addr), port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def run_node(
    plan: Plan,
    model: ModelSpec,
    model_dir: str | Path,
    *,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
    nodes: Sequence[Sequence[int]] | None = None,
    device: str = "cpu",
    timeout_s: float = 60.0,
    join_timeout_s: float = 600.0,
    dtype: str | None = None,
    kernels: str = "opweave",
    decode_step: str = "per-request",
    threads: int = 1,
) -> None:
    """A node other than 0: start its ranks, which join node 0's driver, and wait for them.

    Returns after every rank exited cleanly (the driver shut the run down); raises
    :class:`RunFailedError` when one failed (the driver on node 0 names the cause).
    """
    check_plan(plan, model)
    check_weights(model_dir, model)
    layout = node_layout(total_ranks(plan), nnodes, nodes)
    if not 0 < node_rank < nnodes:
        raise OpWeaveRuntimeError(f"node rank {node_rank} is not in 1..{nnodes - 1}")
    key = run_secret(multi_process_origin=True)
    host = node_address(master_addr)
    if rank_programs(device, decode_step):
        native.load()  # built once here (cached), not by every rank at once
    run_dir = Path(tempfile.mkdtemp(prefix="opweave-node-"))
    children: list[_Child] = []
    try:
        local = layout[node_rank]
        method = "fork" if device == "cpu" and _fork_is_safe() else "spawn"
        for lr, rank in enumerate(local):
            spec = RankSpec(
                plan=plan.model_dump(mode="json"),
                model_dir=str(model_dir),
                rank=rank,
                world_size=total_ranks(plan),
                local_rank=lr,
                local_world_size=len(local),
                device=device,
                timeout_s=timeout_s,
                key=key.hex(),
                host=host,
                store={"host": master_addr, "port": master_port},
                control=None,
                dtype=dtype,
                kernels=kernels,
                decode_step=decode_step,
                join_timeout_s=join_timeout_s,
                threads=threads,
            )
            children.append(start_rank(spec, run_dir, method, []))
        while any(c.poll() is None for c in children):
            failed = [c for c in children if c.poll() not in (None, 0)]
            if failed:
                break
            time.sleep(_POLL_S)
        failed = [c for c in children if c.poll() not in (None, 0)]
        if failed:
            c = failed[0]
            tail = c.log_tail()
            raise RunFailedError(
                f"rank {c.rank} on node {node_rank} {c.ended()}"
                + (f" ({tail})" if tail else "")
                + "; node 0's driver names the cause"
            )
    finally:
        for child in children:
            child.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env() -> dict[str, str] | None:
    """torchrun's variables when this process is one of its workers, else ``None``."""
    if all(k in os.environ for k in TORCHRUN_KEYS):
        return {k: os.environ[k] for k in TORCHRUN_KEYS}
    return None


def run_torchrun_rank(
    plan: Plan,
    model: ModelSpec,
    model_dir: str | Path,
    *,
    device: str = "cpu",
    timeout_s: float = 60.0,
    join_timeout_s: float = 600.0,
    dtype: str | None = None,
    kernels: str = "opweave",
    decode_step: str = "per-request",
    threads: int = 1,
) -> None:
    """This process is a rank torchrun started (other than 0): run it here, joining the driver
    that torchrun's rank 0 hosts. Raises :class:`RunFailedError` if the rank fails."""
    env = torchrun_env()
    assert env is not None
    check_plan(plan, model, int(env["WORLD_SIZE"]))
    key = run_secret(multi_process_origin=True)
    spec = RankSpec(
        plan=plan.model_dump(mode="json"),
        model_dir=str(model_dir),
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        device=device,
        timeout_s=timeout_s,
        key=key.hex(),
        host=node_address(env["MASTER_ADDR"]),
        store={"host": env["MASTER_ADDR"], "port": int(env["MASTER_PORT"])},
        control=None,
        dtype=dtype,
        kernels=kernels,
        decode_step=decode_step,
        join_timeout_s=join_timeout_s,
        threads=threads,
    )

    torch.set_num_threads(threads)
    if run_rank(spec) != 0:
        raise RunFailedError(f"rank {spec.rank} failed; torchrun's rank 0 names the cause")


def layout_from_file(path: str | Path) -> list[list[int]]:
    """Global ranks per node from a deployment's ``nodes.json`` (a list of
    ``{"gpu", "gpus", "ranks"}`` objects)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise OpWeaveRuntimeError(f"cannot read the node layout {path}: {exc}") from None
    if not isinstance(data, list) or not all(
        isinstance(n, dict)
        and isinstance(n.get("ranks"), list)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in n["ranks"])
        for n in data
    ):
        raise OpWeaveRuntimeError(
            f'{path}: expected a list of nodes, each with its "ranks" (a list of rank numbers)'
        )
    return [list(n["ranks"]) for n in data]
